"""DAPO's shaping of answers that reach the length budget (Yu et al. 2025, "DAPO", section 3.4),
applied to a step's rewards before the advantages:
- overlong filtering (algorithm.overlong_filter): an answer cut at the budget (finish reason
  "length") carries no gradient, its sample weight 0: its reward judges an unfinished answer,
  which would teach the policy that a long reasoning chain is wrong;
- soft overlong punishment (algorithm.overlong_buffer = L_cache > 0): with L_max =
  rollout.max_new_tokens, an answer of L tokens gets ((L_max - L_cache) - L) / L_cache added
  to its reward when L_max - L_cache < L <= L_max (0 down to -1 over the buffer's length), and
  -1 beyond (which the budget never lets happen here)."""

from __future__ import annotations


def overlong_penalty(length: int, max_tokens: int, buffer: int) -> float:
    """The soft punishment of an answer of `length` tokens (0 when buffer is 0)."""
    if buffer <= 0 or length <= max_tokens - buffer:
        return 0.0
    if length > max_tokens:
        return -1.0
    return ((max_tokens - buffer) - length) / buffer


def shape_overlong(rewards: list[float], lengths: list[int], truncated: list[bool],
                   max_tokens: int, buffer: int, filter_truncated: bool
                   ) -> tuple[list[float], list[float]]:
    """(the rewards with the soft punishment added, each sample's weight: 0 for a truncated
    answer under filtering, else 1)."""
    shaped = [r + overlong_penalty(n, max_tokens, buffer) for r, n in zip(rewards, lengths)]
    weights = [0.0 if filter_truncated and cut else 1.0 for cut in truncated]
    return shaped, weights

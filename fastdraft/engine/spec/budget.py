"""Length-aware speculation budgets (DAS, ../shared/papers/das-distribution-aware-speculation):
only the requests predicted to set the rollout's makespan speculate; the rest decode plainly
in the same forward (ModelRunner.verify_split), so their draft tokens stop costing compute.

DAS's optimum (its eq. 7) gives request i no speculative tokens when its length is within the
batch's forward-pass count N_fwd. Here: the batch needs about N = max_j r_j / a more steps (its
longest predicted remainder r_j, speculating at `a` tokens per step, the measured accept
length); a request predicted to finish in fewer than N plain steps (r_i < margin * N) is off
the critical path and decodes plainly. Its prediction is DAS's "history + runtime" one: the
mean remainder of this prompt's earlier lengths that exceed its current length (survival-
conditioned, so a request that outlives its history is re-predicted long and speculates
again); past every length of its prompt, those of all prompts; past everything seen, as long
again as it already is.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from fastdraft.config.engine import BudgetConfig
from fastdraft.engine.request import Request


class _Tail:
    """Sorted lengths with suffix sums: mean remainder of the lengths above l in O(log n)."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = sorted(lengths)
        self.suffix = [0] * (len(self.lengths) + 1)
        for i in range(len(self.lengths) - 1, -1, -1):
            self.suffix[i] = self.suffix[i + 1] + self.lengths[i]

    def mean_remaining(self, current: int) -> float | None:
        i = bisect.bisect_right(self.lengths, current)
        count = len(self.lengths) - i
        return self.suffix[i] / count - current if count else None


class LengthBudget:
    """Per-prompt answer-length history (the window's RL steps; the running step's answers
    join at advance_step) and the running accept length: which rows speculate."""

    def __init__(self, config: BudgetConfig) -> None:
        self.config = config
        self.step = 0
        self.accept_length = config.initial_accept_length
        self._pending: list[tuple[int, int]] = []                  # (prompt key, length)
        self._history: dict[int, list[tuple[int, int]]] = defaultdict(list)  # key: (step, len)
        self._tails: dict[int, _Tail] = {}
        self._all: _Tail = _Tail([])

    def record(self, prompt_key: int, length: int) -> None:
        """A finished answer of `length` tokens to the prompt of that key (request.prompt_key);
        it counts from the next RL step on."""
        self._pending.append((prompt_key, length))

    def advance_step(self) -> None:
        for key, length in self._pending:
            self._history[key].append((self.step, length))
        self._pending = []
        self.step += 1
        self._rebuild()

    def _rebuild(self) -> None:
        """Drops what is older than the window; the tails answer predictions until the next."""
        oldest = self.step - self.config.window
        self._history = defaultdict(list, {k: kept for k, v in self._history.items()
                                           if (kept := [e for e in v if e[0] >= oldest])})
        self._tails = {k: _Tail([n for _, n in v]) for k, v in self._history.items()}
        self._all = _Tail([n for v in self._history.values() for _, n in v])

    def predict_remaining(self, prompt_key: int, current: int) -> float:
        tail = self._tails.get(prompt_key)
        for source in (tail, self._all):
            if source is not None and (left := source.mean_remaining(current)) is not None:
                return left
        return float(max(current, 1))

    def observe(self, tokens_per_row: float) -> None:
        """A step's tokens per speculating row (accepted + bonus)."""
        w = self.config.accept_ema
        self.accept_length = (1 - w) * self.accept_length + w * tokens_per_row

    def speculating(self, remaining: list[float]) -> list[bool]:
        """Which rows speculate, from their predicted remainders (DAS eq. 7)."""
        horizon = max(remaining) / max(self.accept_length, 1.0)
        return [r >= self.config.margin * horizon for r in remaining]

    def choose(self, requests: list[Request], round_up: Callable[[int], int]
               ) -> list[Request]:
        """The requests to speculate on this step, longest predicted first; a partial choice
        grows to round_up(count) (a batch bucket: its padding rows would cost the same)."""
        remaining = [self.predict_remaining(r.prompt_key, len(r.output_token_ids))
                     for r in requests]
        num = sum(self.speculating(remaining))
        if num in (0, len(requests)):   # nothing to reorder
            return list(requests[:num])
        num = min(round_up(num), len(requests))
        order = sorted(range(len(requests)), key=lambda i: -remaining[i])
        return [requests[i] for i in order[:num]]

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "accept_length": self.accept_length,
                "history": [[k, s, n] for k, v in self._history.items() for s, n in v],
                "pending": [list(e) for e in self._pending]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._history = defaultdict(list)
        for key, step, length in state["history"]:
            self._history[key].append((step, length))
        self._pending = [(k, n) for k, n in state["pending"]]
        self.step, self.accept_length = state["step"], state["accept_length"]
        self._rebuild()

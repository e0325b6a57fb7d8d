"""One-step-offset sampling (TLT): which samples make up one training batch.

While step i's rollouts run, the drafter trains on the samples that have finished: mostly short
ones, since the long tail finishes last (or never, before the step ends). Training only on those
would teach the drafter short answers, while speculation pays off most on the long ones. So a
batch mixes this step's finished samples with the previous step's longest samples (the tail of
step i - 1, produced by a policy one update old): `offset_mix` of the token budget goes to the
previous step's tail first, the rest to this step.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from fastdraft.databuffer.sample import Sample


def longest_tail(samples: Sequence[Sample], tail_fraction: float) -> list[Sample]:
    """The longest ceil(tail_fraction * n) samples (at least one when any), ties kept in the
    given order so the choice is deterministic."""
    if not samples:
        return []
    keep = max(1, math.ceil(tail_fraction * len(samples)))
    return sorted(samples, key=lambda s: -s.num_tokens)[:keep]


def _fill(pool: list[Sample], chosen: list[Sample], used: int, budget: int,
          share: int | None = None) -> int:
    """Moves samples from pool into chosen, in pool order, while they fit in the budget; returns
    the tokens used. With a share, a sample is taken only when at least half of it falls within
    the share (so the mix is right on average, at one-sequence grain), except that the first one
    always is: a long tail sample must get in even when the share is shorter than it."""
    keep, first = [], True
    for s in pool:
        fits = used + s.num_tokens <= budget
        in_share = share is None or (share > 0 and (first or used + s.num_tokens / 2 <= share))
        if fits and in_share:
            chosen.append(s)
            used += s.num_tokens
            first = False
        else:
            keep.append(s)
    pool[:] = keep
    return used


def select_offset(current: Sequence[Sample], previous: Sequence[Sample], token_budget: int,
                  offset_mix: float, tail_fraction: float, rng: random.Random) -> list[Sample]:
    """Samples for one batch of at most token_budget tokens, each used at most once.

    Order of filling: the previous step's tail (longest_tail) up to about offset_mix *
    token_budget tokens (see _fill), then this step's samples, then more of the tail if room is
    left. Each pool is shuffled by `rng`, so the result depends only on the inputs and the rng's
    state. With no current samples the whole budget goes to the tail, with no previous ones to
    this step.
    Samples longer than the budget are cut to it (Sample.truncated: prompt first).
    Returns [] when both pools are empty.
    """
    def prepared(samples: Sequence[Sample]) -> list[Sample]:
        pool = [s if s.num_tokens <= token_budget else s.truncated(token_budget)
                for s in samples]
        rng.shuffle(pool)
        return pool

    tail, cur = prepared(longest_tail(previous, tail_fraction)), prepared(current)
    if not cur:
        share = token_budget
    elif not tail:
        share = 0
    else:
        share = round(offset_mix * token_budget)
    chosen: list[Sample] = []
    used = _fill(tail, chosen, 0, token_budget, share)
    used = _fill(cur, chosen, used, token_budget)
    _fill(tail, chosen, used, token_budget)
    return chosen

"""One-step-offset selection: budget, mix, the previous step's longest tail, determinism."""

from __future__ import annotations

import random

from fastdraft.databuffer import longest_tail, select_offset
from tests.databuffer.helpers import make_sample

PREVIOUS = [make_sample(i, n, rl_step=0) for i, n in enumerate((4, 30, 8, 25, 6, 20, 5, 3))]
CURRENT = [make_sample(i, n, rl_step=1) for i, n in enumerate((5, 7, 4, 6, 5, 8, 3, 6, 4, 5))]


def test_longest_tail_is_the_longest_fraction_ties_in_order() -> None:
    assert [s.num_tokens for s in longest_tail(PREVIOUS, 0.5)] == [30, 25, 20, 8]
    assert [s.num_tokens for s in longest_tail(PREVIOUS, 0.01)] == [30]
    ties = [make_sample(i, 5) for i in range(4)]
    assert [s.request_index for s in longest_tail(ties, 0.5)] == [0, 1]
    assert longest_tail([], 0.5) == []


def test_selection_fits_the_budget_uses_each_sample_once_and_mixes_by_tokens() -> None:
    rng = random.Random(0)
    prev_share = []
    # Budgets well above the sequence lengths, as in training (the mix has one-sequence grain).
    for budget in (64, 96, 128):
        for _ in range(50):
            chosen = select_offset(CURRENT, PREVIOUS, budget, 0.5, 0.5, rng)
            assert chosen and sum(s.num_tokens for s in chosen) <= budget
            assert len({s.key for s in chosen}) == len(chosen)
            prev = [s for s in chosen if s.rl_step == 0]
            # previous-step samples come only from its longest half
            assert all(s.num_tokens >= 8 for s in prev)
            prev_share.append(sum(s.num_tokens for s in prev) / budget)
    mean_share = sum(prev_share) / len(prev_share)
    assert 0.4 < mean_share < 0.6, mean_share


def test_mix_zero_and_one() -> None:
    rng = random.Random(0)
    # mix 0: this step first; the tail only fills room this step cannot
    chosen = select_offset(CURRENT, PREVIOUS, 20, 0.0, 0.5, rng)
    assert all(s.rl_step == 1 for s in chosen)
    everything = select_offset(CURRENT, PREVIOUS, 200, 0.0, 0.5, rng)
    assert sum(s.rl_step == 0 for s in everything) == 4  # the whole tail, after all of CURRENT
    # mix 1: the tail first
    chosen = select_offset(CURRENT, PREVIOUS, 30, 1.0, 0.5, rng)
    assert chosen[0].rl_step == 0


def test_one_long_tail_sample_gets_in_even_when_it_overshoots_the_share() -> None:
    long_only = [make_sample(0, 30, rl_step=0)]
    chosen = select_offset(CURRENT, long_only, 40, 0.25, 1.0, random.Random(0))
    assert chosen[0].rl_step == 0 and chosen[0].num_tokens == 30


def test_empty_pools_and_over_long_samples() -> None:
    rng = random.Random(0)
    assert select_offset([], [], 10, 0.5, 0.5, rng) == []
    only_prev = select_offset([], PREVIOUS, 40, 0.0, 0.5, rng)
    assert only_prev and all(s.rl_step == 0 for s in only_prev)
    cut = select_offset([make_sample(0, 50)], [], 16, 0.5, 0.5, rng)
    assert [s.num_tokens for s in cut] == [16]


def test_same_rng_state_same_choice() -> None:
    def run(seed: int) -> list:
        rng = random.Random(seed)
        return [[s.key for s in select_offset(CURRENT, PREVIOUS, 32, 0.5, 0.5, rng)]
                for _ in range(10)]
    assert run(1) == run(1)
    assert run(1) != run(2)

"""DataBuffer: capacity never exceeded, FIFO eviction, steps, rewards, deterministic batches."""

from __future__ import annotations

import math
import random

import pytest

from fastdraft.databuffer import DataBuffer
from tests.databuffer.helpers import make_sample, sample_bytes


def _check_invariants(buf: DataBuffer) -> None:
    stats, resident = buf.stats(), buf.samples()
    assert stats.num_bytes <= buf.capacity_bytes
    assert stats.num_bytes == sum(s.nbytes for s in resident)
    assert stats.num_tokens == sum(s.num_tokens for s in resident)
    assert stats.num_samples == len(resident) == len({s.window_key for s in resident})


@pytest.mark.parametrize("seed", range(4))
def test_capacity_is_never_exceeded_under_random_operations(seed: int) -> None:
    rng = random.Random(seed)
    capacity = sample_bytes(120, num_aux=1)
    buf = DataBuffer(capacity, offset_mix=rng.random(), seed=seed)
    step, next_index, keys = 0, 0, []
    for _ in range(300):
        op = rng.random()
        if op < 0.5:
            n = rng.choice([rng.randint(1, 40), rng.randint(100, 130)])  # a few too large
            sample = make_sample(next_index, n, rl_step=step, num_aux=1)
            next_index += 1
            if sample.nbytes > capacity:   # held as windows that fit, never refused
                cut_before = buf.stats().cut_samples
                buf.add(sample)
                keys.append(sample.key)
                assert buf.stats().cut_samples == cut_before + 1
                windows = [s for s in buf.samples() if s.key == sample.key]
                assert windows and windows[-1].positions[-1] == n - 1   # the newest: the end
            else:
                evicted = buf.add(sample)
                keys.append(sample.key)
                assert sample.key not in evicted
        elif op < 0.75:
            budget = rng.randint(1, 100)
            batch = buf.sample(budget, pad_to_budget=rng.random() < 0.5)
            resident = {s.key: s for s in buf.samples()}
            if batch is None:
                assert buf.stats().current_samples + buf.stats().previous_samples == 0
                continue
            assert batch.num_tokens <= budget and batch.input_ids.shape[1] <= budget
            for key in batch.keys:  # single-threaded: all still resident, this or last step
                assert key in resident and key[0] in (step, step - 1)
        elif op < 0.85:
            buf.advance_step()
            step += 1
        elif keys:
            key = rng.choice(keys)
            found = buf.set_reward(key, rng.random())
            assert found == (key in {s.key for s in buf.samples()})
        _check_invariants(buf)
    assert buf.stats().evicted_samples > 0


def test_eviction_is_oldest_first_and_reported() -> None:
    buf = DataBuffer(sample_bytes(30))
    for i in range(3):
        assert buf.add(make_sample(i, 10)) == []
    assert buf.add(make_sample(3, 15)) == [(0, 0), (0, 1)]
    assert [s.request_index for s in buf.samples()] == [2, 3]
    stats = buf.stats()
    assert (stats.num_samples, stats.num_tokens, stats.evicted_samples) == (2, 25, 2)
    assert stats.num_bytes == sample_bytes(25) and stats.capacity_bytes == sample_bytes(30)


def test_rejects_oversized_duplicate_and_bad_arguments() -> None:
    with pytest.raises(ValueError, match="raise capacity_bytes"):   # not even one pair fits
        DataBuffer(sample_bytes(1)).add(make_sample(0, 11))
    buf = DataBuffer(sample_bytes(10))
    buf.add(make_sample(0, 4))
    with pytest.raises(ValueError, match="already in the buffer"):
        buf.add(make_sample(0, 4))
    with pytest.raises(ValueError, match="token_budget"):
        buf.sample(0)
    for kwargs in ({"capacity_bytes": 0}, {"capacity_bytes": 10, "offset_mix": 1.5},
                   {"capacity_bytes": 10, "tail_fraction": 0.0}):
        with pytest.raises(ValueError):
            DataBuffer(**kwargs)
    with pytest.raises(ValueError, match="spill_dir"):
        buf.flush()


def test_rewards_arrive_later_and_reach_batches() -> None:
    buf = DataBuffer(sample_bytes(20))
    buf.add(make_sample(0, 8))
    batch = buf.sample(16)
    assert batch is not None and math.isnan(batch.rewards[0])
    assert buf.set_reward((0, 0), 0.75)
    batch = buf.sample(16)
    assert batch is not None and batch.rewards.tolist() == [0.75]
    assert not buf.set_reward((0, 99), 1.0)  # unknown or evicted: nothing to set
    with pytest.raises(ValueError, match="finite"):
        buf.set_reward((0, 0), float("inf"))
    buf.add(make_sample(1, 15))  # evicts (0, 0)
    assert not buf.set_reward((0, 0), 1.0)


def test_steps_offset_sampling_and_stale_samples() -> None:
    buf = DataBuffer(10**6, offset_mix=0.5, seed=0, tail_fraction=0.25)
    lengths = [4, 6, 40, 5, 7, 36, 3, 5]
    for i, n in enumerate(lengths):
        buf.add(make_sample(i, n, rl_step=0))
    batch = buf.sample(1000)
    assert batch is not None and sorted(batch.seq_lens.tolist()) == sorted(lengths)

    buf.advance_step()
    for i in range(6):
        buf.add(make_sample(i, 6, rl_step=1))
    stats = buf.stats()
    assert (stats.step, stats.current_samples, stats.previous_samples) == (1, 6, 8)
    seen_prev = set()
    for _ in range(20):
        batch = buf.sample(64)
        assert batch is not None
        seen_prev |= {k for k in batch.keys if k[0] == 0}
        assert any(k[0] == 1 for k in batch.keys)
    assert seen_prev == {(0, 2), (0, 5)}  # only the previous step's longest quarter

    buf.advance_step()
    buf.advance_step()  # steps 0 and 1 are now too old to sample
    assert buf.sample(64) is None
    assert buf.stats().num_samples == 14  # but they stay until evicted


def test_same_seed_same_batches() -> None:
    def run(seed: int) -> list:
        buf = DataBuffer(10**6, seed=seed)
        for i in range(12):
            buf.add(make_sample(i, 3 + i % 5, rl_step=0))
        buf.advance_step()
        for i in range(12):
            buf.add(make_sample(i, 3 + i % 7, rl_step=1))
        out = []
        for _ in range(10):
            batch = buf.sample(24)
            assert batch is not None
            out.append(batch.keys)
        return out
    assert run(3) == run(3)
    assert run(3) != run(4)


def test_held_out_rollouts_are_never_trained_on_and_are_what_held_out_returns() -> None:
    buf = DataBuffer(10**8, holdout_every=4, seed=0)
    for i in range(16):
        buf.add(make_sample(i, 6 + i % 3, rl_step=0))
    held = {(0, i) for i in range(16) if i % 4 == 0}
    assert {(0, i) for i in range(16) if buf.is_held_out((0, i))} == held
    drawn = set()
    for _ in range(50):
        batch = buf.sample(40)
        drawn.update(batch.keys)
    assert drawn == {(0, i) for i in range(16)} - held
    batches = buf.held_out(token_budget=10)   # one sample per batch: each holds 6-8 tokens
    assert sorted(k for b in batches for k in b.keys) == sorted(held)
    assert len(batches) == 4
    # A step later the choice rotates, and the newest step's held-out rollouts are returned.
    buf.advance_step()
    for i in range(8):
        buf.add(make_sample(i, 6, rl_step=1))
    assert sorted(k for b in buf.held_out(100) for k in b.keys) == [(1, 3), (1, 7)]
    buf.advance_step()   # nothing held out of this step yet: the previous one's
    assert sorted(k for b in buf.held_out(100) for k in b.keys) == [(1, 3), (1, 7)]
    buf.advance_step()   # two steps old: too stale to judge the next drafter by
    assert buf.held_out(100) == [] and DataBuffer(10**8).held_out(100) == []
    with pytest.raises(ValueError, match="holdout_every"):
        DataBuffer(10**8, holdout_every=1)


def test_a_held_out_rollout_is_kept_whole_or_as_a_prefix_never_as_windows() -> None:
    buf = DataBuffer(10**8, holdout_every=2, max_sample_tokens=8, window_context=2,
                     holdout_tokens=20)
    buf.add(make_sample(0, 30))   # held out: its first 20 tokens, prompt included
    buf.add(make_sample(1, 30))   # trained on: windows of 8
    buf.add(make_sample(2, 12))   # held out, whole
    held = {k: s for k, s in ((s.key, s) for s in buf.samples()) if buf.is_held_out(k)}
    assert sorted(held) == [(0, 0), (0, 2)]
    assert held[(0, 0)].num_tokens == 20 and held[(0, 0)].start == 0
    assert held[(0, 2)].num_tokens == 12
    assert len([s for s in buf.samples() if s.key == (0, 1)]) > 1

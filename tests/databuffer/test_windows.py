"""Long rollouts are held as windows, never refused: contiguous positions, each hidden state a
training target in exactly one window, one reward for all of a rollout's windows, spilled and
restored like any sample."""

from __future__ import annotations

import itertools

import pytest
import torch

from fastdraft.databuffer import DataBuffer, load_spill
from fastdraft.databuffer.windows import cut_windows
from tests.databuffer.helpers import make_sample, sample_bytes


def test_a_long_sample_becomes_overlapping_windows_with_its_own_positions() -> None:
    sample = make_sample(3, 25, rl_step=1, num_aux=2, prompt_len=4)
    windows = cut_windows(sample, 10)
    assert [(w.start, w.num_tokens) for w in windows] == [(0, 10), (9, 10), (18, 7)]
    for w in windows:
        cut = slice(w.start, w.start + w.num_tokens)
        assert w.positions.tolist() == list(range(cut.start, cut.stop))
        assert torch.equal(w.token_ids, sample.token_ids[cut])
        assert torch.equal(w.hidden, sample.hidden[cut])
        assert torch.equal(w.loss_mask, sample.loss_mask[cut])
        assert all(torch.equal(a, b[cut]) for a, b in zip(w.aux_hidden, sample.aux_hidden))
        assert w.key == sample.key and w.hidden.untyped_storage().nbytes() == w.hidden.nbytes
    # A window predicts hidden t + 1 from its pairs (t, t + 1): every target once, as uncut.
    targets = [p for w in windows for p in w.positions[1:].tolist()]
    assert sorted(targets) == list(range(1, 25))
    assert len(cut_windows(sample, 25)) == 1 and cut_windows(sample, 25)[0] is sample


@pytest.mark.parametrize("context", [1, 4, 8])
def test_windows_lead_with_unscored_context_and_score_every_pair_once(context: int) -> None:
    sample = make_sample(3, 40, num_aux=1, prompt_len=4)
    windows = cut_windows(sample, 10, context)

    def scored(s):   # the positions t whose pair (t, t + 1) a loss trains: both tokens valid
        m = s.loss_mask
        return s.positions[:-1][m[:-1] & m[1:]].tolist()
    pairs = [t for w in windows for t in scored(w)]
    assert sorted(pairs) == scored(sample)   # each once, none lost, none new
    assert windows[0].start == 0 and all(w.num_tokens <= 10 for w in windows)
    for before, w in itertools.pairwise(windows):
        first = scored(w)[0]
        assert first == scored(before)[-1] + 1
        assert w.start == first - context   # led by `context` tokens, unscored
        assert not w.loss_mask[:context].any() and w.loss_mask[context:].all()
        cut = slice(w.start, w.start + w.num_tokens)
        assert torch.equal(w.hidden, sample.hidden[cut])
        assert torch.equal(w.aux_hidden[0], sample.aux_hidden[0][cut])
    with pytest.raises(ValueError, match="context"):
        cut_windows(sample, 10, 9)


def test_the_buffer_leads_its_windows_with_context() -> None:
    buf = DataBuffer(sample_bytes(1000), max_sample_tokens=8, window_context=3)
    buf.add(make_sample(1, 20))
    held = buf.samples()
    assert [(s.start, s.num_tokens) for s in held] == [(0, 8), (4, 8), (8, 8), (12, 8)]
    assert [int((~s.loss_mask).sum()) for s in held] == [2, 3, 3, 3]   # prompt, then context
    with pytest.raises(ValueError, match="window_context"):
        DataBuffer(100, window_context=-1)


def test_windows_without_an_answer_token_are_left_out() -> None:
    sample = make_sample(0, 30, prompt_len=21)   # loss mask from token 21 on
    windows = cut_windows(sample, 10)
    assert [w.start for w in windows] == [18, 27]
    with pytest.raises(ValueError, match="2 tokens"):
        cut_windows(sample, 1)


def test_the_buffer_cuts_long_samples_and_rewards_reach_every_window() -> None:
    buf = DataBuffer(sample_bytes(1000), max_sample_tokens=8)
    buf.add(make_sample(0, 5))
    buf.add(make_sample(1, 20))
    held = buf.samples()
    assert [(s.request_index, s.start, s.num_tokens) for s in held] == [
        (0, 0, 5), (1, 0, 8), (1, 7, 8), (1, 14, 6)]
    assert buf.stats().cut_samples == 1 and buf.stats().num_samples == 4
    assert buf.set_reward((0, 1), 0.5)
    assert [s.reward for s in buf.samples()] == [None, 0.5, 0.5, 0.5]
    batch = buf.sample(8)   # every window fits a micro-batch: none is cut to its prefix
    assert batch is not None and batch.num_tokens <= 8


def test_a_sample_larger_than_the_capacity_is_windowed_not_refused() -> None:
    capacity = sample_bytes(12, num_aux=1)
    buf = DataBuffer(capacity)
    evicted = buf.add(make_sample(0, 30, num_aux=1))
    held = buf.samples()
    assert held and all(s.nbytes <= capacity for s in held)
    assert buf.stats().num_bytes <= capacity and held[-1].positions[-1] == 29
    assert evicted and set(evicted) == {(0, 0)}   # its own first windows made room


def test_windows_spill_and_restore_as_distinct_samples(tmp_path) -> None:
    buf = DataBuffer(sample_bytes(100), spill_dir=tmp_path, max_sample_tokens=6)
    buf.add(make_sample(0, 14, reward=None))
    buf.set_reward((0, 0), 1.0)
    buf.flush()
    on_disk = load_spill(tmp_path)
    assert [(s.key, s.start) for s in on_disk] == [((0, 0), 0), ((0, 0), 5), ((0, 0), 10)]
    assert all(s.reward == 1.0 for s in on_disk)
    restored = DataBuffer.restore(tmp_path, sample_bytes(100))
    assert [s.window_key for s in restored.samples()] == [(0, 0, 0), (0, 0, 5), (0, 0, 10)]
    assert restored.set_reward((0, 0), 0.25)
    assert {s.reward for s in load_spill(tmp_path)} == {0.25}


def test_the_sampling_rng_state_round_trips() -> None:
    def batches(buf: DataBuffer) -> list:
        return [buf.sample(16).keys for _ in range(5)]
    first, second = DataBuffer(sample_bytes(500), seed=3), DataBuffer(sample_bytes(500), seed=9)
    for buf in (first, second):
        for i in range(12):
            buf.add(make_sample(i, 3 + i % 5))
    first.sample(16)
    second.set_rng_state([list(x) if isinstance(x, tuple) else x
                          for x in first.rng_state()])   # as a JSON checkpoint hands it back
    assert batches(first) == batches(second)

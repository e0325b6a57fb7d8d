"""pack / pad: field layout, boundaries, the block-diagonal causal mask, boundary-safe targets."""

from __future__ import annotations

import math

import pytest
import torch

from fastdraft.databuffer import (
    block_causal_mask,
    pack,
    pad,
    per_sequence_mean,
    shifted_valid,
)
from tests.databuffer.helpers import make_sample


def _samples(lengths=(3, 5, 2), num_aux=0):
    return [make_sample(i, n, num_aux=num_aux, reward=None if i == 1 else float(i),
                        policy_version=10 + i) for i, n in enumerate(lengths)]


def test_pack_concatenates_with_positions_restarting_per_sequence() -> None:
    samples = _samples(num_aux=2)
    b = pack(samples, token_budget=16)
    assert b.input_ids.shape == (1, 10) and b.hidden.shape == (1, 10, 4)
    assert [a.shape for a in b.aux_hidden] == [(1, 10, 4)] * 2
    assert b.positions[0].tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1]
    assert b.segment_ids[0].tolist() == [0] * 3 + [1] * 5 + [2] * 2
    assert torch.equal(b.input_ids[0], torch.cat([s.token_ids for s in samples]))
    assert torch.equal(b.hidden[0], torch.cat([s.hidden for s in samples]))
    assert torch.equal(b.aux_hidden[1][0], torch.cat([s.aux_hidden[1] for s in samples]))
    assert torch.equal(b.loss_mask[0], torch.cat([s.loss_mask for s in samples]))
    assert b.seq_lens.tolist() == [3, 5, 2] and b.num_tokens == 10 and b.density == 1.0
    assert b.rewards[0] == 0.0 and math.isnan(b.rewards[1]) and b.rewards[2] == 2.0
    assert b.policy_versions.tolist() == [10, 11, 12]
    assert b.keys == ((0, 0), (0, 1), (0, 2)) and b.num_sequences == 3


def test_pack_to_budget_pads_the_tail() -> None:
    b = pack(_samples(), token_budget=14, pad_to_budget=True)
    assert b.input_ids.shape == (1, 14) and b.num_tokens == 10
    assert b.segment_ids[0, 10:].tolist() == [-1] * 4
    assert not b.loss_mask[0, 10:].any() and not b.hidden[0, 10:].any()
    assert b.density == pytest.approx(10 / 14)


def test_pack_refuses_more_than_the_budget_and_mixed_shapes() -> None:
    with pytest.raises(ValueError, match="raise token_budget"):
        pack(_samples(), token_budget=9)
    with pytest.raises(ValueError, match="zero samples"):
        pack([], token_budget=9)
    with pytest.raises(ValueError, match="hidden size"):
        pack([make_sample(0, 3), make_sample(1, 3, hidden_size=8)], token_budget=9)
    with pytest.raises(ValueError, match="aux"):
        pad([make_sample(0, 3), make_sample(1, 3, num_aux=1)])


def test_pad_gives_one_right_padded_row_per_sequence() -> None:
    samples = _samples(num_aux=1)
    b = pad(samples)
    assert b.input_ids.shape == (3, 5) and b.aux_hidden[0].shape == (3, 5, 4)
    for i, s in enumerate(samples):
        n = s.num_tokens
        assert torch.equal(b.input_ids[i, :n], s.token_ids) and not b.input_ids[i, n:].any()
        assert torch.equal(b.hidden[i, :n], s.hidden)
        assert b.segment_ids[i].tolist() == [i] * n + [-1] * (5 - n)
        assert b.loss_mask[i].tolist() == s.loss_mask.tolist() + [False] * (5 - n)
    assert b.num_tokens == 10 and b.density == pytest.approx(10 / 15)


def test_block_causal_mask_equals_a_brute_force_reference() -> None:
    seg = torch.tensor([[0, 0, 0, 1, 1, 2, -1, -1], [0, 0, 0, 0, 0, -1, -1, -1]])
    mask = block_causal_mask(seg)
    for b in range(2):
        for q in range(8):
            for k in range(8):
                real = bool(seg[b, q] >= 0)
                want = (bool(seg[b, q] == seg[b, k]) and k <= q) if real else q == k
                assert bool(mask[b, q, k]) == want, (b, q, k)


def test_shifted_valid_never_crosses_a_boundary() -> None:
    # every token is an answer token, so only boundaries and padding limit the pairs
    samples = [make_sample(i, n, prompt_len=0) for i, n in enumerate((3, 2, 4))]
    b = pack(samples, token_budget=11, pad_to_budget=True)
    assert shifted_valid(b, 1)[0].int().tolist() == [1, 1, 0, 1, 0, 1, 1, 1, 0, 0, 0]
    assert shifted_valid(b, 2)[0].int().tolist() == [1, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0]
    assert not shifted_valid(b, 11).any()
    with pytest.raises(ValueError):
        shifted_valid(b, 0)


def test_per_sequence_mean_ignores_unscored_and_non_finite_slots() -> None:
    b = pack(_samples(), token_budget=10)
    values = torch.arange(10, dtype=torch.float32).view(1, 10)
    values[0, 9] = float("inf")
    valid = torch.tensor([[1, 1, 0, 0, 0, 1, 1, 0, 0, 0]], dtype=torch.bool)
    means, counts = per_sequence_mean(values, valid, b)
    assert means.tolist() == [0.5, 5.5, 0.0] and counts.tolist() == [2, 2, 0]

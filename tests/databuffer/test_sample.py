"""Sample: normalised to what the buffer stores, checked on construction, nbytes exact."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fastdraft.databuffer import Sample
from tests.databuffer.helpers import make_sample, sample_bytes


def _kwargs(num_tokens: int = 6, hidden_size: int = 4) -> dict:
    return dict(request_index=3, policy_version=1, rl_step=2,
                token_ids=torch.arange(num_tokens, dtype=torch.int32),
                positions=torch.arange(num_tokens), hidden=torch.randn(num_tokens, hidden_size),
                loss_mask=torch.tensor([0, 0, 1, 1, 1, 1][:num_tokens]))


def test_tensors_are_normalised_to_host_storage_dtypes() -> None:
    s = Sample(**_kwargs(), aux_hidden=(torch.randn(6, 4, dtype=torch.float64),))
    assert s.token_ids.dtype == s.positions.dtype == torch.int64
    assert s.loss_mask.dtype == torch.bool and s.loss_mask.tolist() == [False] * 2 + [True] * 4
    assert s.hidden.dtype == s.aux_hidden[0].dtype == torch.bfloat16
    assert s.key == (2, 3) and s.num_tokens == 6 and s.hidden_size == 4


def test_nbytes_counts_every_tensor() -> None:
    assert make_sample(0, 7).nbytes == sample_bytes(7)
    assert make_sample(0, 7, num_aux=3, hidden_size=8).nbytes == sample_bytes(7, 8, 3)


def test_a_slice_of_a_larger_tensor_is_copied_so_nbytes_is_what_it_pins() -> None:
    step_hidden = torch.randn(100, 4, dtype=torch.bfloat16)  # a whole step's states
    kw = _kwargs()
    kw["hidden"] = step_hidden[10:16]
    s = Sample(**kw)
    assert s.hidden.untyped_storage().nbytes() == s.hidden.nbytes == 6 * 4 * 2
    assert torch.equal(s.hidden, step_hidden[10:16])


@pytest.mark.parametrize("change, match", [
    ({"token_ids": torch.zeros(6)}, "integers"),
    ({"token_ids": torch.zeros(0, dtype=torch.long)}, "T >= 1"),
    ({"positions": torch.arange(5)}, "positions"),
    ({"loss_mask": torch.ones(7, dtype=torch.bool)}, "loss_mask"),
    ({"hidden": torch.randn(5, 4)}, "hidden"),
    ({"hidden": torch.ones(6, 4, dtype=torch.long)}, "floating"),
    ({"aux_hidden": (torch.randn(6, 3),)}, "aux_hidden"),
    ({"reward": float("nan")}, "finite"),
    ({"hidden": [[0.0]]}, "torch.Tensor"),
])
def test_invalid_samples_are_rejected(change: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Sample(**{**_kwargs(), **change})


def test_frozen_and_rewards_make_new_records() -> None:
    s = make_sample(0, 5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.reward = 1.0  # type: ignore[misc]
    r = s.with_reward(1)
    assert r.reward == 1.0 and isinstance(r.reward, float) and s.reward is None
    assert r.hidden.data_ptr() == s.hidden.data_ptr()  # no tensor copy for a reward


def test_truncated_keeps_the_prefix_and_owns_its_storage() -> None:
    s = make_sample(0, 10, num_aux=1)
    t = s.truncated(4)
    assert t.num_tokens == 4 and t.nbytes == sample_bytes(4, num_aux=1)
    assert torch.equal(t.token_ids, s.token_ids[:4]) and torch.equal(t.hidden, s.hidden[:4])
    assert torch.equal(t.aux_hidden[0], s.aux_hidden[0][:4])
    assert s.truncated(10) is s
    with pytest.raises(ValueError):
        s.truncated(11)

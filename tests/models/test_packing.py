from __future__ import annotations

import pytest
import torch

from fastdraft.models import load_model, load_named_tensors
from fastdraft.models.packing import pack_for_inference
from tests.conftest import make_tiny_checkpoint


@pytest.mark.parametrize("model_type", ["qwen2", "llama", "qwen3"])
def test_packed_inference_equals_reference_and_follows_weight_loads(model_type, tmp_path):
    make_tiny_checkpoint(tmp_path / "a", model_type=model_type)
    other = make_tiny_checkpoint(tmp_path / "b", model_type=model_type, seed=1)
    ref, packed = load_model(tmp_path / "a"), pack_for_inference(load_model(tmp_path / "a"))
    ids, pos = torch.randint(0, 64, (2, 9)), torch.arange(9).expand(2, -1)
    with torch.inference_mode():
        torch.testing.assert_close(packed(ids, pos)[0], ref(ids, pos)[0], atol=1e-5, rtol=0)
    load_named_tensors(packed, other.state_dict().items())  # an RL step's weight push
    with torch.inference_mode():
        torch.testing.assert_close(packed(ids, pos)[0], other(ids).logits, atol=1e-4, rtol=0)


def test_training_through_a_packed_model_updates_its_weights(tmp_path):
    make_tiny_checkpoint(tmp_path)
    model = pack_for_inference(load_model(tmp_path))
    ids, pos = torch.randint(0, 64, (1, 6)), torch.arange(6)[None]
    logits, _ = model(ids, pos)
    logits.sum().backward()
    q = model.model.layers[0].self_attn.q_proj.weight
    assert q.grad is not None and q.grad.abs().sum() > 0

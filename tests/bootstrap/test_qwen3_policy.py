"""A Qwen3 bootstrap (a few steps of a small ``tiny-qwen3``): a checkpoint that transformers
loads as a Qwen3 and runs to the same logits as fastdraft's decoder, with its QK-norm trained and
head_dim as set (its q projection wider than hidden_size, as in Qwen3); and its EAGLE-3 warm-up
drafter through the path a recipe takes (``ensure_drafter``)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import transformers
from safetensors.torch import load_file

from fastdraft.bootstrap.policy import encode_prompt
from fastdraft.bootstrap.run import run_bootstrap
from fastdraft.bootstrap.spec import get_spec
from fastdraft.demo import ensure_drafter
from fastdraft.drafter.checkpoint import load_drafter
from fastdraft.drafter.warmup import WarmupConfig
from fastdraft.models import load_model

# hidden 32 but 2 heads x 64: q is 128 wide, k and v 64 (one kv head).
SMALL_QWEN3 = replace(get_spec("tiny-qwen3"), hidden_size=32, intermediate_size=64,
                      num_layers=8, num_heads=2, num_kv_heads=1, head_dim=64, steps=6,
                      batch_size=8, warmup_steps=1, bucket_batches=2, num_dev=8,
                      num_heldout=8, eval_batch_size=8, max_new_tokens=16)


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory):
    return run_bootstrap(tmp_path_factory.mktemp("cache"), spec=SMALL_QWEN3, log=lambda _: None)


def test_writes_a_qwen3_checkpoint_with_head_dim_and_trained_qk_norm(report) -> None:
    hf_config = json.loads((report.policy_dir / "config.json").read_text())
    assert hf_config["model_type"] == "qwen3"
    assert hf_config["architectures"] == ["Qwen3ForCausalLM"]
    assert hf_config["head_dim"] == 64 and hf_config["hidden_size"] == 32
    weights = load_file(report.policy_dir / "model.safetensors")
    q_norm = weights["model.layers.0.self_attn.q_norm.weight"]
    assert q_norm.shape == (64,) and "model.layers.0.self_attn.k_norm.weight" in weights
    assert not torch.equal(q_norm, torch.ones(64))  # trained, not left at its init
    assert weights["model.layers.0.self_attn.q_proj.weight"].shape == (2 * 64, 32)
    assert not any(name.endswith("q_proj.bias") for name in weights)  # Qwen3: no qkv bias
    assert report.spec["architecture"] == "qwen3" and report.spec["head_dim"] == 64
    assert report.policy_dir.parent.name == f"modsum-{SMALL_QWEN3.digest(0)}"


def test_transformers_loads_it_as_qwen3_with_the_same_logits(report) -> None:
    ours = load_model(report.policy_dir)
    assert ours.config.qk_norm and not ours.config.qkv_bias and ours.config.head_dim == 64
    hf = transformers.AutoModelForCausalLM.from_pretrained(report.policy_dir,
                                                           attn_implementation="eager").eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    tokenizer = transformers.AutoTokenizer.from_pretrained(report.policy_dir)
    ids = torch.tensor([encode_prompt(tokenizer, "12+7+30+4+5+66=")])
    positions = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        logits, _ = ours(ids, positions)
        ref = hf(ids).logits
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)


def test_eagle3_warmup_drafter_for_it_through_ensure_drafter(report, capsys) -> None:
    warmup = WarmupConfig(kind="eagle3", num_rollouts=8, max_new_tokens=12, steps=3,
                          batch_size=4, warmup_steps=1)
    out = ensure_drafter(report.policy_dir, None, warmup=warmup)
    assert out.parent == report.policy_dir.parent and out.name.startswith("drafter-eagle3")
    policy = load_model(report.policy_dir)
    drafter = load_drafter(out, policy, 64)
    assert drafter.aux_layers == (2, 4, 5) and type(drafter).__name__ == "Eagle3Drafter"
    assert "drafter step 3/3" in capsys.readouterr().out
    assert ensure_drafter(report.policy_dir, None, warmup=warmup) == out  # cached: not retrained
    assert "warming" not in capsys.readouterr().out

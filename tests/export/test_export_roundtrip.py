"""Exported directories hold exactly the trained drafter: reloaded through the inverse name
mapping, a fresh drafter computes bit-identical steps."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from fastdraft.drafter import build_drafter, save_drafter
from fastdraft.engine.spec.draft_head import DraftHead
from fastdraft.export import export_drafter, load_exported_drafter
from fastdraft.export.sources import read_policy_lm_head
from tests.conftest import make_tiny_checkpoint
from tests.export.conftest import MAX_POSITIONS, load_policy, saved_drafter


def _assert_same_steps(original, reloaded) -> None:
    torch.manual_seed(7)
    hidden = original.config.hidden_size
    features = torch.randn(2, 5, hidden)
    ids = torch.randint(0, original.config.vocab_size, (2, 5))
    positions = torch.arange(1, 6).expand(2, -1)
    with torch.no_grad():
        want_out, want_logits = original.step(features, ids, positions)
        got_out, got_logits = reloaded.step(features, ids, positions)
        assert torch.equal(got_out, want_out)
        assert torch.equal(got_logits, want_logits)
        want_draft = DraftHead(original).logits(want_out)
        assert torch.equal(DraftHead(reloaded).logits(got_out), want_draft)


def _read(path):
    config = json.loads((path / "config.json").read_text())
    return config, load_file(str(path / "model.safetensors"))


def test_eagle1_llama_both_variants_round_trip(llama_policy_dir, tmp_path):
    policy = load_policy(llama_policy_dir)
    drafter = saved_drafter(policy, "eagle1", tmp_path / "drafter")
    written = export_drafter(tmp_path / "drafter", llama_policy_dir, tmp_path / "out", "all")
    assert written == [tmp_path / "out" / "sglang", tmp_path / "out" / "vllm"]

    sglang_cfg, sglang = _read(written[0])
    vllm_cfg, vllm = _read(written[1])
    assert sglang_cfg["architectures"] == ["LlamaForCausalLMEagle"]
    assert vllm_cfg["architectures"] == ["LlamaForCausalLM"]
    assert torch.equal(sglang["fc.bias"], torch.zeros(64, dtype=torch.bfloat16))
    assert set(sglang) - set(vllm) == {"fc.bias"}
    for cfg in (sglang_cfg, vllm_cfg):
        assert cfg["num_hidden_layers"] == 1 and cfg["vocab_size"] == 64
        assert (cfg["hidden_size"], cfg["num_key_value_heads"], cfg["head_dim"]) == (64, 2, 16)
        assert {"rope_theta", "rope_scaling", "max_position_embeddings", "rms_norm_eps",
                "intermediate_size", "num_attention_heads"} <= set(cfg)
    assert not any(k.startswith(("lm_head", "embed_tokens", "norm")) or "input_layernorm" in k
                   for k in vllm)
    assert sglang["fc.weight"].dtype == torch.bfloat16
    for path in written:
        _assert_same_steps(drafter, load_exported_drafter(path, policy, MAX_POSITIONS))


def test_qwen2_target_gets_qwen2_eagle_class_and_keeps_qkv_biases(qwen2_policy_dir, tmp_path):
    policy = load_policy(qwen2_policy_dir)
    drafter = saved_drafter(policy, "eagle1", tmp_path / "drafter", seed=1)
    sglang_dir, vllm_dir = export_drafter(tmp_path / "drafter", qwen2_policy_dir,
                                          tmp_path / "out", "all")
    sglang_cfg, sglang = _read(sglang_dir)
    vllm_cfg, vllm = _read(vllm_dir)
    assert sglang_cfg["architectures"] == ["Qwen2ForCausalLMEagle"]
    assert sglang_cfg["model_type"] == "qwen2"
    assert "layers.0.self_attn.q_proj.bias" in sglang
    assert "layers.0.self_attn.o_proj.bias" not in sglang
    # vLLM's Llama layer: qkv_bias switches the q/k/v biases on, attention_bias o_proj's off.
    assert vllm_cfg["architectures"] == ["LlamaForCausalLM"]
    assert vllm_cfg["qkv_bias"] is True and vllm_cfg["attention_bias"] is False
    assert "layers.0.self_attn.v_proj.bias" in vllm
    for path in (sglang_dir, vllm_dir):
        _assert_same_steps(drafter, load_exported_drafter(path, policy, MAX_POSITIONS))


def test_eagle3_full_vocabulary_round_trip(llama_policy_dir, tmp_path):
    policy = load_policy(llama_policy_dir)
    drafter = saved_drafter(policy, "eagle3", tmp_path / "drafter", seed=2)
    [out] = export_drafter(tmp_path / "drafter", llama_policy_dir, tmp_path / "out", "sglang")
    assert out == tmp_path / "out"
    cfg, tensors = _read(out)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["draft_vocab_size"] is None and "draft_vocab_size" in cfg
    assert cfg["tie_word_embeddings"] is False and cfg["torch_dtype"] == "bfloat16"
    assert "eagle_config" not in cfg
    assert not {"d2t", "t2d"} & set(tensors) and not any("embed" in k for k in tensors)
    assert tensors["fc.weight"].shape == (64, 192)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (64, 128)
    assert torch.equal(tensors["lm_head.weight"], policy.lm_head.weight.to(torch.bfloat16))
    _assert_same_steps(drafter, load_exported_drafter(out, policy, MAX_POSITIONS))


def test_eagle3_draft_vocabulary_round_trip(llama_policy_dir, tmp_path):
    policy = load_policy(llama_policy_dir)
    draft_ids = [5, 2, 40, 7, 63, 0]  # draft order is not target order
    drafter = saved_drafter(policy, "eagle3", tmp_path / "drafter", seed=3,
                            draft_token_ids=draft_ids)
    [out] = export_drafter(tmp_path / "drafter", llama_policy_dir, tmp_path / "out", "all")
    cfg, tensors = _read(out)
    assert cfg["draft_vocab_size"] == 6
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert (tensors["d2t"] + torch.arange(6)).tolist() == draft_ids
    assert tensors["t2d"].shape == (64,) and int(tensors["t2d"].sum()) == 6
    assert torch.equal(tensors["lm_head.weight"],
                       policy.lm_head.weight[draft_ids].to(torch.bfloat16))
    reloaded = load_exported_drafter(out, policy, MAX_POSITIONS)
    assert reloaded.draft_token_ids.tolist() == draft_ids
    _assert_same_steps(drafter, reloaded)


def test_tied_policy_lm_head_is_read_from_the_embedding(qwen2_policy_dir):
    policy = load_policy(qwen2_policy_dir)
    lm_head = read_policy_lm_head(qwen2_policy_dir, policy.config)
    assert torch.equal(lm_head, policy.model.embed_tokens.weight)


def test_eagle3_attention_biases_are_refused_by_name(qwen2_policy_dir, tmp_path):
    """A Qwen2 policy gives the EAGLE-3 drafter q/k/v biases; SGLang's EAGLE-3 layer has none,
    so the one directory both engines read cannot hold them, and nothing is written."""
    policy = load_policy(qwen2_policy_dir)
    saved_drafter(policy, "eagle3", tmp_path / "drafter")
    with pytest.raises(ValueError, match=r"midlayer\.self_attn\.q_proj\.bias.*no bias"):
        export_drafter(tmp_path / "drafter", qwen2_policy_dir, tmp_path / "out", "all")
    assert not (tmp_path / "out").exists()


def test_unmapped_qk_norm_is_named(tmp_path):
    make_tiny_checkpoint(tmp_path / "qwen3", model_type="qwen3")
    policy = load_policy(tmp_path / "qwen3")
    save_drafter(build_drafter("eagle1", policy.config, MAX_POSITIONS), tmp_path / "drafter")
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.k_norm\.weight.*QK-norm"):
        export_drafter(tmp_path / "drafter", tmp_path / "qwen3", tmp_path / "out", "vllm")


def test_drafter_for_another_target_is_refused(llama_policy_dir, qwen2_policy_dir, tmp_path):
    saved_drafter(load_policy(qwen2_policy_dir), "eagle1", tmp_path / "drafter")
    with pytest.raises(ValueError, match="model_type: drafter qwen2 vs target llama"):
        export_drafter(tmp_path / "drafter", llama_policy_dir, tmp_path / "out", "all")

"""Exported directories hold exactly the trained drafter: reloaded through the inverse name
mapping, a fresh drafter computes bit-identical steps."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from fastdraft.drafter import LayerLayout, build_drafter, load_drafter, save_drafter
from fastdraft.drafter.layout import LAYOUT_KEY
from fastdraft.export import export_drafter, load_exported_drafter
from fastdraft.export.names import to_engine_names
from fastdraft.export.sources import read_policy_lm_head
from fastdraft.utils.file_digest import SUMS_FILE
from tests.conftest import make_tiny_checkpoint
from tests.export.conftest import (
    MAX_POSITIONS,
    assert_same_steps,
    load_policy,
    saved_drafter,
)


def _read(path):
    config = json.loads((path / "config.json").read_text())
    return config, load_file(str(path / "model.safetensors"))


def save_legacy_drafter(policy, kind: str, out):
    """A drafter checkpoint as fastdraft wrote it before drafters had their own layer layout:
    the layer built from the policy's config (its biases, its QK-norm) and no layout recorded."""
    torch.manual_seed(0)
    drafter = build_drafter(kind, policy.config, MAX_POSITIONS,
                            LayerLayout.of(policy.config)).attach(policy)
    save_drafter(drafter, out)
    meta = json.loads((out / "drafter_config.json").read_text())
    del meta[LAYOUT_KEY]
    (out / "drafter_config.json").write_text(json.dumps(meta))
    (out / SUMS_FILE).unlink()   # nor did it keep digests
    return drafter.eval()


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
        assert_same_steps(drafter, load_exported_drafter(path, policy, MAX_POSITIONS))


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
        assert_same_steps(drafter, load_exported_drafter(path, policy, MAX_POSITIONS))


def test_eagle3_full_vocabulary_round_trip(llama_policy_dir, tmp_path):
    policy = load_policy(llama_policy_dir)
    drafter = saved_drafter(policy, "eagle3", tmp_path / "drafter", seed=2)
    [out] = export_drafter(tmp_path / "drafter", llama_policy_dir, tmp_path / "out", "sglang")
    assert out == tmp_path / "out" / "sglang"
    cfg, tensors = _read(out)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["draft_vocab_size"] is None and "draft_vocab_size" in cfg
    assert cfg["tie_word_embeddings"] is False and cfg["torch_dtype"] == "bfloat16"
    assert "eagle_config" not in cfg
    assert not {"d2t", "t2d"} & set(tensors) and not any("embed" in k for k in tensors)
    assert tensors["fc.weight"].shape == (64, 192)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (64, 128)
    assert torch.equal(tensors["lm_head.weight"], policy.lm_head.weight.to(torch.bfloat16))
    assert_same_steps(drafter, load_exported_drafter(out, policy, MAX_POSITIONS))


def test_eagle3_draft_vocabulary_round_trip(llama_policy_dir, tmp_path):
    policy = load_policy(llama_policy_dir)
    draft_ids = [5, 2, 40, 7, 63, 0]  # draft order is not target order
    drafter = saved_drafter(policy, "eagle3", tmp_path / "drafter", seed=3,
                            draft_token_ids=draft_ids)
    out, speculators = export_drafter(tmp_path / "drafter", llama_policy_dir, tmp_path / "out",
                                      "both")
    cfg, tensors = _read(out)
    assert cfg["draft_vocab_size"] == 6
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert (tensors["d2t"] + torch.arange(6)).tolist() == draft_ids
    assert tensors["t2d"].shape == (64,) and int(tensors["t2d"].sum()) == 6
    assert torch.equal(tensors["lm_head.weight"],
                       policy.lm_head.weight[draft_ids].to(torch.bfloat16))
    for path in (out, speculators):
        reloaded = load_exported_drafter(path, policy, MAX_POSITIONS)
        assert reloaded.draft_token_ids.tolist() == draft_ids and reloaded.head is None
        assert_same_steps(drafter, reloaded)
    spec_cfg, spec_tensors = _read(speculators)
    assert {n.replace("layers.0.", "midlayer."): t for n, t in spec_tensors.items()}.keys() == (
        tensors.keys())
    assert spec_cfg["draft_vocab_size"] == 6 and spec_cfg["norm_before_residual"] is False
    assert spec_cfg["eagle_aux_hidden_state_layer_ids"] == list(drafter.aux_layers)
    assert spec_cfg["target_hidden_size"] == 64
    assert spec_cfg["speculators_config"]["verifier"]["name_or_path"] == str(
        llama_policy_dir.resolve())


def test_tied_policy_lm_head_is_read_from_the_embedding(qwen2_policy_dir):
    policy = load_policy(qwen2_policy_dir)
    lm_head = read_policy_lm_head(qwen2_policy_dir, policy.config)
    assert torch.equal(lm_head, policy.model.embed_tokens.weight)


def test_legacy_eagle3_drafter_with_qkv_biases_is_refused_with_the_fix(qwen2_policy_dir,
                                                                        tmp_path):
    """A drafter saved when its layer copied the Qwen2 target's q/k/v biases: SGLang's EAGLE-3
    layer has none, so the export says why and what to do, and writes nothing."""
    save_legacy_drafter(load_policy(qwen2_policy_dir), "eagle3", tmp_path / "drafter")
    with pytest.raises(ValueError, match=r"cannot be exported: its decoder layer has q/k/v bias"
                                         r".*no bias, no QK-norm.*fastdraft drafter warmup"):
        export_drafter(tmp_path / "drafter", qwen2_policy_dir, tmp_path / "out", "all")
    assert not (tmp_path / "out").exists()


def test_legacy_eagle1_drafter_with_qk_norm_is_refused_but_still_loads(tmp_path):
    make_tiny_checkpoint(tmp_path / "qwen3", model_type="qwen3", head_dim=16)
    policy = load_policy(tmp_path / "qwen3")
    legacy = save_legacy_drafter(policy, "eagle1", tmp_path / "drafter")
    with pytest.raises(ValueError, match=r"its decoder layer has QK-norm.*--kind eagle1"):
        export_drafter(tmp_path / "drafter", tmp_path / "qwen3", tmp_path / "out", "vllm")
    # The engine still runs it: loaded with the layout it was trained with, it computes the same.
    again = load_drafter(tmp_path / "drafter", policy, MAX_POSITIONS)
    assert again.layout.qk_norm and "layers.0.self_attn.q_norm.weight" in again.state_dict()
    assert_same_steps(legacy, again)
    # The exporter's name table names what has no place, should a tensor get past that check.
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.k_norm\.weight.*QK-norm"):
        to_engine_names("eagle1", "LlamaForCausalLM", dict(legacy.state_dict()))


def test_drafter_for_another_target_is_refused(llama_policy_dir, qwen2_policy_dir, tmp_path):
    saved_drafter(load_policy(qwen2_policy_dir), "eagle1", tmp_path / "drafter")
    with pytest.raises(ValueError, match="model_type: drafter qwen2 vs target llama"):
        export_drafter(tmp_path / "drafter", llama_policy_dir, tmp_path / "out", "all")

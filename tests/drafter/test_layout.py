"""The drafter's decoder layer has its kind's own switches, not the target's: no QK-norm, and
only the biases the engines' EAGLE layers hold; checkpoints record the layout, and ones saved
before it existed still load as they were trained."""

from __future__ import annotations

import json

import pytest
import torch

from fastdraft.drafter import (
    LayerLayout,
    build_drafter,
    drafter_layer_config,
    load_drafter,
    save_drafter,
)
from fastdraft.drafter.layout import LAYOUT_KEY
from fastdraft.models import CausalLM, ModelConfig
from fastdraft.utils.file_digest import SUMS_FILE, write_sums

_SHAPE = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
TARGETS = {
    "llama": dict(model_type="llama"),
    "llama-biases": dict(model_type="llama", attention_bias=True, mlp_bias=True),
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3", head_dim=32),
    "qwen3-biases": dict(model_type="qwen3", head_dim=32, attention_bias=True),
}
QKV, ALL = {"q_proj", "k_proj", "v_proj"}, {"q_proj", "k_proj", "v_proj", "o_proj"}
# The attention projections with a bias, per (kind, target): EAGLE-3 never has any (SGLang's
# EAGLE-3 q/k/v have none); EAGLE-1 keeps the target's (every engine's EAGLE-1 class holds them).
BIASES = {("eagle1", "llama"): set(), ("eagle1", "llama-biases"): ALL, ("eagle1", "qwen2"): QKV,
          ("eagle1", "qwen3"): set(), ("eagle1", "qwen3-biases"): ALL,
          **{("eagle3", t): set() for t in TARGETS}}


def _target(name: str) -> ModelConfig:
    return ModelConfig.from_hf_dict({**_SHAPE, **TARGETS[name]})


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_drafter_layer_has_no_qk_norm_and_only_the_engines_biases(kind, target):
    cfg = _target(target)
    drafter = build_drafter(kind, cfg, 16)
    names = [n for n, _ in drafter.named_parameters()]
    assert not [n for n in names if "q_norm" in n or "k_norm" in n]
    assert not [n for n in names if ".mlp." in n and n.endswith(".bias")]
    biased = {n.split(".")[-2] for n in names if "self_attn" in n and n.endswith(".bias")}
    assert biased == BIASES[kind, target]
    layer = drafter_layer_config(kind, cfg)
    assert drafter.layer_config == layer and not layer.qk_norm and not layer.mlp_bias
    # Everything but the switches is the target's: the layer runs with its shapes and rope.
    for field in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "intermediate_size", "rms_norm_eps", "rope_theta", "vocab_size"):
        assert getattr(layer, field) == getattr(cfg, field), field
    assert drafter.config == cfg  # the drafter still knows the target it serves


def test_detached_copy_keeps_the_layout_it_was_built_with():
    cfg = _target("qwen3")
    legacy = build_drafter("eagle3", cfg, 16, LayerLayout.of(cfg))
    copy = legacy.detached()
    assert copy.layout == legacy.layout and copy.layout.qk_norm
    assert copy.state_dict().keys() == legacy.state_dict().keys()
    assert "midlayer.self_attn.k_norm.weight" in copy.state_dict()
    fresh = build_drafter("eagle3", cfg, 16).detached()
    assert "midlayer.self_attn.k_norm.weight" not in fresh.state_dict()


def test_checkpoint_records_the_layout_and_old_checkpoints_load_as_trained(tmp_path):
    cfg = _target("qwen3")
    torch.manual_seed(0)
    policy = CausalLM(cfg, 32).eval()
    save_drafter(build_drafter("eagle1", cfg, 32).attach(policy), tmp_path / "new")
    meta = json.loads((tmp_path / "new" / "drafter_config.json").read_text())
    assert meta[LAYOUT_KEY] == {"qkv_bias": False, "o_proj_bias": False, "mlp_bias": False,
                                "qk_norm": False}
    assert not load_drafter(tmp_path / "new", policy, 32).layout.qk_norm

    # Written by fastdraft before drafters had their own layout: the target's QK-norm, no key.
    old = build_drafter("eagle1", cfg, 32, LayerLayout.of(cfg)).attach(policy).eval()
    with torch.no_grad():
        old.layers[0].self_attn.q_norm.weight.mul_(1.5)
    save_drafter(old, tmp_path / "old")
    meta = json.loads((tmp_path / "old" / "drafter_config.json").read_text())
    del meta[LAYOUT_KEY]
    (tmp_path / "old" / "drafter_config.json").write_text(json.dumps(meta))
    (tmp_path / "old" / SUMS_FILE).unlink()   # older drafters kept no digests either
    loaded = load_drafter(tmp_path / "old", policy, 32)
    assert loaded.layout == LayerLayout.of(cfg) and loaded.layout.qk_norm
    features, ids = torch.randn(1, 4, 64), torch.randint(0, 64, (1, 4))
    with torch.no_grad():
        want = old.step(features, ids, torch.arange(1, 5)[None])
        got = loaded.step(features, ids, torch.arange(1, 5)[None])
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_malformed_saved_layout_is_refused_by_name(tmp_path):
    cfg = _target("llama")
    policy = CausalLM(cfg, 16)
    save_drafter(build_drafter("eagle1", cfg, 16).attach(policy), tmp_path / "d")
    meta = json.loads((tmp_path / "d" / "drafter_config.json").read_text())
    meta[LAYOUT_KEY] = {"qkv_bias": "yes", "o_proj_bias": False, "mlp_bias": False,
                        "qk_norm": False}
    (tmp_path / "d" / "drafter_config.json").write_text(json.dumps(meta))
    write_sums(tmp_path / "d")   # a bad layout written as such, not a damaged file
    with pytest.raises(ValueError, match="qkv_bias must be true or false"):
        load_drafter(tmp_path / "d", policy, 16)
    meta[LAYOUT_KEY] = {"qkv_bias": True}
    (tmp_path / "d" / "drafter_config.json").write_text(json.dumps(meta))
    write_sums(tmp_path / "d")   # a bad layout written as such, not a damaged file
    with pytest.raises(ValueError, match=f"{LAYOUT_KEY} must map exactly"):
        load_drafter(tmp_path / "d", policy, 16)

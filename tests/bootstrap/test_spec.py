"""Named bootstrap specs: the registry, the pinned cache key of the default (``tiny``) policy, the
Qwen3 spec's architecture, and the recipe key that picks a spec (``model.bootstrap``)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

import fastdraft.bootstrap.run as bootstrap_run
from fastdraft.bootstrap.policy import model_config
from fastdraft.bootstrap.spec import BOOTSTRAP_SPECS, BootstrapSpec, get_spec
from fastdraft.config.recipe import load_recipe
from fastdraft.drafter.eagle3 import eagle3_aux_layers
from fastdraft.models import ModelConfig
from fastdraft.run.inputs import resolve_policy

#: The cache key of the tiny CPU recipe's policy. Cached policies (and every figure measured on
#: one) are found by it: a change here silently retrains a different policy for everyone.
TINY_DIGEST_SEED0 = "102333936475"


def test_registry_names_the_specs_and_the_default_is_todays_spec() -> None:
    assert {"tiny", "tiny-qwen3"} <= set(BOOTSTRAP_SPECS.names())
    assert get_spec("tiny") == BootstrapSpec()
    with pytest.raises(ValueError, match=r"unknown bootstrap spec 'huge'.*tiny-qwen3"):
        get_spec("huge")


def test_default_spec_digest_is_pinned() -> None:
    tiny = get_spec("tiny")
    assert tiny.digest(0) == TINY_DIGEST_SEED0
    # The fields added for Qwen3 are hashed only away from what every older spec implied.
    assert BootstrapSpec(head_dim=16).digest(0) == TINY_DIGEST_SEED0
    assert BootstrapSpec(architecture="qwen3").digest(0) != TINY_DIGEST_SEED0
    assert BootstrapSpec(head_dim=32).digest(0) != TINY_DIGEST_SEED0
    assert get_spec("tiny-qwen3").digest(0) != TINY_DIGEST_SEED0


def test_tiny_model_config_is_unchanged() -> None:
    """The tiny policy's model must stay the Qwen2 it always was (its weights depend on it)."""
    assert model_config(get_spec("tiny")) == ModelConfig(
        model_type="qwen2", vocab_size=64, hidden_size=128, intermediate_size=256,
        num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=16,
        rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=True,
        eos_token_ids=(1,), bos_token_id=2, qkv_bias=True)


def test_tiny_qwen3_is_a_qwen3_with_real_head_dim_and_distinct_aux_layers() -> None:
    spec = get_spec("tiny-qwen3")
    cfg = model_config(spec)
    assert cfg.model_type == "qwen3" and cfg.qk_norm and not cfg.qkv_bias
    assert cfg.head_dim == spec.head_dim == 64
    assert cfg.num_attention_heads > cfg.num_key_value_heads  # GQA
    aux = eagle3_aux_layers(cfg.num_hidden_layers)
    assert len(set(aux)) == 3 and max(aux) < cfg.num_hidden_layers - 1


def test_spec_rejects_unknown_architecture_and_bad_head_dim() -> None:
    with pytest.raises(ValueError, match=r"architecture='llama'.*qwen3"):
        BootstrapSpec(architecture="llama")
    with pytest.raises(ValueError, match="head_dim=15"):
        BootstrapSpec(head_dim=15)
    with pytest.raises(ValueError, match="or set head_dim"):
        BootstrapSpec(hidden_size=96, num_heads=5, num_kv_heads=1)
    # With head_dim set, the heads need not divide hidden_size (q is num_heads * head_dim wide).
    wide = BootstrapSpec(hidden_size=96, num_heads=5, num_kv_heads=1, head_dim=32)
    assert model_config(wide).head_dim == 32


def test_model_bootstrap_is_validated_against_the_registry() -> None:
    assert load_recipe(None).model.bootstrap == "tiny"
    assert load_recipe(None, ["model.bootstrap=tiny-qwen3"]).model.bootstrap == "tiny-qwen3"
    with pytest.raises(ValueError, match=r"model.bootstrap must be one of .*'tiny-qwen3'.*'big'"):
        load_recipe(None, ["model.bootstrap=big"])


def test_resolve_policy_trains_the_recipes_bootstrap_spec(monkeypatch, tmp_path: Path) -> None:
    asked: list[object] = []

    def fake_bootstrap(cache_dir, spec="tiny", **_):
        asked.append(spec)
        return SimpleNamespace(policy_dir=tmp_path / str(spec))

    monkeypatch.setattr(bootstrap_run, "run_bootstrap", fake_bootstrap)
    assert resolve_policy(load_recipe(None, ["model.bootstrap=tiny-qwen3"]), tmp_path) == (
        tmp_path / "tiny-qwen3")
    assert resolve_policy(load_recipe(None), tmp_path) == tmp_path / "tiny"
    assert asked == ["tiny-qwen3", "tiny"]

"""Every drafter fastdraft trains can leave it: EAGLE-1 and EAGLE-3 drafters for Llama, Qwen2 and
Qwen3 targets run in the engine, export for every engine, pass the export check, and reload from
the export computing exactly what they computed before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fastdraft import RolloutEngine, SamplingParams
from fastdraft.config.engine import SpecConfig
from fastdraft.drafter import drafter_layer_config
from fastdraft.export import check_export, export_drafter, load_exported_drafter
from tests.conftest import make_tiny_checkpoint
from tests.export.conftest import MAX_POSITIONS, assert_same_steps, load_policy, saved_drafter

# Tiny random policies, one per target family (plus a Llama with every bias switched on). Four
# layers give EAGLE-3 distinct aux layers; Qwen3's head_dim differs from hidden / heads.
FAMILIES = {
    "llama": dict(model_type="llama"),
    "llama-biases": dict(model_type="llama", attention_bias=True, mlp_bias=True),
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3", head_dim=32),
}
# What the exported directories must declare for each kind (architecture per directory name).
ARCHITECTURES = {
    ("eagle1", "llama"): {"sglang": "LlamaForCausalLMEagle", "vllm": "LlamaForCausalLM"},
    ("eagle1", "llama-biases"): {"sglang": "LlamaForCausalLMEagle", "vllm": "LlamaForCausalLM"},
    ("eagle1", "qwen2"): {"sglang": "Qwen2ForCausalLMEagle", "vllm": "LlamaForCausalLM"},
    ("eagle1", "qwen3"): {"sglang": "LlamaForCausalLMEagle", "vllm": "LlamaForCausalLM"},
}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, Path]:
    dirs = {}
    for family, overrides in FAMILIES.items():
        dirs[family] = tmp_path_factory.mktemp(family)
        # No EOS: every completion runs its full length, so every one is drafted for.
        make_tiny_checkpoint(dirs[family], num_hidden_layers=4, tie_word_embeddings=False,
                             eos_token_id=None, **overrides)
    return dirs


def _greedy_equals_plain(policy_dir: Path, drafter_dir: Path) -> RolloutEngine:
    prompts = [[5, 9, 17, 3], [40, 2, 11, 30, 8, 12, 7]]
    params = SamplingParams(greedy=True, max_new_tokens=12)
    plain = RolloutEngine(policy_dir, max_batch_size=2, max_seq_len=48).generate(prompts, params)
    engine = RolloutEngine(policy_dir, max_batch_size=2, max_seq_len=48, drafter=drafter_dir,
                           spec=SpecConfig(method="eagle", depth=3, topk=2, tokens_to_verify=4))
    outs = engine.generate(prompts, params)
    assert [c.token_ids for c in outs] == [c.token_ids for c in plain]
    assert all(c.spec is not None and c.spec.num_verify_steps > 0 for c in outs)
    return engine


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_every_drafter_runs_exports_and_reloads(family_dirs, tmp_path, kind, family):
    policy_dir = family_dirs[family]
    policy = load_policy(policy_dir)
    drafter = saved_drafter(policy, kind, tmp_path / "drafter", seed=5)
    assert drafter.layer_config == drafter_layer_config(kind, policy.config)

    # The engine runs the drafter it loads from the checkpoint, losslessly.
    engine = _greedy_equals_plain(policy_dir, tmp_path / "drafter")
    names = dict(engine.proposer.drafter.named_parameters())  # type: ignore[attr-defined]
    assert names.keys() == dict(drafter.named_parameters()).keys()

    written = export_drafter(tmp_path / "drafter", policy_dir, tmp_path / "out", "all")
    layouts = ["sglang", "speculators"] if kind == "eagle3" else ["sglang", "vllm"]
    assert written == [tmp_path / "out" / layout for layout in layouts]
    for path in written:
        check_export(path, path.name, kind)
        config = json.loads((path / "config.json").read_text())
        if path.name == "speculators":
            assert config["speculators_model_type"] == "eagle3"
            config = config["transformer_layer_config"]
        else:
            want = ("LlamaForCausalLMEagle3" if kind == "eagle3"
                    else ARCHITECTURES[kind, family][path.name])
            assert config["architectures"] == [want]
        assert config["head_dim"] == policy.config.head_dim
        assert_same_steps(drafter, load_exported_drafter(path, policy, MAX_POSITIONS))


def test_reloaded_export_is_the_drafter_not_just_its_shapes(family_dirs, tmp_path):
    """The reload comparison sees a changed weight (so the test above would see a lost one)."""
    policy = load_policy(family_dirs["qwen3"])
    drafter = saved_drafter(policy, "eagle1", tmp_path / "drafter")
    [out] = export_drafter(tmp_path / "drafter", family_dirs["qwen3"], tmp_path / "out", "vllm")
    reloaded = load_exported_drafter(out, policy, MAX_POSITIONS)
    with torch.no_grad():
        reloaded.layers[0].self_attn.k_proj.weight[0, 0] += 0.5
    with pytest.raises(AssertionError):
        assert_same_steps(drafter, reloaded)

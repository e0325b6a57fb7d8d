"""The bundled recipes parse; real-size ones (which cannot run here) name their missing paths and
pass the dry run (`fastdraft run RECIPE --dry-run`: memory plans for a node of 8 x 80 GB)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fastdraft.config import load_recipe
from fastdraft.run.inputs import check_paths

RECIPES = sorted((Path(__file__).parents[2] / "recipes").glob("*.yaml"))


def test_every_bundled_recipe_parses():
    assert {p.name for p in RECIPES} >= {"tiny-grpo.yaml", "qwen2.5-7b-grpo.yaml",
                                          "qwen3-8b-grpo.yaml"}
    for path in RECIPES:
        cfg = load_recipe(path)
        assert cfg.name == path.stem


@pytest.mark.parametrize("name", ["qwen2.5-7b-grpo.yaml", "qwen3-8b-grpo.yaml",
                                  "qwen3-8b-dapo-16k.yaml", "qwen2.5-7b-dapo-16k.yaml",
                                  "qwen3-8b-dapo-32k.yaml"])
def test_real_recipes_are_checked_and_report_missing_paths(name):
    cfg = load_recipe(Path(__file__).parents[2] / "recipes" / name)
    assert cfg.model.dtype == "bfloat16" and cfg.actor.compute_dtype == "bfloat16"
    assert cfg.actor.num_ranks == 8
    assert cfg.data.path is not None and cfg.data.reward == "math"
    with pytest.raises(FileNotFoundError) as err:
        check_paths(cfg)
    for key in ("model.path", "data.path", "drafter.path"):
        assert key in str(err.value)


@pytest.mark.parametrize("key", ["actor.deepspeed={zero_optimization: {stage: 3}}",
                                 "actor.mixed_precision=bf16"])
def test_removed_actor_keys_say_what_replaced_them(key):
    with pytest.raises(ValueError, match=r"was removed: .*actor\.(num_ranks|compute_dtype)"):
        load_recipe(None, [key])


# config.json of the GPU recipes' policies (the dry run reads nothing else of a checkpoint).
QWEN3_8B = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936,
                hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                rope_theta=1e6, max_position_embeddings=40960, tie_word_embeddings=False,
                eos_token_id=151645, bos_token_id=151643)
QWEN25_7B = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=152064,
                 hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                 num_attention_heads=28, num_key_value_heads=4, rms_norm_eps=1e-6,
                 rope_theta=1e6, max_position_embeddings=32768, use_sliding_window=False,
                 tie_word_embeddings=False, eos_token_id=151645, bos_token_id=151643)
QWEN25_32B = dict(QWEN25_7B, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                  num_attention_heads=40, num_key_value_heads=8, rms_norm_eps=1e-5,
                  max_position_embeddings=131072, eos_token_id=151643)
QWEN25_72B = dict(QWEN25_32B, hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                  num_attention_heads=64, num_key_value_heads=8)
# Policies that fit no GPU: engine replicas over 8 GPUs (rollout.tensor_parallel), H200 nodes.
TP_RECIPES = [("qwen2.5-32b-dapo.yaml", QWEN25_32B, 8), ("qwen2.5-72b-grpo.yaml", QWEN25_72B, 32)]
GPU_RECIPES = [("qwen3-8b-grpo.yaml", QWEN3_8B), ("qwen2.5-7b-grpo.yaml", QWEN25_7B),
               ("qwen3-8b-dapo-16k.yaml", QWEN3_8B), ("qwen2.5-7b-dapo-16k.yaml", QWEN25_7B),
               ("qwen3-8b-dapo-32k.yaml", QWEN3_8B)]
LONG_RECIPES = {"qwen3-8b-dapo-16k.yaml": 16384, "qwen2.5-7b-dapo-16k.yaml": 16384,
                "qwen3-8b-dapo-32k.yaml": 32768}


def _local_paths(root: Path, hf: dict) -> list[str]:
    """A model directory with the real config.json, a tokenizer and a stand-in weight file (the
    dry run reads its header only), an EAGLE-3 drafter's drafter_config.json over a 32k draft
    vocabulary (as the recipes' warm-up command makes), and a one-row parquet dataset: the
    recipe's three paths, as overrides."""
    import pandas as pd

    from fastdraft.bootstrap.tokenizer import build_char_tokenizer
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text(json.dumps(hf))
    build_char_tokenizer(root / "model")
    _header_only_weights(hf, root / "model" / "model.safetensors")
    (root / "drafter").mkdir()
    drafter = {"kind": "eagle3", "policy_config": hf, "draft_token_ids": list(range(32768))}
    (root / "drafter" / "drafter_config.json").write_text(json.dumps(drafter))
    _header_only_weights(hf, root / "drafter" / "model.safetensors", drafter)
    pd.DataFrame({"prompt": ["1+1="], "answer": ["2"]}).to_parquet(root / "train.parquet")
    return [f"model.path={root / 'model'}", f"data.path={root / 'train.parquet'}",
            f"drafter.path={root / 'drafter'}"]


def _header_only_weights(hf: dict, path: Path, drafter: dict | None = None) -> None:
    """A safetensors file whose header lists every weight of the config's model (of a drafter
    for it, with `drafter` its drafter_config.json) in bf16 and whose data is a hole of the
    right size (a sparse file: no disk used): what the dry run reads of real weights."""
    import torch

    from fastdraft.drafter import build_drafter
    from fastdraft.drafter.checkpoint import saved_options
    from fastdraft.models import CausalLM, ModelConfig
    with torch.device("meta"):
        config = ModelConfig.from_hf_dict(hf)
        model = (CausalLM(config) if drafter is None else
                 build_drafter(drafter["kind"], config, 1, **saved_options(drafter)))
    header, offset = {}, 0
    for name, param in model.named_parameters():
        size = param.numel() * 2
        header[name] = {"dtype": "BF16", "shape": list(param.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    with path.open("wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        f.truncate(8 + len(text) + offset)


def _dry_run(name: str, *args: str) -> int:
    from fastdraft.cli import main
    return main(["run", str(RECIPES_DIR / name), "--dry-run", *args])


RECIPES_DIR = Path(__file__).parents[2] / "recipes"


@pytest.mark.parametrize("name,hf", GPU_RECIPES)
def test_gpu_recipes_pass_the_dry_run_on_an_8x80_gb_node(name, hf, tmp_path, capsys):
    plan_file = tmp_path / "plan.json"
    assert _dry_run(name, "--device-memory-gb", "80", "--json", str(plan_file),
                    *_local_paths(tmp_path, hf)) == 0
    out = capsys.readouterr().out
    assert f"dry run: {Path(name).stem} fits" in out
    for part in ("engine memory plan (cuda, bfloat16", "actor memory plan", "run memory plan"):
        assert part in out
    plan = json.loads(plan_file.read_text())
    assert plan["device_bytes"] == 80 * 10**9
    assert plan["device0_bytes"] <= plan["usable_bytes"]
    assert plan["actor"]["per_rank_bytes"] <= plan["usable_bytes"]
    cfg = load_recipe(RECIPES_DIR / name)
    assert plan["engine"]["num_slots"] == cfg.rollout.max_batch_size
    assert plan["actor"]["num_ranks"] == 8 and plan["actor"]["compute_dtype"] == "bfloat16"
    # every GPU rolls out: 8 hybrid workers, each an engine replica beside its actor rank
    assert plan["hybrid"] and "8 hybrid workers" in out and "every device rolls out" in out
    assert cfg.cluster.rollout_workers == 8 and cfg.cluster.placement == "hybrid"


@pytest.mark.parametrize("name,answer", sorted(LONG_RECIPES.items()))
def test_the_long_answer_recipes_take_the_long_paths(name, answer):
    """16k / 32k answers: DAPO's overlong shaping and dynamic sampling, prefill in chunks, the
    actor's sequences packed into micro-batches of one longest sequence, its logits chunked."""
    cfg = load_recipe(RECIPES_DIR / name)
    assert cfg.rollout.max_new_tokens == answer and cfg.rollout.max_seq_len == answer + 1024
    assert cfg.algorithm.loss == "dapo" and cfg.algorithm.overlong_buffer == 4096
    assert cfg.algorithm.skip_zero_variance and cfg.algorithm.resample_rounds > 0
    assert 0 < cfg.rollout.prefill_chunk_tokens < answer
    assert cfg.actor.pack_sequences and cfg.actor.micro_batch_tokens == answer + 1024
    assert 0 < cfg.actor.logits_chunk_tokens <= 4096
    assert cfg.drafter.online.enabled and cfg.drafter.online.max_sample_tokens <= 2048


@pytest.mark.parametrize("training", ["one", "data_parallel"])
def test_the_8b_recipe_with_online_training_counts_the_trainer_member_on_each_device(
        tmp_path, capsys, training):
    """Hybrid workers: the online drafter's trainer member is inside a worker, on its device:
    the drafter's fp32 state with AdamW (16 bytes a parameter), the policy head it reads and a
    micro-step's [tokens, vocab] fp32 logits, target and gradient."""
    plans, paths = {}, _local_paths(tmp_path, QWEN3_8B)
    for online in ("false", "true"):
        plan_file = tmp_path / f"plan-{online}.json"
        assert _dry_run("qwen3-8b-grpo.yaml", "--device-memory-gb", "80", "--json",
                        str(plan_file), f"drafter.online.enabled={online}",
                        f"cluster.drafter_training={training}", *paths) == 0
        plans[online] = json.loads(plan_file.read_text())
    out = capsys.readouterr().out
    assert "+ drafter trainer member" in out
    vocab, hidden = QWEN3_8B["vocab_size"], QWEN3_8B["hidden_size"]
    params = plans["true"]["engine"]["drafter_weights"] // 2   # bf16
    member = 16 * params + 2 * vocab * hidden * 2 + 3 * 2048 * vocab * 4
    assert plans["false"]["trainer"] == 0 and plans["true"]["trainer"] == member
    assert plans["true"]["device0_bytes"] == plans["false"]["device0_bytes"] + member
    assert plans["true"]["device0_bytes"] <= plans["true"]["usable_bytes"]


def test_the_8b_recipe_before_its_fix_fails_the_dry_run(tmp_path, capsys):
    paths = _local_paths(tmp_path, QWEN3_8B)
    assert _dry_run("qwen3-8b-grpo.yaml", "--device-memory-gb", "80", *paths,
                    "rollout.max_batch_size=384") == 2
    err = capsys.readouterr().err
    assert "each device (an engine replica and an actor rank and a drafter trainer member)" in err
    slots = int(re.search(r"lower rollout\.max_batch_size to <= (\d+)", err).group(1))
    # the count it names is at least the fixed recipe's (which passes above)
    assert slots >= load_recipe(RECIPES_DIR / "qwen3-8b-grpo.yaml").rollout.max_batch_size
    # The recipe as it was: 116.7 GB of static KV (before the actor's logits were chunked, two
    # settings had to change together; now fewer slots alone fit).
    assert _dry_run("qwen3-8b-grpo.yaml", "--device-memory-gb", "80", *paths,
                    "rollout.max_batch_size=256", "rollout.kv_block_size=0",
                    "rollout.kv_cache_gb=null", "rollout.max_seq_len=3072",
                    "rollout.max_new_tokens=2048", "actor.micro_batch_tokens=16384",
                    "rollout.prefill_chunk_tokens=0") == 2
    err = capsys.readouterr().err
    assert "KV cache 116.7 GB" in err
    assert int(re.search(r"lower rollout\.max_batch_size to <= (\d+)", err).group(1)) < 256


def test_a_dry_run_checks_the_paths_first(tmp_path, capsys):
    assert _dry_run("qwen3-8b-grpo.yaml", f"model.path={tmp_path / 'missing'}") == 2
    assert "model.path" in capsys.readouterr().err


def test_a_dry_run_of_a_bootstrap_recipe_needs_its_cached_policy(tmp_path, capsys):
    assert _dry_run("tiny-grpo.yaml", "--cache-dir", str(tmp_path / "empty-cache")) == 2
    assert "set model.path, or bootstrap the policy first" in capsys.readouterr().err


def test_a_cuda_recipe_planned_without_a_gpu_assumes_80_gb(monkeypatch):
    import torch

    from fastdraft.run.dry_run import node_capacity
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert node_capacity("cuda", None).total == 80 * 10**9
    assert node_capacity("cuda", 141).total == 141 * 10**9
    with pytest.raises(ValueError, match="--device-memory-gb must be > 0"):
        node_capacity("cuda", 0)


def test_the_8b_recipe_plans_a_specforge_drafter_from_its_files(tmp_path, capsys):
    """drafter.path at a SpecForge EAGLE-3 directory: the dry run checks it against the policy
    and plans it (its own lm_head's rows, its aux layers) without importing anything."""
    import torch
    from safetensors.torch import save_file
    paths = [p for p in _local_paths(tmp_path, QWEN3_8B) if not p.startswith("drafter.path")]
    draft_vocab, hidden = 1024, QWEN3_8B["hidden_size"]
    src = tmp_path / "specforge"
    src.mkdir()
    ids = torch.arange(draft_vocab) * 7
    save_file({"lm_head.weight": torch.zeros(draft_vocab, hidden, dtype=torch.bfloat16),
               "d2t": ids - torch.arange(draft_vocab),
               "t2d": torch.zeros(QWEN3_8B["vocab_size"], dtype=torch.bool).index_fill_(0, ids,
                                                                                       True)},
              str(src / "model.safetensors"))
    config = {k: QWEN3_8B[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                       "num_key_value_heads", "head_dim", "vocab_size",
                                       "rope_theta", "max_position_embeddings")}
    (src / "config.json").write_text(json.dumps({
        **config, "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
        "draft_vocab_size": draft_vocab,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 17, 32]}}))
    plan_file = tmp_path / "plan.json"
    assert _dry_run("qwen3-8b-grpo.yaml", "--device-memory-gb", "80", "--json", str(plan_file),
                    *paths, f"drafter.path={src}") == 0
    assert "qwen3-8b-grpo fits" in capsys.readouterr().out
    plan = json.loads(plan_file.read_text())
    layer = 3 * hidden * hidden + 2 * hidden * 4096 + 2 * hidden * 1024 + hidden * 4096 + (
        3 * hidden * QWEN3_8B["intermediate_size"]) + 4 * hidden   # fc, q, k, v, o, MLP, norms
    assert plan["engine"]["drafter_weights"] >= 2 * (layer + draft_vocab * hidden)
    # a longer draft position budget than the policy's is fine; a shorter one is one line
    config["max_position_embeddings"] = 2048
    (src / "config.json").write_text(json.dumps({
        **config, "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
        "draft_vocab_size": draft_vocab}))
    assert _dry_run("qwen3-8b-grpo.yaml", "--device-memory-gb", "80", *paths,
                    f"drafter.path={src}") == 2
    assert "max_position_embeddings: drafter 2048, policy 40960" in capsys.readouterr().err


@pytest.mark.parametrize("name,hf,ranks", TP_RECIPES)
def test_tensor_parallel_recipes_fit_h200_nodes_and_not_80_gb_ones(name, hf, ranks, tmp_path,
                                                                   capsys):
    """32B and 72B: every GPU holds an eighth of an engine replica beside its actor rank and a
    drafter trainer member. On 141 GB GPUs the plan fits and names 8 as the fewest devices a
    replica fits on; on 80 GB the fp32 masters, AdamW state and gradients (16 bytes a
    parameter over the ranks) leave no room."""
    paths = _local_paths(tmp_path, hf)
    plan_file = tmp_path / "plan.json"
    assert _dry_run(name, "--device-memory-gb", "141", "--json", str(plan_file), *paths) == 0
    out = capsys.readouterr().out
    assert "one rank of 8)" in out and f"{ranks} hybrid workers" in out
    assert "the fewest devices an engine replica fits on is 8" in out
    plan = json.loads(plan_file.read_text())
    assert plan["engine"]["tensor_parallel"] == 8 and plan["actor"]["num_ranks"] == ranks
    assert plan["device0_bytes"] <= plan["usable_bytes"]
    cfg = load_recipe(RECIPES_DIR / name)
    assert cfg.rollout.tensor_parallel == 8 and cfg.cluster.rollout_workers == ranks
    assert cfg.drafter.kind == "eagle3" and cfg.drafter.online.enabled
    assert _dry_run(name, "--device-memory-gb", "80", *paths) == 2
    assert "more than the 76.0 GB usable on a device" in capsys.readouterr().err
    # a replica over fewer GPUs does not fit: the refusal names the fewest that do
    assert _dry_run(name, "--device-memory-gb", "141", "rollout.tensor_parallel=4", *paths) == 2
    assert "rollout.tensor_parallel=8 fits" in capsys.readouterr().err


def test_the_32b_recipe_is_dapo():
    cfg = load_recipe(RECIPES_DIR / "qwen2.5-32b-dapo.yaml")
    assert cfg.algorithm.loss == "dapo" and cfg.algorithm.skip_zero_variance
    assert (cfg.algorithm.clip_eps, cfg.algorithm.clip_high) == (0.2, 0.28)
    assert cfg.rollout.max_new_tokens == 20480 and cfg.algorithm.overlong_buffer == 4096
    assert cfg.rollout.group_size == 16 and cfg.actor.lr == 1e-6

"""The miniature of the real recipe end to end (recipes/tiny-qwen3-eagle3.yaml): a Qwen3 policy
(QK-norm, head_dim 64), an EAGLE-3 drafter trained online with reward-weighted KD whose byte and
token caps engage, bf16 compute on fp32 masters sharded over 2 actor ranks, rollouts on 2 Ray
rollout workers (cluster.backend=ray) with tail consolidation, colocated with the actor's
ranks and training the drafter data-parallel on the idle ones, a paged KV cache small enough
to preempt, the lossless gate every step, and an export SGLang and vLLM load. Slow: it
bootstraps its policy once (cached)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fastdraft.config import load_recipe
from fastdraft.export.check import check_export
from fastdraft.observability.metrics import read_metrics
from fastdraft.observability.timeline import read_timeline
from fastdraft.run.run import run_recipe

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]   # one Ray cluster at a time
RECIPE = Path(__file__).parents[2] / "recipes" / "tiny-qwen3-eagle3.yaml"
STEPS = 3   # CI's share of the recipe's 20 steps: every part of the path runs


def test_the_miniature_real_recipe_runs_end_to_end(tmp_path):
    cfg = load_recipe(RECIPE, [f"algorithm.num_steps={STEPS}", "checkpoint.every=2",
                               "logging.wandb.mode=disabled", "cluster.backend=ray",
                               "cluster.rollout_workers=2", "cluster.consolidate_below=16",
                               # actor rank 1 on worker 1's bundle; the workers' KV cache
                               # given back while the actor updates
                               "cluster.placement=colocated",
                               # the drafter trains data-parallel on the idle workers
                               "cluster.drafter_training=data_parallel",
                               # CI's share of the recipe's sizes (600 steps on 512 rollouts,
                               # 32 prompts a step: ~8 min here under CI's load)
                               "drafter.warmup_steps=150", "drafter.warmup_rollouts=256",
                               "rollout.prompts_per_step=16",
                               # a paged KV pool the workers' answers outgrow: preemptions
                               "rollout.kv_cache_gb=0.01",
                               # a publish only when it beats the serving drafter on the
                               # step's held-out rollouts (1 in 4)
                               "drafter.online.holdout_every=4"])
    assert cfg.actor.num_ranks == 2 and cfg.actor.compute_dtype == "bfloat16"
    run = run_recipe(cfg, tmp_path / "run")
    policy = json.loads((run.policy_dir / "config.json").read_text())
    assert policy["model_type"] == "qwen3" and policy["head_dim"] == 64
    assert run.engine.model_drafter.kind == "eagle3" and run.actor.world == 2
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(STEPS))
    # the version rises at every step's publish, unless the held-out check withheld it (a
    # data-parallel member with no held-out rollout of its own publishes unchecked)
    versions = [r["drafter/version"] for r in rows]
    for before, after, row in zip(versions, versions[1:], rows):
        assert after == before + (1 - row.get("drafter/withheld", 0.0)), (versions, row)
    checked = [r for r in rows if "drafter/withheld" in r]
    assert checked and all(r["drafter/held_out_accept"] > 1 for r in checked)
    for row in rows:
        assert 0 <= row["drafter/top1_acc"] <= 1
        assert row["drafter/train_steps"] >= cfg.drafter.online.min_steps_per_step
        assert row["rollout/logprob_diff_p99"] <= 0.5 and abs(row["rollout/law_z"]) < 6
        assert row["actor/skipped"] == 0.0
    # the caps engage: long answers become windows, in-flight bytes stay under the budget
    assert max(r["drafter/inflight_mb_peak"] for r in rows) <= cfg.drafter.online.inflight_mb
    assert rows[-1]["drafter/cut_samples"] > 0 and sum(r["drafter/dropped_tokens"]
                                                       for r in rows) > 0
    for row in rows:   # both workers generated every step; what they did is on the timeline
        assert row["cluster/rollout0/generate_s"] > 0 and row["cluster/rollout1/generate_s"] > 0
        assert 0 <= row["cluster/idle_fraction"] < 1 and row["cluster/push_s"] > 0
        assert row["cluster/released_mb"] > 0
    # tails moved to the worker still generating, and requests whose KV blocks ran out were
    # preempted and recomputed (the gate above held with both)
    assert sum(r["cluster/migrated_requests"] for r in rows) > 0
    # the drafter trained on both workers' devices, as one data-parallel group
    assert min(m.stats.tokens for m in run.drafter.worker.members) > 0
    assert sum(r["rollout/preemptions"] for r in rows) > 0
    assert sorted(read_timeline(tmp_path / "run")) == list(range(STEPS))
    for layout in ("sglang", "speculators"):   # each raises on any problem
        check_export(tmp_path / "run" / "export" / layout, layout, "eagle3",
                     num_layers=run.engine.config.num_hidden_layers)
    assert (tmp_path / "run" / "memory_plan.json").is_file()

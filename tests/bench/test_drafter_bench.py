"""`bench drafter` runs the stale / KD / reward-weighted-KD drift experiment and the unit costs
on a tiny policy and reports every figure the issue names."""

from __future__ import annotations

import json

from fastdraft.bench.drafter_bench import run_drafter_bench, summary_lines


def test_drafter_bench_reports_drift_and_unit_costs(char_policy, char_drafter, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: r\nmodel:\n  path: {char_policy}\ndrafter:\n  path: {char_drafter}\n"
                      "  online:\n    enabled: true\n    token_budget: 64\n"
                      "    tail_fraction: 1.0\nrollout:\n"
                      "  prompts_per_step: 2\n  group_size: 4\n  max_new_tokens: 8\n"
                      "  max_batch_size: 8\n  spec:\n    method: eagle\n    depth: 3\n"
                      "    topk: 2\n    tokens_to_verify: 4\nalgorithm:\n  num_steps: 2\n")
    # one micro-step at least every step: under load the tail window can train nothing, and the
    # actor-sourced run's samples only reach its trainer after the first update
    # (the ceiling drafter's warm-up: the recipe's warm-up budget, small here)
    out = run_drafter_bench(recipe, ["actor.lr=1e-3", "drafter.online.min_steps_per_step=1",
                                     "drafter.warmup_steps=60", "drafter.warmup_rollouts=8"],
                            tmp_path / "runs", tmp_path / "d.json")
    for key in ("packing_speedup", "preemption_latency_s_median", "ckpt_blocking_ratio",
                "adaptive_accept_length", "stale_accept_length", "adaptive_vs_stale",
                "reward_kd_accept_length", "actor_source_update_ratio",
                "actor_source_rollout_ratio", "actor_source_vs_engine",
                "actor_source_vs_engine_online", "ceiling_accept_length", "tracking_efficiency",
                "reward_kd_tracking_efficiency"):
        assert out[key] > 0, key
    assert out["tracking_efficiency"] == (out["adaptive_accept_length"]
                                          / out["ceiling_accept_length"])
    assert out["ceiling"]["warmup_train_tokens"] > 0 and len(out["dropped_tokens_per_step"]) == 2
    assert out["drift"]["stale"]["drafter_version"] == 0
    assert out["drift"]["kd"]["drafter_version"] >= 1
    assert len(out["drift"]["reward_kd"]["rewards"]) == 2
    assert out["drift"]["reward_kd_actor"]["drafter_version"] >= 1   # it trained and published
    assert json.loads((tmp_path / "d.json").read_text())["adaptive_vs_stale"] > 0
    assert all(isinstance(line, str) and line for line in summary_lines(out))

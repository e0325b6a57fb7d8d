"""`bench cluster` runs the local and Ray arms side by side on a tiny policy and reports every
figure the scale-out issue names; with a fixed drafter the Ray run learns exactly what the
local run learns (placement never changes a completion)."""

from __future__ import annotations

import json

import pytest

from fastdraft.bench.cluster_bench import run_cluster_bench, summary_lines

pytest.importorskip("ray")
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]   # one Ray cluster at a time


def test_cluster_bench_reports_costs_accept_and_simulation(char_policy, char_drafter, tmp_path):
    recipe = tmp_path / "r.yaml"
    # Five groups on two workers at a batch of one group: one worker runs three waves, the
    # other two and then idles a whole wave, so the idle-worker arms promote every step. Whether
    # a promoted member's round forms inside the wave is timing (the members train at the
    # lowest CPU priority: two CI runs under load trained 0 tokens in three steps, on idle and
    # in the update), so every step tops its trainer up to one micro-step at its end.
    recipe.write_text(f"name: r\nmodel:\n  path: {char_policy}\ndrafter:\n  path: {char_drafter}\n"
                      "  online:\n    enabled: true\n    token_budget: 64\n"
                      "    min_steps_per_step: 1\nrollout:\n  prompts_per_step: 5\n"
                      "  group_size: 4\n  max_new_tokens: 12\n"
                      "  max_batch_size: 4\n  spec:\n    method: eagle\n    depth: 3\n"
                      "    topk: 2\n    tokens_to_verify: 4\nalgorithm:\n  num_steps: 3\n"
                      "data:\n  task_pool: 5\n")
    out = run_cluster_bench(recipe, ["actor.lr=1e-3"], tmp_path / "runs", tmp_path / "c.json",
                            consolidate_below=9,   # a worker's last 8 requests move to a busy one
                            seeds=2)
    for key in ("exposed_drafter_cost", "local_exposed_cost", "adaptive_vs_stale",
                "adaptive_vs_today", "sim_error", "dp_exposed_drafter_cost", "dp_vs_one",
                "dp_idle_promotions", "dp_train_tokens", "dp_vs_one_online"):
        assert out[key] > 0, key
    # (dp_train_tokens_on_idle is reported whatever it is: that idle members train together
    # is tests/cluster/test_trainer_group.py.)
    per_seed = out["exposed_drafter_cost_per_seed"]
    assert len(per_seed) == 2 and out["exposed_drafter_cost"] == pytest.approx(
        sum(per_seed) / 2)
    assert out["exposed_drafter_cost"] == pytest.approx(out["step_s"]["ray_on"] / out["step_s"][
        "ray_off"] / 2 + out["step_s"]["ray_on+seed1"] / out["step_s"]["ray_off+seed1"] / 2)
    assert out["rollout_workers"] == 2 and set(out["step_s"]) == {
        "local_off", "local_on", "ray_off", "ray_on", "ray_consolidate", "ray_dp",
        "ray_off+seed1", "ray_on+seed1", "local_on+seed1"}
    for key in ("adaptive_vs_stale", "adaptive_vs_today"):   # each seed on its own policy
        per = out[f"{key}_per_seed"]
        assert len(per) == 2 and out[key] == pytest.approx(sum(per) / 2)
    assert len(out["online_vs_today_per_seed"]) == 2
    def answers(arm: str) -> list[tuple[float, float]]:   # another seed: other samples
        rows = [json.loads(line) for line in (tmp_path / "runs" / arm / "metrics.jsonl").open()]
        return [(r["reward/mean"], r["rollout/response_len_mean"]) for r in rows]
    assert answers("ray_off+seed1") != answers("ray_off")
    assert out["consolidation_rollout_ratio"] > 0 and out["migrated_per_step"] > 0
    assert out["rewards"]["ray_off"] == out["rewards"]["local_off"]
    for sim in out["simulation"].values():
        assert sim["simulated_rollout_s"] > 0 and sim["measured_rollout_s"] > 0
    rows = out["projections"]["rows"]
    assert {r["workers"] for r in rows} == {8, 64, 256} and {r["model"] for r in rows} == {
        "7B", "32B"} and all(r["label"] == "projection" for r in rows)
    assert json.loads((tmp_path / "c.json").read_text())["sim_error"] == out["sim_error"]
    assert all(isinstance(line, str) and line for line in summary_lines(out))

"""`bench hybrid` runs its five arms side by side on a tiny policy and reports every figure the
hybrid-workers issue names: step and push time of each layout, the exposed cost of online
drafter training (the hybrid worker's trainer member against the local trainer process), both
hybrid workers generating every step, and the simulator replaying the hybrid run."""

from __future__ import annotations

import json

import pytest

from fastdraft.bench.hybrid_bench import run_hybrid_bench, summary_lines

pytest.importorskip("ray")
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]   # one Ray cluster at a time


def test_hybrid_bench_reports_layouts_push_and_exposed_cost(char_policy, char_drafter,
                                                             tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: r\nmodel:\n  path: {char_policy}\ndrafter:\n  path: {char_drafter}\n"
                      "  online:\n    enabled: true\n    token_budget: 64\nrollout:\n"
                      "  prompts_per_step: 4\n  group_size: 4\n  max_new_tokens: 12\n"
                      "  max_batch_size: 8\n  spec:\n    method: eagle\n    depth: 3\n"
                      "    topk: 2\n    tokens_to_verify: 4\nalgorithm:\n  num_steps: 2\n"
                      "data:\n  task_pool: 4\n")
    out = run_hybrid_bench(recipe, ["actor.lr=1e-3"], tmp_path / "runs", tmp_path / "h.json")
    assert set(out["phases_s"]) == {"local", "colocated", "hybrid", "local_off", "hybrid_off"}
    for name, phases in out["phases_s"].items():
        assert all(phases[k] > 0 for k in ("step", "rollout", "update", "push")), name
    step = {name: p["step"] for name, p in out["phases_s"].items()}
    assert out["hybrid_vs_local"] == pytest.approx(step["hybrid"] / step["local"])
    assert out["hybrid_off_vs_local_off"] == pytest.approx(step["hybrid_off"] / step["local_off"])
    assert len(out["hybrid_vs_local_per_step"]) == out["num_steps"] - 1   # step 0: warm-up
    tokens = out["answer_tokens"]
    assert out["hybrid_vs_local_per_token"] == pytest.approx(
        step["hybrid"] / tokens["hybrid"] / (step["local"] / tokens["local"]))
    assert tokens["hybrid_off"] == tokens["local_off"]   # the same completions
    assert out["hybrid_exposed_drafter_cost"] == pytest.approx(step["hybrid"]
                                                               / step["hybrid_off"])
    assert out["local_exposed_cost"] == pytest.approx(step["local"] / step["local_off"])
    # both hybrid workers generate every step
    assert all(s > 0 for seconds in out["hybrid_generate_s"].values() for s in seconds)
    assert len(out["hybrid_generate_s"]) == 2
    # the same seeds: the layouts sample the same answers at step 0
    assert len({r[0] for r in out["rewards"].values()}) == 1
    assert out["sim_error"] >= 0
    assert json.loads((tmp_path / "h.json").read_text())["sim_error"] == out["sim_error"]
    assert all(isinstance(line, str) and line for line in summary_lines(out))

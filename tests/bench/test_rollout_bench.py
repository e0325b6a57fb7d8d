"""`bench rollout` serves one RL batch with no speculation, each static arm and the tuner, and
reports every key the issue names (and the per-bucket oracle bound), on a tiny policy."""

from __future__ import annotations

import json

from fastdraft.bench.rollout_bench import oracle_seconds, run_rollout_bench, summary_lines
from fastdraft.engine.trace import RolloutTrace
from tests.bench.recipes import eagle_rollout_recipe


def test_rollout_bench_reports_every_key(char_policy, char_drafter, tmp_path):
    recipe = eagle_rollout_recipe(tmp_path, char_policy, char_drafter,
                                  "  tuner:\n    enabled: true\n    elastic_threshold: 8\n")
    out = run_rollout_bench(recipe, [], tmp_path / "runs", tmp_path / "r.json", rounds=1)
    for key in ("none_s", "best_static_s", "adaptive_s", "adaptive_vs_none",
                "adaptive_vs_best_static", "oracle_s"):
        assert out[key] > 0, key
    assert 0 <= out["tail_fraction_of_time"] <= 1
    assert out["best_static_name"] in out["contenders"]
    assert set(out["contenders"]) >= {"none", "adaptive", "eagle/3/2/4"}
    assert out["contenders"]["none"]["sd_fraction"] == 0
    assert out["num_requests"] == 16
    assert (tmp_path / "runs" / "rollout_bench.png").stat().st_size > 0
    assert json.loads((tmp_path / "r.json").read_text())["best_static_name"]
    assert all(isinstance(line, str) and line for line in summary_lines(out))
    assert "budget_on_vs_off" not in out


def test_rollout_bench_measures_budgets_on_and_off(char_policy, char_drafter, tmp_path):
    recipe = eagle_rollout_recipe(tmp_path, char_policy, char_drafter,
                                  "  budget:\n    enabled: true\n")
    out = run_rollout_bench(recipe, [], tmp_path / "runs", None, rounds=1)
    assert set(out["contenders"]) >= {"adaptive", "adaptive_no_budget", "eagle/3/2/4+budget"}
    assert out["budget_on_vs_off"] > 0 and out["static_budget_on_vs_off"] > 0
    # The drafting share is measured (a static tree drafts on its rows; the tuner's contenders
    # pick arms by their timings, and on a loaded machine plain decoding may win every step).
    assert 0 < out["contenders"]["eagle/3/2/4"]["drafting_row_fraction"] <= 1
    assert any("budgets on / off" in line for line in summary_lines(out))
    assert out["row_costs"]["batch"] == 16 and out["row_costs"]["row_step_ms"] > 0


def _trace(steps: list[tuple[int, str, int, float]]) -> RolloutTrace:
    """(active, arm, tokens, seconds) per step."""
    trace, now = RolloutTrace(num_requests=steps[0][0]), 0.0
    for active, arm, tokens, seconds in steps:
        trace.times.append(now)
        trace.active.append(active)
        trace.end_step(arm, tokens)
        now += seconds
    trace.end = now
    return trace


def test_the_oracle_takes_the_best_rate_per_group_of_running_requests():
    none = _trace([(8, "prefill", 8, 0.5), (8, "off", 8, 1.0), (1, "off", 1, 1.0)])
    spec = _trace([(8, "prefill", 8, 0.5), (8, "e", 8, 2.0), (1, "e", 4, 1.0)])
    # 8 running: plain is best (8 tok/s); 1 running: speculation (4 tok/s) -> 1 token in 0.25s
    assert oracle_seconds({"none": [none], "spec": [spec]}) == 0.5 + 1.0 + 0.25

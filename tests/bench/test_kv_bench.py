"""`bench kv` rolls a recipe's batch out with the group's prompt prefilled once and with every
row prefilled, same seeds: identical completions, and the prompt tokens computed fall to one
row's in a group."""

from __future__ import annotations

import json

from fastdraft.bench.kv_bench import run_kv_bench, summary_lines
from tests.bench.recipes import eagle_rollout_recipe


def test_kv_bench_measures_what_prompt_sharing_saves(char_policy, char_drafter, tmp_path):
    recipe = eagle_rollout_recipe(tmp_path, char_policy, char_drafter)
    out = run_kv_bench(recipe, [], tmp_path / "runs", tmp_path / "kv.json", rounds=1)
    tokens = out["prefill_tokens"]
    assert tokens["shared"]["rows"] == tokens["unshared"]["rows"] == tokens["unshared"][
        "computed"] > 0
    # All 16 requests fit one prefill batch: each group's prompt is computed once.
    assert out["prefill_tokens_shared_vs_unshared"] == 1 / 4
    assert out["identical_completions"] and out["rollout_time_ratio"] > 0
    assert 0 < out["prefill_share_unshared"] < 1
    assert json.loads((tmp_path / "kv.json").read_text())["rollout_time_ratio"] > 0
    assert all(isinstance(line, str) and line for line in summary_lines(out))

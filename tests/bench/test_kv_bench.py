"""`bench kv` rolls a recipe's batch out on static slots (every row prefilled), static slots with
the group's prompt computed once, and the paged cache, same seeds: identical completions, the
prompt tokens computed fall to one row's in a group, and a batch-64 decode step is timed on
both caches, and the concurrency figure is reported for the 8B recipe's shapes."""

from __future__ import annotations

import json

from fastdraft.bench.kv_bench import run_kv_bench, summary_lines
from tests.bench.recipes import eagle_rollout_recipe


def test_kv_bench_measures_paging_and_prompt_sharing(char_policy, char_drafter, tmp_path):
    recipe = eagle_rollout_recipe(tmp_path, char_policy, char_drafter)
    out = run_kv_bench(recipe, [], tmp_path / "runs", tmp_path / "kv.json", rounds=1)
    tokens = out["prefill_tokens"]
    assert tokens["paged"]["rows"] == tokens["static"]["rows"] == tokens["static"][
        "computed"] > 0
    # All 16 requests fit one prefill batch: each group's prompt is computed once.
    assert out["prefill_tokens_shared_vs_unshared"] == 1 / 4
    assert tokens["static_shared"]["computed"] == tokens["paged"]["computed"]
    assert out["identical_completions"] and out["rollout_time_ratio"] > 0
    assert 0 < out["prefill_share_static"] < 1
    decode = out["decode_batch64"]
    assert decode["batch"] == 64 and decode["static_ms"] > 0 and decode["paged_ms"] > 0
    assert decode["bookkeeping_ms"] > 0 and decode["overhead_share"] < 1
    assert json.loads((tmp_path / "kv.json").read_text())["rollout_time_ratio"] > 0
    assert out["chunked_reads_time_ratio"] > 0
    assert out["concurrency"]["recipe"] == "recipes/qwen3-8b-grpo.yaml"
    assert out["concurrency_ratio"] == out["concurrency"]["concurrency_ratio"] > 1
    assert all(isinstance(line, str) and line for line in summary_lines(out))

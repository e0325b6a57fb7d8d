"""`fastdraft bench update`: the three arms run one and the same update (the bench checks their
losses agree), packing computes fewer tokens than padding, and chunked logits lower the peak."""

from __future__ import annotations

import json

from fastdraft.bench.update_bench import UpdateBench, run_update_bench


def test_the_update_bench_reports_the_arms_side_by_side(tmp_path):
    cfg = UpdateBench(hidden=64, layers=1, rows=4, long_tokens=400, prompt_tokens=16,
                      micro_batch_tokens=1024, chunk_tokens=128, repeats=1)
    report = run_update_bench(cfg, tmp_path / "update.json")
    arms = report["arms"]
    assert set(arms) == {"padded_full", "padded_chunked", "packed_chunked"}
    assert arms["packed_chunked"]["computed_tokens"] < arms["padded_full"]["computed_tokens"]
    # a 400-token answer's [tokens, 152k] logits (243 MB in fp32) never exist when chunked
    assert arms["padded_chunked"]["peak_bytes"] < 0.6 * arms["padded_full"]["peak_bytes"]
    assert report["peak_ratio_packed_vs_padded"] < 0.6
    assert json.loads((tmp_path / "update.json").read_text())["arms"] == arms

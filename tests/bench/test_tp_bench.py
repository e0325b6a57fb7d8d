"""`fastdraft bench tp`: one rank against two (gloo) on a tiny shape: the rows side by side, the
all-reduces' share measured on the tensor-parallel arm, the greedy tokens of both arms equal."""

from __future__ import annotations

import json

import pytest

from fastdraft.bench.tp_bench import TPBench, run_tp_bench, table_lines

pytestmark = pytest.mark.slow


def test_bench_tp_reports_both_arms_and_the_all_reduce_share(tmp_path):
    cfg = TPBench(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=256,
                  batch_sizes=(1, 2), new_tokens=4, prompt_tokens=8, repeats=1)
    out = run_tp_bench(cfg, tmp_path / "tp.json")
    written = json.loads((tmp_path / "tp.json").read_text())
    assert written.pop("fastdraft").endswith(" bench")   # its stamp: a later --json replaces it
    assert written == json.loads(json.dumps(out))
    assert [r["batch_size"] for r in out["rows"]] == [1, 2]
    for row in out["rows"]:
        assert row["tp1_decode_ms"] > 0 and row["tp2_decode_ms"] > 0
        assert row["decode_speedup"] == pytest.approx(row["tp1_decode_ms"] / row["tp2_decode_ms"])
        assert 0 < row["all_reduce_share_decode"] < 1 and 0 < row["all_reduce_share_cycle"] < 1
    assert "tp2" in table_lines(out)[2]

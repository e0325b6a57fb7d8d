"""The simulator's layouts of one node: the same step with one engine, colocated Ray workers and
hybrid workers; every device rolling out shortens the rollout, and the push over the
interconnect in the serving dtype is the cheapest."""

from __future__ import annotations

import pytest

from fastdraft.bench.projections import H100_7B, projection_lines, recipe_8b_layouts
from fastdraft.cluster.layouts import NodeLinks, compare_layouts, push_s, update_s_estimate
from fastdraft.cluster.simulator import StepShape, long_tail_lengths


def test_push_models_each_layouts_path():
    links = NodeLinks(interconnect=100.0, host=20.0, object_store=4.0)
    params = 8e9
    # hybrid: a device receives 7/8 of the bf16 weights over the interconnect
    assert push_s("hybrid", params, 2, 8, links) == pytest.approx(16 * 7 / 8 / 100)
    assert push_s("one_engine", params, 2, 8, links) == pytest.approx(32 * 7 / 8 / 100)
    colocated = push_s("colocated", params, 2, 8, links)
    assert colocated == pytest.approx(32 * 7 / 8 / 100 + 32 / 20 + 2 * 32 / 4 + 32 / 20
                                      + 2 * 16 / 20)
    with pytest.raises(ValueError, match="layout must be one of"):
        push_s("shared", params, 2, 8, links)


def test_every_device_rolling_out_shortens_the_step():
    shape = StepShape(long_tail_lengths(256, 8, 400, 2.5, 1024, seed=1), 8, 100)
    rows = {r["layout"]: r for r in compare_layouts(shape, H100_7B, 8, 64, update_s=5.0,
                                                    params=7.6e9)}
    assert rows["one_engine"]["workers"] == 1 and rows["hybrid"]["workers"] == 8
    assert rows["hybrid"]["rollout_s"] == rows["colocated"]["rollout_s"]
    assert rows["hybrid"]["rollout_s"] < rows["one_engine"]["rollout_s"] / 2
    assert rows["hybrid"]["push_s"] < rows["one_engine"]["push_s"] < rows["colocated"]["push_s"]
    for row in rows.values():
        assert row["step_s"] == pytest.approx(row["rollout_s"] + 5.0 + row["push_s"])
    assert rows["hybrid"]["vs_one_engine"] > max(rows["colocated"]["vs_one_engine"], 1.0)


def test_the_8b_recipe_projection_prints_all_three_layouts():
    out = recipe_8b_layouts()
    assert [r["layout"] for r in out["rows"]] == ["one_engine", "colocated", "hybrid"]
    assert out["rows"][0]["update_s"] == pytest.approx(update_s_estimate(8.19e9, 1024 * 1000, 8))
    lines = projection_lines({"projections": {"source": "x", "rows": []}, "layouts": out})
    assert sum("[projection]" in line for line in lines) == 3

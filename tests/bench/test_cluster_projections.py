"""`fastdraft bench cluster --simulate`: the simulator's projections alone, from a `bench gpu`
JSON's unit costs (or the H100 floors), without the bench's runs."""

from __future__ import annotations

import json

import pytest

from fastdraft.bench import cluster_bench, projections
from fastdraft.cli import main
from fastdraft.cluster.unit_costs import UnitCosts
from tests.cluster.test_simulator import bench_payload


def test_simulate_projects_from_the_gpu_json_alone(tmp_path, monkeypatch, capsys):
    seen = {}

    def fake_projections(models, tensor_parallel):
        seen.update(models)
        seen["tp"] = tensor_parallel
        return [{"model": m, "workers": 8, "mode": "plain", "step_s": 1.0, "idle_fraction": 0.5,
                 "speedup_vs_plain": 1.0, "label": "projection"} for m in models]
    monkeypatch.setattr(projections, "projections", fake_projections)
    monkeypatch.setattr(cluster_bench, "run_cluster_bench",
                        lambda *a, **k: pytest.fail("--simulate ran the bench's runs"))
    gpu_json, out_json = tmp_path / "gpu.json", tmp_path / "proj.json"
    gpu_json.write_text(json.dumps(bench_payload()))
    assert main(["bench", "cluster", "--simulate", "--gpu-json", str(gpu_json),
                 "--json", str(out_json)]) == 0
    measured = UnitCosts.from_gpu_bench(bench_payload())
    assert seen["7B"].step_base_s == pytest.approx(measured.step_base_s)
    assert seen["7B"].verify_factor == pytest.approx(measured.verify_factor)
    assert seen["7B"].prefill_token_s == projections.H100_7B.prefill_token_s   # not measured
    # 32B: scaled by parameters, its engines tensor-parallel over TP_32B GPUs
    tp, all_reduces = projections.TP_32B, 2 * projections.LAYERS_32B
    assert seen["tp"] == {"32B": tp}
    assert seen["32B"].step_base_s == pytest.approx(
        measured.step_base_s * 32.8 / 7.6 / tp + all_reduces * projections.ALL_REDUCE_S)
    written = json.loads(out_json.read_text())["projections"]
    assert str(gpu_json) in written["source"] and len(written["rows"]) == 2
    assert "[projection]  7B x8" in capsys.readouterr().out
    seen.clear()
    assert main(["bench", "cluster", "--simulate"]) == 0   # no JSON: the H100 floors
    assert seen["7B"] == projections.H100_7B


def test_simulate_belongs_to_bench_cluster(capsys):
    assert main(["bench", "kv", "--simulate"]) != 0
    assert "--simulate is for `bench cluster`" in capsys.readouterr().err

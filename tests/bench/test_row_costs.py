"""bench/row_costs.py: the unit costs of a split step, measured with the engine's own runner."""

from __future__ import annotations

import math

import pytest

from fastdraft.bench.row_costs import row_costs, summary_line
from fastdraft.config.engine import SpecConfig
from fastdraft.engine.envelope import Envelope
from fastdraft.engine.model_runner import ModelRunner
from fastdraft.models import load_model


def test_row_costs_reports_every_unit(tiny_checkpoint):
    spec = SpecConfig(method="eagle", depth=4, topk=2, tokens_to_verify=6)
    runner = ModelRunner(load_model(tiny_checkpoint[0]), Envelope.for_spec(64, spec), 8)
    costs = row_costs(runner, batch=8, context=30, width=6, tree_rows=3, repeats=2)
    for key in ("decode_ms", "verify_ms", "split_ms", "row_step_ms", "split_vs_verify"):
        assert costs[key] > 0 and math.isfinite(costs[key]), key
    assert costs["drafted_token_ms"] >= 0 and costs["breakeven_accept_length"] >= 1
    assert costs["row_step_ms"] == pytest.approx(costs["decode_ms"] / 8)
    assert "accept length" in summary_line(costs)
    with pytest.raises(ValueError, match="tree_rows"):
        row_costs(runner, batch=8, context=30, width=6, tree_rows=8)

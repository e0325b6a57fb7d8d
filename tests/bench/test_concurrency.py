"""concurrency_ratio (bench/concurrency.py): a static slot's cells over a paged request's,
worked by hand for the 8B recipe and the bundled trace; shared prompt blocks count once a
group; a trace without its source or lengths is refused with what it lacks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fastdraft.bench.concurrency import DEFAULT_TRACE, concurrency
from fastdraft.config import load_recipe

EIGHT_B = Path("recipes/qwen3-8b-grpo.yaml")


def _trace(tmp_path: Path, **fields) -> Path:
    data = {"source": "test", "response_length": {"mean": 300.0}, "response_cap": 1000,
            "prompt_length": 40, **fields}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(data))
    return path


def test_the_8b_recipe_with_the_bundled_trace(tmp_path):
    cfg = load_recipe(EIGHT_B, [])
    out = concurrency(cfg, DEFAULT_TRACE, 16)
    trace = json.loads(DEFAULT_TRACE.read_text())
    assert trace["source"].startswith("https://github.com/")
    # the engine's slot: 3072 cells + the tree cells (the memory plan's "64 slots x 3092
    # cells"); answers 1267/3072 of the 2048 budget
    assert out["static_cells_per_request"] == 3092
    answer = 1267.024169921875 / 3072 * 2048
    own = -(-(150 % 16 + answer) // 16)
    assert out["paged_cells_per_request"] == pytest.approx((150 // 16 / 8 + own) * 16)
    assert out["concurrency_ratio"] == pytest.approx(3092 / out["paged_cells_per_request"])


def test_prompt_blocks_are_held_once_a_group(tmp_path):
    trace = _trace(tmp_path, prompt_length=320)           # 20 full blocks, no partial one
    pair = concurrency(load_recipe(EIGHT_B, ["rollout.group_size=2"]), trace, 16)
    group = concurrency(load_recipe(EIGHT_B, ["rollout.group_size=8"]), trace, 16)
    assert pair["paged_cells_per_request"] - group["paged_cells_per_request"] == (
        20 * 16 * (1 / 2 - 1 / 8))


def test_a_trace_without_its_lengths_is_refused(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"source": "x", "response_length": {"mean": 1.0}}))
    with pytest.raises(ValueError, match="needs 'response_cap'"):
        concurrency(load_recipe(EIGHT_B, []), path, 16)

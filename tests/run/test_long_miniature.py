"""The long-answer miniature end to end (recipes/tiny-qwen3-long.yaml): every step's prompts
are 1040-1200 tokens, prefilled in chunks of 256 between decode steps, and its answers run past
1000 tokens (every problem asks for 1041-1201); a paged KV pool they outgrow preempts and
re-prefills them (in chunks too); the actor trains on packed sequences with chunked logits; the
gate holds every step and the online drafter publishes a new version every step. Slow: 4-6 min
here, alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastdraft.config import load_recipe
from fastdraft.observability.metrics import read_metrics
from fastdraft.run.run import run_recipe

# the same warm-up as tests/run/test_miniature.py: one cached drafter serves both (one at a time)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]
RECIPE = Path(__file__).parents[2] / "recipes" / "tiny-qwen3-long.yaml"


def test_the_long_answer_miniature_runs_its_ten_steps(tmp_path):
    cfg = load_recipe(RECIPE, ["logging.wandb.mode=disabled", "drafter.warmup_steps=150",
                               "drafter.warmup_rollouts=256"])
    assert cfg.algorithm.num_steps == 10 and cfg.rollout.prefill_chunk_tokens == 256
    assert cfg.actor.pack_sequences and cfg.actor.logits_chunk_tokens == 512
    run_recipe(cfg, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(10))
    for row in rows:
        assert row["rollout/response_len_max"] > 1000, row["step"]
        assert row["rollout/logprob_diff_p99"] <= 0.5 and abs(row["rollout/law_z"]) < 6
        assert row["drafter/train_steps"] >= cfg.drafter.online.min_steps_per_step
    versions = [r["drafter/version"] for r in rows]
    assert versions == sorted(set(versions)), versions   # a new drafter every step
    assert sum(r["rollout/preemptions"] for r in rows) > 0
    # every prompt is longer than a chunk: prefilled in chunks, a group's prompt once
    assert all(r["rollout/prefill_computed_tokens"] < r["rollout/prefill_tokens"] for r in rows)

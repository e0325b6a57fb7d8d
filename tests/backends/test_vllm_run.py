"""The miniature real recipe on vLLM (rollout.backend=vllm): vLLM serves the rollouts with the
EAGLE-3 drafter inside, the FSDP2 actor (2 ranks, bf16 on fp32 masters) learns, the lossless
gate reads vLLM's logprobs every step, and the drafter, trained online from the actor's
forward, is pushed into vLLM every step. Skipped where vLLM is not installed. Slow."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastdraft.config import load_recipe
from fastdraft.run.loop import train_step
from fastdraft.run.run import Run
from tests.backends.needs_vllm import needs_vllm

needs_vllm()
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("vllm")]
RECIPE = Path(__file__).parents[2] / "recipes" / "tiny-qwen3-eagle3.yaml"
STEPS = 3


def test_the_miniature_recipe_trains_on_vllm_rollouts_and_pushes_its_drafter_every_step(
        tmp_path):
    cfg = load_recipe(RECIPE, [
        "rollout.backend=vllm", f"algorithm.num_steps={STEPS}", "logging.wandb.mode=disabled",
        # the miniature test's warm-up (its cached drafter), CI's share of the prompts
        "drafter.warmup_steps=150", "drafter.warmup_rollouts=256", "rollout.prompts_per_step=8"])
    assert cfg.actor.num_ranks == 2 and cfg.drafter.online.source == "auto"
    run = Run(cfg, tmp_path / "run")
    served, rows = [], []
    try:
        assert run.drafter.on_hidden is None and run.drafter.actor_hidden_layers
        for step in range(STEPS):
            rows.append(train_step(run, step))
            served.append(run.engine.served_versions())
    finally:
        run.finish()
    for step, (row, versions) in enumerate(zip(rows, served)):
        # the gate held on vLLM's logprobs (a failure raises): what it measured
        assert row["rollout/logprob_diff_p99"] <= 0.5 and abs(row["rollout/law_z"]) < 6
        assert row["drafter/samples_added"] == 8 * cfg.rollout.group_size   # every rollout
        assert row["rollout/accept_length"] > 1.5   # vLLM drafts with the trained drafter
        # what vLLM serves after the step: the actor's weights and the new drafter
        assert versions == [{"policy": step + 1, "drafter": step + 1}]
    assert [r["drafter/version"] for r in rows] == [0, 1, 2]   # each rollout's, rising

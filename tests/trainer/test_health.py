"""The health check on the real bootstrap policy: a zeroed drafter (acceptance collapses) is
detected within HEALTH_WINDOW steps, the engine falls back to plain decoding (no drafting at
all from then on), and every step's rollout still is the policy's (the lossless gate)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fastdraft import RolloutEngine, SamplingParams
from fastdraft.bootstrap.run import run_bootstrap
from fastdraft.config import load_recipe
from fastdraft.drafter import build_drafter, save_drafter
from fastdraft.models import load_model
from fastdraft.observability.metrics import read_metrics
from fastdraft.run.loop import train
from fastdraft.run.run import Run
from fastdraft.trainer.drafter_health import HEALTH_WINDOW

pytestmark = pytest.mark.slow


def test_a_zeroed_drafter_is_detected_and_rollouts_fall_back_to_plain(tmp_path, monkeypatch):
    policy_dir = run_bootstrap().policy_dir
    policy = load_model(policy_dir)
    drafter = build_drafter("eagle1", policy.config, 512).attach(policy)
    with torch.no_grad():
        for p in drafter.parameters():
            p.zero_()
    save_drafter(drafter, tmp_path / "zeroed")
    cfg = load_recipe(Path("recipes/tiny-grpo.yaml"), [
        f"model.path={policy_dir}", f"drafter.path={tmp_path / 'zeroed'}",
        "model.extend_positions=true",
        "drafter.online.enabled=false", "rollout.prompts_per_step=4", "rollout.group_size=4",
        "rollout.max_new_tokens=48", f"algorithm.num_steps={HEALTH_WINDOW + 2}",
        "logging.wandb.mode=disabled", "logging.progress=false", "logging.dashboard=false",
        "drafter.export=false"])
    run = Run(cfg, tmp_path / "run")
    drafts: list[int] = []
    real_draft = run.engine.proposer.draft
    monkeypatch.setattr(run.engine.proposer, "draft",
                        lambda *a, **k: (drafts.append(1), real_draft(*a, **k))[1])
    train(run)
    rows = read_metrics(tmp_path / "run")
    assert all(r["rollout/logprob_diff_max"] < 1e-3 for r in rows)   # lossless throughout
    first = [r["rollout/accept_length"] for r in rows[:HEALTH_WINDOW]]
    assert max(first) <= 1.5
    assert rows[HEALTH_WINDOW - 1].get("drafter/fallback") == 1.0   # detected in the window
    assert run.engine.spec.method == "none" and "broken" in run.engine.fallback_reason
    assert all("rollout/accept_length" not in r for r in rows[HEALTH_WINDOW:])
    drafted = len(drafts)
    prompt = run.prompts.batch(0, 1)[0].ids
    params = SamplingParams(greedy=True, max_new_tokens=24)
    out = run.engine.generate([prompt], params)   # plain decoding now: nothing drafted
    plain = RolloutEngine(policy_dir, max_seq_len=run.engine.max_seq_len)
    plain.load_weights(run.actor.full_parameters())
    assert len(drafts) == drafted and out[0].spec is None
    expected = plain.generate([prompt], params)[0]
    assert out[0].token_ids == expected.token_ids
    # --resume keeps the fallback: no silent speculation with the drafter the run gave up on.
    resumed = Run(load_recipe(Path("recipes/tiny-grpo.yaml"), [
        f"model.path={policy_dir}", f"drafter.path={tmp_path / 'zeroed'}",
        "model.extend_positions=true",
        "drafter.online.enabled=false", "rollout.prompts_per_step=4", "rollout.group_size=4",
        "rollout.max_new_tokens=48", f"algorithm.num_steps={HEALTH_WINDOW + 3}",
        "logging.wandb.mode=disabled", "logging.progress=false", "logging.dashboard=false",
        "drafter.export=false"]), tmp_path / "run", resume=True)
    assert resumed.engine.spec.method == "none" and "broken" in resumed.engine.fallback_reason
    assert resumed.drafter.health.fallback and resumed.drafter.health.fallbacks == 1
    resumed.finish()

"""The GRPO main job end to end on a tiny untrained policy: every step logs its metrics, the
lossless gate holds (and fires on a corrupted rollout), checkpoints resume, the dashboard draws."""

from __future__ import annotations

import pytest

from fastdraft.algo.gate import LosslessGateError
from fastdraft.config import load_recipe
from fastdraft.observability.metrics import read_metrics
from fastdraft.run.loop import train
from fastdraft.run.run import Run


def _cfg(policy, *overrides):
    return load_recipe(None, [
        f"model.path={policy}", "rollout.prompts_per_step=3", "rollout.group_size=4",
        "rollout.max_new_tokens=10", "rollout.max_batch_size=8", "rollout.spec.method=none",
        "algorithm.num_steps=3", "actor.lr=1e-3", "checkpoint.every=1",
        "logging.wandb.mode=disabled", "logging.progress=false", *overrides])


def test_a_run_logs_every_step_checkpoints_and_draws_its_dashboard(char_policy, tmp_path):
    run = Run(_cfg(char_policy), tmp_path / "run")
    train(run)
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows:
        for key in ("reward/mean", "rollout/time_s", "rollout/tail_time_s",
                    "rollout/tokens_per_s", "rollout/logprob_diff_max", "actor/loss",
                    "actor/grad_norm", "timing/rollout_s", "timing/step_s", "policy/version"):
            assert key in row, key
        assert row["rollout/logprob_diff_max"] < 1e-3
    assert rows[-1]["policy/version"] == 3.0
    assert (tmp_path / "run" / "dashboard.png").stat().st_size > 10_000
    assert (tmp_path / "run" / "config.yaml").is_file()
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [
        "step-000002", "step-000003"]


def test_resume_continues_from_the_newest_checkpoint(char_policy, tmp_path):
    train(Run(_cfg(char_policy, "algorithm.num_steps=2"), tmp_path / "run"))
    with pytest.raises(ValueError, match="--resume"):
        Run(_cfg(char_policy), tmp_path / "run")
    run = Run(_cfg(char_policy, "algorithm.num_steps=4"), tmp_path / "run", resume=True)
    assert run.start_step == 2 and run.engine.policy_version == 2
    train(run)
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="no complete checkpoint"):
        Run(_cfg(char_policy), tmp_path / "other", resume=True)


def test_speculative_rollouts_log_acceptance_to_jsonl_and_offline_wandb(char_policy, tmp_path):
    cfg = _cfg(char_policy, "rollout.spec.method=suffix", "algorithm.num_steps=2",
               "logging.wandb.mode=offline")
    train(Run(cfg, tmp_path / "run"))
    rows = read_metrics(tmp_path / "run")
    assert all("rollout/accept_length" in r and "rollout/accept_rate_pos0" in r for r in rows)
    # the offline run's record file holds every logged key (protobuf: names stored verbatim)
    records = list((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(records) == 1 and b"rollout/accept_length" in records[0].read_bytes()


def test_the_lossless_gate_stops_a_run_whose_rollout_is_not_the_policys(char_policy, tmp_path,
                                                                         monkeypatch):
    run = Run(_cfg(char_policy), tmp_path / "run")
    real = run.engine.generate

    def corrupted(*args, **kwargs):
        outs = real(*args, **kwargs)
        outs[0].logprobs[0] -= 0.5  # as if the token came from another distribution
        return outs
    monkeypatch.setattr(run.engine, "generate", corrupted)
    with pytest.raises(LosslessGateError, match=r"^step 0: .*differs from the actor.s"):
        train(run)


def test_the_actor_scores_positions_beyond_the_checkpoints_trained_length(char_policy, tmp_path):
    # Prompts of 520-560 tokens: past char_policy's max_position_embeddings (512), where the
    # engine extends its rotary table; the actor must extend its own the same way.
    run = Run(_cfg(char_policy, "algorithm.num_steps=1", "data.task_options.min_terms=260",
                   "data.task_options.max_terms=280", "model.extend_positions=true"),
              tmp_path / "run")
    assert run.engine.max_seq_len > 512
    train(run)
    assert read_metrics(tmp_path / "run")[0]["rollout/logprob_diff_max"] < 1e-3


def test_an_adaptive_run_logs_its_speculation_share_and_resumes_the_tuner(char_policy,
                                                                            tmp_path):
    tuned = ["rollout.spec.method=suffix", "rollout.tuner.enabled=true",
             "rollout.tuner.elastic_threshold=4", "rollout.budget.enabled=true"]
    run = Run(_cfg(char_policy, *tuned, "algorithm.num_steps=2"), tmp_path / "run")
    train(run)
    rows = read_metrics(tmp_path / "run")
    assert all(0 <= r["rollout/sd_fraction"] <= 1 for r in rows)
    saved = run.engine.tuner.state_dict()
    assert sum(a["num_chosen"] for a in saved["arms"].values()) > 0
    resumed = Run(_cfg(char_policy, *tuned, "algorithm.num_steps=3"), tmp_path / "run",
                  resume=True)
    assert resumed.engine.tuner.state_dict() == saved
    # The answer-length history of length-aware budgets resumes too.
    history = run.engine.budget.state_dict()
    assert len(history["history"]) == 2 * 3 * 4   # two steps' answers: 3 prompts x 4
    assert history["step"] == 2 and resumed.engine.rl_step == 2
    assert resumed.engine.budget.state_dict() == history


def test_an_evaluation_rollout_feeds_no_hook(char_policy, tmp_path):
    """bench recipe's law check rolls the same step out again with other seeds: those samples
    must never reach the online drafter (its buffer refuses a second sample of a request)."""
    from fastdraft.run.loop import rollout
    run = Run(_cfg(char_policy), tmp_path / "run")
    seen = []
    run.on_finish_hooks.append(seen.append)
    prompts = [item.ids for item in run.prompts.batch(0, 2)]
    rollout(run, 5, prompts, train_drafter=False)
    assert seen == []
    rollout(run, 5, prompts)
    assert len(seen) == 2 * run.cfg.rollout.group_size


def test_the_suffix_drafters_window_slides_with_the_rl_steps(char_policy, tmp_path):
    """Every step ends with engine.advance_step(): the suffix drafter keeps the rollouts of its
    last window_steps steps (4) and the current one, not every rollout of a run that lasts
    days."""
    run = Run(_cfg(char_policy, "rollout.spec.method=suffix", "algorithm.num_steps=6",
                   "checkpoint.every=100"), tmp_path / "run")
    train(run)
    assert run.engine.rl_step == 6
    assert 0 < run.engine.proposer.drafter.num_prompts <= 4 * 3   # steps 2..5, 3 prompts each

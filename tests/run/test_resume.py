"""--resume continues a run exactly: the steps after a resume equal an unbroken run's (weights,
optimizer, LR schedule over optimizer steps, the suffix drafter's window, the RNGs), and a
resume that would change what is learned is refused before anything is written."""

from __future__ import annotations

import pytest
import torch

from fastdraft.actor.sharding import full_tensor
from fastdraft.bootstrap.run import run_bootstrap
from fastdraft.config import load_recipe
from fastdraft.observability.metrics import read_metrics
from fastdraft.run.loop import train
from fastdraft.run.run import Run

pytestmark = pytest.mark.slow
EXACT = ("actor/loss", "actor/grad_norm", "actor/lr", "reward/mean",
         "rollout/response_len_mean", "rollout/accept_length")


@pytest.fixture(scope="module")
def policy():
    """The bootstrap policy (cached): its rewards vary within a group, so every step learns and
    a resume that lost the weights or the optimizer would show in the next step's loss."""
    return run_bootstrap().policy_dir


def _cfg(policy, *overrides):
    return load_recipe(None, [
        f"model.path={policy}", "data.task_options.max_terms=5", "rollout.prompts_per_step=4",
        "rollout.group_size=4", "rollout.max_new_tokens=40", "rollout.max_batch_size=16",
        "rollout.spec.method=suffix",
        "algorithm.num_steps=4", "actor.lr=1e-3", "actor.warmup_steps=3",
        "actor.updates_per_step=2", "checkpoint.every=2", "logging.wandb.mode=disabled",
        "logging.progress=false", "logging.dashboard=false", *overrides])


def _weights(run: Run) -> dict[str, torch.Tensor]:
    model = run.actor.ranks.rank0.model
    return {n: full_tensor(p.detach()).clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("sharding", [
    pytest.param([], id="1-rank-fp32"),
    pytest.param(["actor.num_ranks=2", "actor.compute_dtype=bfloat16",
                  "algorithm.kl_coef=0.01"], id="2-ranks-bf16-kl"),
])
def test_a_resumed_run_continues_exactly_as_an_unbroken_one(policy, tmp_path, sharding):
    unbroken = Run(_cfg(policy, *sharding), tmp_path / "unbroken")
    train(unbroken)
    expected = _weights(unbroken) if not sharding else None
    first = Run(_cfg(policy, *sharding, "algorithm.num_steps=2"), tmp_path / "broken")
    train(first)
    taken = first.actor.step   # optimizer steps (a step whose batch has no gradient takes none)
    resumed = Run(_cfg(policy, *sharding), tmp_path / "broken", resume=True)
    assert resumed.start_step == 2 and resumed.actor.step == taken > 0
    train(resumed)
    want, got = read_metrics(tmp_path / "unbroken"), read_metrics(tmp_path / "broken")
    assert [r["step"] for r in got] == [0, 1, 2, 3]
    for step in (2, 3):   # the steps after the resume, value for value
        for key in EXACT:
            assert (key in got[step]) == (key in want[step]), (step, key)
            if key in want[step]:
                assert got[step][key] == pytest.approx(want[step][key], rel=1e-6, abs=1e-9), (
                    step, key)
    if expected is not None:   # (the sharded runs' actors are closed by then)
        for name, value in _weights(resumed).items():
            torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6)


def test_the_suffix_window_is_restored(policy, tmp_path):
    run = Run(_cfg(policy, "algorithm.num_steps=2"), tmp_path / "run")
    train(run)
    saved = run.engine.state_dict()
    assert saved["proposer"]["window"]["rollouts"]   # the window holds the two steps' answers
    resumed = Run(_cfg(policy), tmp_path / "run", resume=True)
    assert resumed.engine.state_dict() == saved


def test_a_resume_that_changes_what_is_learned_is_refused_unless_forced(policy, tmp_path):
    train(Run(_cfg(policy, "algorithm.num_steps=2"), tmp_path / "run"))
    recorded = (tmp_path / "run" / "config.yaml").read_text()
    with pytest.raises(ValueError, match=r"actor\.lr: 0\.001 -> 0\.002.*--resume-force"):
        Run(_cfg(policy, "actor.lr=2e-3"), tmp_path / "run", resume=True)
    assert (tmp_path / "run" / "config.yaml").read_text() == recorded   # nothing written
    # what only decides how long, how fast or what is logged may change
    Run(_cfg(policy, "algorithm.num_steps=6", "rollout.max_batch_size=4",
             "rollout.spec.method=none", "logging.progress=true", "rollout.kv_block_size=8",
             "rollout.kv_cache_gb=0.01", "rollout.prefill_chunk_tokens=64"), tmp_path / "run",
        resume=True)
    forced = Run(_cfg(policy, "actor.lr=2e-3"), tmp_path / "run", resume=True,
                 resume_force=True)
    assert forced.cfg.actor.lr == 2e-3

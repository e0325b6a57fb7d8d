"""TrainerGroup (cluster.drafter_training=data_parallel): the members of the idle workers train
together and stay identical, a member promoted later starts from the freshest state (a new
step's first idle worker too, through a handover), versions rise whichever member publishes,
and a killed member is a WorkerFailure for the loop."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from fastdraft.trainer.service import WorkerFailure
from fastdraft.trainer.spot import SpotStats
from tests.cluster.test_trainer_actor import CFG, _trainer_setup
from tests.trainer.test_spot import _samples, _setup

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.xdist_group("ray")   # one Ray cluster at a time


@pytest.fixture
def started(local_ray, tiny_checkpoint):
    """A group of two members on the local Ray cluster, told of step 1 and fed 12 samples."""
    from fastdraft.workers.trainer_actor import OwnActor
    from fastdraft.workers.trainer_group import TrainerGroup
    policy, drafter = _setup(tiny_checkpoint)
    group = TrainerGroup(_trainer_setup(policy, drafter), CFG, SpotStats(),
                         [OwnActor({"num_cpus": 0}), OwnActor({"num_cpus": 0})])
    try:
        group.advance_step()
        group.sync_policy(policy.named_parameters())
        group.add_many(_samples(policy, 12, step=1))   # every member gets every sample
        yield group
    finally:
        group.close()


def _steps(group, k: int) -> int:
    return group.members[k].state()["steps"]


def _until(condition, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the members did not train"
        time.sleep(0.2)


def test_idle_workers_members_train_together_and_stay_identical(started):
    group = started
    group.go(worker=1)   # worker 1 went idle first: its member trains alone
    _until(lambda: _steps(group, 1) >= 2)
    group.go(worker=0)   # then worker 0: a round of both, from member 1's state
    _until(lambda: _steps(group, 0) >= _steps(group, 1) > 3)
    group.pause()
    group.settle()
    states = [m.state() for m in group.members]
    assert states[0]["steps"] == states[1]["steps"]
    for name, tensor in states[0]["drafter"].items():
        assert torch.equal(tensor, states[1]["drafter"][name]), name   # one drafter
    tokens = [m.stats.tokens for m in group.members]
    assert min(tokens) > 0 and group.stats.tokens == sum(tokens)   # both trained
    first, second = group.publish(), group.publish()
    assert (first.version, second.version) == (1, 2)
    assert first.checksum == second.checksum   # paused: nothing trained in between


def test_a_steps_first_idle_member_starts_from_the_freshest_state(started):
    group = started
    group.go(worker=1)
    _until(lambda: _steps(group, 1) >= 3)
    group.pause()
    group.settle()
    assert group.publish().version == 1   # from member 1, the one that trained
    fresh = group.members[1].state()
    assert _steps(group, 0) == 0 and group.members[0].state()["version"] == 0
    group.go(worker=0)   # member 0 has nothing of that: member 1 hands it over first
    _until(lambda: _steps(group, 0) > fresh["steps"])   # it went on from member 1's count
    group.pause()
    group.settle()
    assert group.members[0].state()["version"] == 1   # member 1's, handed over
    assert group.members[1].state()["steps"] == fresh["steps"]   # 1 only handed over


def test_a_killed_member_is_a_worker_failure(started):
    group = started
    os.kill(group.members[1].pid, signal.SIGKILL)
    with pytest.raises(WorkerFailure, match="died"):
        group.publish()
    assert not group.alive and "member 1" in group.death


@pytest.mark.parametrize("source", ["engine", "actor"])
def test_a_ray_run_trains_its_drafter_data_parallel_on_idle_workers(char_policy, char_drafter,
                                                                    tmp_path, source):
    from fastdraft.observability.metrics import read_metrics
    from fastdraft.run.loop import train
    from fastdraft.run.run import Run
    from fastdraft.workers.trainer_group import TrainerGroup
    from tests.run.test_loop import _cfg
    from tests.trainer.test_drafter_resilience import ONLINE
    # Three groups on two workers at a batch of one group: one worker runs two waves, the
    # other idles for a whole wave, long enough for a round to form and train (with two
    # groups each, the idle window was a few decode steps and on a fast machine often none;
    # with 32-token answers a CI dry run under load still had the actor-sourced run's two idle
    # waves train nothing, so the answers are 64 tokens).
    run = Run(_cfg(char_policy, *ONLINE, f"drafter.path={char_drafter}", "cluster.backend=ray",
                   "cluster.rollout_workers=2", "cluster.drafter_training=data_parallel",
                   "rollout.prompts_per_step=3", "rollout.max_new_tokens=64",
                   "rollout.max_batch_size=4",
                   # every step publishes a trained drafter (topped up at the step's end): a CI
                   # dry run under load had a step whose idle window trained nothing
                   "drafter.online.min_steps_per_step=1",
                   f"drafter.online.source={source}"), tmp_path / "run")
    assert isinstance(run.drafter.worker, TrainerGroup)
    # actor: the workers capture nothing, the update's forward feeds every member
    assert (run.drafter.on_hidden is None) == (source == "actor")
    train(run)
    rows = read_metrics(tmp_path / "run")
    versions = [r["drafter/version"] for r in rows]
    # rises every step; from the actor's forward the samples come a step later (the first
    # step's arrive after its rollout and update), so its first new drafter serves step 3
    lag = 1 if source == "actor" else 0
    assert versions[lag:] == sorted(set(versions[lag:])) and len(versions) == 3
    assert versions[-1] > 0
    assert sum(r["drafter/train_tokens_on_idle"] for r in rows) > 0
    assert all(r["drafter/samples_added"] > 0 for r in rows)
    assert all(r["rollout/logprob_diff_max"] < 1e-3 for r in rows)
    # Which members get a micro-step in a tail or an update is timing (one of four runs left
    # a member without one): that idle members train together is
    # test_idle_workers_members_train_together_and_stay_identical.
    assert max(m.stats.tokens for m in run.drafter.worker.members) > 0

"""The drafter trainer's bounds as the loop sees them (workers/trainer_actor.RayTrainer, the one
handle for every placement): samples sent and not yet taken never exceed
drafter.online.inbox_samples (the rest are dropped and counted), every wait ends (a dead, hung
or failing trainer is a WorkerFailure within the reply timeout, never a hung run), and it
trains on the device it is given."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from fastdraft.config.sections import OnlineDrafterConfig
from fastdraft.trainer.service import TrainerSetup, WorkerFailure
from fastdraft.trainer.spot import SpotConfig, SpotStats
from tests.trainer.test_spot import _samples, _setup

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.xdist_group("ray")   # one Ray cluster at a time


def _trainer(tiny_checkpoint, timeout_s: float = 60.0, inbox: int = 256, **spot) -> tuple:
    from fastdraft.workers.trainer_actor import OwnActor, RayTrainer
    policy, drafter = _setup(tiny_checkpoint)
    cfg = OnlineDrafterConfig(enabled=True, reply_timeout_s=timeout_s, inbox_samples=inbox)
    trainer = RayTrainer(TrainerSetup(
        drafter=drafter, policy_config=policy.config,
        embed=policy.model.embed_tokens.weight.detach().clone(), lm_head=None,
        spot=SpotConfig(token_budget=64, **spot), buffer_bytes=2**24, offset_mix=0.5, seed=0,
        num_threads=1), cfg, SpotStats(), OwnActor({"num_cpus": 0}))
    return policy, trainer


def _stop(pid: int) -> None:
    """SIGSTOP, and wait until the process is stopped (delivery is asynchronous)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_the_inbox_holds_at_most_its_bound_and_counts_what_it_drops(local_ray, tiny_checkpoint):
    policy, trainer = _trainer(tiny_checkpoint, inbox=3)
    try:
        trainer.publish()                          # up and serving
        _stop(trainer.pid)                         # a trainer that takes nothing for now
        samples = _samples(policy, 10)
        for s in samples:
            trainer.add(s)
        assert trainer.inbox_dropped == 7          # 3 sent, never more
        os.kill(trainer.pid, signal.SIGCONT)
        trainer.publish()
        assert trainer.buffer_bytes == sum(s.nbytes for s in samples[:3])
        for s in _samples(policy, 3, step=1):      # taken: room for 3 again
            trainer.add(s)
        trainer.publish()
        assert trainer.inbox_dropped == 7
    finally:
        trainer.close()


def test_a_batch_waits_for_room_in_the_inbox_and_gives_up_at_the_timeout(local_ray,
                                                                         tiny_checkpoint):
    """The actor's samples of a step arrive at once: they wait for the trainer to take what
    was sent (add() would drop all but its bound), and the wait ends at the reply timeout."""
    policy, trainer = _trainer(tiny_checkpoint, timeout_s=3.0, inbox=3)
    try:
        trainer.publish()                          # up and serving
        pid = trainer.pid
        _stop(pid)                                 # takes nothing until resumed
        resume = threading.Timer(0.5, os.kill, (pid, signal.SIGCONT))
        resume.start()
        samples = _samples(policy, 10)
        trainer.add_many(samples)                  # 3 at once, the rest as room frees
        resume.join()
        assert trainer.inbox_dropped == 0
        trainer.publish()
        assert trainer.buffer_bytes == sum(s.nbytes for s in samples)
        _stop(pid)                                 # never resumed within the timeout
        start = time.monotonic()
        trainer.add_many(_samples(policy, 10, step=1))
        assert trainer.inbox_dropped == 7          # 3 sent; the rest waited 3 s in all
        assert 2.5 < time.monotonic() - start < 15
        os.kill(pid, signal.SIGCONT)
    finally:
        trainer.close()


def test_a_hung_trainer_is_a_failure_within_the_timeout_and_close_ends_it(local_ray,
                                                                          tiny_checkpoint):
    _, trainer = _trainer(tiny_checkpoint, timeout_s=2.0)
    pid = trainer.pid
    try:
        trainer.publish()
        _stop(pid)                                 # alive, but never replies
        start = time.monotonic()
        with pytest.raises(WorkerFailure, match="hangs"):
            trainer.publish()
        assert time.monotonic() - start < 10
    finally:
        trainer.close(timeout_s=2.0)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid):
        assert time.monotonic() < deadline, "close left the trainer's process running"
        time.sleep(0.1)


def _state(pid: int) -> str:
    try:
        return {"Z": "zombie"}.get(
            Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0], "running")
    except FileNotFoundError:
        return "zombie"


def test_a_dead_trainer_is_a_failure_at_once_and_nothing_is_sent_to_it(local_ray,
                                                                       tiny_checkpoint):
    policy, trainer = _trainer(tiny_checkpoint)
    try:
        trainer.publish()
        trainer.go()
        os.kill(trainer.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerFailure, match="died"):
            trainer.publish()
        assert time.monotonic() - start < 30
        trainer.add(_samples(policy, 1)[0])
        assert not trainer.alive and trainer._pending == [] and trainer.inbox_dropped == 1
    finally:
        trainer.close()


def test_an_error_in_the_trainer_reaches_the_caller(local_ray, tiny_checkpoint):
    _, trainer = _trainer(tiny_checkpoint)
    try:
        trainer._hold("no_such_method")
        with pytest.raises(WorkerFailure, match="no_such_method"):
            trainer.publish()
    finally:
        trainer.close()


def test_the_trainer_is_built_on_the_device_it_is_given(local_ray, tiny_checkpoint):
    _, trainer = _trainer(tiny_checkpoint, device="cpu")
    try:
        trainer.publish()
        assert trainer.stats.device == "cpu"
    finally:
        trainer.close()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"drafter\.online\.device=cpu"):
            SpotConfig(device="cuda")

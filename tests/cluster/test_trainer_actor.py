"""RayTrainer: the online drafter trainer as a Ray actor trains exactly as its TrainerService
does in this process, trains only while told to and idles within a micro-step of a pause, and
a killed actor is a WorkerFailure for the loop, never a hang."""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest
import torch

from fastdraft.config.sections import OnlineDrafterConfig
from fastdraft.trainer.service import (
    TrainerService,
    TrainerSetup,
    WorkerFailure,
    policy_head_tensors,
)
from fastdraft.trainer.spot import SpotConfig, SpotStats
from fastdraft.utils.process import LOWEST_NICE
from tests.trainer.test_spot import _samples, _setup, train_until

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.xdist_group("ray")   # one Ray cluster at a time

CFG = OnlineDrafterConfig(enabled=True, reply_timeout_s=30.0)


def _trainer_setup(policy, drafter) -> TrainerSetup:
    return TrainerSetup(drafter=drafter, policy_config=policy.config,
                        embed=policy.model.embed_tokens.weight.detach().clone(), lm_head=None,
                        spot=SpotConfig(token_budget=64), buffer_bytes=2**24, offset_mix=0.5,
                        seed=0, num_threads=1)


def _thread_nices(pid: int) -> list[int]:
    """The nice value of each thread of process `pid`, its main thread first."""
    tasks = sorted(os.listdir(f"/proc/{pid}/task"), key=lambda t: int(t) != pid)
    return [int(open(f"/proc/{pid}/task/{t}/stat").read().rsplit(")", 1)[1].split()[16])
            for t in tasks]


def _ray_trainer(setup: TrainerSetup):
    from fastdraft.workers.trainer_actor import OwnActor, RayTrainer
    return RayTrainer(setup, CFG, SpotStats(), OwnActor({"num_cpus": 0}))


def test_the_ray_trainer_trains_exactly_as_its_service_in_this_process(local_ray,
                                                                        tiny_checkpoint):
    policy, drafter = _setup(tiny_checkpoint)
    samples = _samples(policy, 12, step=1)   # after advance_step: the buffer's step 1
    here = TrainerService(_trainer_setup(policy, drafter))
    here.advance_step()
    here.sync_policy(policy_head_tensors(policy.named_parameters()))
    here.add_many(samples)
    for i, s in enumerate(samples):
        here.set_reward((s.rl_step, s.request_index), float(i % 3))
    local = here.publish(min_steps=4).published   # four micro-steps, no idle time
    trainer = _ray_trainer(_trainer_setup(policy, drafter))
    try:
        trainer.advance_step()
        trainer.sync_policy(policy.named_parameters())
        for s in samples[:4]:
            trainer.add(s)
        # The rest arrive as a rollout worker's batch: a Ray reference the actor opens itself.
        trainer.add_many(ray.put(samples[4:]))
        for i, s in enumerate(samples):
            trainer.set_reward((s.rl_step, s.request_index), float(i % 3))
        remote = trainer.publish(min_steps=4)
        assert trainer.stats.steps == 4 and trainer.buffer_bytes > 0
    finally:
        trainer.close()
    assert remote.version == local.version == 1
    assert remote.checksum == local.checksum   # bit for bit: one trainer, two processes


def test_the_ray_trainer_trains_while_told_and_idles_once_paused(local_ray, tiny_checkpoint):
    policy, drafter = _setup(tiny_checkpoint)
    trainer = _ray_trainer(_trainer_setup(policy, drafter))
    try:
        first = trainer.publish()
        assert trainer.stats.steps == 0 and trainer.pid != os.getpid()
        # Its micro-steps run at the lowest CPU priority, its calls at the worker's (Ray
        # starts its workers at nice 15).
        nices = _thread_nices(trainer.pid)
        assert nices.count(LOWEST_NICE) == 1 and nices[0] < LOWEST_NICE
        # (at nice 19 beside a loaded machine a micro-step may take seconds)
        train_until(trainer, _samples(policy, 12), steps=3, timeout_s=180)
        trainer.pause()    # returns at once
        trainer.settle()   # the running micro-step has ended
        paused_at = trainer.stats.steps
        assert trainer.stats.preemptions == 1 and len(trainer.stats.preemption_latencies_s) == 1
        time.sleep(0.3)
        published = trainer.publish()
        assert trainer.stats.steps == paused_at   # idle once paused
        assert published.checksum != first.checksum
        state = trainer.state()
        assert state["steps"] == paused_at and torch.equal(
            state["drafter"][published.tensors[0][0]], published.tensors[0][1])
    finally:
        trainer.close()


def test_a_killed_trainer_actor_is_a_worker_failure(local_ray, tiny_checkpoint):
    policy, drafter = _setup(tiny_checkpoint)
    trainer = _ray_trainer(_trainer_setup(policy, drafter))
    try:
        os.kill(trainer.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerFailure, match="died"):
            trainer.publish()
        assert time.monotonic() - start < 30 and not trainer.alive
        with pytest.raises(WorkerFailure, match="gone"):
            trainer.state()
    finally:
        trainer.close()



def test_the_held_out_check_crosses_from_the_actor(local_ray, tiny_checkpoint):
    from fastdraft.utils.digest import tensor_digest
    policy, drafter = _setup(tiny_checkpoint)
    setup = dataclasses.replace(_trainer_setup(policy, drafter), holdout_every=2)
    trainer = _ray_trainer(setup)
    try:
        for sample in _samples(policy, 6):
            trainer.add(sample)
        published = trainer.publish()   # untrained: the serving drafter, a tie, published
        assert published.check is not None and published.check.chains > 0
        assert published.check.passed and published.version == 1
        assert published.checksum == tensor_digest(published.tensors)
    finally:
        trainer.close()

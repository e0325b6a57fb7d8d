"""The online drafter trainer member shares its process (and device) with the engine inside a
hybrid worker: it must never do device work while the engine captures a CUDA graph
(engine/graphs.py CAPTURE_GUARD), and a training thread that raises is a failure the loop is
told of, never a hang. The CPU has no graphs: a stand-in capture (GraphPool's `_record`
replaced) fails when a micro-step runs during it; the rule it checks is the one a real capture
needs."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from fastdraft.config.sections import OnlineDrafterConfig
from fastdraft.engine.graphs import GraphPool
from fastdraft.trainer.service import TrainerSetup, WorkerFailure, policy_head_tensors
from fastdraft.trainer.spot import SpotConfig, SpotStats
from fastdraft.workers.trainer_actor import OwnActor, RayTrainer, TrainerActor
from tests.trainer.test_spot import _samples, _setup


def _trainer_setup(policy, drafter) -> TrainerSetup:
    return TrainerSetup(drafter=drafter, policy_config=policy.config,
                        embed=policy.model.embed_tokens.weight.detach().clone(), lm_head=None,
                        spot=SpotConfig(token_budget=64), buffer_bytes=2**24, offset_mix=0.5,
                        seed=0, num_threads=1)


class Watched:
    """Wraps the member's SpotTrainer.step: `busy` while a micro-step runs."""

    def __init__(self, step) -> None:
        self.step, self.busy, self.steps = step, threading.Event(), 0

    def __call__(self, *args, **kwargs):
        self.busy.set()
        try:
            return self.step(*args, **kwargs)
        finally:
            self.steps += 1
            self.busy.clear()


class StandInCapture(GraphPool):
    """A GraphPool whose capture is a stand-in on the CPU: it warms the stage up and 'captures'
    it over hold_s, and counts every moment a micro-step of the member ran meanwhile."""

    def __init__(self, busy: threading.Event, hold_s: float = 0.02) -> None:
        super().__init__("cpu", enabled=False)
        self.enabled, self.busy, self.hold_s = True, busy, hold_s
        self.overlaps = 0

    def _record(self, stage):
        deadline = time.perf_counter() + self.hold_s
        while time.perf_counter() < deadline:
            stage()
            self.overlaps += self.busy.is_set()
            time.sleep(0.001)
        return _Replay(stage)


class _Replay:
    def __init__(self, stage) -> None:
        self.replay = stage


def _member(tiny_checkpoint) -> tuple[TrainerActor, Watched]:
    policy, drafter = _setup(tiny_checkpoint)
    member = TrainerActor(_trainer_setup(policy, drafter))
    member.service.advance_step()
    member.service.sync_policy(policy_head_tensors(policy.named_parameters()))
    member.service.add_many(_samples(policy, 16, step=1))
    watched = member.service.trainer.step = Watched(member.service.trainer.step)
    return member, watched


def test_no_micro_step_of_the_member_overlaps_a_capture(tiny_checkpoint):
    member, watched = _member(tiny_checkpoint)
    pool = StandInCapture(watched.busy)
    try:
        member.go()
        deadline = time.monotonic() + 60
        while watched.steps < 2:   # training, so that every capture below has a rival
            assert time.monotonic() < deadline, "the member did not train"
            time.sleep(0.01)
        before = watched.steps
        for key in range(20):
            pool.run(("decode", key), lambda: None)   # a new key: a capture
            time.sleep(0.01)                          # the member trains between captures
        assert pool.stats.num_graphs == 20
        assert watched.steps > before, "the member never trained between the captures"
        assert pool.overlaps == 0, f"a micro-step ran during a capture {pool.overlaps} times"
    finally:
        member.stop()


def test_a_training_thread_that_raises_is_reported_not_a_hang(tiny_checkpoint):
    member, watched = _member(tiny_checkpoint)

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    watched.step = broken
    member.go()
    deadline = time.monotonic() + 30
    while member.crashed is None:   # its first micro-step raises
        assert time.monotonic() < deadline, "the member never ran a micro-step"
        time.sleep(0.01)
    answer: list[BaseException | object] = []

    def pause() -> None:
        try:
            answer.append(member.pause(time.perf_counter()))
        except BaseException as err:
            answer.append(err)

    waiter = threading.Thread(target=pause, daemon=True)
    waiter.start()
    waiter.join(timeout=5)   # answered, not waiting on an idle flag never set again
    assert answer, "pause() hangs after the training thread raised"
    assert isinstance(answer[0], RuntimeError), answer[0]
    assert "training thread raised" in str(answer[0]) and "not permitted" in str(answer[0])
    with pytest.raises(RuntimeError, match="not permitted"):
        member.publish(0)
    with pytest.raises(RuntimeError, match="not permitted"):
        member.pid()
    member.stop()   # the hybrid worker's restart of its member stops the old one: no raise


class RaisingMember(TrainerActor):
    """A trainer body whose micro-steps raise (a capture error, an OOM), in its Ray actor."""

    def __init__(self, setup: TrainerSetup) -> None:
        super().__init__(setup)

        def broken(*args, **kwargs):
            raise RuntimeError("CUDA out of memory in the drafter's backward")

        self.service.trainer.step = broken


@pytest.mark.xdist_group("ray")   # one Ray cluster at a time
def test_a_raising_member_is_a_worker_failure_for_the_loop(local_ray, tiny_checkpoint):
    pytest.importorskip("ray").cloudpickle.register_pickle_by_value(sys.modules[__name__])
    policy, drafter = _setup(tiny_checkpoint)
    trainer = RayTrainer(_trainer_setup(policy, drafter),
                         OnlineDrafterConfig(enabled=True, reply_timeout_s=30.0), SpotStats(),
                         OwnActor({"num_cpus": 0}), body=RaisingMember)
    try:
        trainer.advance_step()
        trainer.add_many(_samples(policy, 4, step=1))
        trainer.go()
        time.sleep(0.5)
        trainer.pause()
        start = time.monotonic()
        with pytest.raises(WorkerFailure, match=r"raised(.|\n)*out of memory"):
            trainer.settle()   # the step's pause: what the loop waits on before publishing
        assert time.monotonic() - start < 30
    finally:
        trainer.close()

"""RayTrainer: the online drafter trainer, the TrainerService (trainer/service.py) behind Ray
calls: in a Ray actor of its own (OwnActor: the local backend's, on the run's own Ray cluster,
so that it shares nothing with the RL loop but the machine: no GIL, its own torch threads; the
Ray backend's on a rollout worker's bundle, on a GPU node that worker's GPU, which the
rollout's tail leaves idle), or inside a hybrid worker (InWorker). Every call is a Ray actor
call on the service's own method, and tensors travel as Ray serializes them.

Inside the actor one thread trains (a micro-step at a time while `go` is set) and Ray's own
thread serves the calls, so a `pause` returns within one micro-step and samples keep arriving
while it trains. The calls that answer nothing (samples, rewards, the step, the policy head) are
held and sent together (`apply`: every `SEND_EVERY` calls, or before the next call that
answers, or at a `go` while training), not one Ray call each: a rollout's rewards are one call.
Every answer is awaited at most drafter.online.reply_timeout_s: a dead, hung or raising actor
becomes a WorkerFailure, and the online drafter restarts it from the last good drafter.

Bound (drafter.online.inbox_samples): samples sent and not yet taken by the actor never exceed
it. A sample past it is dropped and counted (the trainer is behind, or gone: never pile up); a
batch of them (the actor's forward over a step's rollout) waits for room, at most the reply
timeout in all. A Ray reference to a rollout worker's share goes from the worker's object
store to the trainer without passing the driver, and is not counted."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import traceback
from typing import Any, Protocol

import torch

from fastdraft.cluster.ray_cluster import require_ray
from fastdraft.config.sections import OnlineDrafterConfig
from fastdraft.databuffer import Sample
from fastdraft.errors import FastdraftError
from fastdraft.trainer.service import (
    TrainerHandle,
    TrainerService,
    TrainerSetup,
    WorkerFailure,
    policy_head_tensors,
)
from fastdraft.trainer.spot import Published, SpotStats
from fastdraft.trainer.stream import device_stream
from fastdraft.utils.objects import resolved
from fastdraft.utils.process import run_when_idle

TRAINER = "trainer"   # a hybrid worker's concurrency group of its trainer member's calls
SEND_EVERY = 64   # calls held at most before they are sent as one
FEED = ("add", "add_many", "set_reward", "advance_step", "sync_policy")   # what `apply` takes
#: Added to the reply timeout until the first reply: starting a process (imports, a CUDA
#: context, the trainer's weights) is not hanging.
STARTUP_GRACE_S = 120.0


class TrainerActor:
    """The actor's body: a TrainerService and the thread that trains it while told to."""

    def __init__(self, setup: TrainerSetup) -> None:
        self.service = TrainerService(setup)
        self.device = torch.device(setup.spot.device)
        self._go = threading.Event()
        self._idle = threading.Event()   # set while the training thread is between steps
        self._idle.set()
        self._gate = threading.Lock()    # a micro-step starts only while `go` is still set
        self.stopped = threading.Event()   # the member inside a hybrid worker is done
        self.crashed: str | None = None   # the training thread's traceback, if it raised
        # A daemon: it ends with the actor's process (ray.kill), between micro-steps or not.
        threading.Thread(target=self._run, name="drafter-trainer", daemon=True).start()

    def _run(self) -> None:
        """The training thread: `_train` until stopped. If it raises, the traceback is kept
        and the thread is idle for good: a pause answers at once, and every call that answers
        (`pid`, `pause`, `publish`, `state`) raises it, which the loop's handle reports as a
        WorkerFailure (the run goes on with the last published drafter)."""
        try:
            run_when_idle()   # the micro-steps take only CPU time the workers leave
            with device_stream(self.device):
                self._train()
        except BaseException:
            self.crashed = traceback.format_exc(limit=8)
        finally:
            self._idle.set()

    def _train(self) -> None:
        while not self.stopped.is_set():
            if not self._go.wait(timeout=0.1):
                continue
            with self._gate:
                if not self._go.is_set():
                    continue
                self._idle.clear()
            try:
                trained = self.service.micro_step()
            finally:
                self._idle.set()
            if not trained:
                time.sleep(0.005)   # nothing to train on yet, or this step's share is done

    def _check(self) -> None:
        if self.crashed is not None:
            raise RuntimeError(f"the drafter trainer's training thread raised:\n{self.crashed}")

    def pid(self) -> int:
        """(The driver's liveness check: a training thread that raised fails it.)"""
        self._check()
        return os.getpid()

    def stop(self) -> None:
        """Ends the training thread after its micro-step (a member inside a hybrid worker,
        whose process lives on; one whose thread raised too)."""
        self._halt()
        self.stopped.set()

    def apply(self, calls: list[tuple[str, tuple]]) -> None:
        """The service's methods that answer nothing (FEED), in the order the loop made them;
        an argument that is a Ray reference (a rollout worker's samples) is fetched here,
        straight from the worker's object store."""
        for method, args in calls:
            if method not in FEED:
                raise FastdraftError(f"TrainerActor.apply: {method!r} is not one of {FEED}")
            getattr(self.service, method)(*map(resolved, args))

    def go(self) -> None:
        self._go.set()

    def pause(self, asked_at: float) -> SpotStats:
        self._halt()
        self._check()
        return self.service.paused(asked_at)

    def _halt(self) -> None:
        with self._gate:
            self._go.clear()
        self._idle.wait()   # the micro-step running now ends first

    def publish(self, min_steps: int) -> Any:
        self._check()
        return self.service.publish(min_steps)

    def last_published(self) -> list[torch.Tensor]:
        """(In this process: a hybrid worker's broadcast of what its member published.)"""
        return self.service.last_published()

    def state(self) -> dict:
        self._check()
        return self.service.state()


class TrainerHost(Protocol):
    """Where a trainer body (TrainerActor or a data-parallel member) runs, as the loop's
    handle calls it: each call is a Ray call answered in the order made. held_by: the hybrid
    worker whose process the body lives in (what it publishes is there too), else None."""

    held_by: int | None

    def call(self, method: str, *args: Any) -> Any:
        """The body's `method(*args)`; its future."""

    def end(self) -> None:
        """The body gone (its process killed, or its thread stopped), not waited for."""


class OwnActor:
    """A trainer body in a Ray actor of its own; options: where Ray places it (the pool's
    trainer_placement: a rollout worker's bundle, no cores of its own)."""

    held_by = None   # a process of its own

    def __init__(self, options: dict[str, Any]) -> None:
        self.options = options

    def start(self, body: type, setup: TrainerSetup, args: tuple) -> OwnActor:
        import ray
        require_ray("the drafter trainer")
        self.actor = ray.remote(body).options(max_restarts=0, **self.options).remote(
            setup, *args)
        return self

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.actor, method).remote(*args)

    def end(self) -> None:
        import ray
        if ray.is_initialized():   # else Ray went down already, and the actor with it
            ray.kill(self.actor, no_restart=True)


#: A trainer actor beside the run's own process claims this share of the run's GPU (Ray's
#: count; it trains in the rollout's tail and the update, when the engine leaves it idle).
BESIDE_GPU_SHARE = 0.1


def beside(device: str) -> OwnActor:
    """A trainer body in a Ray actor of its own beside this process (the local backend): no
    cores reserved (it trains at the lowest priority); on a GPU a share of one, which the actor
    sees as cuda:0 (with several GPUs visible, Ray's first)."""
    gpu = device.startswith("cuda")
    return OwnActor({"num_cpus": 0, **({"num_gpus": BESIDE_GPU_SHARE} if gpu else {})})


class InWorker:
    """A trainer body inside a hybrid worker's process (workers/hybrid.py: its trainer
    member), on that worker's device, its calls on a thread of their own beside the
    worker's generate and update (the worker's TRAINER concurrency group)."""

    def __init__(self, worker: Any, index: int) -> None:
        self.worker, self.held_by = worker, index   # index: the worker's in its pool

    def start(self, body: type, setup: TrainerSetup, args: tuple) -> InWorker:
        self.worker.start_member.options(concurrency_group=TRAINER).remote(body, setup, *args)
        return self

    def call(self, method: str, *args: Any) -> Any:
        return self.worker.member_call.options(concurrency_group=TRAINER).remote(method, *args)

    def end(self) -> None:
        import ray
        if ray.is_initialized():
            self.worker.stop_member.options(concurrency_group=TRAINER).remote()


Placement = OwnActor | InWorker


class RayTrainer(TrainerHandle):
    """The loop's handle on a TrainerActor; `where`: its own Ray actor (OwnActor: on a rollout
    worker's bundle) or a hybrid worker's member (InWorker). body, args: the body's class and
    its arguments after the setup (a data-parallel member: workers/trainer_group.py)."""

    def __init__(self, setup: TrainerSetup, cfg: OnlineDrafterConfig, stats: SpotStats,
                 where: Placement, body: type = TrainerActor, args: tuple = ()) -> None:
        super().__init__(stats)
        self.reply_timeout_s = cfg.reply_timeout_s
        self.inbox_samples = cfg.inbox_samples
        self.host: TrainerHost = where.start(body, setup, args)
        self._pending: list[tuple[str, tuple]] = []
        self._held = 0   # samples in self._pending
        self._unread: list[tuple[Any, int]] = []   # (an `apply` not answered yet, its samples)
        self._taken: list[Any] = []   # `apply`s answered, their errors not looked at yet
        self._going = False
        self._pausing: Any = None   # the future of a pause not waited for yet
        self._dead: str | None = None
        self.pid = self._get(self.host.call("pid"), "pid", STARTUP_GRACE_S)

    @property
    def alive(self) -> bool:
        return not self.closed and self._dead is None

    @property
    def death(self) -> str:
        return self._dead or "closed"

    # producer side (what SampleCollector calls): held, then sent as one call
    def add(self, sample: Sample) -> None:
        if self._room(1, wait_s=0.0):
            self._held += 1
            self._hold("add", sample)

    def add_many(self, samples: list[Sample] | Any) -> None:
        if not isinstance(samples, list):
            self._hold("add_many", samples)   # a reference stays one: the actor fetches it
            return
        deadline = time.monotonic() + self.reply_timeout_s
        for sample in samples:
            if self._room(1, wait_s=max(0.0, deadline - time.monotonic())):
                self._held += 1
                self._hold("add", sample)

    def _room(self, n: int, wait_s: float) -> bool:
        """Room for n more samples in the inbox within wait_s (what the actor took frees
        some), else they are dropped and counted."""
        import ray
        if not self.alive:
            self.inbox_dropped += n
            return False
        if not self.inbox_samples:
            return True
        deadline = time.monotonic() + wait_s
        while True:
            if self._unread:
                futures = [f for f, _ in self._unread]
                done, _ = ray.wait(futures, num_returns=len(futures), timeout=0)
                self._unread = [(f, k) for f, k in self._unread if f not in done]
                self._taken += done
            if self._held + sum(k for _, k in self._unread) + n <= self.inbox_samples:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                self.inbox_dropped += n
                return False
            if self._held:
                self._send()   # what is held goes, so that its taking can free room
            if self._unread:
                ray.wait([self._unread[0][0]], timeout=min(left, 1.0))

    def set_reward(self, key: tuple[int, int], reward: float | None) -> None:
        self._hold("set_reward", key, reward)

    def advance_step(self) -> None:
        self._hold("advance_step")

    def sync_policy(self, named_tensors) -> None:
        self._hold("sync_policy", {n: t.cpu() for n, t in
                                   policy_head_tensors(named_tensors).items()})

    def _hold(self, method: str, *args: Any) -> None:
        self._pending.append((method, args))
        if len(self._pending) >= SEND_EVERY:
            self._send()

    # control
    def go(self, worker: int | None = None, every: bool = False) -> None:
        """Train now; while training, what is held is sent (the tail's samples reach it)."""
        if self._going:
            self._send()
            return
        self._going = True
        self._call("go")

    def join(self, round_id: int, members: tuple[int, ...], train: bool) -> None:
        """A data-parallel member into round `round_id` (workers/trainer_group.py)."""
        self._going = self._going or train
        self._call("join", round_id, members, train)

    def pause(self) -> None:
        """Stops training without waiting: the micro-step running now ends at the lowest CPU
        priority (on a GPU, on the lowest-priority stream) beside whatever the loop does next,
        and the next call that answers (or self.settle()) waits for it and takes the stats."""
        if not self._going:
            return
        self._going = False
        self._pausing = self._call("pause", time.perf_counter())

    def settle(self) -> None:
        """Waits for a pause asked for: the trainer is idle, self.stats holds its latency."""
        pausing, self._pausing = self._pausing, None
        if pausing is not None:
            self.stats = self._get(pausing, "pause")

    def ping(self) -> None:
        """Raises WorkerFailure when the actor died or hangs."""
        self._get(self._call("pid"), "pid")

    def publish(self, min_steps: int = 0) -> Published:
        self.settle()
        published = self._answered(self._get(self._call("publish", min_steps), "publish"))
        return dataclasses.replace(published, held_by=self.host.held_by)

    def state(self) -> dict:
        self.settle()
        return self._get(self._call("state"), "state")

    def close(self, timeout_s: float = 30.0) -> None:
        self.closed = True
        self.host.end()

    # calls
    def _send(self) -> None:
        calls, self._pending = self._pending, []
        held, self._held = self._held, 0
        if calls and self.alive:
            self._unread.append((self.host.call("apply", calls), held))

    def _call(self, method: str, *args: Any) -> Any:
        """The actor's `method` after the calls held (Ray runs an actor's calls in the order
        they were made); its future (None when the actor is gone)."""
        if not self.alive:
            return None
        self._send()
        return self.host.call(method, *args)

    def _get(self, future: Any, method: str, grace_s: float = 0.0) -> Any:
        import ray
        if future is None:
            raise WorkerFailure(f"the drafter trainer is gone ({self.death})")
        try:
            value = ray.get(future, timeout=self.reply_timeout_s + grace_s)
            # The `apply`s that ran meanwhile answer nothing: an error in one is seen here.
            sent = self._taken + [f for f, _ in self._unread]
            done, _ = ray.wait(sent, num_returns=len(sent), timeout=0) if sent else ([], [])
            self._taken, self._unread = [], [(f, k) for f, k in self._unread if f not in done]
            ray.get(done)
            return value
        except ray.exceptions.GetTimeoutError:
            raise WorkerFailure(f"the drafter trainer sent no {method!r} reply in "
                                f"{self.reply_timeout_s:g} s (drafter.online.reply_timeout_s): "
                                "it hangs") from None
        except ray.exceptions.RayActorError as err:
            self._dead = f"its Ray actor died: {type(err).__name__}"
            raise WorkerFailure(f"the drafter trainer died ({self._dead})") from None
        except ray.exceptions.RayTaskError as err:
            raise WorkerFailure(f"the drafter trainer raised {err.cause!r}\n{err}") from None

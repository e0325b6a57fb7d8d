"""TrainerService: the online drafter trainer as the RL loop calls it, whatever process it
runs in. It owns the trainer's DataBuffer and SpotTrainer and answers the loop's calls (samples
and rewards in, the policy head at each step, micro-steps while told to train, preemption,
publish, state). One handle serves it, `workers/trainer_actor.RayTrainer`, wherever it runs:
a Ray actor of its own (the local backend's, beside the run; the Ray backend's on a rollout
worker's bundle) or a member inside a hybrid worker. It calls these methods by name and nothing
else, so every placement trains the same way.

Thread-safe: the Ray actor trains on a thread of its own while its calls arrive on another;
one lock orders a micro-step against the step boundary, the publish and the state. Its device
work (micro-steps, the policy head's copy, the publish's and the state's reads) holds the
process's CAPTURE_GUARD (engine/graphs.py): a member inside a hybrid worker never works on the
device while the worker's engine captures a graph."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from fastdraft.databuffer import DataBuffer, Sample
from fastdraft.drafter.base import Drafter
from fastdraft.engine.graphs import CAPTURE_GUARD
from fastdraft.trainer.data_parallel import sync_state
from fastdraft.trainer.spot import (
    GradReduce,
    PolicyHead,
    Published,
    SpotConfig,
    SpotStats,
    SpotTrainer,
)
from fastdraft.utils.memory import release_free_memory, rss_mb
from fastdraft.utils.objects import resolved


class WorkerFailure(RuntimeError):
    """The drafter trainer's process died, hung past its reply timeout, or raised."""


@dataclass(frozen=True, slots=True)
class TrainerSetup:
    """Everything the trainer's process builds it from (picklable). The trainer's device is
    spot.device."""

    drafter: Drafter                 # attached later to the trainer's PolicyHead
    policy_config: Any
    embed: torch.Tensor
    lm_head: torch.Tensor | None     # None: tied to the embedding
    spot: SpotConfig
    buffer_bytes: int
    offset_mix: float
    seed: int
    num_threads: int
    max_steps_per_step: int = 0      # micro-steps per RL step at most (0: no cap)
    state: dict | None = None        # SpotTrainer.state() to continue from
    max_sample_tokens: int | None = None   # longer samples are held as windows (DataBuffer)
    window_context: int = 0                # unscored tokens leading a window (DataBuffer)
    holdout_every: int = 0                 # rollouts held out to check each publish on


@dataclass(frozen=True, slots=True)
class PublishReply:
    """A publish's answer: the drafter and the trainer's counters at that moment."""

    published: Published
    stats: SpotStats
    buffer_bytes: int
    cut_samples: int
    rss_mb: float


class TrainerService:
    def __init__(self, setup: TrainerSetup) -> None:
        torch.set_num_threads(setup.num_threads)
        torch.manual_seed(setup.seed)
        self.buffer = DataBuffer(setup.buffer_bytes, setup.offset_mix, seed=setup.seed,
                                 max_sample_tokens=setup.max_sample_tokens,
                                 window_context=setup.window_context,
                                 holdout_every=setup.holdout_every,
                                 # a held-out rollout is scored whole up to what one
                                 # micro-batch holds (the check runs the training's forward)
                                 holdout_tokens=setup.spot.token_budget)
        head = PolicyHead(setup.policy_config, setup.embed, setup.lm_head)
        self.trainer = SpotTrainer(setup.drafter, head, self.buffer, setup.spot)
        if setup.state is not None:
            self.trainer.load_state(setup.state)
        self.cap = setup.max_steps_per_step or None
        self._lock = threading.Lock()

    @property
    def stats(self) -> SpotStats:
        return self.trainer.stats

    # The DataBuffer is thread-safe on its own, and takes samples between the micro-steps'
    # draws: a sample never waits for a micro-step to end (that made a pause wait seconds).
    def add(self, sample: Sample) -> None:
        self.buffer.add(sample)

    def add_many(self, samples: list[Sample]) -> None:
        for sample in samples:
            self.buffer.add(sample)

    def set_reward(self, key: tuple[int, int], reward: float | None) -> None:
        self.buffer.set_reward(key, reward)

    def advance_step(self) -> None:
        with self._lock:
            self.buffer.advance_step()
            self.stats.steps_at_advance = self.stats.steps
        release_free_memory()   # a step's freed samples and batches back to the OS

    def sync_policy(self, tensors: dict[str, torch.Tensor]) -> None:
        """The policy head the next rollout samples from (policy_head_tensors)."""
        with CAPTURE_GUARD:
            self.trainer.sync_policy(tensors.items())

    def micro_step(self) -> bool:
        """One micro-step of training; False when there is nothing to do (an empty buffer,
        or this RL step's cap reached): the caller waits a little before asking again."""
        return self._step(self.cap)

    def _step(self, cap: int | None) -> bool:
        with CAPTURE_GUARD, self._lock:
            if self.capped(cap):
                return False
            return self.trainer.step()

    def capped(self, cap: int | None = None) -> bool:
        """This RL step's micro-steps reached the cap (default: max_steps_per_step)."""
        cap = self.cap if cap is None else cap
        return cap is not None and self.stats.steps - self.stats.steps_at_advance >= cap

    # data-parallel members (workers/trainer_group.py): a round's collectives
    def round_start(self, pg: Any, rank: int) -> int:
        """The freshest member's state, in every member of the round (its rank returned)."""
        with CAPTURE_GUARD, self._lock:
            done = self.stats.steps - self.stats.steps_at_advance
            root = sync_state(self.trainer, pg, rank)
            self.stats.steps_at_advance = self.stats.steps - done   # this step's own count
            return root

    def round_step(self, reduce: GradReduce) -> bool:
        """One data-parallel micro-step (every member of the round calls it together)."""
        with CAPTURE_GUARD, self._lock:
            return self.trainer.step(reduce)

    def paused(self, asked_at: float) -> SpotStats:
        """The loop asked to stop training at `asked_at` (time.perf_counter); the micro-step
        running then has ended. Records the preemption latency."""
        with self._lock:
            self.trainer.record_preemption(asked_at)
            return self.stats

    def publish(self, min_steps: int = 0) -> PublishReply:
        """The newest drafter, after topping this RL step's training up to min_steps
        micro-steps (while the buffer has data)."""
        while self._step(min_steps):   # the step's cap does not limit the top-up
            pass
        with CAPTURE_GUARD:
            published = self.trainer.publish()
        buffer = self.buffer.stats()
        return PublishReply(published, self.stats, buffer.num_bytes, buffer.cut_samples,
                            rss_mb())

    def state(self) -> dict:
        with CAPTURE_GUARD, self._lock:
            return self.trainer.state()

    def last_published(self) -> list[torch.Tensor]:
        """The tensors of the last publish (host copies, in trainable_named_tensors order)."""
        return list(self.trainer.serving)


#: What the trainer reads of the policy (PolicyHead): its embedding and lm_head.
POLICY_HEAD = ("model.embed_tokens.weight", "lm_head.weight")


def policy_head_tensors(named_tensors) -> dict[str, torch.Tensor]:
    return {n: t.detach() for n, t in named_tensors if n in POLICY_HEAD}


class TrainerHandle:
    """What the RL loop holds of a TrainerService elsewhere (RayTrainer, TrainerGroup):
    the service's calls, plus the counters its last answers carried. Calls that answer raise
    WorkerFailure when the process died, hung past its reply timeout, or raised."""

    def __init__(self, stats: SpotStats | None = None) -> None:
        self.stats = stats or SpotStats()
        self.buffer_bytes = 0
        self.cut_samples = 0     # rollouts the buffer held as windows, since it started
        self.rss_mb: float | None = None   # the trainer process's resident size, MiB
        self.inbox_dropped = 0             # samples dropped: the trainer was behind
        self.closed = False

    per_worker = False   # one trainer: only the first idle worker is promoted (TrainerGroup: each)
    alive: bool   # the process runs and was not closed
    pid: int
    death: str    # how the process ended, for the log

    def add(self, sample: Sample) -> None: ...

    def add_many(self, samples: list[Sample] | Any) -> None:
        """A batch of samples, or a Ray reference to one (a rollout worker's share): the
        RayTrainer passes the reference on, so the samples go from the worker to the trainer
        without the driver opening them; this default opens it here."""
        for sample in resolved(samples):
            self.add(sample)
    def set_reward(self, key: tuple[int, int], reward: float | None) -> None: ...
    def advance_step(self) -> None: ...
    def sync_policy(self, named_tensors) -> None: ...
    def go(self, worker: int | None = None, every: bool = False) -> None:
        """Train now. worker (an idle rollout worker) and every (all of them, while the actor
        updates) say where, for a trainer that trains on several (TrainerGroup)."""

    def pause(self) -> None:
        """Stops training: no micro-step starts after it. It returns at once; the next answer
        waits for the running micro-step (settle: the stats, with the preemption latency, are
        then in self.stats)."""

    def settle(self) -> None:
        """Waits for the last pause to take effect (stats included)."""

    def publish(self, min_steps: int = 0) -> Published:
        """The trainer's newest drafter, after topping its training this RL step up to
        min_steps micro-steps (while its buffer has data)."""
        raise NotImplementedError

    def state(self) -> dict:
        """The trainer's state (SpotTrainer.state), for the run's checkpoint."""
        raise NotImplementedError

    def close(self, timeout_s: float = 30.0) -> None: ...

    def _answered(self, reply: PublishReply) -> Published:
        self.stats, self.buffer_bytes = reply.stats, reply.buffer_bytes
        self.cut_samples, self.rss_mb = reply.cut_samples, reply.rss_mb
        return reply.published

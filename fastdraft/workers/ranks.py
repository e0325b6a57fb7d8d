"""The actor's ranks as the driver talks to them (workers/actor.py): one Protocol, two transports.

- `LocalRanks`: rank 0 in this process, ranks 1..N-1 as its followers (Ray actors,
  workers/actor_group.py: on bundles of their own, or beside the rollout workers).
- `WorkerRanks` (workers/hybrid_ranks.py): every rank inside a hybrid worker, beside that
  worker's engine replica; the driver holds none.

`call(name, args)` runs `ActorRank.<name>` on every rank at once (SPMD: the collectives inside
pair up across ranks) and returns the answers in rank order."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

import torch

from fastdraft.actor.rank import ActorRank, ActorSpec
from fastdraft.actor.sharding import leave_ranks
from fastdraft.checkpoint.snapshot import WeightSource

PerRank = list[tuple] | tuple   # one argument tuple per rank, or one tuple for all
REPLY_TIMEOUT_S = 3 * 3600.0   # one command (a long update, a checkpoint gather) at most


class ActorRankError(RuntimeError):
    """A rank other than the driver's failed or died; the message names it and carries its
    traceback, or how it ended."""


class ActorRanks(Protocol):
    world: int

    def call(self, name: str, args: PerRank = ()) -> list[Any]:
        """ActorRank.<name>(*args) on every rank; the answers in rank order."""

    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full fp32 tensor) one at a time, here (every rank takes part in the
        gathers; consume it to the end)."""

    def full_state(self) -> AbstractContextManager[tuple[WeightSource, dict]]:
        """The full weights (a one-pass WeightSource) and the training state (full AdamW state
        by name, LR schedule, loss scale), here, for a checkpoint."""

    def lost(self, grace_s: float = 0.0) -> str | None:
        """A rank that died, as words; None when all live (watched for grace_s)."""

    def close(self, timeout_s: float = 30.0) -> None: ...


def answer(args: PerRank, i: int) -> tuple:
    """Rank-list member i's arguments of a call."""
    return args[i] if args and isinstance(args, list) else args


class LocalRanks:
    """Rank 0 in this process, its followers started by `peers(spec)` (they start first: rank
    0's rendezvous waits for them; default: Ray actors on bundles of their own, Ray up). The
    ranks rendezvous at this node's address as Ray names it (a follower on another node
    reaches it there), the spec's port."""

    def __init__(self, spec: ActorSpec, peers: Callable[[ActorSpec], Any] | None = None) -> None:
        self.world = spec.actor.num_ranks
        if peers is None:
            from fastdraft.workers.actor_group import RayActorPeers as peers
        if self.world > 1:
            from fastdraft.workers.actor_group import node_address
            spec = dataclasses.replace(spec, address=node_address())
        self.peers = peers(spec) if self.world > 1 else None
        try:
            self.rank0 = ActorRank(spec, 0)
            self._gather("start-up")
        except BaseException:
            self.close()
            raise

    def call(self, name: str, args: PerRank = ()) -> list[Any]:
        self._send(name, args[1:] if isinstance(args, list) else args)
        mine = getattr(self.rank0, name)(*answer(args, 0))
        return [mine, *self._gather(name)]

    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        self._send("drain_parameters")
        gathered = self.rank0.gathered()
        try:
            yield from gathered.named_parameters()
        finally:
            gathered.finish()   # a consumer that stopped early: the followers still gather
            self._gather("the weight gather")

    @contextmanager
    def full_state(self) -> Iterator[tuple[WeightSource, dict]]:
        self._send("checkpoint_gather")
        gathered = self.rank0.gathered()
        try:
            yield gathered, self.rank0.training_state()
        finally:
            gathered.finish()
            self._gather("the checkpoint gather")

    def lost(self, grace_s: float = 0.0) -> str | None:
        return self.peers.lost(grace_s) if self.peers is not None else None

    def close(self, timeout_s: float = 30.0) -> None:
        """Ends the follower ranks (asked, then killed after timeout_s)."""
        if getattr(self, "peers", None) is not None:
            self.peers.close(timeout_s)
            self.peers = None
            leave_ranks()

    def _send(self, name: str, args: PerRank = ()) -> None:
        if self.peers is not None:
            self.peers.send(name, args)

    def _gather(self, what: str) -> list:
        return self.peers.gather(what) if self.peers is not None else []

"""WorkerRanks: the actor's ranks inside the hybrid workers (workers/hybrid.py), behind the
driver's ActorRanks Protocol (workers/ranks.py). A call goes to every worker at once and is
answered in rank order; a worker that died is an ActorRankError naming it (the run then
resumes from its last checkpoint: the rank's shard died with it). The full weights and
training state come to the driver only for a checkpoint (rank 0 gathers them to its host)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from fastdraft.checkpoint.manager import CheckpointWriteError
from fastdraft.errors import FastdraftError
from fastdraft.models import ModelConfig
from fastdraft.workers.ranks import REPLY_TIMEOUT_S, ActorRankError, PerRank, answer


@dataclass(frozen=True, slots=True)
class HostWeights:
    """Full weights in host memory as a checkpoint's WeightSource."""

    config: ModelConfig
    tensors: dict[str, torch.Tensor]

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.tensors.items()


class WorkerRanks:
    """workers: the hybrid workers' Ray handles, rank r = worker r."""

    def __init__(self, workers: list[Any], config: ModelConfig,
                 timeout_s: float = REPLY_TIMEOUT_S) -> None:
        self.workers, self.config, self.timeout_s = workers, config, timeout_s
        self.world = len(workers)
        self.closed = False   # the workers are gone (the pool closed them)

    def call(self, name: str, args: PerRank = ()) -> list[Any]:
        return get_all([w.rank_call.remote(name, answer(args, r))
                        for r, w in enumerate(self.workers)], name, self.timeout_s)

    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        params, _ = self._host_state()
        yield from params.items()

    @contextmanager
    def full_state(self) -> Iterator[tuple[HostWeights, dict]]:
        params, training = self._host_state()
        yield HostWeights(self.config, params), training

    def _host_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        return self.call("host_state")[0]

    def save_checkpoint(self, root: str, keep: int, step: int, rest: dict[str, Any]
                        ) -> tuple[float, float]:
        """Checkpoint `step` written by worker 0 (workers/hybrid.py); (seconds, the previous
        write's seconds)."""
        return get_all([w.save_checkpoint.remote(root, keep, step, rest) for w in self.workers],
                       "the checkpoint (each worker its shard)", self.timeout_s)[0]

    def wait_checkpoint(self, timeout_s: float | None = None) -> None:
        """Worker 0's checkpoint write on disk (nothing once the workers are closed).
        timeout_s (after a failure): a peer's death can leave worker 0 waiting in a collective,
        so it is given that long and then no more waits are made (what it publishes is whole or
        absent either way: the atomic publish)."""
        if self.closed:
            return
        try:
            [failed] = get_all([self.workers[0].wait_checkpoint.remote()], "the checkpoint write",
                               self.timeout_s if timeout_s is None else timeout_s)
        except ActorRankError:
            if timeout_s is None:
                raise
            self.closed = True
            return
        if failed is not None:   # worker 0's CheckpointWriteError, its OS error as the cause
            raise failed

    def poll_checkpoint(self) -> None:
        """wait_checkpoint() without waiting for the write (a step boundary's look): a write
        worker 0 saw fail raises its CheckpointWriteError here."""
        if self.closed:
            return
        [failed] = get_all([self.workers[0].poll_checkpoint.remote()],
                           "the checkpoint write's state", self.timeout_s)
        if failed is not None:
            raise failed

    def lost(self, grace_s: float = 0.0) -> str | None:
        import ray
        for rank, worker in enumerate(self.workers):
            try:
                ray.get(worker.pid.remote(), timeout=max(grace_s, 10.0))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                return f"hybrid worker {rank} (actor rank {rank}) died"
        return None

    def close(self, timeout_s: float = 30.0) -> None:
        """The workers are the rollout pool's, closed with it; no call reaches them after."""
        self.closed = True


def get_all(futures: list[Any], what: str, timeout_s: float = REPLY_TIMEOUT_S) -> list[Any]:
    """Every hybrid worker's answer to one call (worker r's future at r), in rank order, taken
    as they come: a worker that died, failed or went silent is an ActorRankError naming it at
    once, even while its peers still wait for it in a collective."""
    import ray
    rank_of = {future: rank for rank, future in enumerate(futures)}
    out: list[Any] = [None] * len(futures)
    pending, deadline = list(futures), time.monotonic() + timeout_s
    while pending:
        ready, pending = ray.wait(pending, num_returns=1,
                                  timeout=max(deadline - time.monotonic(), 0.0))
        if not ready:
            rank = rank_of[pending[0]]
            raise ActorRankError(f"hybrid worker {rank} (actor rank {rank}) sent nothing for "
                                 f"{what} in {timeout_s:.0f} s")
        rank = rank_of[ready[0]]
        try:
            out[rank] = ray.get(ready[0])
        except ray.exceptions.RayActorError:
            raise ActorRankError(f"hybrid worker {rank} (actor rank {rank}) died during "
                                 f"{what}") from None
        except ray.exceptions.RayTaskError as err:
            if isinstance(err.cause, CheckpointWriteError):   # a disk, not a lost rank: at once
                raise err.cause from err.cause.error
            # A collective fails on every rank when one dies: name the dead one if there is
            dead = _died(pending, rank_of)
            if dead is not None:
                raise ActorRankError(f"hybrid worker {dead} (actor rank {dead}) died during "
                                     f"{what}") from None
            raise ActorRankError(f"hybrid worker {rank} (actor rank {rank}) failed during "
                                 f"{what}:\n{err}") from None
    return out


def _died(pending: list[Any], rank_of: dict[Any, int], grace_s: float = 5.0) -> int | None:
    """The rank among `pending` whose worker died, watched for grace_s (a killed worker's
    death reaches Ray a moment after its peers' collective failed); None when all live."""
    import ray
    ready, _ = ray.wait(pending, num_returns=len(pending), timeout=grace_s)
    for future in ready:
        try:
            ray.get(future)
        except ray.exceptions.RayActorError:
            return rank_of[future]
        except ray.exceptions.RayTaskError:
            continue
    return None


def share_drafter(workers: list[Any], named: list[tuple[str, torch.Tensor]], version: int,
                  checksum: str | None, src: int) -> None:
    """Every hybrid worker's engine loads the drafter `named` (the driver's copy of what worker
    src's trainer member published) from src, broadcast over the workers' process group
    (HybridWorker.share_drafter); a checksum that fails there fails everywhere (the same
    bytes), and no engine loaded anything: a FastdraftError."""
    layout = [(name, tuple(t.shape), t.dtype) for name, t in named]
    errors = get_all([w.share_drafter.remote(layout, version, checksum, src) for w in workers],
                     "the drafter's broadcast")
    if errors[src] is not None:
        raise FastdraftError(f"the drafter hybrid worker {src} holds: {errors[src]}")

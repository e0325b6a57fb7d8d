"""The worker calls of one rollout on a RolloutPool: which requests (indices in the whole
rollout) each running call answers for. That is what lets a dead worker's share be re-run
exactly, and a yielded tail move into a peer's running call (cluster.consolidate_below)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastdraft.engine import SamplingParams
from fastdraft.engine.migration import MigratedRequest
from fastdraft.workers.rollout_worker import Capture

if TYPE_CHECKING:
    from fastdraft.workers.pool import RolloutPool


@dataclass
class WorkerCall:
    """One generate call in flight: its worker, the requests it answers for (indices in the
    whole rollout; tails it takes join them), its ticket (the pool numbers every call) and
    the reference to the drafter samples it will return (opened by the trainer, not here)."""

    worker: int
    indices: list[int]
    ticket: int
    samples: Any = None
    follower: bool = False   # a tensor-parallel rank past the first: its replica's leader answers


class RolloutCalls:
    """The worker calls of one rollout: which requests (indices in the whole rollout) each
    running call answers for, so a worker's death re-runs exactly those, and the tails that
    change worker."""

    def __init__(self, pool: RolloutPool, prompts: list[list[int]], params: SamplingParams,
                 capture: Capture | None) -> None:
        self.pool, self.prompts, self.params, self.capture = pool, prompts, params, capture
        self.pending: dict[Any, WorkerCall] = {}   # future -> the call it answers
        self.migrated = 0

    def submit(self, k: int, indices: list[int], peers_busy: int,
               resume: list[MigratedRequest] = (), follower: bool = False) -> None:
        """Worker k generates `indices` from their prompts (and continues `resume`). follower:
        k is a tensor-parallel rank making the same calls as its replica's first, which alone
        captures hidden states and answers."""
        fresh = [i for i in indices if i not in {m.index for m in resume}]
        ticket = next(self.pool.tickets)
        future, samples = self.pool.workers[k].generate.remote(
            [self.prompts[i] for i in fresh], self.params, fresh,
            None if follower else self.capture, resume=resume, ticket=ticket,
            peers_busy=peers_busy, yield_below=self.pool.cfg.consolidate_below if not resume else 0)
        self.pending[future] = WorkerCall(k, list(indices), ticket, samples, follower)

    def submit_replica(self, workers: range, indices: list[int], peers_busy: int) -> None:
        """The same call on every worker of a replica (one, or a tensor-parallel replica's
        ranks, the first of which answers)."""
        for k in workers:
            self.submit(k, indices, peers_busy, follower=k != workers[0])

    def busy(self) -> set[int]:
        return {c.worker for c in self.pending.values()}

    def tell_peers(self) -> None:
        """Every generating worker learns how many others still generate (a worker yields its
        tail only while one does)."""
        busy = self.busy()
        for c in self.pending.values():
            self.pool.workers[c.worker].peers.remote(c.ticket, len(busy) - 1)

    def forward(self, donor: int, tail: list[MigratedRequest]) -> None:
        """A yielded tail into the call with the most requests left, running or queued (a
        worker that yielded at the same moment as the donor and got its own tail back takes
        this one too); if every call has ended meanwhile, the donor finishes it itself (no
        further yield)."""
        import ray
        indices = [m.index for m in tail]
        for c in sorted(self.pending.values(), key=lambda c: -len(c.indices)):
            if c.worker == donor:
                continue
            try:
                taken = ray.get(self.pool.workers[c.worker].accept.remote(tail, c.ticket))
            except ray.exceptions.RayActorError:
                taken = False   # it died: its own call fails and is re-run
            if taken:
                c.indices += indices
                self.migrated += len(tail)
                return
        self.submit(donor, indices, peers_busy=0, resume=tail)

    def rerun(self, k: int, indices: list[int], err: Exception) -> None:
        """Worker k died with `indices` unfinished: a replacement takes its place (with the
        current weights) and they are re-run from their prompts (the same streams: the same
        completions) split over every worker, the new one too."""
        print(f"cluster: rollout worker {k} died ({type(err).__name__}); re-running its "
              f"{len(indices)} requests on the others")
        self.pool.reruns += len(indices)
        self.pool.replace_worker(k)
        live = len(self.pool.workers)
        for w in range(live):
            if indices[w::live]:
                self.submit(w, indices[w::live], peers_busy=live - 1)

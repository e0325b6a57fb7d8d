"""The actor's ranks 1..N-1 as Ray actors beside rank 0 in the driver (workers/ranks.LocalRanks):
one worker group, placed by Ray in a placement group of its own (one bundle a rank: its threads,
or its GPU; the local backend's ranks on the run's own Ray cluster), or with
cluster.placement=colocated on the rollout workers' bundles (rank r beside worker r, sharing
its device while the worker sleeps). torch.distributed (gloo on the CPU, nccl on GPUs) runs
inside them: rank 0 (the driver) sends a command to every follower, then gathers their answers
in rank order, so the collectives inside pair up across ranks. A rank that died, failed or
went silent is an ActorRankError naming it."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from fastdraft.actor.rank import ActorRank, ActorSpec
from fastdraft.cluster.ray_cluster import require_ray
from fastdraft.cluster.reserve import reserve
from fastdraft.workers.ranks import REPLY_TIMEOUT_S, ActorRankError


class _Rank:
    """One follower rank in a Ray actor."""

    def __init__(self, spec: ActorSpec, rank: int, num_threads: int) -> None:
        import torch
        torch.set_num_threads(num_threads)
        # Ray gives the rank one GPU, which it sees as cuda:0 (not the r-th after model.device)
        self.actor = ActorRank(spec, rank, "cuda:0" if spec.device.startswith("cuda") else None)

    def call(self, name: str, args: tuple) -> Any:
        return getattr(self.actor, name)(*args)

    def pid(self) -> int:
        return os.getpid()

    def placement(self) -> tuple[str, str]:
        import ray
        context = ray.get_runtime_context()
        return str(context.get_placement_group_id()), context.get_node_id()


def node_address() -> str:
    """This node's IP as Ray knows it (a run's own local cluster: 127.0.0.1)."""
    import ray
    return ray.util.get_node_ip_address()


class RayActorPeers:
    """Rank 0's handle on ranks 1..N-1 as Ray actors."""

    def __init__(self, spec: ActorSpec, num_threads: int = 1,
                 placement: Callable[[int], dict[str, Any]] | None = None,
                 placement_timeout_s: float = 120.0) -> None:
        """placement: rank -> its Ray options, where the ranks share bundles made elsewhere
        (colocated placement: the rollout workers', RolloutPool.actor_rank_options); None:
        a placement group of their own, one bundle (its threads, its GPU) a rank."""
        import ray
        require_ray("actor ranks 1..")
        cls = ray.remote(_Rank)
        self.group = None
        if placement is None:
            self.group, placement = self._own_group(spec, num_threads, placement_timeout_s)
        # The rank's ActorRank builds (and joins the process group) in its constructor: rank
        # 0's rendezvous waits for it, as with process ranks.
        self.ranks = [cls.options(max_restarts=0, **placement(rank)).remote(
            spec, rank, num_threads) for rank in range(1, spec.actor.num_ranks)]
        self._pending: list[Any] = [r.pid.remote() for r in self.ranks]

    @staticmethod
    def _own_group(spec: ActorSpec, num_threads: int, timeout_s: float
                   ) -> tuple[Any, Callable[[int], dict[str, Any]]]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        gpus = 1 if spec.device.startswith("cuda") else 0
        bundle = {"CPU": num_threads, **({"GPU": gpus} if gpus else {})}
        group = reserve([bundle] * (spec.actor.num_ranks - 1), timeout_s,
                        f"actor.num_ranks={spec.actor.num_ranks} (ranks 1.. a bundle each)")
        return group, lambda rank: {
            "num_cpus": num_threads, "num_gpus": gpus,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=rank - 1)}

    def placements(self) -> list[tuple[str, str]]:
        """Every follower's (placement group id, node id), as Ray placed it."""
        import ray
        return ray.get([r.placement.remote() for r in self.ranks])

    def send(self, name: str, per_rank_args: list[tuple] | tuple = ()) -> None:
        self._pending = [rank.call.remote(name, per_rank_args[i] if per_rank_args and isinstance(
            per_rank_args, list) else per_rank_args) for i, rank in enumerate(self.ranks)]

    def gather(self, what: str, timeout: float = REPLY_TIMEOUT_S) -> list[Any]:
        import ray
        out = []
        for rank, future in enumerate(self._pending, start=1):
            try:
                out.append(ray.get(future, timeout=timeout))
            except ray.exceptions.RayActorError:
                raise ActorRankError(f"actor rank {rank} died during {what}") from None
            except ray.exceptions.GetTimeoutError:
                raise ActorRankError(f"actor rank {rank} sent nothing for {what} in "
                                     f"{timeout:.0f} s") from None
            except ray.exceptions.RayTaskError as err:
                raise ActorRankError(f"actor rank {rank} failed during {what}:\n{err}") from None
        return out

    def started(self) -> None:
        self.gather("start-up")

    def lost(self, grace_s: float = 0.0) -> str | None:
        """The first follower that no longer answers, as words; None when all do. (grace_s:
        Ray's own 10 s wait for an answer covers a death still on its way.)"""
        import ray
        for rank, actor in enumerate(self.ranks, start=1):
            try:
                ray.get(actor.pid.remote(), timeout=10)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                return f"actor rank {rank} died"
        return None

    def pids(self) -> list[int]:
        import ray
        return ray.get([r.pid.remote() for r in self.ranks])

    def close(self, timeout_s: float = 30.0) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group
        if not ray.is_initialized():
            return
        for rank in self.ranks:
            ray.kill(rank, no_restart=True)
        if self.group is not None:   # bundles shared with the rollout workers stay theirs
            remove_placement_group(self.group)

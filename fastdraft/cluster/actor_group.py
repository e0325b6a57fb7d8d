"""The actor's ranks 1..N-1 as Ray actors (cluster.backend=ray): one worker group, placed by
Ray in a placement group (one bundle a rank: its threads, or its GPU), torch.distributed (gloo
on the CPU, nccl on GPUs) inside them exactly as in the process ranks (rl/actor_peers.py),
whose interface this keeps: rank 0 (the driver) sends a command to every follower, then
gathers their answers in rank order, so the collectives inside pair up across ranks. A rank
that died, failed or went silent is an ActorRankError naming it."""

from __future__ import annotations

import os
from typing import Any

from fastdraft.rl.actor_peers import REPLY_TIMEOUT_S, ActorRankError
from fastdraft.rl.actor_rank import ActorRank, ActorSpec


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


class RayActorPeers:
    """Rank 0's handle on ranks 1..N-1 as Ray actors."""

    def __init__(self, spec: ActorSpec, num_threads: int = 1) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        followers = spec.actor.num_ranks - 1
        gpus = 1 if spec.device.startswith("cuda") else 0
        bundle = {"CPU": num_threads, **({"GPU": gpus} if gpus else {})}
        self.group = placement_group([bundle] * followers, strategy="PACK")
        ray.get(self.group.ready())
        cls = ray.remote(_Rank)
        # The rank's ActorRank builds (and joins the process group) in its constructor: rank
        # 0's rendezvous waits for it, as with process ranks.
        self.ranks = [cls.options(
            num_cpus=num_threads, num_gpus=gpus, max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=rank - 1)).remote(spec, rank, num_threads)
            for rank in range(1, spec.actor.num_ranks)]
        self._pending: list[Any] = [r.pid.remote() for r in self.ranks]

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
        remove_placement_group(self.group)

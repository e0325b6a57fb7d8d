"""WarmupGroup: where the drafter warm-up's members run. One member is this process on the given
device (inline: no Ray). More are a placement group of one bundle a member (a CPU thread, and on
GPUs a GPU each, PACKed onto as few nodes as Ray can): member 0 is this process computing on
bundle 0's GPU (which Ray then hands to no one else), members 1.. Ray actors in bundles 1..,
each seeing its GPU as cuda:0. The members rendezvous for their gradient sums at a TCPStore
this process hosts. Their spill directories live in the warm-up's work directory: across
nodes that is a shared filesystem."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fastdraft.cluster.ray_cluster import connect, cuda_name
from fastdraft.cluster.reserve import in_bundle, reserve
from fastdraft.config.sections.cluster import ClusterConfig
from fastdraft.errors import FastdraftError
from fastdraft.workers.warmup_member import WarmupMember


class WarmupGroup:
    """`world` members on `device` (cpu, or cuda: a GPU each); `lead` is member 0 (this
    process's), `others` members 1.. (Ray actor handles)."""

    def __init__(self, device: str, world: int, num_threads: int = 1,
                 timeout_s: float = 120.0) -> None:
        self.world, self.others = world, []
        self.group, self.started, self.store = None, False, None
        if world == 1:
            self.lead = WarmupMember(device, num_threads=num_threads)
            return
        import ray
        gpu = torch.device(device).type == "cuda"
        self.started = connect(ClusterConfig(), world * num_threads)
        bundle = {"CPU": num_threads, **({"GPU": 1} if gpu else {})}
        self.group = reserve([bundle] * world, timeout_s,
                             f"drafter warmup --workers {world} (a bundle each)")
        try:
            self.lead = WarmupMember(self._bundle_zero_gpu(bundle) if gpu else device, 0,
                                     world, num_threads)
            member = ray.remote(WarmupMember)
            self.others = [member.options(num_cpus=num_threads, max_restarts=0,
                                          **in_bundle(self.group, bundle, r, 1.0)).remote(
                "cuda:0" if gpu else device, r, world, num_threads) for r in range(1, world)]
            host = ray.util.get_node_ip_address()   # where the members reach this process
            self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
            self.store_at = (host, self.store.port)
        except BaseException:
            self.close()
            raise

    def _bundle_zero_gpu(self, bundle: dict[str, float]) -> str:
        """Bundle 0's GPU as this process names it; it must be on this process's node."""
        import ray

        @ray.remote(num_cpus=0)
        def where() -> tuple[str, str]:
            return str(ray.get_gpu_ids()[0]), ray.get_runtime_context().get_node_id()

        gpu, node = ray.get(where.options(**in_bundle(self.group, bundle, 0, 1.0)).remote())
        if node != ray.get_runtime_context().get_node_id():
            raise FastdraftError("drafter warmup --workers: Ray placed member 0's GPU on another "
                                 "node than this process, which is member 0: start the warm-up "
                                 "on a node with GPUs of the cluster")
        return cuda_name(gpu)

    def call(self, name: str, *args: Any, lead_kwargs: dict | None = None) -> list[Any]:
        """`name`(*args) on every member at once (member 0 here, with lead_kwargs too),
        answered in rank order."""
        if not self.others:
            return [getattr(self.lead, name)(*args, **(lead_kwargs or {}))]
        import ray
        pending = [getattr(m, name).remote(*args) for m in self.others]
        mine = getattr(self.lead, name)(*args, **(lead_kwargs or {}))
        return [mine, *ray.get(pending)]

    def close(self) -> None:
        if self.group is None:
            return
        import ray
        from ray.util.placement_group import remove_placement_group
        for member in self.others:
            ray.kill(member, no_restart=True)
        remove_placement_group(self.group)
        self.group = None
        if self.started:
            ray.shutdown()

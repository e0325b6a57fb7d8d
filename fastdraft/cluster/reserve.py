"""Placement groups reserved within a bound: a request the Ray cluster cannot place (more GPUs or
CPUs than it has, or than it has free) is one line after cluster.placement_timeout_s, naming what
was asked and what the cluster holds, instead of a wait that never ends."""

from __future__ import annotations

from typing import Any

from fastdraft.config.sections.cluster import ClusterConfig
from fastdraft.errors import FastdraftError

#: Of a rollout worker's GPU, what the drafter trainer's actor claims, and with colocated
#: placement the actor rank beside it (Ray's bookkeeping: every process sees the whole device).
TRAINER_GPU_SHARE = 0.1
ACTOR_GPU_SHARE = 0.4


def worker_bundle(cfg: ClusterConfig, device: str) -> dict[str, float]:
    """What a rollout worker's placement bundle reserves: its threads, and on a GPU node
    `cluster.gpus_per_worker` of a GPU (0.5: two workers, each with its engine, share one)."""
    gpus = cfg.gpus_per_worker if device.startswith("cuda") else 0
    return {"CPU": max(cfg.worker_threads, 1), **({"GPU": gpus} if gpus else {})}


def in_bundle(group: Any, bundle: dict[str, float], index: int, gpu_share: float
              ) -> dict[str, Any]:
    """Ray options that put an actor in bundle `index` of `group` with `gpu_share` of its GPU."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    return {"num_gpus": bundle.get("GPU", 0) * gpu_share,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=index)}


def reserve(bundles: list[dict[str, float]], timeout_s: float, what: str) -> Any:
    """A ready placement group of `bundles` (PACK: a node's bundles together), or a
    FastdraftError once timeout_s passed; what: who asks, in the settings' words."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    group = placement_group(bundles, strategy="PACK")
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise FastdraftError(
            f"{what}: Ray could not place {len(bundles)} bundle(s) of {_resources(bundles[0])} "
            f"({_resources(_total(bundles))} in all) within cluster.placement_timeout_s="
            f"{timeout_s:g} s; the cluster holds {_resources(ray.cluster_resources())} "
            f"({_resources(ray.available_resources())} free): ask for fewer (the settings "
            "named), free what other jobs hold, or add nodes (`ray status` shows them)") from None
    return group


def _total(bundles: list[dict[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for bundle in bundles:
        for key, value in bundle.items():
            total[key] = total.get(key, 0) + value
    return total


def _resources(resources: dict[str, float]) -> str:
    """`CPU 2, GPU 1`: the resources a person counts (Ray's node and memory keys left out)."""
    shown = {k: v for k, v in resources.items() if k in ("CPU", "GPU")}
    return ", ".join(f"{k} {v:g}" for k, v in sorted(shown.items())) or "nothing"

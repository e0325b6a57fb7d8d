"""Joining or starting the Ray cluster a run's roles live on. `cluster.address` joins one that
is running (`ray start --head` on the first node, `ray start --address=HEAD:6379` on the
others); without it a local one is started for the run and shut down with it."""

from __future__ import annotations

import os

from fastdraft.config.sections.cluster import ClusterConfig


def connect(cfg: ClusterConfig, cpus: int) -> bool:
    """Ray ready for the run's roles; True when this call started it (the run then shuts it
    down at its end). cpus: the logical CPUs the roles reserve (threads per rollout worker and
    per actor rank); a local cluster gets at least that many, so the placement groups never
    wait for CPUs this machine has but Ray would not count."""
    import ray
    if ray.is_initialized():   # a test's, a bench's, or the user's own driver
        return False
    options = {} if cfg.address else {"num_cpus": max(os.cpu_count() or 1, cpus)}
    ray.init(address=cfg.address, include_dashboard=False, log_to_driver=True, **options)
    return True


def shutdown() -> None:
    import ray
    ray.shutdown()

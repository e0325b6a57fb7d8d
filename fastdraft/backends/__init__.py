"""Rollout backends (rollout.backend): what serves the RL loop's rollouts behind the engine's
interface. `native` is fastdraft's own engine (one process, or replicas behind the Ray pool);
`vllm` the user's vLLM with fastdraft's drafter inside (backends/vllm_rollout.py), imported only
when chosen."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastdraft.config import RunConfig
from fastdraft.engine import RolloutEngine


def build_rollout(cfg: RunConfig, make_engine: Callable[..., RolloutEngine], policy_dir: Path,
                  drafter_dir: Path | None, work_dir: Path, max_seq_len: int,
                  actor: Any = None, memory_reserve: int = 0) -> Any:
    """The run's rollout engine: fastdraft's own in this process (cluster.backend=local) or
    replicas on Ray actors behind a RolloutPool (ray; Ray is up: run/placement.connect_ray),
    or vLLM (rollout.backend=vllm); each has the engine's interface. make_engine(device,
    host=False): a native engine. actor (an ActorSpec; cluster.placement=hybrid): the workers
    hold the actor's ranks too. memory_reserve: what vLLM leaves of device 0 (the run's
    RunPlan.engine_reserve; the native engine's factory has it already)."""
    device = cfg.model.device
    if cfg.rollout.backend == "vllm":
        from fastdraft.backends.vllm_rollout import VllmRollout
        rollout = cfg.rollout
        return VllmRollout(make_engine("cpu", host=True), policy_dir, drafter_dir, work_dir,
                           device=device, max_seq_len=max_seq_len,
                           max_batch_size=rollout.max_batch_size, dtype=cfg.model.dtype,
                           seed=cfg.seed, spec_depth=rollout.spec.depth,
                           kv_cache_gb=rollout.kv_cache_gb,
                           tensor_parallel=rollout.tensor_parallel,
                           memory_reserve=memory_reserve)
    if cfg.cluster.backend == "local":
        return make_engine(device)
    from fastdraft.workers.hybrid import head_only
    from fastdraft.workers.pool import RolloutPool
    hybrid = cfg.cluster.placement == "hybrid"
    # What the workers load, and hybrid workers' rank 0 writes (checkpoints): on every node.
    paths = {"model.path": policy_dir, "drafter.path": drafter_dir,
             **({"--run-dir": work_dir} if hybrid else {})}
    host = make_engine("cpu", host=True)   # hybrid: the workers hold the policy, not the driver
    return RolloutPool(cfg.cluster, make_engine, head_only(host) if hybrid else host, device,
                       cfg.rollout.group_size, actor=actor if hybrid else None, paths=paths,
                       tensor_parallel=cfg.rollout.tensor_parallel)

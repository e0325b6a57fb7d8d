"""Where each role of a run goes: the Ray cluster its roles live on (joined or started: the
local backend starts one too when a role needs a process of its own), its engine built (in
this process, or as a Ray worker's or the driver's host replica), the actor's ranks (inside
the hybrid workers, or rank 0 here and a Ray worker group), rank 0's device, and the online
drafter's trainer (a Ray actor beside this process, members inside the hybrid workers, or Ray
actors on the workers' bundles). run/run.py composes them."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from fastdraft.actor.rank import ActorSpec
from fastdraft.cluster.ray_cluster import cuda_name
from fastdraft.config import RunConfig
from fastdraft.engine import RolloutEngine
from fastdraft.engine.paged_kv import kv_blocks_in
from fastdraft.errors import FastdraftError
from fastdraft.models import ModelConfig
from fastdraft.models.tensor_parallel import TPRank, shard_config
from fastdraft.trainer.online_drafter import trainer_aux_layers
from fastdraft.workers.actor_group import RayActorPeers
from fastdraft.workers.hybrid_ranks import WorkerRanks
from fastdraft.workers.pool import RolloutPool
from fastdraft.workers.ranks import ActorRanks, LocalRanks
from fastdraft.workers.trainer_actor import RayTrainer, beside
from fastdraft.workers.trainer_group import TrainerGroup

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def connect_ray(cfg: RunConfig) -> bool:
    """Ray up for the run's roles where any runs outside this process: the Ray backend's
    workers; with the local backend, the drafter's trainer (drafter.online.enabled) and actor
    ranks 1.. (actor.num_ranks > 1). True when this call started it (the run shuts it down at
    its end); False when none is needed or one was up already."""
    from fastdraft.cluster.ray_cluster import connect
    threads = max(cfg.cluster.worker_threads, 1)
    if cfg.cluster.backend == "ray":
        hybrid = cfg.cluster.placement == "hybrid"
        return connect(cfg.cluster, threads * cfg.cluster.rollout_workers
                       + (0 if hybrid else cfg.actor.num_ranks - 1))
    if cfg.drafter.online.enabled or cfg.actor.num_ranks > 1:
        return connect(cfg.cluster, cfg.actor.num_ranks - 1)
    return False


def build_engine(cfg: RunConfig, policy_dir: Path, drafter_dir: Path | None, max_seq_len: int,
                 reserve: int, device: str, host: bool = False, tp: TPRank | None = None
                 ) -> RolloutEngine:
    """The run's rollout engine on `device`. host: the driver's replica of a Ray run (weights
    only: one KV slot, eager, no tuner or budgets; it never generates). tp: this worker's rank
    of a tensor-parallel replica (its paged cache of rollout.kv_cache_gb holds its KV heads)."""
    rollout = cfg.rollout
    policy = ModelConfig.from_pretrained(policy_dir)
    return RolloutEngine(
        policy_dir, device=device, dtype=DTYPES[cfg.model.dtype],
        max_batch_size=1 if host else rollout.max_batch_size, max_seq_len=max_seq_len,
        drafter=drafter_dir, memory_reserve=0 if host else reserve,
        # The hidden states the online trainer's drafter reads (EAGLE-3's aux layers).
        capture_aux_layers=trainer_aux_layers(cfg.drafter.online, drafter_dir),
        spec=rollout.spec, compile=rollout.compile and not host,
        graphs=rollout.graphs and not host,
        tuner=rollout.tuner.build(rollout.spec, cfg.seed, rollout.max_batch_size)
        if rollout.tuner.enabled and not host else None,
        budget=rollout.budget.build() if rollout.budget.enabled and not host else None,
        kv_block_size=rollout.kv_block_size, prefill_chunk_tokens=rollout.prefill_chunk_tokens,
        paged_attention="gather" if host else rollout.paged_attention,
        kv_blocks=None if host else kv_blocks_in(
            rollout.kv_cache_gb, policy if tp is None else shard_config(policy, tp.size),
            DTYPES[cfg.model.dtype], rollout.kv_block_size), tp=tp)


def actor_ranks(cfg: RunConfig, pool: RolloutPool | None, workers: WorkerRanks | None
                 ) -> Callable[[ActorSpec], ActorRanks]:
    """Where the actor's ranks run (workers/ranks.py): inside the hybrid workers; or rank 0 in
    this process and ranks 1..N-1 as a Ray worker group (on bundles of their own, or
    colocated: on the rollout workers')."""
    if workers is not None:
        return lambda spec: workers
    if pool is not None and cfg.cluster.placement == "colocated":
        return partial(LocalRanks, peers=partial(RayActorPeers,
                                                 placement=pool.actor_rank_options))
    return partial(LocalRanks, peers=partial(
        RayActorPeers, placement_timeout_s=cfg.cluster.placement_timeout_s))


def actor_device(cfg: RunConfig, pool: RolloutPool | None) -> str:
    """The actor's rank 0 (this process): model.device, or colocated on GPUs rollout worker
    0's GPU."""
    if pool is None or not pool.colocated or not pool.device.startswith("cuda"):
        return cfg.model.device
    import ray
    gpu, node = ray.get(pool.workers[0].gpu.remote())   # as this process numbers them: it
    if node != ray.get_runtime_context().get_node_id():   # sees every GPU of its node
        raise FastdraftError("cluster.placement=colocated: rollout worker 0 is on another node "
                             "than the driver, whose process is the actor's rank 0; start "
                             "the run on a node with GPUs of the cluster")
    return cuda_name(gpu)


def trainer_placement(cfg: RunConfig, pool: RolloutPool | None) -> dict[str, Any]:
    """Where the online drafter trains: a Ray actor beside this process (local: its own
    process, no cores reserved, on a GPU a share of the run's); inside the hybrid workers
    (their trainer members); else as Ray actors on the rollout workers' bundles and devices
    (ray): the pool's trainer_placement."""
    if pool is None:
        gpu = cfg.model.device.startswith("cuda")
        return {"device": "cuda:0" if gpu else None,   # the one GPU Ray shows the actor
                "start_trainer": lambda setup, online, stats: RayTrainer(
                    setup, online, stats, beside(cfg.model.device))}
    if cfg.cluster.drafter_training == "data_parallel":
        members = [pool.trainer_placement(k) for k in range(cfg.cluster.rollout_workers)]
        return {"device": pool.device,
                "start_trainer": lambda setup, online, stats: TrainerGroup(setup, online,
                                                                           stats, members)}
    return {"device": pool.device,
            "start_trainer": lambda setup, online, stats: RayTrainer(
                setup, online, stats, pool.trainer_placement())}

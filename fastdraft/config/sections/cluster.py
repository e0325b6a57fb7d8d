"""Where the run's roles live: `local` (one process and its helpers, the default) or `ray`
(rollout engine replicas as Ray actors, fastdraft/cluster/)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, ClassVar

from fastdraft.config.sections.common import Range, check_ranges
from fastdraft.config.sections.common import require as _require

BACKENDS = ("local", "ray")
DISPATCH = ("balance", "concentrate", "round_robin")
PLACEMENT = ("separate", "colocated", "hybrid")
DRAFTER_TRAINING = ("one", "data_parallel")


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterConfig:
    """backend: local | ray. rollout_workers: engine replicas (ray; one per device on a GPU node).
    address: an existing Ray cluster to join (`ray start --head` prints it); None starts a local
    one. connect_timeout_s: how long the run waits for that address to answer before it stops
    with what to check (a port where nothing listens is told at once). placement_timeout_s: how
    long the workers' and actor ranks' placement groups may wait for their bundles before the run
    stops naming what it asked and what the cluster holds. worker_threads: torch
    threads of each rollout worker (CPU; 0 leaves torch's default).
    worker_device: the rollout workers' device (None: model.device; on a GPU node each worker
    gets one GPU from Ray and sees it as cuda:0). gpus_per_worker: the share of a GPU each
    rollout worker's bundle reserves (0 < x <= 1; 0.5 puts 2 workers on one GPU, each with
    its own engine and KV cache in that GPU's memory; the worker's trainer and colocated actor
    rank split its bundle as with a whole GPU). dispatch: how whole GRPO groups go to workers:
    balance (the predicted cost, longest first, onto the least loaded), concentrate (the longest
    groups packed together so other workers free up early) or round_robin.
    max_worker_restarts: a rollout worker that dies is replaced this many times in a run; its
    requests re-run on the others either way. max_actor_restarts: a run whose actor rank died
    resumes from its last checkpoint by itself this many times (either backend).
    push_bucket_mb: the policy's weights reach the workers in object-store buckets of this size,
    streamed from the actor's gather (the driver holds one bucket at a time).
    consolidate_below: tail consolidation (ray, 2+ workers; 0: off): a worker left with fewer
    unfinished requests than this, while another still generates, moves them to that one (a
    re-prefill there; the same random streams) and goes idle, free to train the drafter.
    Exact for greedy requests; sampled ones keep their law, and are token-identical too when
    no tuner or length budget picks the step kind per batch (engine/migration.py).
    placement (ray): separate: the actor's ranks 1..N-1 get bundles (devices) of their own;
    colocated: actor rank r shares rollout worker r's bundle and device (rank 0, the driver,
    worker 0's), and the workers give their KV cache (on a GPU also their weights, to the
    host) back while the actor updates. Needs actor.num_ranks <= cluster.rollout_workers.
    hybrid: one process per worker holds actor rank r beside its engine replica
    (workers/hybrid.py, as verl's hybrid engine does): every worker rolls out and updates,
    the weights go from the shards into each worker's engine on its own device (no host
    copy, no object store), the engine gives back its KV cache for the update; the driver
    holds no actor rank. Needs actor.num_ranks == cluster.rollout_workers.
    drafter_training (ray, online drafter): one (a trainer on the last worker's bundle, fed
    by every worker, promoted when the first worker goes idle) or data_parallel (a member on
    every worker's bundle; the idle workers' members train together, gradients all-reduced:
    workers/trainer_group.py)."""

    SECTION: ClassVar[str] = "cluster"

    backend: str = "local"
    rollout_workers: Annotated[int, Range(ge=1)] = 1
    address: str | None = None
    connect_timeout_s: Annotated[float, Range(gt=0, note="seconds")] = 30.0
    placement_timeout_s: Annotated[float, Range(gt=0, note="seconds")] = 120.0
    worker_threads: Annotated[int, Range(ge=0, note="0: torch's default")] = 1
    worker_device: str | None = None
    gpus_per_worker: Annotated[float, Range(gt=0, le=1, note="a worker's engine runs on one "
                                            "GPU; 0.5 puts two on one")] = 1.0
    dispatch: str = "balance"
    max_worker_restarts: Annotated[int, Range(ge=0)] = 3
    max_actor_restarts: Annotated[int, Range(ge=0)] = 2
    push_bucket_mb: Annotated[float, Range(gt=0)] = 512.0
    consolidate_below: Annotated[int, Range(ge=0, note="0: off")] = 0
    placement: str = "separate"
    drafter_training: str = "one"

    def __post_init__(self) -> None:
        check_ranges(self)
        _require(self.backend in BACKENDS, f"cluster.backend must be one of {BACKENDS}, got "
                 f"{self.backend!r}")
        _require(self.backend == "ray" or self.rollout_workers == 1,
                 f"cluster.rollout_workers={self.rollout_workers} needs cluster.backend=ray "
                 "(the local backend runs one engine)")
        _require(self.gpus_per_worker == 1 or self.backend == "ray",
                 f"cluster.gpus_per_worker={self.gpus_per_worker} shares GPUs among Ray "
                 "rollout workers: set cluster.backend=ray")
        _require(self.dispatch in DISPATCH, f"cluster.dispatch must be one of {DISPATCH}, got "
                 f"{self.dispatch!r}")
        _require(self.consolidate_below == 0 or self.rollout_workers >= 2,
                 f"cluster.consolidate_below={self.consolidate_below} moves a worker's tail to "
                 "another worker: set cluster.backend=ray and cluster.rollout_workers >= 2, or "
                 "cluster.consolidate_below=0")
        _require(self.placement in PLACEMENT, f"cluster.placement must be one of {PLACEMENT}, "
                 f"got {self.placement!r}")
        _require(self.placement == "separate" or self.backend == "ray",
                 f"cluster.placement={self.placement} places actor ranks beside Ray rollout "
                 "workers: set cluster.backend=ray")
        _require(self.drafter_training in DRAFTER_TRAINING, "cluster.drafter_training must be "
                 f"one of {DRAFTER_TRAINING}, got {self.drafter_training!r}")
        _require(self.drafter_training == "one" or self.backend == "ray",
                 "cluster.drafter_training=data_parallel trains on the Ray rollout workers: "
                 "set cluster.backend=ray")

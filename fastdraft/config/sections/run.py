"""The run as a whole: checkpoints, logging, and RunConfig holding every section."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, ClassVar

from fastdraft.config.sections.actor import ActorConfig
from fastdraft.config.sections.algorithm import AlgorithmConfig
from fastdraft.config.sections.cluster import ClusterConfig
from fastdraft.config.sections.common import SEED_RANGE, Range, check_ranges
from fastdraft.config.sections.common import require as _require
from fastdraft.config.sections.drafter import DrafterConfig
from fastdraft.config.sections.policy import DataConfig, PolicyConfig
from fastdraft.config.sections.rollout import RolloutConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointConfig:
    """every: steps between checkpoints; keep: the newest kept. stop_grace_s: what a stop signal
    (SIGTERM, SIGINT) leaves before the hard kill a scheduler sends next (Kubernetes' and SLURM's
    default: 30 s): the step under way is finished and checkpointed if the last step's time says
    both fit in it, else abandoned (the newest checkpoint on disk is whole) -- a step killed
    half-way would lose the same and waste the grace period."""

    SECTION: ClassVar[str] = "checkpoint"

    every: Annotated[int, Range(ge=1, note="steps")] = 10
    keep: Annotated[int, Range(ge=1)] = 2
    stop_grace_s: Annotated[float, Range(ge=0, note="seconds")] = 30.0

    def __post_init__(self) -> None:
        check_ranges(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class WandbConfig:
    SECTION: ClassVar[str] = "logging.wandb"

    mode: str = "offline"       # offline | online | disabled
    project: str = "fastdraft"

    def __post_init__(self) -> None:
        check_ranges(self)
        _require(self.mode in ("offline", "online", "disabled"),
                 "logging.wandb.mode must be offline, online or disabled")


@dataclass(frozen=True, kw_only=True, slots=True)
class LoggingConfig:
    SECTION: ClassVar[str] = "logging"

    wandb: WandbConfig = field(default_factory=WandbConfig)
    progress: bool = True
    dashboard: bool = True

    def __post_init__(self) -> None:
        check_ranges(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    SECTION: ClassVar[str] = ""

    name: str = "run"
    seed: Annotated[int, SEED_RANGE] = 0
    model: PolicyConfig = field(default_factory=PolicyConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def __post_init__(self) -> None:
        check_ranges(self)
        _require(self.rollout.group_size >= 2, f"rollout.group_size={self.rollout.group_size}: "
                 f"algorithm.advantage={self.algorithm.advantage} is group-relative (each answer "
                 "against the others of its prompt's group), and a group of one has no "
                 "baseline: every advantage is 0 and nothing trains; set rollout.group_size >= 2")
        _require(self.cluster.placement == "separate"
                 or self.actor.num_ranks <= self.cluster.rollout_workers,
                 f"cluster.placement=colocated puts actor rank r beside rollout worker r: "
                 f"actor.num_ranks={self.actor.num_ranks} needs cluster.rollout_workers >= "
                 f"{self.actor.num_ranks} (now {self.cluster.rollout_workers})")
        _require(self.cluster.placement != "hybrid"
                 or self.actor.num_ranks == self.cluster.rollout_workers,
                 f"cluster.placement=hybrid makes every rollout worker an actor rank: set "
                 f"actor.num_ranks={self.cluster.rollout_workers} (the workers) or "
                 f"cluster.rollout_workers={self.actor.num_ranks} (now actor.num_ranks="
                 f"{self.actor.num_ranks})")
        _require(self.cluster.backend != "local" or self.actor.num_ranks == 1
                 or not self.model.device.startswith("cuda"),
                 f"actor.num_ranks={self.actor.num_ranks} on GPUs spreads the actor over "
                 f"{self.actor.num_ranks} devices, and cluster.backend=local rolls out on one: "
                 f"set cluster.backend=ray cluster.placement=hybrid cluster.rollout_workers="
                 f"{self.actor.num_ranks} (every GPU holds an actor rank and rolls out), or "
                 "actor.num_ranks=1")
        worker_device = self.cluster.worker_device or self.model.device
        _require(self.cluster.gpus_per_worker == 1 or worker_device.startswith("cuda"),
                 f"cluster.gpus_per_worker={self.cluster.gpus_per_worker} shares GPUs, and the "
                 f"rollout workers run on {worker_device}: set model.device=cuda (or "
                 "cluster.worker_device=cuda), or leave cluster.gpus_per_worker at 1")
        _require(self.algorithm.overlong_buffer < self.rollout.max_new_tokens,
                 f"algorithm.overlong_buffer={self.algorithm.overlong_buffer} punishes the last "
                 f"tokens of the answer budget: it must be < rollout.max_new_tokens="
                 f"{self.rollout.max_new_tokens}")
        if self.rollout.tensor_parallel > 1 and self.rollout.backend == "native":
            self._check_tensor_parallel()
        if self.rollout.backend == "vllm":
            self._check_vllm()
        method = self.rollout.spec.method
        _require(not self.drafter.online.enabled or self.rollout.spec.uses_drafter,
                 f"drafter.online.enabled trains the EAGLE drafter the rollouts serve, and "
                 f"rollout.spec.method={method} serves none: add drafter.online.enabled=false "
                 f"(or serve one: rollout.spec.method=eagle)")

    def _check_tensor_parallel(self) -> None:
        """A tensor-parallel replica spans consecutive hybrid workers (workers/hybrid.py)."""
        tp, cluster = self.rollout.tensor_parallel, self.cluster
        _require(cluster.backend == "ray" and cluster.placement == "hybrid",
                 f"rollout.tensor_parallel={tp} spreads an engine replica over {tp} hybrid "
                 "workers: set cluster.backend=ray cluster.placement=hybrid")
        _require(cluster.rollout_workers % tp == 0,
                 f"cluster.rollout_workers={cluster.rollout_workers} is not whole replicas of "
                 f"rollout.tensor_parallel={tp}: use a multiple of {tp}")
        _require(cluster.consolidate_below == 0, "cluster.consolidate_below moves a worker's "
                 "tail to another, which the other ranks of its tensor-parallel replica cannot "
                 "follow: set it to 0 with rollout.tensor_parallel > 1")

    def _check_vllm(self) -> None:
        """What rollout.backend=vllm serves (backends/vllm_rollout.py): fastdraft's own
        engine features that live inside the engine have no vLLM counterpart."""
        spec, online = self.rollout.spec, self.drafter.online
        _require(self.cluster.backend == "local", "rollout.backend=vllm runs vLLM in this "
                 "process: set cluster.backend=local (vLLM spreads itself over its devices)")
        _require(spec.method in ("none", "eagle"), f"rollout.backend=vllm serves "
                 f"rollout.spec.method eagle or none, not {spec.method!r}")
        _require(spec.method == "none" or self.drafter.kind == "eagle3", "rollout.backend=vllm "
                 "serves EAGLE-3 drafters: set drafter.kind=eagle3")
        _require(not (self.rollout.tuner.enabled or self.rollout.budget.enabled),
                 "rollout.tuner and rollout.budget are fastdraft-engine features: disable them "
                 "with rollout.backend=vllm")
        _require(self.rollout.top_p == 1 and self.rollout.top_k == -1, "rollout.backend=vllm "
                 "needs rollout.top_p=1 and top_k=-1: vLLM's processed logprobs renormalize over "
                 "the top-p / top-k set, the loss and the gate use the policy's own logprob")
        _require(not online.enabled or online.source != "engine", "rollout.backend=vllm hands "
                 "out no hidden states: set drafter.online.source=actor or auto (the drafter "
                 "learns from the actor's forward)")


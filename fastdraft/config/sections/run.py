"""The run as a whole: checkpoints, logging, and RunConfig holding every section."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastdraft.config.sections.actor import ActorConfig
from fastdraft.config.sections.algorithm import AlgorithmConfig
from fastdraft.config.sections.cluster import ClusterConfig
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

    every: int = 10
    keep: int = 2
    stop_grace_s: float = 30.0

    def __post_init__(self) -> None:
        _require(self.every >= 1 and self.keep >= 1, "checkpoint.every and keep must be >= 1")
        _require(self.stop_grace_s >= 0, "checkpoint.stop_grace_s must be >= 0 (seconds)")


@dataclass(frozen=True, kw_only=True, slots=True)
class WandbConfig:
    mode: str = "offline"       # offline | online | disabled
    project: str = "fastdraft"

    def __post_init__(self) -> None:
        _require(self.mode in ("offline", "online", "disabled"),
                 "logging.wandb.mode must be offline, online or disabled")


@dataclass(frozen=True, kw_only=True, slots=True)
class LoggingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    progress: bool = True
    dashboard: bool = True


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    name: str = "run"
    seed: int = 0
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
        _require(self.cluster.placement == "separate"
                 or self.actor.num_ranks <= self.cluster.rollout_workers,
                 f"cluster.placement=colocated puts actor rank r beside rollout worker r: "
                 f"actor.num_ranks={self.actor.num_ranks} needs cluster.rollout_workers >= "
                 f"{self.actor.num_ranks} (now {self.cluster.rollout_workers})")

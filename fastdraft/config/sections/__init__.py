"""The sections of a run, one frozen dataclass each, checked at construction. A YAML recipe maps
onto them 1:1 (config/recipe.py): `actor.lr` in a recipe is `RunConfig.actor.lr` here. One file
per section; this package exports them all."""

from fastdraft.config.sections.actor import ActorConfig
from fastdraft.config.sections.algorithm import AlgorithmConfig, GateSection
from fastdraft.config.sections.cluster import ClusterConfig
from fastdraft.config.sections.common import DTYPES
from fastdraft.config.sections.drafter import DrafterConfig, OnlineDrafterConfig
from fastdraft.config.sections.policy import DataConfig, PolicyConfig
from fastdraft.config.sections.rollout import BudgetSection, RolloutConfig, TunerSection
from fastdraft.config.sections.run import CheckpointConfig, LoggingConfig, RunConfig, WandbConfig

__all__ = ["DTYPES", "ActorConfig", "AlgorithmConfig", "BudgetSection", "CheckpointConfig",
           "ClusterConfig",
           "DataConfig", "DrafterConfig", "GateSection", "LoggingConfig", "OnlineDrafterConfig",
           "PolicyConfig", "RolloutConfig", "RunConfig", "TunerSection", "WandbConfig"]

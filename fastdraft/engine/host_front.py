"""The engine state a rollout that is not one engine in this process shows the RL loop.

A Ray worker pool and the vLLM backend keep a host replica of fastdraft's engine that takes
every weight and drafter update they take; what the loop reads of an engine (the policy and
drafter modules, the speculation config, the versions, the health fallback) is that replica's.
Each property is declared here, by name: no attribute reaches the host by accident."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastdraft.config.engine import SpecConfig
    from fastdraft.engine.engine import RolloutEngine
    from fastdraft.models import CausalLM, ModelConfig


class HostFront:
    """Base of the rollouts behind a host replica (`self.host`)."""

    host: RolloutEngine

    @property
    def model(self) -> CausalLM:
        return self.host.model

    @property
    def model_drafter(self) -> Any:
        return self.host.model_drafter

    @property
    def config(self) -> ModelConfig:
        return self.host.config

    @property
    def spec(self) -> SpecConfig:
        return self.host.spec

    @property
    def policy_version(self) -> int:
        return self.host.policy_version

    @property
    def drafter_version(self) -> int | None:
        return self.host.drafter_version

    @property
    def fallback_reason(self) -> str | None:
        return self.host.fallback_reason

    @property
    def captures_hidden(self) -> bool:
        return self.host.captures_hidden

"""Rollout: what the RL loop (run/, trainer/) holds of whatever serves its rollouts. Three
implementations: fastdraft's engine inline in this process (engine/engine.py: one device), a
pool of Ray workers with an engine replica each, hybrid workers among them (workers/pool.py),
and the user's vLLM with fastdraft's drafter inside (backends/vllm_rollout.py). The last two
read their state (modules, spec, versions) from a host replica, each property declared
(engine/host_front.py). What only a Ray pool has (its workers' timeline, the hybrid weight
sync, where trainers go) the run takes from the pool itself (Run.pool)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from fastdraft.config.engine import SpecConfig
    from fastdraft.engine.request import Completion
    from fastdraft.engine.sampling_params import SamplingParams
    from fastdraft.engine.spec.stats import SpecStats
    from fastdraft.engine.trace import RolloutTrace
    from fastdraft.models import CausalLM, ModelConfig


class Rollout(Protocol):
    # what the last generate call did (its trace: times, tokens, preemptions; spec counters)
    last_trace: RolloutTrace
    last_stats: SpecStats

    @property
    def model(self) -> CausalLM:
        """The policy as served (a host replica's, behind a pool or vLLM; behind hybrid
        workers its head only: workers/hybrid.head_only)."""

    @property
    def model_drafter(self) -> torch.nn.Module | None: ...

    @property
    def config(self) -> ModelConfig: ...

    @property
    def spec(self) -> SpecConfig:
        """The speculation in force (method "none" after a health fallback)."""

    @property
    def policy_version(self) -> int: ...

    @property
    def drafter_version(self) -> int | None: ...

    @property
    def fallback_reason(self) -> str | None: ...

    @property
    def captures_hidden(self) -> bool:
        """Whether generate hands the policy's hidden states to on_hidden (the online
        drafter's samples): fastdraft's engine does, vLLM does not."""

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams, *,
                 on_finish: Callable[[Completion], None] | None = None,
                 on_hidden: Any = None, use_tqdm: bool | None = None) -> list[Completion]:
        """One completion per prompt, in prompt order, with its sampled tokens' logprobs."""

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                     version: int | None = None) -> int:
        """The policy's new weights, by HF name; the new policy version."""

    def load_drafter_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                             version: int | None = None, checksum: str | None = None,
                             held_by: int | None = None) -> int:
        """The drafter's trainable tensors (checked against `checksum`); its new version.
        held_by: the rollout worker whose process holds them too (a hybrid worker's trainer
        member, trainer/spot.Published): a pool of hybrid workers broadcasts them from there;
        an engine in this process or vLLM has no workers of that kind and ignores it."""

    def fall_back_to_plain(self, reason: str) -> None: ...

    def resume_speculation(self, spec: SpecConfig) -> None: ...

    def advance_step(self) -> None:
        """The end of an RL step (model-free drafters slide their window, budgets their
        history)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def close(self) -> None:
        """Whatever it started (workers, vLLM's processes) ended."""

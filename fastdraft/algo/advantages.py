"""Group-relative advantage estimators: G samples per prompt, no value network.

Estimators register by name (``@register_advantage("grpo")``) and are called through
``compute_advantages(name, rewards, group_size, **options)``. Rewards arrive flat in group-major
order (the G samples of prompt 0, then those of prompt 1, ...), which is the order the rollout
engine returns them in; estimators see them reshaped to [num_prompts, G].

An estimator can be defined together with the loss aggregation it needs (a preset:
``register_advantage("dr_grpo", aggregation="seq-mean-token-sum-norm")``): the run then uses
that aggregation, and a recipe that asks for another one is refused (config/sections.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TypeVar

import torch

from fastdraft.errors import FastdraftError
from fastdraft.utils.registry import Registry

GRPO_EPS = 1e-6

AdvantageFn = Callable[..., torch.Tensor]
_F = TypeVar("_F", bound=AdvantageFn)
_ADVANTAGES: Registry[AdvantageFn] = Registry("advantage estimator")
_AGGREGATION: dict[str, str] = {}   # estimator -> the loss aggregation it is defined with


def register_advantage(name: str, *, aggregation: str | None = None) -> Callable[[_F], _F]:
    """Decorator: register ``fn(grouped [P, G], **options) -> [P, G]`` under ``name``.
    aggregation: the loss aggregation (policy_loss.py) the estimator is only correct with."""
    register = _ADVANTAGES.register(name)

    def decorate(fn: _F) -> _F:
        register(fn)
        if aggregation is not None:
            _AGGREGATION[name] = aggregation
        return fn
    return decorate


def available_advantages() -> list[str]:
    """Names of the registered estimators, sorted."""
    return _ADVANTAGES.names()


def advantage_defaults(name: str) -> dict[str, object]:
    """The keyword options estimator ``name`` takes, with their defaults (unknown name: a
    FastdraftError listing the registered ones)."""
    params = list(inspect.signature(_ADVANTAGES.get(name)).parameters.values())[1:]
    return {p.name: p.default for p in params}


def advantage_aggregation(name: str) -> str | None:
    """The loss aggregation estimator ``name`` is defined with (None: any)."""
    return _AGGREGATION.get(name)


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Validate flat rewards [P * G] and view them as float [P, G]."""
    if group_size < 1:
        raise FastdraftError(f"group_size={group_size}: use 1 or more samples per prompt")
    if rewards.dim() != 1:
        raise FastdraftError(f"rewards has shape {tuple(rewards.shape)}: pass a flat [P * G] "
                             "tensor")
    if rewards.numel() == 0 or rewards.numel() % group_size:
        raise FastdraftError(
            f"{rewards.numel()} rewards is not a positive multiple of group_size={group_size}: "
            "pass all G samples of every prompt"
        )
    rewards = rewards.detach()
    if not rewards.is_floating_point():
        rewards = rewards.float()
    if not torch.isfinite(rewards).all():
        raise FastdraftError("rewards contain NaN or inf: fix the reward function's output")
    return rewards.view(-1, group_size)


def compute_advantages(
    name: str, rewards: torch.Tensor, group_size: int, **options: object
) -> torch.Tensor:
    """Per-sample advantages [P * G] from rewards [P * G] (group-major), same order.

    Advantages carry no gradient: they are targets for the policy loss, not a function of it.
    """
    accepted = list(advantage_defaults(name))
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise FastdraftError(f"advantage {name!r} got unknown options {unknown}: it takes "
                             f"{accepted}")
    return _ADVANTAGES.get(name)(_grouped(rewards, group_size), **options).reshape(-1)


def zero_variance_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Bool [P]: True where all G rewards of a prompt are equal.

    Such groups have zero advantage under every group-relative estimator, so they add no
    policy gradient; DAPO drops them (pass ``sample_weight = ~mask.repeat_interleave(G)``).
    """
    grouped = _grouped(rewards, group_size)
    return (grouped == grouped[:, :1]).all(dim=1)


@register_advantage("grpo")
def grpo_advantages(grouped: torch.Tensor, *, scale_std: bool = True) -> torch.Tensor:
    """(r - group mean) / (group std + 1e-6); ``scale_std=False``: the mean only.

    The std is the unbiased sample std (divides by G - 1), as ``torch.std`` in verl's GRPO, so
    values match that reference; it needs G >= 2. ``scale_std=False`` alone is NOT Dr. GRPO:
    the loss's aggregation still divides each answer by its own length; ``dr_grpo`` is both.
    """
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if not scale_std:
        return centered
    if grouped.shape[1] < 2:
        raise FastdraftError("grpo with scale_std=True needs group_size >= 2 (std of one sample)")
    return centered / (grouped.std(dim=1, unbiased=True, keepdim=True) + GRPO_EPS)


@register_advantage("dr_grpo", aggregation="seq-mean-token-sum-norm")
def dr_grpo_advantages(grouped: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-like Training"): r - group mean.

    GRPO has two biases this removes. The std division up-weights prompts that are nearly
    always right or always wrong (a difficulty bias): gone here. And dividing each answer's
    token losses by its own length |o| makes a long wrong answer cost less per token than a
    short one (a length bias that grows wrong answers): so this estimator is registered with
    the aggregation seq-mean-token-sum-norm, which divides by a constant (the run's
    rollout.max_new_tokens) instead. The run uses that aggregation; another is refused.
    """
    return grouped - grouped.mean(dim=1, keepdim=True)


@register_advantage("rloo")
def rloo_advantages(grouped: torch.Tensor) -> torch.Tensor:
    """r_i - mean of the other G - 1 rewards of the group (leave-one-out baseline).

    The baseline excludes the sample itself, so it is independent of r_i and the gradient
    estimate is unbiased; it equals G / (G - 1) * (r_i - group mean).
    """
    g = grouped.shape[1]
    if g < 2:
        raise FastdraftError(f"rloo needs group_size >= 2 (got {g}): leave-one-out needs others")
    others_mean = (grouped.sum(dim=1, keepdim=True) - grouped) / (g - 1)
    return grouped - others_mean

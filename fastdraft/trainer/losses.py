"""Online drafter losses, registered by name; each maps (drafter, batch, the policy's lm_head)
to (loss, metrics with top1_acc and top3_acc). They reuse the warm-up's unrolled loss
(drafter/losses.py), so offline warm-up and online training optimise the same thing.

- "eagle1": 1.0 * SmoothL1(f^, f) + 0.1 * soft-CE per unrolled step (HASS-style steps).
- "eagle3": soft-CE with the training-time test.
- "reward_kd" (ReSpec): w(r) * sum_t KL(p(.|x, y<t) || q(.|x, y<t)) per sample, w from the
  sample's reward (`reward_weights`), over the drafter kind's unrolled steps. Gradients equal
  those of the w-weighted soft-CE (p's entropy is a constant); the metrics report the KL.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from fastdraft.drafter.base import Drafter
from fastdraft.drafter.losses import DEFAULT_NUM_STEPS, LOSSES, Metrics, unrolled_loss
from fastdraft.errors import FastdraftError
from fastdraft.models import HiddenStates
from fastdraft.utils.registry import Registry


@dataclass(frozen=True, slots=True)
class DraftBatch:
    """Sequences (padded rows, or packed rows with `segments`) and the policy's hidden states.

    input_ids [B, T]; hidden: final [B, T, H] (+ aux); valid [B, T] bool: tokens that may be
    scored (answer tokens); rewards [N] of the N samples, or None; segments [B, T] long: the
    sample index (into rewards) of each token (padded rows: row b is sample b, use
    `DraftBatch.padded`); positions [B, T]: per-sequence positions (None: 0..T-1)."""

    input_ids: torch.Tensor
    hidden: HiddenStates
    valid: torch.Tensor
    rewards: torch.Tensor | None = None
    segments: torch.Tensor | None = None
    positions: torch.Tensor | None = None

    def __post_init__(self) -> None:
        shape = self.input_ids.shape
        if self.valid.shape != shape or self.hidden.final.shape[:2] != shape:
            raise FastdraftError(f"DraftBatch: input_ids {tuple(shape)}, valid "
                                 f"{tuple(self.valid.shape)} and hidden "
                                 f"{tuple(self.hidden.final.shape)} must agree on [B, T]")
        for name in ("segments", "positions"):
            value = getattr(self, name)
            if value is not None and value.shape != shape:
                raise FastdraftError(f"DraftBatch.{name} must be [B, T] like input_ids")

    def to(self, device: torch.device) -> DraftBatch:
        """The batch on `device` (itself when already there)."""
        if self.input_ids.device == torch.device(device):
            return self

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)
        return DraftBatch(move(self.input_ids),
                          HiddenStates(move(self.hidden.final),
                                       tuple(move(a) for a in self.hidden.aux)),
                          move(self.valid), move(self.rewards), move(self.segments),
                          move(self.positions))

    def sample_of_token(self) -> torch.Tensor:
        """[B, T] long: which sample each token belongs to."""
        if self.segments is not None:
            return self.segments
        return torch.arange(self.input_ids.shape[0]).view(-1, 1).expand_as(self.input_ids)


DrafterLoss = Callable[..., tuple[torch.Tensor, Metrics]]
_LOSSES: Registry[DrafterLoss] = Registry("drafter loss")
register_drafter_loss = _LOSSES.register


def drafter_loss_names() -> list[str]:
    return _LOSSES.names()


def compute_drafter_loss(name: str, drafter: Drafter, batch: DraftBatch, lm_head: nn.Module,
                         **options: float) -> tuple[torch.Tensor, Metrics]:
    return _LOSSES.get(name)(drafter, batch, lm_head, **options)


def reward_weights(rewards: torch.Tensor, floor: float = 0.1, max_weight: float = 3.0
                   ) -> torch.Tensor:
    """[N] rewards -> [N] weights w(r) > 0: (max(r, 0) + floor) normalised to mean 1 over the
    batch, then clipped to max_weight. w(r) = r (ReSpec's default) would drop every wrong
    answer entirely; the floor keeps them at a small weight, since the drafter must still
    draft what the policy samples there."""
    if floor <= 0 or max_weight <= 0:
        raise FastdraftError(f"reward_weights: floor={floor} and max_weight={max_weight} must be "
                             "> 0")
    raw = rewards.float().clamp_min(0) + floor
    return (raw / raw.mean()).clamp_max(max_weight)


def _packing(batch: DraftBatch) -> dict[str, torch.Tensor | None]:
    return {"segments": batch.segments, "positions": batch.positions}


def _kind_check(drafter: Drafter, kind: str) -> None:
    if drafter.kind != kind:
        raise FastdraftError(f"drafter loss {kind!r} trains an {kind} drafter, not {drafter.kind}: "
                             f"use drafter loss {drafter.kind!r} or 'reward_kd'")


def _kind_loss(kind: str) -> DrafterLoss:
    """The warm-up's loss of one drafter kind (drafter/losses.LOSSES) over a DraftBatch."""
    def loss(drafter: Drafter, batch: DraftBatch, lm_head: nn.Module,
             num_steps: int = DEFAULT_NUM_STEPS[kind]) -> tuple[torch.Tensor, Metrics]:
        _kind_check(drafter, kind)
        return LOSSES[kind](drafter, batch.input_ids, batch.hidden, batch.valid, lm_head,
                            num_steps=num_steps, **_packing(batch))
    return loss


for _kind in LOSSES:
    register_drafter_loss(_kind)(_kind_loss(_kind))


@register_drafter_loss("reward_kd")
def reward_kd(drafter: Drafter, batch: DraftBatch, lm_head: nn.Module,
              num_steps: int | None = None, floor: float = 0.1, max_weight: float = 3.0
              ) -> tuple[torch.Tensor, Metrics]:
    if batch.rewards is None:
        raise FastdraftError("drafter loss 'reward_kd' needs every sample's reward (batch.rewards)")
    per_sample = reward_weights(batch.rewards, floor, max_weight)
    weights = per_sample[batch.sample_of_token()]
    loss, metrics = unrolled_loss(
        drafter, batch.input_ids, batch.hidden, batch.valid, lm_head, weights,
        DEFAULT_NUM_STEPS[drafter.kind] if num_steps is None else num_steps,
        regression_weight=0.0, ce_weight=1.0, **_packing(batch))
    metrics.update(kl=metrics["kl_0"], weight_min=float(per_sample.min()),
                   weight_max=float(per_sample.max()))
    return loss, metrics

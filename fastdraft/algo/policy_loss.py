"""Token-level policy-gradient losses (GRPO, DAPO) and the loss aggregation modes.

Losses register by name (``@register_policy_loss("grpo")``) and are called through
``policy_loss(name, batch, **options) -> (loss, metrics)``. Aggregation modes decide how token
losses become one scalar, which sets how much a long answer weighs against a short one:

- "token-mean": sum over every masked token of the batch / number of masked tokens (DAPO).
- "seq-mean-token-mean": mean over each sequence's masked tokens, then mean over sequences
  (GRPO paper).
- "seq-mean-token-sum-norm": sum over each sequence's masked tokens / ``max_tokens`` (a
  constant, default T), then mean over sequences (Dr. GRPO).

``sample_weight`` [B] scales each sequence in numerator and denominator alike (0 = skip it);
sequences with no masked token count in neither, so they contribute nothing and never make NaN.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from fastdraft.errors import FastdraftError
from fastdraft.utils.registry import Registry

# exp() of a log-ratio beyond this is clipped anyway; clamping keeps ratio and k3 finite.
LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyBatch:
    """Inputs of one loss call; checked on construction.

    ``logprobs`` [B, T]: current policy (carries grad). ``old_logprobs`` [B, T]: the sampling
    policy's, from the engine. ``advantages`` [B]: per sequence, broadcast over its tokens.
    ``mask`` [B, T] bool: answer tokens. ``ref_logprobs`` [B, T] or None: frozen reference for
    KL. ``sample_weight`` [B] or None: >= 0 per sequence, 0 skips it (e.g. DAPO's zero-variance
    groups, found with ``advantages.zero_variance_groups``). Non-finite values where ``mask``
    is true raise a FastdraftError: a NaN there would silently poison the whole update. A caller
    that must survive one bad sequence masks it out first (``finite_sequences``: its mask row
    all False, so it weighs nothing); ``Algorithm.objective`` (algo/objective.py) does.
    """

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    ref_logprobs: torch.Tensor | None = None
    sample_weight: torch.Tensor | None = None

    def __post_init__(self) -> None:
        shape = tuple(self.logprobs.shape)
        if len(shape) != 2:
            raise FastdraftError(f"logprobs has shape {shape}: pass [B, T]")
        wanted = {"old_logprobs": shape, "mask": shape, "ref_logprobs": shape}
        wanted |= {"advantages": shape[:1], "sample_weight": shape[:1]}
        for name, want in wanted.items():
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != want:
                raise FastdraftError(f"{name} has shape {tuple(t.shape)}: expected {want}")
        if self.mask.dtype != torch.bool:
            raise FastdraftError(f"mask has dtype {self.mask.dtype}: pass a bool tensor")
        with torch.no_grad():
            for name in ("logprobs", "old_logprobs", "ref_logprobs"):
                t = getattr(self, name)
                if t is not None and not torch.isfinite(t[self.mask]).all():
                    raise FastdraftError(f"{name} has NaN/inf on masked (answer) tokens")
            if not torch.isfinite(self.advantages[self.mask.any(dim=1)]).all():
                raise FastdraftError("advantages have NaN/inf for sequences with answer tokens")
            w = self.sample_weight
            if w is not None and not (torch.isfinite(w) & (w >= 0)).all():
                raise FastdraftError("sample_weight must be finite and >= 0 (0 skips a sequence)")


def finite_sequences(mask: torch.Tensor, advantages: torch.Tensor,
                     *token_values: torch.Tensor | None) -> torch.Tensor:
    """mask [B, T] bool, advantages [B], token_values [B, T] each (None skipped) -> bool [B]:
    the sequences whose advantage and every masked token value are finite. Values off the mask
    do not count (padding may hold anything)."""
    ok = torch.isfinite(advantages.detach()).to(mask.device)
    for values in token_values:
        if values is not None:
            ok &= (torch.isfinite(values.detach()) | ~mask).all(dim=1)
    return ok


def _safe(denominator: torch.Tensor) -> torch.Tensor:
    """Denominator with 0 replaced by 1: an empty sum then gives 0, not NaN."""
    return torch.where(denominator > 0, denominator, torch.ones_like(denominator))


def _token_mean(values, mask, weight, max_tokens):
    tok_w = mask * weight[:, None]
    return (values * tok_w).sum() / _safe(tok_w.sum())


def _seq_mean(per_seq: torch.Tensor, mask: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    seq_w = weight * mask.any(dim=1)
    return (per_seq * seq_w).sum() / _safe(seq_w.sum())


def _seq_mean_token_mean(values, mask, weight, max_tokens):
    return _seq_mean(values.sum(dim=1) / _safe(mask.sum(dim=1)), mask, weight)


def _seq_mean_token_sum_norm(values, mask, weight, max_tokens):
    return _seq_mean(values.sum(dim=1) / (max_tokens or values.shape[1]), mask, weight)


_AGGREGATIONS: dict[str, Callable[..., torch.Tensor]] = {
    "token-mean": _token_mean,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}


def available_aggregations() -> list[str]:
    """Names of the aggregation modes, sorted."""
    return sorted(_AGGREGATIONS)


def aggregate(
    mode: str,
    values: torch.Tensor,
    mask: torch.Tensor,
    sample_weight: torch.Tensor | None = None,
    *,
    max_tokens: int | None = None,
) -> torch.Tensor:
    """Scalar from token values [B, T] over ``mask`` [B, T]; modes in the module docstring.

    Values off the mask are replaced (not multiplied) by 0, so NaN there cannot leak in.
    """
    if mode not in _AGGREGATIONS:
        raise FastdraftError(f"unknown aggregation {mode!r}: choose one of {sorted(_AGGREGATIONS)}")
    if max_tokens is not None and (mode != "seq-mean-token-sum-norm" or max_tokens < 1):
        raise FastdraftError(f"max_tokens={max_tokens}: only >= 1 with seq-mean-token-sum-norm")
    values = torch.where(mask, values, torch.zeros_like(values))
    weight = torch.ones_like(values[:, 0]) if sample_weight is None else sample_weight.to(values)
    return _AGGREGATIONS[mode](values, mask, weight, max_tokens)


_F = TypeVar("_F", bound=Callable[..., tuple[torch.Tensor, dict[str, float]]])
_LOSSES: Registry[Callable[..., tuple[torch.Tensor, dict[str, float]]]] = Registry("policy loss")


def register_policy_loss(name: str) -> Callable[[_F], _F]:
    """Decorator: register ``fn(batch, **options) -> (loss, metrics)`` under ``name``."""
    return _LOSSES.register(name)  # type: ignore[return-value]


def available_policy_losses() -> list[str]:
    """Names of the registered losses, sorted."""
    return _LOSSES.names()


def policy_loss_defaults(name: str) -> dict[str, object]:
    """The keyword options loss ``name`` takes, with their defaults (unknown name: a
    FastdraftError listing the registered ones)."""
    params = list(inspect.signature(_LOSSES.get(name)).parameters.values())[1:]
    return {p.name: p.default for p in params}


def policy_loss(
    name: str, batch: PolicyBatch, **options: object
) -> tuple[torch.Tensor, dict[str, float]]:
    """Scalar loss (to minimise) and metrics: loss, pg_loss, kl, clip_frac, ratio_mean.

    kl, clip_frac and ratio_mean are means over masked tokens of sequences with weight > 0
    (0.0 when there are none). clip_frac counts tokens where the clip binds, i.e. the clipped
    term wins the min and the token's gradient is cut off (verl's definition). kl is the mean
    k3 estimate when ``ref_logprobs`` is given, else 0.0.
    """
    accepted = list(policy_loss_defaults(name))
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise FastdraftError(f"policy loss {name!r} got unknown options {unknown}: it takes "
                             f"{accepted}")
    return _LOSSES.get(name)(batch, **options)


def _clipped_surrogate(
    batch: PolicyBatch,
    clip_low: float,
    clip_high: float,
    kl_coef: float,
    aggregation: str,
    max_tokens: int | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate per token + kl_coef * k3, aggregated; shared by GRPO and DAPO."""
    if not (0 <= clip_low < 1 and clip_high >= 0):
        raise FastdraftError(f"clip range ({clip_low}, {clip_high}): need 0 <= low < 1, high >= 0")
    if kl_coef < 0 or (kl_coef > 0 and batch.ref_logprobs is None):
        raise FastdraftError(f"kl_coef={kl_coef}: use >= 0, and pass ref_logprobs when > 0")
    mask = batch.mask
    zero = torch.zeros_like(batch.logprobs)
    # where() (not *mask) so garbage off the mask gets neither into the loss nor into grads
    logp = torch.where(mask, batch.logprobs, zero)
    old = torch.where(mask, batch.old_logprobs.detach(), zero)
    adv = torch.where(mask.any(dim=1), batch.advantages.detach().to(zero), zero[:, 0])[:, None]
    ratio = torch.exp((logp - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = -ratio * adv
    clipped = -ratio.clamp(1 - clip_low, 1 + clip_high) * adv
    pg = torch.maximum(unclipped, clipped)
    k3 = zero
    if batch.ref_logprobs is not None:
        # k3 = e^d - d - 1 with d = ref - logp: unbiased for KL(pi || ref), always >= 0
        d = torch.where(mask, batch.ref_logprobs.detach(), zero) - logp
        d = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        k3 = torch.exp(d) - d - 1
    agg = {"mode": aggregation, "mask": mask, "sample_weight": batch.sample_weight}
    loss = aggregate(values=pg + kl_coef * k3, max_tokens=max_tokens, **agg)
    with torch.no_grad():
        weight = batch.sample_weight
        active = mask if weight is None else mask & (weight > 0)[:, None]
        n = max(int(active.sum()), 1)
        metrics = {
            "loss": float(loss),
            "pg_loss": float(aggregate(values=pg, max_tokens=max_tokens, **agg)),
            "kl": float(k3[active].sum()) / n,
            "clip_frac": float((clipped > unclipped)[active].sum()) / n,
            "ratio_mean": float(ratio[active].sum()) / n,
        }
    return loss, metrics


@register_policy_loss("grpo")
def grpo_loss(
    batch: PolicyBatch,
    *,
    clip_eps: float = 0.2,
    kl_coef: float = 0.0,
    aggregation: str = "seq-mean-token-mean",
    max_tokens: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO: symmetric clip [1 - clip_eps, 1 + clip_eps], optional k3 KL penalty to ref."""
    return _clipped_surrogate(batch, clip_eps, clip_eps, kl_coef, aggregation, max_tokens)


@register_policy_loss("dapo")
def dapo_loss(
    batch: PolicyBatch,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    kl_coef: float = 0.0,
    aggregation: str = "token-mean",
    max_tokens: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DAPO: clip-higher (a wider upper clip lets rare good tokens grow, against entropy
    collapse), token-mean so long answers weigh per token, no KL by default. Dynamic sampling
    (dropping zero-variance groups) is the caller's job: ``sample_weight`` = 0 for them.
    """
    return _clipped_surrogate(batch, clip_low, clip_high, kl_coef, aggregation, max_tokens)

"""Rotary position embeddings: inverse frequencies for each supported scaling type, and the
rotation itself in the HF `rotate_half` convention (so HF q/k weights work unchanged)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

InvFreqFn = Callable[[torch.Tensor, dict[str, Any], int, float], tuple[torch.Tensor, float]]
_SCALINGS: dict[str, InvFreqFn] = {}


def _register(name: str) -> Callable[[InvFreqFn], InvFreqFn]:
    def wrap(fn: InvFreqFn) -> InvFreqFn:
        _SCALINGS[name] = fn
        return fn
    return wrap


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                  max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [head_dim // 2] float64, attention_scaling applied to cos and sin)."""
    base = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    scaling = scaling or {}
    return _SCALINGS[scaling.get("rope_type", "default")](base, scaling, max_position_embeddings,
                                                          theta)


@_register("default")
def _default(inv_freq: torch.Tensor, s: dict[str, Any], max_pos: int,
             theta: float) -> tuple[torch.Tensor, float]:
    return inv_freq, 1.0


@_register("linear")
def _linear(inv_freq: torch.Tensor, s: dict[str, Any], max_pos: int,
             theta: float) -> tuple[torch.Tensor, float]:
    return inv_freq / s["factor"], 1.0


@_register("llama3")
def _llama3(inv_freq: torch.Tensor, s: dict[str, Any], max_pos: int,
             theta: float) -> tuple[torch.Tensor, float]:
    factor, old_len = s["factor"], s["original_max_position_embeddings"]
    low, high = s["low_freq_factor"], s["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    # Between the two wavelengths, blend scaled and unscaled frequencies linearly.
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, blended, scaled), 1.0


@_register("yarn")
def _yarn(inv_freq: torch.Tensor, s: dict[str, Any], max_pos: int,
             theta: float) -> tuple[torch.Tensor, float]:
    factor = s["factor"]
    old_len = s.get("original_max_position_embeddings") or max_pos
    dim = 2 * inv_freq.numel()

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(old_len / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.get("beta_fast", 32)), correction_dim(s.get("beta_slow", 1))
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    mixed = inv_freq / factor * (1 - extrapolation_weight) + inv_freq * extrapolation_weight

    def mscale(scale: float, m: float = 1.0) -> float:
        return 0.1 * m * math.log(scale) + 1.0 if scale > 1 else 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention_factor = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    return mixed, float(attention_factor)


class RopeTable(NamedTuple):
    """cos, sin: [B, T, 1, D] for the tokens of one forward, shared by every layer."""

    cos: torch.Tensor
    sin: torch.Tensor


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables indexed by absolute position; positions come from the caller so
    draft trees (many tokens at one depth) get the right rotation."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None,
                 max_position_embeddings: int, max_positions: int) -> None:
        super().__init__()
        inv_freq, attention_scaling = rope_inv_freq(head_dim, theta, scaling,
                                                    max_position_embeddings)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", (angles.cos() * attention_scaling).float(), persistent=False)
        self.register_buffer("sin", (angles.sin() * attention_scaling).float(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTable:
        """positions: [B, T] -> RopeTable for those positions. No bounds check here (it would
        wait on the device every forward): callers size the table (`max_positions`) and check
        lengths once, on admission."""
        return RopeTable(self.cos[positions].unsqueeze(2).to(dtype),
                         self.sin[positions].unsqueeze(2).to(dtype))


def rotate(x: torch.Tensor, rope: RopeTable) -> torch.Tensor:
    """x: [B, T, heads, D] -> x rotated by its tokens' positions (HF rotate_half convention)."""
    return x * rope.cos + _rotate_half(x) * rope.sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

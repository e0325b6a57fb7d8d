"""Counter-based random numbers: a uniform is a hash of (request seed, draw site, counter).

A request's draws depend only on its own seed and on where it is in its answer (the counter is
built from the token position), never on its batch neighbours, on bucket padding, or on how
often a step was run: a captured CUDA graph replays the same kernels with new counters, warm-up
runs before a capture change nothing, and a run with graphs samples exactly what an eager run
samples. Everything is int64 tensor arithmetic, on any device, with no per-request launches.

The hash is SplitMix64's finalizer (Steele, Lea, Flood 2014) over the counter offset by a
per-row key; int64 products wrap modulo 2^64 in torch on CPU and CUDA (tests/engine/test_rng.py
checks that against exact Python integers). The top 53 bits make a float64 uniform, so
inverse-CDF sampling is exact to float64 resolution.
"""

from __future__ import annotations

from enum import IntEnum

import torch

_GOLDEN = 0x9E3779B97F4A7C15
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


class Stream(IntEnum):
    """Draw sites: each has its own key, so no two sites ever share a uniform."""

    SAMPLE = 1     # a plain decoding / prefill token: counter = its position
    VERIFY = 2     # one uniform per draft node: counter = root_pos * 2^12 + node
    BONUS = 3      # the token after the accepted path: counter = root_pos
    DRAFT = 4      # drafting children without replacement: see draft_counter


def _signed(x: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (>> on int64 is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer on int64 bit patterns (products wrap modulo 2^64)."""
    x = (x ^ _shr(x, 30)) * _signed(_MIX1)
    x = (x ^ _shr(x, 27)) * _signed(_MIX2)
    return x ^ _shr(x, 31)


def stream_keys(seeds: torch.Tensor, stream: Stream) -> torch.Tensor:
    """seeds [B] int64 -> the rows' keys [B] for one draw site (compute once, draw many)."""
    return mix64(seeds * _signed(_GOLDEN) + _signed(int(stream) * _MIX2))


def all_stream_keys(seeds: torch.Tensor) -> torch.Tensor:
    """seeds [B] -> keys [B, len(Stream)], column s - 1 for Stream s."""
    return torch.stack([stream_keys(seeds, s) for s in Stream], 1)


def uniform_keyed(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """keys [B] (stream_keys), counters [B, ...] int64 >= 0 -> uniforms [B, ...] float64 in
    (0, 1)."""
    keys = keys.view((keys.shape[0],) + (1,) * (counters.dim() - 1))
    bits = _shr(mix64(counters * _signed(_GOLDEN) + keys), 11)            # 53 random bits
    return (bits.double() + 0.5) * 2.0 ** -53


def uniform(seeds: torch.Tensor, counters: torch.Tensor, stream: Stream) -> torch.Tensor:
    """seeds [B] int64, counters [B, ...] int64 >= 0 -> uniforms [B, ...] float64 in (0, 1)."""
    return uniform_keyed(stream_keys(seeds, stream), counters)


def draft_counter(root_pos: torch.Tensor, level: int, index: torch.Tensor) -> torch.Tensor:
    """Counter of a draft draw: root_pos [B, 1, ...], level < 2^8, index [..] < 2^16."""
    return (root_pos << 24) + (level << 16) + index


def seed_of(seed: int | None, index: int, generator: torch.Generator | None = None) -> int:
    """The int64 seed of request `index` of a call: seed + index (so repeated prompts of a GRPO
    group differ), or a fresh draw from torch's RNG for unseeded requests."""
    if seed is None:
        return int(torch.randint(0, 2 ** 62, (1,), generator=generator))
    return (seed + index) % 2 ** 63

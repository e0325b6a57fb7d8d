"""What the model needs to know about the KV cache and the attention pattern of one forward.

The engine owns the cache tensors; the model only reads and writes them through a KVView. Shapes
are static per batch bucket (no per-request Python lists), so a captured CUDA graph can replay them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVView:
    """Slot KV cache: k[i], v[i] are layer i's [num_slots, num_kv_heads, max_seq_len, head_dim].

    slot_ids: [B] long, the cache slot of each batch row. When the rows use the consecutive slots
    slot_start .. slot_start+B-1, reads are views instead of gathers.
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    slot_ids: torch.Tensor
    slot_start: int | None = None

    @classmethod
    def for_slots(cls, k: list[torch.Tensor], v: list[torch.Tensor], slots: list[int]
                  ) -> KVView:
        start = slots[0]
        is_range = slots == list(range(start, start + len(slots)))
        return cls(k, v, torch.tensor(slots, device=k[0].device), start if is_range else None)


class KVViews:
    """KVView.for_slots with memory: the running batch is the same step after step, so the view
    (and its slot-id tensor) is built once per batch composition, not once per forward."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        self.k, self.v = k, v
        self._slots: tuple[int, ...] = ()
        self._view: KVView | None = None

    def __call__(self, slots: list[int]) -> KVView:
        key = tuple(slots)
        if key != self._slots or self._view is None:
            self._view = KVView.for_slots(self.k, self.v, slots)
            self._slots = key
        return self._view


@dataclass(frozen=True, slots=True)
class AttnMeta:
    """cache_positions: [B, T] long, where each new token's K/V is written in its slot (equals the
    RoPE position for plain prefill/decode; differs for draft-tree nodes).
    mask: [B, T, ctx_len] bool, True where query t may attend cache position s (< ctx_len).
    Without a KV cache (training), mask is [B, T, T] over the batch's own tokens, or None = causal.
    """

    mask: torch.Tensor | None
    cache_positions: torch.Tensor | None = None
    sees_all: bool = False  # every query may attend every one of the ctx_len cells

    def __post_init__(self) -> None:
        assert self.mask is not None or self.cache_positions is None, "a cache read needs a mask"

    @property
    def ctx_len(self) -> int:
        assert self.mask is not None
        return self.mask.shape[-1]


def causal_cache_meta(positions: torch.Tensor, ctx_len: int, sees_all: bool = False) -> AttnMeta:
    """Plain prefill/decode: token at position p sees cache positions 0..p of its own slot.
    sees_all: the caller knows every row is one token at position ctx_len - 1 (a decode step of
    equal-length rows), so the mask is all True and attention may skip it."""
    cols = torch.arange(ctx_len, device=positions.device)
    return AttnMeta(mask=cols.view(1, 1, -1) <= positions.unsqueeze(-1), cache_positions=positions,
                    sees_all=sees_all)

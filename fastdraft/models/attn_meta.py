"""What the model needs to know about the KV cache and the attention pattern of one forward.

The engine owns the cache tensors; the model reads and writes them through a KVView: slot
caches, where batch row b uses cache slot `slot_start + b` (the engine keeps running requests in
consecutive slots, so a read is a view, never a gather), or paged ones, where row b's cells live
in the blocks its table row names (engine/paged_kv.py). The same code serves eager steps and
captured graphs.
Masks are built from device tensors by the functions below: no host value enters a forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True, slots=True)
class ReadChunk:
    """Rows of a paged forward that attention reads together (engine/ragged_reads.py): rows
    [n] of the batch, pages [n * blocks] their first blocks (table order), ctx_len the cells
    read, bias [n, 1, T, ctx_len] those rows' mask as an additive bias."""

    rows: torch.Tensor
    pages: torch.Tensor
    ctx_len: int
    bias: torch.Tensor


@dataclass(frozen=True, slots=True)
class KVView:
    """Slot KV cache: k[i], v[i] are layer i's [num_slots, num_kv_heads, cache_len, head_dim];
    batch row b reads and writes slot slot_start + b.
    Paged (table set): k[i], v[i] are layer i's [num_blocks, block_size, num_kv_heads,
    head_dim]; row b's cell c is block table[b, c // block_size] at offset c % block_size, and
    write_at gives the (block, offset) [B, T] of the forward's new tokens (once per forward)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    slot_start: int = 0
    row_ids: torch.Tensor | None = None  # [B, 1] arange, built once per forward (not per layer)
    table: torch.Tensor | None = None
    write_at: tuple[torch.Tensor, torch.Tensor] | None = None
    # Paged decode and verify steps: attention that reads the rows' blocks in place, (q [B, T,
    # H, D], k pool, v pool, table, ctx_lens [B], new_mask [B, T, T] or None = causal) ->
    # [B, T, H, D]; the step's T new cells are each row's last ctx_lens cells and new_mask says
    # which of them each query sees. None: gather the blocks (kernels/
    # triton_paged_attention.py; set by the engine, never imported here).
    paged_attention: Callable[..., torch.Tensor] | None = None
    ctx_lens: torch.Tensor | None = None
    new_mask: torch.Tensor | None = None
    # Paged eager forwards: attention reads these row chunks, each padded only to its own
    # longest row (None: one read of every row to ctx_len).
    chunks: tuple[ReadChunk, ...] | None = None
    # Paged eager forwards of one row whose blocks up to ctx_len are consecutive, from this one:
    # attention reads them as a view of the pool, no gather (None: gather).
    span_start: int | None = None

    @property
    def reads_mask(self) -> bool:
        """Whether attention reads the forward's mask (a kernel builds its own from ctx_lens
        and new_mask; read chunks carry their rows' bias)."""
        return self.paged_attention is None and self.chunks is None

    def rows(self, layer_idx: int, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer_idx`'s K and V of the batch's slots, as views [B, Hkv, cache_len, D]."""
        end = self.slot_start + num_rows
        return self.k[layer_idx][self.slot_start: end], self.v[layer_idx][self.slot_start: end]


@dataclass(frozen=True, slots=True)
class AttnMeta:
    """cache_positions: [B, T] long, where each new token's K/V is written in its slot (equals the
    RoPE position for plain prefill/decode; differs for draft-tree nodes).
    mask: [B, T, ctx_len] bool, True where query t may attend cache cell s (< ctx_len); None with
    a cache read: every query sees all `cache_len` cells (a decode step whose rows all end at
    the last cell: attention then runs without a mask, faster).
    Without a KV cache (training), mask is [B, T, T] over the batch's own tokens, or None = causal.
    bias: the mask as an additive float bias [B, 1, T, ctx_len] (`with_bias`, once per forward:
    attention would otherwise convert the bool mask in every layer).
    """

    mask: torch.Tensor | None
    cache_positions: torch.Tensor | None = None
    cache_len: int | None = None
    bias: torch.Tensor | None = None

    def __post_init__(self) -> None:
        assert self.mask is not None or self.cache_positions is None or self.cache_len, \
            "a cache read needs a mask or cache_len"

    @property
    def ctx_len(self) -> int:
        if self.mask is None:
            assert self.cache_len is not None
            return self.cache_len
        return self.mask.shape[-1]

    @property
    def sdpa_mask(self) -> torch.Tensor | None:
        """What scaled_dot_product_attention takes: the bias if built, else the bool mask
        [B, 1, T, ctx_len], None for no mask."""
        if self.bias is not None:
            return self.bias
        return None if self.mask is None else self.mask.unsqueeze(1)

    def with_bias(self, dtype: torch.dtype) -> AttnMeta:
        if self.mask is None or self.bias is not None:
            return self
        bias = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device)
        return replace(self, bias=bias.masked_fill_(~self.mask, float("-inf")).unsqueeze(1))


@dataclass(frozen=True, slots=True)
class PackedSeqs:
    """A training forward (no KV cache) over sequences packed along T of one [1, N] row without
    padding: sequence i is tokens bounds[i]:bounds[i + 1] (its positions restart at 0: the
    caller's) and attends causally within itself only. Attention runs per run of equally long
    neighbours (causal SDPA over [n, L] at once), so it costs sum L_i^2, never N^2, and no
    [N, N] mask exists."""

    bounds: tuple[int, ...]

    def with_bias(self, dtype: torch.dtype) -> PackedSeqs:
        return self

    def runs(self) -> list[tuple[int, int, int]]:
        """(start, length, count): consecutive sequences of one length, attended together."""
        out: list[tuple[int, int, int]] = []
        for start, end in zip(self.bounds[:-1], self.bounds[1:]):
            if out and out[-1][1] == end - start:
                out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
            else:
                out.append((start, end - start, 1))
        return out


@dataclass(frozen=True, slots=True)
class RowGroup:
    """Rows of one width inside a packed forward: `num_rows` rows of `width` tokens each, row
    b in cache slot kv.slot_start + b, attending as `attn` says ([num_rows, width, ctx_len])."""

    num_rows: int
    width: int
    kv: KVView
    attn: AttnMeta

    @property
    def num_tokens(self) -> int:
        return self.num_rows * self.width


@dataclass(frozen=True, slots=True)
class GroupedAttn:
    """A ragged forward: groups of rows with different widths (draft-tree rows beside one-token
    decode rows) packed into one sequence [1, sum of num_tokens], in group order. The linears
    run once over the real tokens; attention runs per group, each padded only to its own width
    and context (a step's cost then follows its real tokens, not its widest row)."""

    groups: tuple[RowGroup, ...]

    def with_bias(self, dtype: torch.dtype) -> GroupedAttn:
        return GroupedAttn(tuple(replace(g, attn=g.attn.with_bias(dtype)) if g.kv.reads_mask
                                 else g for g in self.groups))


def causal_cache_meta(positions: torch.Tensor, ctx_len: int) -> AttnMeta:
    """Plain prefill/decode: the token at position p sees cells 0..p of its own slot.
    positions: [B, T]; ctx_len: cells read (a bucket >= every row's last position + 1)."""
    cols = torch.arange(ctx_len, device=positions.device)
    return AttnMeta(mask=cols.view(1, 1, -1) <= positions.unsqueeze(-1), cache_positions=positions)


class TreeMask:
    """Attention of draft-tree queries whose tree cells sit right after each row's context.

    root_pos [B]: each row's last committed position (its context is cells first_cell..root_pos;
    the drafter's cache starts at 1: position 0 has no (feature, token) pair); tree cell m of a
    row is stored at root_pos + 1 + m (m < num_cells). Built once per step, called per level:
    tree_ancestors [B, Q, num_cells] bool (query q may see tree cell m) -> mask [B, Q, ctx_len].
    A row's cells depend only on that row, never on its neighbours."""

    def __init__(self, root_pos: torch.Tensor, num_cells: int, ctx_len: int,
                 first_cell: int = 0) -> None:
        cols = torch.arange(ctx_len, device=root_pos.device)
        rel = cols.unsqueeze(0) - root_pos.unsqueeze(1) - 1                      # [B, C]
        self.context = ((rel < 0) & (cols >= first_cell)).unsqueeze(1)           # [B, 1, C]
        self.in_tree = ((rel >= 0) & (rel < num_cells)).unsqueeze(1)
        self.index = rel.clamp(0, max(num_cells - 1, 0)).unsqueeze(1)
        self.num_cells = num_cells

    def __call__(self, tree_ancestors: torch.Tensor) -> torch.Tensor:
        if not self.num_cells:
            return self.context.expand(-1, tree_ancestors.shape[1], -1)
        index = self.index.expand(-1, tree_ancestors.shape[1], -1)
        return self.context | (tree_ancestors.gather(2, index) & self.in_tree)


def tree_mask(root_pos: torch.Tensor, tree_ancestors: torch.Tensor, ctx_len: int,
              first_cell: int = 0) -> torch.Tensor:
    """TreeMask for one set of queries: root_pos [B], tree_ancestors [B, Q, M] -> [B, Q, C]."""
    return TreeMask(root_pos, tree_ancestors.shape[2], ctx_len, first_cell)(tree_ancestors)


def causal_pairs_mask(positions: torch.Tensor, ctx_len: int) -> torch.Tensor:
    """The drafter's causal mask: the pair at position p sees cells 1..p (cell 0 holds no
    pair). positions [B, T] -> [B, T, ctx_len]."""
    cols = torch.arange(ctx_len, device=positions.device)
    return (cols >= 1) & (cols <= positions.unsqueeze(-1))

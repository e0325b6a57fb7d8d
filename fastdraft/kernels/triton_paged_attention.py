"""Attention over a paged KV cache as Triton kernels: the same signature and result as
kernels/paged_attention.py's torch reference, but each program reads only its row's own blocks
(the reference gathers every row to the longest context).

Flash-decoding with grouped query heads: a program of _split_kernel takes one row, one KV head
and one split (a chunk of the committed context, or the last split: the step's new cells with
the tree mask). Its query tile holds all GROUP query heads of that KV head times all NEW tokens,
so each K/V tile is read once for all of them (scores by tl.dot), and an online softmax leaves a
partial (max, sum, weighted sum) per query in a scratch buffer; _combine_kernel rescales and adds
the splits. The split count comes from shapes only (never from ctx_lens, which lives on the
device): no host sync, so the pair can be captured in a CUDA graph. Checked against the reference
on the CPU under TRITON_INTERPRET=1 (tests/kernels)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from fastdraft.errors import FastdraftError
from fastdraft.kernels.paged_attention import check_paged_inputs

TILE = 64               # committed cells per loop step (several blocks through the block table)
MIN_SPLIT_CELLS = 128   # a split shorter than this costs more in partials than it saves
MAX_SPLITS = 64
LOG2E = 1.4426950408889634


@triton.jit
def _load_kv(K, V, table, cells, valid, kv_off, s_kb, s_ks, d, dim, BLOCK: tl.constexpr):
    """K / V [N, D] of a row's `cells` (its block table at `table`); zeros where not valid."""
    block = tl.load(table + cells // BLOCK, mask=valid, other=0)
    at = block[:, None] * s_kb + (cells % BLOCK)[:, None] * s_ks + kv_off + d[None, :]
    both = valid[:, None] & (d < dim)[None, :]
    return tl.load(K + at, mask=both, other=0.0), tl.load(V + at, mask=both, other=0.0)


@triton.jit
def _fold(q, k, v, visible, best, total, acc, qk_scale, PRECISION: tl.constexpr):
    """One online-softmax step: the cells of k / v [N, D] that `visible` [M, N] lets each query
    row see join its running max `best`, sum `total` [M] and weighted sum `acc` [M, D]
    (log2 units: exp2 is the cheap exponential)."""
    k, v = k.to(q.dtype), v.to(q.dtype)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    scores = tl.where(visible, scores, -1.0e30)
    best_new = tl.maximum(best, tl.max(scores, 1))
    # Masked cells weigh 0 even in a row that has seen nothing yet (its max still -1e30).
    weights = tl.where(visible, tl.exp2(scores - best_new[:, None]), 0.0)
    fade = tl.exp2(best - best_new)
    acc = acc * fade[:, None] + tl.dot(weights.to(q.dtype), v, input_precision=PRECISION)
    return best_new, total * fade + tl.sum(weights, 1), acc


@triton.jit
def _split_kernel(Q, K, V, TABLES, CTX, MASK, PART_MAX, PART_SUM, PART_ACC, qk_scale,
                  split_cells, s_qb, s_qt, s_qh, s_kb, s_ks, s_kh, s_tb, s_mb, s_mt,
                  NEW: tl.constexpr, NEW_TILE: tl.constexpr, ROWS: tl.constexpr,
                  TILE: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
                  DIM: tl.constexpr, GROUP: tl.constexpr, HEADS: tl.constexpr,
                  SPLITS: tl.constexpr, HAS_MASK: tl.constexpr, PRECISION: tl.constexpr):
    split, row, kv_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # Query tile row r = token t * GROUP + g, query head kv_head * GROUP + g; padded to ROWS.
    r = tl.arange(0, ROWS)
    t, head = r // GROUP, kv_head * GROUP + r % GROUP
    real = r < NEW * GROUP
    d = tl.arange(0, DIM)   # head_dim padded to 16 for tl.dot
    q = tl.load(Q + row * s_qb + t[:, None] * s_qt + head[:, None] * s_qh + d[None, :],
                mask=real[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    table, kv_off = TABLES + row * s_tb, kv_head * s_kh
    committed = tl.load(CTX + row) - NEW
    best = tl.full((ROWS,), -1.0e30, tl.float32)   # finite: no inf - inf
    total = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, DIM), tl.float32)
    if split < SPLITS - 1:   # a chunk of the committed cells, seen by every query
        start = split * split_cells
        end = tl.minimum(start + split_cells, committed)   # <= start: an empty partial
        offs = tl.arange(0, TILE)
        for lo in range(start, end, TILE):
            cells = lo + offs
            valid = cells < end
            k, v = _load_kv(K, V, table, cells, valid, kv_off, s_kb, s_ks, d, HEAD_DIM, BLOCK)
            visible = valid[None, :] & real[:, None]
            best, total, acc = _fold(q, k, v, visible, best, total, acc, qk_scale, PRECISION)
    else:   # the step's own cells: token t sees new cell j by the tree mask (or j <= t)
        j = tl.arange(0, NEW_TILE)
        inside = j < NEW
        k, v = _load_kv(K, V, table, committed + j, inside, kv_off, s_kb, s_ks, d, HEAD_DIM,
                        BLOCK)
        both = inside[None, :] & real[:, None]
        if HAS_MASK:
            sees = tl.load(MASK + row * s_mb + t[:, None] * s_mt + j[None, :], mask=both, other=0)
            visible = both & (sees != 0)
        else:
            visible = both & (j[None, :] <= t[:, None])
        best, total, acc = _fold(q, k, v, visible, best, total, acc, qk_scale, PRECISION)
    # Partials laid out [B, T, H, SPLITS(, D)]: the combine reads one query's splits at once.
    at = ((row * NEW + t) * HEADS + head) * SPLITS + split
    tl.store(PART_MAX + at, best, mask=real)
    tl.store(PART_SUM + at, total, mask=real)
    tl.store(PART_ACC + at[:, None] * DIM + d[None, :], acc, mask=real[:, None])


@triton.jit
def _combine_kernel(PART_MAX, PART_SUM, PART_ACC, OUT, SPLITS: tl.constexpr,
                    SPLITS_P2: tl.constexpr, HEAD_DIM: tl.constexpr, DIM: tl.constexpr):
    """out = sum_s 2^(max_s - M) acc_s / sum_s 2^(max_s - M) sum_s, M the largest max_s: an
    empty split (max -1e30, sum 0) weighs 0, and the new-cells split is never empty."""
    query = tl.program_id(0)
    s = tl.arange(0, SPLITS_P2)
    d = tl.arange(0, DIM)
    here = s < SPLITS
    best = tl.load(PART_MAX + query * SPLITS + s, mask=here, other=-1.0e30)
    total = tl.load(PART_SUM + query * SPLITS + s, mask=here, other=0.0)
    acc = tl.load(PART_ACC + (query * SPLITS + s)[:, None] * DIM + d[None, :],
                  mask=here[:, None], other=0.0)
    weight = tl.exp2(best - tl.max(best, 0))
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(total * weight, 0)
    tl.store(OUT + query * HEAD_DIM + d, out.to(OUT.dtype.element_ty), mask=d < HEAD_DIM)


@functools.cache
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors to fill (a host-side property: no sync); 132 (an H100 or
    H200) off the GPU, so that the interpreter runs the same splits."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_splits(batch: int, kv_heads: int, max_cells: int, sms: int = 132) -> tuple[int, int]:
    """(splits of the committed context, cells per split) from shapes only: enough programs for
    about two per SM, each split at least MIN_SPLIT_CELLS and a whole number of tiles."""
    want = -(-2 * sms // (batch * kv_heads))
    splits = max(1, min(want, max_cells // MIN_SPLIT_CELLS, MAX_SPLITS))
    split_cells = -(-max_cells // (splits * TILE)) * TILE
    return -(-max_cells // split_cells), split_cells


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, ctx_lens: torch.Tensor,
                           new_mask: torch.Tensor | None = None,
                           scale: float | None = None) -> torch.Tensor:
    """paged_attention_ref's contract. block_size and head_dim must be powers of two (Triton
    vectors); every query must see at least one cell (a new token sees itself)."""
    check_paged_inputs(q, k_cache, v_cache, block_tables, ctx_lens, new_mask)
    batch, new, heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    for name, size in (("block_size", block_size), ("head_dim", dim)):
        if size & (size - 1):
            raise FastdraftError(f"paged_attention_triton: {name} must be a power of two, got "
                                 f"{size}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    ctx = ctx_lens.to(torch.int32).contiguous()
    mask = (new_mask if new_mask is not None else torch.ones(1, 1, 1, device=q.device)
            ).to(torch.int8).contiguous()
    group = heads // kv_heads
    ctx_splits, split_cells = num_splits(batch, kv_heads, tables.shape[1] * block_size,
                                         _sm_count(q.device))
    splits = ctx_splits + 1   # and the new cells' split
    part_max = torch.empty(batch, new, heads, splits, device=q.device, dtype=torch.float32)
    part_sum = torch.empty_like(part_max)
    dim_p = max(16, dim)   # tl.dot's smallest side
    part_acc = torch.empty(batch, new, heads, splits, dim_p, device=q.device,
                           dtype=torch.float32)
    _split_kernel[(splits, batch, kv_heads)](
        q, k_cache, v_cache, tables, ctx, mask, part_max, part_sum, part_acc,
        (scale or dim ** -0.5) * LOG2E, split_cells, q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tables.stride(0),
        mask.stride(0), mask.stride(1),
        NEW=new, NEW_TILE=max(16, triton.next_power_of_2(new)),
        ROWS=max(16, triton.next_power_of_2(group * new)), TILE=TILE, BLOCK=block_size,
        HEAD_DIM=dim, DIM=dim_p,
        GROUP=group, HEADS=heads, SPLITS=splits, HAS_MASK=new_mask is not None,
        # float32 exactly, as the reference (tf32 would cost ~1e-3); 16-bit inputs: tensor cores
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    out = torch.empty(batch, new, heads, dim, device=q.device, dtype=q.dtype)
    _combine_kernel[(batch * new * heads,)](part_max, part_sum, part_acc, out, SPLITS=splits,
                                            SPLITS_P2=triton.next_power_of_2(splits),
                                            HEAD_DIM=dim, DIM=dim_p)
    return out

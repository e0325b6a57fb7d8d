"""Attention over a paged KV cache as a Triton kernel: the same signature and result as
kernels/paged_attention.py's torch reference, but each program reads only its row's own blocks
(the reference gathers every row to the longest context). One program per (row, query head,
query token): an online softmax over the committed cells a block at a time, then over the
step's new cells (a decode token, or a tree's root and nodes) with the tree mask. Checked
against the reference on the CPU under TRITON_INTERPRET=1 (tests/kernels)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastdraft.kernels.paged_attention import check_paged_inputs


@triton.jit
def _fold(best, total, acc, q, k, v, valid):
    """One online-softmax update: the cells `valid` of k / v [N, D] join the running max
    `best`, sum of exponentials `total` and weighted sum `acc` [D]."""
    scores = tl.where(valid, tl.sum(k * q[None, :], 1), -1.0e30)
    best_new = tl.maximum(best, tl.max(scores, 0))
    weights = tl.where(valid, tl.exp(scores - best_new), 0.0)
    fade = tl.exp(best - best_new)
    return best_new, total * fade + tl.sum(weights, 0), acc * fade + tl.sum(weights[:, None] * v, 0)


@triton.jit
def _paged_attention_kernel(Q, K, V, TABLES, CTX, MASK, OUT, scale,
                            s_qb, s_qt, s_qh, s_kb, s_ks, s_kh, s_tb, s_mb, s_mt,
                            s_ob, s_ot, s_oh,
                            NEW: tl.constexpr, NEW_P2: tl.constexpr, BLOCK: tl.constexpr,
                            DIM: tl.constexpr, GROUP: tl.constexpr, HAS_MASK: tl.constexpr):
    row, head, t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kv_head = head // GROUP
    d = tl.arange(0, DIM)
    q = tl.load(Q + row * s_qb + t * s_qt + head * s_qh + d).to(tl.float32) * scale
    committed = tl.load(CTX + row) - NEW
    best = tl.full((), -1.0e30, tl.float32)   # running max (finite: no inf - inf)
    total = tl.full((), 0.0, tl.float32)      # running sum of exp
    acc = tl.zeros((DIM,), tl.float32)
    offs = tl.arange(0, BLOCK)
    for i in range(0, tl.cdiv(committed, BLOCK)):
        block = tl.load(TABLES + row * s_tb + i)
        valid = i * BLOCK + offs < committed
        at = block * s_kb + offs[:, None] * s_ks + kv_head * s_kh + d[None, :]
        k = tl.load(K + at, mask=valid[:, None], other=0.0).to(tl.float32)
        v = tl.load(V + at, mask=valid[:, None], other=0.0).to(tl.float32)
        best, total, acc = _fold(best, total, acc, q, k, v, valid)
    # The step's own cells, one lane each.
    j = tl.arange(0, NEW_P2)
    if HAS_MASK:
        sees = tl.load(MASK + row * s_mb + t * s_mt + j, mask=j < NEW, other=0) != 0
    else:
        sees = j <= t
    sees = sees & (j < NEW)
    cell = committed + j
    block = tl.load(TABLES + row * s_tb + cell // BLOCK, mask=sees, other=0)
    at = block[:, None] * s_kb + (cell % BLOCK)[:, None] * s_ks + kv_head * s_kh + d[None, :]
    k = tl.load(K + at, mask=sees[:, None], other=0.0).to(tl.float32)
    v = tl.load(V + at, mask=sees[:, None], other=0.0).to(tl.float32)
    best, total, acc = _fold(best, total, acc, q, k, v, sees)
    out = acc / total
    tl.store(OUT + row * s_ob + t * s_ot + head * s_oh + d, out.to(OUT.dtype.element_ty))


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
            raise ValueError(f"paged_attention_triton: {name} must be a power of two, got {size}")
    k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    ctx = ctx_lens.to(torch.int32).contiguous()
    mask = (new_mask if new_mask is not None else torch.ones(1, 1, 1, device=q.device)
            ).to(torch.int8).contiguous()
    out = torch.empty_like(q)
    _paged_attention_kernel[(batch, heads, new)](
        q, k_cache, v_cache, tables, ctx, mask, out, scale or dim ** -0.5,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tables.stride(0),
        mask.stride(0), mask.stride(1), out.stride(0), out.stride(1), out.stride(2),
        NEW=new, NEW_P2=triton.next_power_of_2(new), BLOCK=block_size, DIM=dim,
        GROUP=heads // kv_heads, HAS_MASK=new_mask is not None)
    return out

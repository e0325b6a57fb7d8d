"""Attention over a paged KV cache (engine/kv_blocks.py's layout), the torch reference: every
row's blocks gathered into a padded context, then one masked scaled_dot_product_attention. It
is the path on CPU and the slow path every kernel is checked against (kernels/
triton_paged_attention.py has the same signature and reads only a row's own blocks).

The layout, one layer: k_cache / v_cache [num_blocks, block_size, kv_heads, head_dim]; row b's
cell c lives in block block_tables[b, c // block_size] at offset c % block_size. The step's T
new tokens of row b (a decode token, or a tree's root and nodes) already have their K/V in
cells ctx_lens[b] - T .. ctx_lens[b] - 1; every query sees the row's committed cells
0 .. ctx_lens[b] - T - 1, and new cell j where new_mask[b, t, j] (default: j <= t, causal)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastdraft.errors import FastdraftError


def check_paged_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_tables: torch.Tensor, ctx_lens: torch.Tensor,
                       new_mask: torch.Tensor | None) -> None:
    """Shapes that agree, or a FastdraftError that names the one that does not."""
    batch, new, heads, dim = q.shape
    _, _, kv_heads, kv_dim = k_cache.shape
    if v_cache.shape != k_cache.shape:
        raise FastdraftError(f"v_cache {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}")
    if kv_dim != dim or heads % kv_heads:
        raise FastdraftError(f"q {tuple(q.shape)} does not fit k_cache {tuple(k_cache.shape)}: "
                             "head_dim must match and q's heads be a multiple of the KV heads")
    if block_tables.shape[0] != batch or ctx_lens.shape != (batch,):
        raise FastdraftError(f"block_tables {tuple(block_tables.shape)} and ctx_lens "
                             f"{tuple(ctx_lens.shape)} must have one row per query row ({batch})")
    if new_mask is not None and new_mask.shape != (batch, new, new):
        raise FastdraftError(f"new_mask must be [B, T, T] = {(batch, new, new)}, got "
                             f"{tuple(new_mask.shape)}")


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, ctx_lens: torch.Tensor,
                        new_mask: torch.Tensor | None = None,
                        scale: float | None = None) -> torch.Tensor:
    """q [B, T, H, D] -> out [B, T, H, D]. block_tables [B, max_blocks] (entries past a row's
    blocks are ignored, any valid index), ctx_lens [B] cells of each row including the T new
    ones."""
    check_paged_inputs(q, k_cache, v_cache, block_tables, ctx_lens, new_mask)
    batch, new, heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    span = block_tables.shape[1] * block_size
    # [B, max_blocks, block_size, Hkv, D] -> [B, Hkv, span, D]
    k = k_cache[block_tables.long()].reshape(batch, span, kv_heads, dim).transpose(1, 2)
    v = v_cache[block_tables.long()].reshape(batch, span, kv_heads, dim).transpose(1, 2)
    groups = heads // kv_heads
    if groups > 1:
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    cells = torch.arange(span, device=q.device)
    committed = (ctx_lens - new).view(batch, 1, 1)
    sees = cells.view(1, 1, -1) < committed                                 # [B, 1, span]
    if new_mask is None:
        new_mask = torch.ones(new, new, dtype=torch.bool, device=q.device).tril().expand(
            batch, -1, -1)
    j = cells.view(1, 1, -1) - committed                                    # new cell index
    inside = (j >= 0) & (j < new)
    picked = torch.gather(new_mask, 2, j.clamp(0, new - 1).expand(batch, new, span))
    mask = sees | (inside & picked)                                         # [B, T, span]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.to(q.dtype), v.to(q.dtype),
                                         attn_mask=mask.unsqueeze(1), scale=scale)
    return out.transpose(1, 2)

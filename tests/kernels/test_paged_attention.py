"""Attention over a paged KV cache: the torch reference equals attention computed row by row on
each row's cells laid out contiguously (scattered random blocks, ragged lengths, grouped KV
heads, decode, causal prefill chunks and draft-tree masks), and the Triton kernel equals the
reference under TRITON_INTERPRET=1 (the CPU runs the kernel's own program)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastdraft.kernels.paged_attention import paged_attention_ref

CASES = [   # (block_size, new tokens, tree mask)
    (4, 1, False), (16, 1, False), (4, 5, False), (16, 6, True), (8, 13, True)]


def _inputs(block_size: int, new: int, tree: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    batch, heads, kv_heads, dim, num_blocks = 4, 4, 2, 16, 64
    ctx = torch.tensor([new, 7 + new, 29 + new, 3 * block_size + new])   # one with no context
    max_blocks = -(-int(ctx.max()) // block_size) + 1
    tables = torch.randperm(num_blocks, generator=g)[: batch * max_blocks].view(batch, max_blocks)
    k = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g)
    v = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g)
    q = torch.randn(batch, new, heads, dim, generator=g)
    mask = None
    if tree:   # each node sees the root, a random subset of earlier nodes, and itself
        mask = torch.rand(batch, new, new, generator=g) < 0.5
        mask = (mask.tril() | torch.eye(new, dtype=torch.bool)).contiguous()
        mask[:, :, 0] = True
    return q, k, v, tables, ctx, mask


def _row_by_row(q, k_cache, v_cache, tables, ctx, mask):
    batch, new, heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros_like(q)
    for b in range(batch):
        n = int(ctx[b])
        cells = [(int(tables[b, c // block_size]), c % block_size) for c in range(n)]
        k = torch.stack([k_cache[blk, off] for blk, off in cells])   # [n, Hkv, D]
        v = torch.stack([v_cache[blk, off] for blk, off in cells])
        for t in range(new):
            seen = [c for c in range(n) if c < n - new or (
                mask[b, t, c - (n - new)] if mask is not None else c - (n - new) <= t)]
            for h in range(heads):
                kh = k[seen, h // (heads // kv_heads)]
                weights = torch.softmax(kh @ q[b, t, h] / math.sqrt(dim), 0)
                out[b, t, h] = weights @ v[seen, h // (heads // kv_heads)]
    return out


@pytest.mark.parametrize("block_size,new,tree", CASES)
def test_the_reference_is_attention_on_each_rows_own_cells(block_size, new, tree):
    q, k, v, tables, ctx, mask = _inputs(block_size, new, tree)
    got = paged_attention_ref(q, k, v, tables, ctx, mask)
    assert torch.allclose(got, _row_by_row(q, k, v, tables, ctx, mask), atol=1e-5)


def test_mismatched_shapes_are_named():
    q, k, v, tables, ctx, _ = _inputs(4, 3, False)
    with pytest.raises(ValueError, match="new_mask must be"):
        paged_attention_ref(q, k, v, tables, ctx, torch.ones(4, 2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="one row per query row"):
        paged_attention_ref(q, k, v, tables[:2], ctx, None)


def test_the_triton_kernel_matches_the_reference():
    """On a GPU, here; on the CPU, in a process started with TRITON_INTERPRET=1 (triton.jit
    reads it when it decorates, Triton's own library functions included: it cannot be
    switched on in a process that imported triton already)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        errors = triton_errors("cuda")
    else:
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        run = subprocess.run([sys.executable, "-c", _IN_INTERPRETER], env=env, cwd=_ROOT,
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        errors = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(errors) == len(CASES) and max(errors) < 1e-4, errors


def triton_errors(device: str) -> list[float]:
    """The kernel's largest difference from the reference, one per case."""
    from fastdraft.kernels.triton_paged_attention import paged_attention_triton
    errors = []
    for case in CASES:
        q, k, v, tables, ctx, mask = _inputs(*case, seed=1)
        args = [x.to(device) if x is not None else None for x in (q, k, v, tables, ctx, mask)]
        got = paged_attention_triton(*args).cpu()
        errors.append(float((got - paged_attention_ref(q, k, v, tables, ctx, mask)).abs().max()))
    return errors


_ROOT = Path(__file__).resolve().parents[2]
_IN_INTERPRETER = ("import json; from tests.kernels.test_paged_attention import triton_errors; "
                   "print(json.dumps(triton_errors('cpu')))")


def test_the_kernel_refuses_sizes_it_cannot_vectorize():
    pytest.importorskip("triton")
    from fastdraft.kernels.triton_paged_attention import paged_attention_triton
    q, k, v, tables, ctx, _ = _inputs(4, 1, False)
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        paged_attention_triton(q, k[:, :3], v[:, :3], tables, ctx)

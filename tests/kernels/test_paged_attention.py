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
# Contexts over several of the kernel's splits (64 cells each while the tests run, see
# triton_errors): (block_size, new, tree, query heads, KV heads, head_dim, committed cells per
# row). Short rows beside long ones leave some splits empty; 64 and 128 fill whole splits.
SPLIT_CASES = [
    (16, 1, False, 8, 2, 16, (300, 5, 64, 128)),
    (4, 6, True, 8, 2, 16, (0, 200, 64, 17)),
    (8, 3, False, 8, 1, 32, (129, 1, 250, 63)),
    (16, 1, False, 4, 4, 8, (192, 0, 40, 191)),   # no grouping; head_dim padded to tl.dot's 16
    (16, 5, True, 6, 2, 16, (256, 3, 100, 255))]


def _inputs(block_size: int, new: int, tree: bool, seed: int = 0, heads: int = 4,
            kv_heads: int = 2, dim: int = 16, committed: tuple[int, ...] = (0, 7, 29, -1)):
    g = torch.Generator().manual_seed(seed)
    batch = len(committed)
    ctx = torch.tensor([(c if c >= 0 else 3 * block_size) + new for c in committed])
    max_blocks = -(-int(ctx.max()) // block_size) + 1
    num_blocks = max(64, batch * max_blocks)
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
    assert len(errors["cases"]) == len(CASES) and max(errors["cases"]) < 1e-4, errors
    assert len(errors["splits"]) == len(SPLIT_CASES) and max(errors["splits"]) < 1e-4, errors
    assert min(errors["num_splits"]) >= 2, errors   # each split case crosses splits
    assert max(errors["half"]) < 2e-2, errors


def triton_errors(device: str) -> dict:
    """The kernel's largest difference from the reference, one per case: CASES, SPLIT_CASES
    (with splits of 64 cells, so that small contexts cross several), and one in half precision:
    float16, and bfloat16 on a GPU (the interpreter multiplies bfloat16's bit patterns in
    tl.dot: triton-lang/triton#11584)."""
    from fastdraft.kernels import triton_paged_attention as kernel

    def error(inputs, dtype=torch.float32):
        q, k, v, tables, ctx, mask = inputs
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        args = [x.to(device) if x is not None else None for x in (q, k, v, tables, ctx, mask)]
        got = kernel.paged_attention_triton(*args).cpu().float()
        want = paged_attention_ref(q, k, v, tables, ctx, mask).float()
        return float((got - want).abs().max())

    out = {"cases": [error(_inputs(*case, seed=1)) for case in CASES]}
    splits = [_inputs(*case[:3], 1, *case[3:]) for case in SPLIT_CASES]
    min_split, kernel.MIN_SPLIT_CELLS = kernel.MIN_SPLIT_CELLS, kernel.TILE
    try:
        out["splits"] = [error(inputs) for inputs in splits]
        out["num_splits"] = [kernel.num_splits(len(c), k.shape[2], t.shape[1] * k.shape[1])[0]
                             for _, k, _, t, c, _ in splits]
        halves = [torch.float16] + [torch.bfloat16] * (device != "cpu")
        out["half"] = [error(splits[1], dtype) for dtype in halves]
    finally:   # on a GPU this runs in the tests' own process
        kernel.MIN_SPLIT_CELLS = min_split
    return out


_ROOT = Path(__file__).resolve().parents[2]
_IN_INTERPRETER = ("import json; from tests.kernels.test_paged_attention import triton_errors; "
                   "print(json.dumps(triton_errors('cpu')))")


def test_the_kernel_refuses_sizes_it_cannot_vectorize():
    pytest.importorskip("triton")
    from fastdraft.kernels.triton_paged_attention import paged_attention_triton
    q, k, v, tables, ctx, _ = _inputs(4, 1, False)
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        paged_attention_triton(q, k[:, :3], v[:, :3], tables, ctx)


def test_the_split_rule_fills_the_gpu_from_shapes_alone(monkeypatch):
    """Splits come from batch, KV heads and the table's width (never from ctx_lens, on the
    device): about two programs per SM of an H100 / H200 (132), whole tiles, none past the
    table's end."""
    pytest.importorskip("triton")
    from fastdraft.kernels import triton_paged_attention as kernel
    # Qwen2.5-7B decode (4 KV heads): batch 1 gets 32 splits of 128 cells, batch 64 two.
    assert kernel.num_splits(1, 4, 4096) == (32, 128)
    assert kernel.num_splits(64, 4, 4096) == (2, 2048)
    assert kernel.num_splits(1, 4, 512) == (4, 128)
    for batch, kv_heads, cells in [(1, 1, 16), (3, 2, 1000), (8, 8, 130), (1, 4, 1 << 17)]:
        splits, size = kernel.num_splits(batch, kv_heads, cells)
        assert size % kernel.TILE == 0 and 1 <= splits <= kernel.MAX_SPLITS
        assert (splits - 1) * size < cells <= splits * size
    monkeypatch.setattr(kernel, "MIN_SPLIT_CELLS", kernel.TILE)   # as triton_errors runs
    assert kernel.num_splits(4, 2, 320) == (5, 64)   # SPLIT_CASES[0]: its 64 and 128 fill splits


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_the_kernel_replays_in_a_cuda_graph_as_lengths_change():
    """No host sync and no data-sized allocation: one capture serves other lengths."""
    from fastdraft.kernels.triton_paged_attention import paged_attention_triton
    case = SPLIT_CASES[1]
    q, k, v, tables, ctx, mask = (x.cuda() for x in _inputs(*case[:3], 1, *case[3:]))
    paged_attention_triton(q, k, v, tables, ctx, mask)   # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention_triton(q, k, v, tables, ctx, mask)
    for lengths in (ctx.clone(), ctx.flip(0), torch.full_like(ctx, int(ctx.max()))):
        ctx.copy_(lengths)
        graph.replay()
        want = paged_attention_ref(q, k, v, tables, ctx, mask)
        assert torch.allclose(out, want, atol=1e-4), lengths

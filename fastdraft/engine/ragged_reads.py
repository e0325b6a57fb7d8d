"""Reading a paged cache row group by row group (the torch path): attention then reads each
row close to its own length instead of every row to the longest one.

A single gather pads every row's context to the batch's longest: in an RL rollout batch the
rows' lengths spread widely (prompts of different sizes, answers at different points), and the
padded cells cost gather copies and attention work while the mask throws them away. Sorting the
rows by the blocks they read and cutting them into a few chunks, each gathered to its own
longest row, removes most of that padding (on the tiny recipe's rollout the cells read drop to
~60% of the padded ones). Chunks are planned once per forward, on the host, from the forward's
mask: an eager-path speed-up (a captured graph needs one static shape; the Triton kernel
already reads each row's own blocks). Each row's attention is the same computation over the
same cells either way: only how much padding rides along changes."""

from __future__ import annotations

import math

import torch

from fastdraft.models.attn_meta import ReadChunk

MAX_CHUNKS = 4
# A chunk's fixed cost (its SDPA call, gathers and scatter in every layer), in rows x blocks
# read: a split must save more padding than this to pay (measured on the CPU, see docs/).
CHUNK_COST = 48
_LEVELS = 16   # block counts are rounded up to at most this many levels before planning


def plan_reads(mask: torch.Tensor, table: torch.Tensor, block_size: int,
               dtype: torch.dtype) -> tuple[ReadChunk, ...] | None:
    """mask [B, T, ctx_len] bool (query t of row b sees cell s), table [B, max_blocks] ->
    chunks of rows that each read as few padded blocks as the plan allows, or None when one
    gather is as cheap (then attention takes the usual single read)."""
    batch = mask.shape[0]
    if batch < 2:
        return None
    ctx_len = mask.shape[-1]
    seen = mask.any(1)                                                     # [B, ctx_len]
    last = ctx_len - seen.flip(1).int().argmax(1)                          # cells read per row
    blocks = ((last + block_size - 1) // block_size).tolist()
    order = sorted(range(batch), key=blocks.__getitem__)
    sizes = [blocks[r] for r in order]
    cuts = _cuts(sizes)
    if len(cuts) == 1:
        return None
    chunks, start = [], 0
    for end in cuts:
        rows = torch.tensor(order[start:end], device=mask.device)
        width = sizes[end - 1]
        cells = min(width * block_size, ctx_len)
        sees = mask.index_select(0, rows)[:, :, :cells]
        bias = torch.zeros(sees.shape, dtype=dtype, device=mask.device)
        chunks.append(ReadChunk(rows=rows,
                                pages=table.index_select(0, rows)[:, :width].flatten(),
                                ctx_len=cells,
                                bias=bias.masked_fill_(~sees, float("-inf")).unsqueeze(1)))
        start = end
    return tuple(chunks)


def _cuts(sizes: list[int]) -> list[int]:
    """sizes: blocks each row reads, ascending -> the end index of each chunk (the last is
    len(sizes)), minimising sum(rows x widest row) + CHUNK_COST per chunk, at most MAX_CHUNKS.
    A dynamic programme over the distinct (rounded) sizes: a chunk always ends where a size
    level does."""
    step = max(1, math.ceil(sizes[-1] / _LEVELS))
    ends: list[int] = []       # index after the last row of each size level
    widths: list[int] = []     # that level's rounded size
    for i, size in enumerate(sizes):
        level = -(-size // step) * step
        if widths and widths[-1] == level:
            ends[-1] = i + 1
        else:
            widths.append(level)
            ends.append(i + 1)
    levels, inf = len(ends), float("inf")
    # cost[k][j]: the cheapest split of the rows up to level j's end into exactly k + 1 chunks,
    # the last one ending there; link[k][j]: the level where chunk k - 1 ended
    cost = [[ends[j] * widths[j] + CHUNK_COST for j in range(levels)]]
    link = [[-1] * levels]
    for k in range(1, min(MAX_CHUNKS, levels)):
        cost.append([inf] * levels)
        link.append([-1] * levels)
        for j in range(k, levels):
            for i in range(k - 1, j):
                c = cost[k - 1][i] + (ends[j] - ends[i]) * widths[j] + CHUNK_COST
                if c < cost[k][j]:
                    cost[k][j], link[k][j] = c, i
    k = min(range(len(cost)), key=lambda n: cost[n][levels - 1])
    cuts, j = [], levels - 1
    while k >= 0:
        cuts.append(ends[j])
        j, k = link[k][j], k - 1
    return cuts[::-1]

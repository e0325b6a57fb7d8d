"""Chunked reads of a paged cache (engine/ragged_reads.py): the plan is the cheapest split into
at most MAX_CHUNKS, every row is read exactly once and to at least its own last cell, attention
through the chunks equals one padded read, and an engine that reads in chunks completes
exactly as one that does not (and does chunk on a ragged batch)."""

from __future__ import annotations

import itertools

import pytest
import torch

import fastdraft.engine.ragged_reads as ragged
from fastdraft.config.engine import SpecConfig
from fastdraft.engine import RolloutEngine, SamplingParams
from fastdraft.engine.ragged_reads import CHUNK_COST, MAX_CHUNKS, _cuts, plan_reads
from fastdraft.models import KVView, ModelConfig, causal_cache_meta
from fastdraft.models.layers import Attention
from fastdraft.models.rope import RotaryEmbedding


def _cost(sizes: list[int], cuts: list[int]) -> int:
    start, total = 0, 0
    for end in cuts:
        total += (end - start) * sizes[end - 1] + CHUNK_COST
        start = end
    return total


@pytest.mark.parametrize("seed", range(6))
def test_the_plan_is_the_cheapest_split(seed):
    g = torch.Generator().manual_seed(seed)
    sizes = sorted(torch.randint(1, 12, (int(torch.randint(2, 40, (1,), generator=g)),),
                                 generator=g).tolist())
    cuts = _cuts(sizes)
    assert cuts[-1] == len(sizes) and len(cuts) <= MAX_CHUNKS
    # every split between different sizes (fewer than 16 levels: planned exactly)
    bounds = [i for i in range(1, len(sizes)) if sizes[i] != sizes[i - 1]]
    best = min(_cost(sizes, [*c, len(sizes)]) for n in range(MAX_CHUNKS)
               for c in itertools.combinations(bounds, n))
    assert _cost(sizes, cuts) == best


def _ragged_batch(block_size: int = 4):
    lengths = torch.tensor([3, 40, 5, 38, 9, 2, 41, 7] * 6)
    batch, max_blocks, heads, kv_heads, dim = len(lengths), 12, 4, 2, 8
    g = torch.Generator().manual_seed(0)
    table = torch.randperm(batch * max_blocks, generator=g).view(batch, max_blocks)
    pool = torch.randn(2, batch * max_blocks + 1, block_size, kv_heads, dim, generator=g)
    positions = (lengths - 1).unsqueeze(1)                    # one decode token a row
    attn = causal_cache_meta(positions, int(lengths.max()))
    return table, pool, positions, attn, (heads, kv_heads, dim)


def test_every_row_is_read_once_and_to_its_own_end():
    table, _, positions, attn, _ = _ragged_batch()
    chunks = plan_reads(attn.mask, table, 4, torch.float32)
    assert chunks is not None and len(chunks) > 1
    rows = torch.cat([c.rows for c in chunks])
    assert sorted(rows.tolist()) == list(range(table.shape[0]))
    for chunk in chunks:
        assert chunk.ctx_len >= int(positions[chunk.rows].max()) + 1
        assert torch.equal(chunk.pages.view(len(chunk.rows), -1),
                           table[chunk.rows, : chunk.pages.numel() // len(chunk.rows)])
    assert max(c.ctx_len for c in chunks[:-1]) < attn.ctx_len   # the short rows read less


def test_attention_through_chunks_equals_one_padded_read():
    table, pool, positions, attn, (heads, kv_heads, dim) = _ragged_batch()
    cfg = ModelConfig(model_type="llama", vocab_size=32, hidden_size=heads * dim,
                      intermediate_size=16, num_hidden_layers=1, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=dim)
    layer = Attention(cfg, 0).eval()
    x = torch.randn(table.shape[0], 1, heads * dim, generator=torch.Generator().manual_seed(1))
    rope = RotaryEmbedding(dim, 10000.0, None, 64, 64)(positions, x.dtype)
    chunks = plan_reads(attn.mask, table, 4, torch.float32)
    assert chunks is not None
    outs = []
    for read in (None, chunks):
        k, v = pool.clone().unbind(0)
        kv = KVView([k], [v], table=table, write_at=(table.gather(1, positions // 4),
                                                      positions % 4), chunks=read)
        with torch.no_grad():
            outs.append(layer(x, rope, kv, attn.with_bias(x.dtype)))
    assert torch.allclose(outs[0], outs[1], atol=1e-6)


def test_an_engine_reading_in_chunks_completes_as_one_that_does_not(
        tiny_checkpoint, random_drafter, monkeypatch):
    path, _ = tiny_checkpoint
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 60, (int(n),), generator=g).tolist()
               for n in torch.randint(2, 60, (12,), generator=g)]
    params = SamplingParams(temperature=1.0, max_new_tokens=30, seed=3)
    spec = SpecConfig(method="eagle", depth=3, topk=2, tokens_to_verify=6)
    planned = []
    real = ragged.plan_reads

    def counting(*args):
        chunks = real(*args)
        planned.append(0 if chunks is None else len(chunks))
        return chunks
    monkeypatch.setattr("fastdraft.engine.model_runner.plan_reads", counting)
    out = []
    for chunked in (False, True):
        engine = RolloutEngine(path, "cpu", max_batch_size=12, max_seq_len=128,
                               drafter=random_drafter, spec=spec, kv_block_size=4)
        engine.runner.ragged_reads = chunked
        out.append(engine.generate(prompts, params, use_tqdm=False))
    assert max(planned) > 1                     # the ragged batch was read in chunks
    assert [c.token_ids for c in out[0]] == [c.token_ids for c in out[1]]
    logprobs = [torch.tensor([lp for c in o for lp in c.logprobs]) for o in out]
    assert torch.allclose(*logprobs, atol=1e-5)


def test_only_an_eager_uncompiled_paged_engine_reads_in_chunks(tiny_checkpoint):
    path, _ = tiny_checkpoint
    paged = RolloutEngine(path, "cpu", max_batch_size=4, max_seq_len=64, kv_block_size=4)
    assert paged.runner.ragged_reads
    paged.eager_shortcuts = False              # the path captured graphs run
    assert not paged.runner.ragged_reads
    static = RolloutEngine(path, "cpu", max_batch_size=4, max_seq_len=64, kv_block_size=0)
    assert not static.runner.ragged_reads
    compiled = RolloutEngine(path, "cpu", max_batch_size=4, max_seq_len=64, kv_block_size=4,
                             compile=True)
    assert not compiled.runner.ragged_reads

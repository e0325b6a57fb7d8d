"""What one engine step costs, stage by stage, at batch 1: a plain decode step, a draft tree, a
verify pass (with acceptance and KV compaction), the drafter's commit. Each stage runs exactly
as inside `generate` (through the engine's graph pool: replayed CUDA graphs on a GPU, eager on
the CPU), over a request primed with `context_len` tokens of context. Stages are idempotent
for fixed inputs, so each can be repeated in place."""

from __future__ import annotations

from typing import Any

import torch

from fastdraft.bench.common import median_seconds
from fastdraft.engine import RolloutEngine, SamplingParams
from fastdraft.engine.step_io import SamplingMode


def prime(engine: RolloutEngine, context_len: int, token: int = 5) -> None:
    """Prefills one request of context_len tokens into slot 0 (its KV, its drafter state)."""
    engine.generate([[token] * context_len], SamplingParams(greedy=True, max_new_tokens=1,
                                                            ignore_eos=True))


def stage_costs(engine: RolloutEngine, context_len: int = 64, repeats: int = 200,
                mode: SamplingMode = SamplingMode.GREEDY) -> dict[str, float]:
    """Milliseconds per stage at batch 1 and their ratios to a decode step. Speculative
    engines with an on-device drafter also get draft_tree, verify, commit and the whole
    cycle (draft tree + verify + accept + commit)."""
    context_len = min(context_len, engine.max_seq_len - 2)
    prime(engine, context_len)
    io, graphs, spec = engine.io, engine.graphs, engine.spec
    ctx = engine.buckets.context_bucket(context_len + 1 + engine.envelope.tree_cells)
    io.sampling.admit(0, [SamplingParams(greedy=True) if mode is SamplingMode.GREEDY
                          else SamplingParams(temperature=1.0)], [1])
    io.load([5], [context_len], 1)
    decode_ctx = engine.buckets.context_bucket(context_len + 1)  # as a plain step reads it
    stages: dict[str, Any] = {
        "decode": lambda: graphs.run(("decode", 1, decode_ctx, mode, False),
                                     lambda: engine._decode_stage(1, decode_ctx, mode))}
    proposer = engine.proposer
    if spec.enabled and proposer.drafts_on_device:
        width = proposer.draft_width(spec)
        sampled = mode is not SamplingMode.GREEDY
        stages["draft_tree"] = lambda: graphs.run(
            ("draft", 1, ctx, spec.depth, spec.topk, width, mode),
            lambda: proposer.draft(io, 1, ctx, spec, mode))
        stages["verify"] = lambda: graphs.run(
            ("verify", 1, ctx, width, spec.depth, mode, sampled),
            lambda: engine._verify_stage(1, ctx, width, spec.depth, mode, sampled))
        stages["commit"] = lambda: graphs.run(("commit", 1, ctx),
                                              lambda: proposer.commit(io, 1, ctx))

        def cycle() -> None:
            stages["draft_tree"]()
            stages["verify"]()
            stages["commit"]()
            io.read_out(1)
        stages["cycle"] = cycle
    out: dict[str, float] = {}
    with torch.inference_mode():
        for name, fn in stages.items():
            seconds, _ = median_seconds(fn, repeats, warmup=3)
            out[f"{name}_ms"] = seconds * 1e3
    decode = out["decode_ms"]
    for name in stages:
        if name != "decode":
            out[f"{name}_over_decode"] = out[f"{name}_ms"] / decode
    return out

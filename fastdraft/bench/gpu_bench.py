"""`fastdraft bench gpu`: the engine at real model sizes (random weights in a real shape, no
download), side by side in one run:

- decode steps at batch 1/8/64 and context 512/4096, with and without CUDA graphs, against the
  HBM roofline (weight + KV bytes over the bandwidth measured here by a device-to-device copy),
  on the paged KV cache (`decode`: the torch gather; `decode_paged_triton`: the Triton kernel
  reading blocks in place) and on static slots (`decode_static`);
  batch 1 at context 512 also through the whole `generate` call;
- the speculative cycle at batch 1 (draft tree + verify + accept + commit, depth 6, 16 nodes)
  in decode steps, with the full vocabulary and a 32k draft vocabulary, and the speedup it
  gives at accept lengths 3, 5, 7 (accept length / cycle cost); with the full vocabulary also
  with the paged cache read by the Triton kernel (decode and verify steps);
- graph memory and capture time: one shared pool with identical shapes merged across
  speculation strategies vs one pool per strategy;
- `rows`: a row-step's and a drafted token's cost at batch 64 / 256 (bench/row_costs.py): the
  accept length below which length-aware budgets' plain rows are cheaper than trees.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fastdraft.bench.common import device_name, print_table, write_json
from fastdraft.bench.real_shapes import random_drafter, random_policy
from fastdraft.bench.row_costs import row_costs, summary_line
from fastdraft.bench.step_costs import stage_costs
from fastdraft.config.engine import KV_BLOCK_SIZE, SpecConfig
from fastdraft.engine import RolloutEngine, SamplingParams
from fastdraft.engine.envelope import Envelope
from fastdraft.engine.graphs import GraphPool
from fastdraft.engine.model_runner import ModelRunner
from fastdraft.engine.request import make_requests
from fastdraft.engine.scheduler import Scheduler
from fastdraft.engine.spec.eagle import EagleProposer
from fastdraft.engine.step_io import SamplingMode
from fastdraft.errors import FastdraftError

# Strategies a tuner would switch between (depth, topk, tokens_to_verify); the first is the
# cycle measured.
STRATEGIES = ((6, 4, 16), (6, 2, 16), (4, 4, 16), (5, 2, 8), (3, 4, 8))


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuBenchConfig:
    shape: str = "qwen2.5-7b"
    batch_sizes: tuple[int, ...] = (1, 8, 64)
    contexts: tuple[int, ...] = (512, 4096)
    num_steps: int = 32
    repeats: int = 3
    compile: bool = True
    draft_vocab: int = 32768
    device: str = "cuda"
    dtype: torch.dtype = torch.bfloat16
    memory_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    strategies: tuple[tuple[int, int, int], ...] = field(default=STRATEGIES)

    def __post_init__(self) -> None:
        if not str(self.device).startswith("cuda"):
            raise FastdraftError("bench gpu measures CUDA graphs: pass --device cuda on a GPU "
                                 "machine (bench spec / engine run on the CPU)")
        if self.num_steps < 2 or self.repeats < 1:
            raise FastdraftError("num_steps must be >= 2 and repeats >= 1")


def measure_bandwidth(device: str, num_bytes: int = 2 << 30) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(20):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    return 2 * num_bytes * 20 / (time.perf_counter() - start)


def _kv_bytes(engine: RolloutEngine, batch: int, ctx: float) -> float:
    cfg, elem = engine.config, engine.runner.kv_cache.element_size()
    return cfg.num_hidden_layers * 2 * batch * cfg.num_key_value_heads * ctx * cfg.head_dim * elem


def start_decoding(engine: RolloutEngine, batch: int, prompt_len: int, max_new: int
                   ) -> Scheduler:
    """`batch` requests prefilled and ready to decode (greedy, EOS ignored)."""
    params = SamplingParams(greedy=True, max_new_tokens=max_new, ignore_eos=True)
    scheduler = Scheduler(engine.max_batch_size, engine.max_prefill_tokens)
    prompts = [[5 + i % 97] * prompt_len for i in range(batch)]
    for request in make_requests(prompts, params, engine.config.vocab_size, engine.max_seq_len,
                                 engine.eos_token_ids):
        scheduler.add(request)
    while scheduler.waiting:
        engine.step(scheduler)
    return scheduler


def decode_step_seconds(engine: RolloutEngine, scheduler: Scheduler, num_steps: int
                        ) -> tuple[float, float]:
    """(seconds per decode step, mean context) through the engine's own step loop (schedule,
    copy in, replay or eager forward, sample, copy out, postprocess). A few warm-up steps
    first (they capture this shape's graph)."""
    for _ in range(3):
        engine.step(scheduler)
    first = scheduler.running[0].num_tokens
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(num_steps):
        engine.step(scheduler)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / num_steps, first + num_steps / 2


def generate_step_seconds(engine: RolloutEngine, ctx: int, num_steps: int, repeats: int
                          ) -> float:
    """Seconds per generated token through whole `generate` calls at batch 1: the median time
    of a call that generates num_steps + 1 tokens minus that of one that generates 1 (prefill
    and the first token), over num_steps."""
    prompt = [[7] * (ctx - num_steps - 4)]

    def call(n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.generate(prompt, SamplingParams(greedy=True, max_new_tokens=n, ignore_eos=True))
        torch.cuda.synchronize()
        return time.perf_counter() - start

    call(num_steps + 1)  # warm-up and captures
    longs, shorts = [], []
    for _ in range(repeats):
        longs.append(call(num_steps + 1))
        shorts.append(call(1))
    return (statistics.median(longs) - statistics.median(shorts)) / num_steps


def _set_variant(engine: RolloutEngine, graphs: bool, compiled: Any | None) -> None:
    """Switches graphs and torch.compile on one engine (same weights, same KV cache); graphs
    captured under the other variant are dropped."""
    engine.graphs.reset()
    engine.graphs.enabled = graphs
    engine.runner.forward = compiled if compiled is not None else engine.runner.model


def _decode_rows(cfg: GpuBenchConfig, engine: RolloutEngine, bandwidth: float,
                 weight_bytes: int) -> list[dict[str, Any]]:
    """Each (batch, context) is prefilled once; the variants then take turns (round-robin,
    `repeats` rounds) on the same requests, whose contexts grow towards `context`."""
    compiled = engine.runner.forward if cfg.compile else None  # the engine's compiled forward
    variants = {"eager": (False, None), "graphs": (True, None)}
    if compiled is not None:
        variants["compiled_graphs"] = (True, compiled)
    growth = cfg.repeats * len(variants) * (cfg.num_steps + 3)
    rows = []
    for batch in cfg.batch_sizes:
        for ctx in cfg.contexts:
            scheduler = start_decoding(engine, batch, ctx - growth - 2, growth + 8)
            times: dict[str, list[float]] = {name: [] for name in variants}
            rooflines: dict[str, list[float]] = {name: [] for name in variants}
            for _ in range(cfg.repeats):
                for name, (graphs, fn) in variants.items():
                    _set_variant(engine, graphs, fn)
                    seconds, mean_ctx = decode_step_seconds(engine, scheduler, cfg.num_steps)
                    times[name].append(seconds)
                    rooflines[name].append(
                        (weight_bytes + _kv_bytes(engine, batch, mean_ctx)) / bandwidth)
            row: dict[str, Any] = dict(batch_size=batch, context=ctx)
            for name in variants:
                seconds, roofline = statistics.median(times[name]), statistics.median(
                    rooflines[name])
                row[f"{name}_ms"] = seconds * 1e3
                row[f"{name}_tok_s"] = batch / seconds
                row[f"{name}_of_roofline"] = roofline / seconds
            row["roofline_ms"] = statistics.median(rooflines["eager"]) * 1e3
            rows.append(row)
            print_table([row], list(row))
    best = "compiled_graphs" if compiled is not None else "graphs"
    _set_variant(engine, *variants[best])
    return rows


def _generate_row(cfg: GpuBenchConfig, engine: RolloutEngine, bandwidth: float,
                  weight_bytes: int) -> dict[str, Any]:
    ctx = 512
    seconds = generate_step_seconds(engine, ctx, 64, cfg.repeats)
    roofline = (weight_bytes + _kv_bytes(engine, 1, ctx - 36)) / bandwidth
    return dict(batch_size=1, context=ctx, generate_ms_per_token=seconds * 1e3,
                generate_tok_s=1 / seconds, roofline_ms=roofline * 1e3,
                generate_of_roofline=roofline / seconds)


def _spec_engine(cfg: GpuBenchConfig, policy: Any, strategy: tuple[int, int, int],
                 draft_vocab: int | None, max_batch: int, envelope_spec: SpecConfig,
                 paged_attention: str = "gather") -> RolloutEngine:
    depth, topk, ttv = strategy
    envelope = Envelope.for_spec(1024, envelope_spec)
    drafter = random_drafter(policy, "eagle1", envelope.rope_len)
    token_ids = None if draft_vocab is None else torch.arange(draft_vocab)
    proposer = EagleProposer(drafter=drafter, num_slots=max_batch, envelope=envelope,
                             compile=cfg.compile, draft_token_ids=token_ids)
    engine = RolloutEngine.from_model(policy, max_batch_size=max_batch, max_seq_len=1024,
                                      spec=envelope_spec, compile=cfg.compile,
                                      proposer=proposer, share_weights=True,
                                      paged_attention=paged_attention)
    engine.spec = SpecConfig(method="eagle", depth=depth, topk=topk, tokens_to_verify=ttv)
    return engine


def _cycle_rows(cfg: GpuBenchConfig, policy: Any) -> list[dict[str, Any]]:
    strategy = cfg.strategies[0]
    spec = SpecConfig(method="eagle", depth=strategy[0], topk=strategy[1],
                      tokens_to_verify=strategy[2])
    rows = []
    # The paged cache's decode and verify read by the gather, then (full vocabulary) by the
    # Triton kernel in place.
    for vocab, attention in ((None, "gather"), (cfg.draft_vocab, "gather"), (None, "triton")):
        engine = _spec_engine(cfg, policy, strategy, vocab, 1, spec, attention)
        for mode in (SamplingMode.GREEDY, SamplingMode.SAMPLED):
            costs = stage_costs(engine, context_len=512, repeats=50, mode=mode)
            row: dict[str, Any] = dict(draft_vocab=vocab or policy.config.vocab_size,
                                       paged_attention=attention, mode=mode.name.lower(),
                                       **costs)
            for accept_length in (3, 5, 7):
                row[f"speedup_at_{accept_length}"] = accept_length / costs["cycle_over_decode"]
            rows.append(row)
            print_table([row], ["draft_vocab", "paged_attention", "mode", "decode_ms",
                                "cycle_ms", "cycle_over_decode", "speedup_at_5"])
        del engine
        torch.cuda.empty_cache()
    return rows


@torch.inference_mode()
def _capture_all(engine: RolloutEngine, strategies: tuple[tuple[int, int, int], ...],
                 batch_sizes: tuple[int, ...], ctx_len: int) -> None:
    """Captures every stage graph the strategies need at these batch buckets (largest first,
    so later captures fit in the pool the first one grew), in inference mode as `generate`
    runs them."""
    io, proposer, mode = engine.io, engine.proposer, SamplingMode.GREEDY
    for batch in sorted(batch_sizes, reverse=True):
        io.sampling.admit(0, [SamplingParams(greedy=True)] * batch, [0] * batch)
        io.load([5] * batch, [ctx_len // 2] * batch, batch)
        engine.graphs.run(("decode", batch, ctx_len, mode, False),
                          lambda b=batch: engine._decode_stage(b, ctx_len, mode))
        for depth, topk, ttv in strategies:
            spec = SpecConfig(method="eagle", depth=depth, topk=topk, tokens_to_verify=ttv)
            width = proposer.draft_width(spec)
            engine.graphs.run(("draft", batch, ctx_len, depth, topk, width, mode),
                              lambda b=batch, s=spec: proposer.draft(io, b, ctx_len, s, mode))
            engine.graphs.run(("verify", batch, ctx_len, width, depth, mode, False),
                              lambda b=batch, w=width, d=depth: engine._verify_stage(
                                  b, ctx_len, w, d, mode, False))
            engine.graphs.run(("commit", batch, ctx_len),
                              lambda b=batch: proposer.commit(io, b, ctx_len))


def _release_cached() -> None:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _memory_rows(cfg: GpuBenchConfig, policy: Any) -> dict[str, Any]:
    biggest = SpecConfig(method="eagle", depth=max(s[0] for s in cfg.strategies),
                         topk=max(s[1] for s in cfg.strategies),
                         tokens_to_verify=max(s[2] for s in cfg.strategies))
    engine = _spec_engine(cfg, policy, cfg.strategies[0], cfg.draft_vocab,
                          max(cfg.memory_batch_sizes), biggest)
    ctx_len = 512
    # Compile and allocate everything lazy once, eagerly, so neither measurement pays for it.
    engine.graphs.enabled = False
    _capture_all(engine, cfg.strategies, cfg.memory_batch_sizes, ctx_len)
    out: dict[str, Any] = dict(strategies=[list(s) for s in cfg.strategies],
                               batch_sizes=list(cfg.memory_batch_sizes), context=ctx_len)
    # Bucketed: one pool, keys merged across strategies. The allocator's cache is emptied
    # before each measurement, so the growth of reserved memory is the graphs' pool.
    engine.graphs = GraphPool(engine.runner.device)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    _capture_all(engine, cfg.strategies, cfg.memory_batch_sizes, ctx_len)
    _release_cached()  # warm-up leftovers: what stays reserved is the graphs' pool
    out.update(bucketed_bytes=torch.cuda.memory_reserved() - before,
               bucketed_graphs=engine.graphs.stats.num_graphs,
               bucketed_capture_s=engine.graphs.stats.capture_s)
    engine.graphs.reset()
    torch.cuda.empty_cache()
    # One set per strategy: each its own pool, nothing shared.
    pools = []
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    for strategy in cfg.strategies:
        engine.graphs = GraphPool(engine.runner.device)
        _capture_all(engine, (strategy,), cfg.memory_batch_sizes, ctx_len)
        pools.append(engine.graphs)
    _release_cached()
    out.update(per_strategy_bytes=torch.cuda.memory_reserved() - before,
               per_strategy_graphs=sum(p.stats.num_graphs for p in pools),
               per_strategy_capture_s=sum(p.stats.capture_s for p in pools))
    out["bucketed_over_per_strategy"] = out["bucketed_bytes"] / max(out["per_strategy_bytes"], 1)
    print_table([out], ["bucketed_bytes", "per_strategy_bytes", "bucketed_over_per_strategy",
                        "bucketed_graphs", "per_strategy_graphs", "bucketed_capture_s",
                        "per_strategy_capture_s"])
    del pools, engine
    torch.cuda.empty_cache()
    return out


def _row_cost_rows(cfg: GpuBenchConfig, policy: Any, context: int = 1024, width: int = 12,
                   batches: tuple[int, ...] = (64, 256)) -> list[dict[str, Any]]:
    """Unit costs of a split step at real size (eager forwards, as the runner runs them)."""
    spec = SpecConfig(method="eagle", depth=6, topk=3, tokens_to_verify=width)
    runner = ModelRunner(policy, Envelope.for_spec(context + 64, spec), max(batches))
    rows = [row_costs(runner, b, context, width, b // 3, cfg.repeats * 3) for b in batches]
    for row in rows:
        print(summary_line(row))
    del runner
    _release_cached()
    return rows


def run_gpu_bench(cfg: GpuBenchConfig, json_path: str | Path | None = None,
                  parts: tuple[str, ...] = ("decode", "generate", "cycle", "memory")
                  ) -> dict[str, Any]:
    bandwidth = measure_bandwidth(cfg.device)
    print(f"device-to-device copy: {bandwidth / 1e9:.0f} GB/s (read + write)")
    max_ctx = max(cfg.contexts)
    policy = random_policy(cfg.shape, cfg.device, cfg.dtype, max_positions=max_ctx + 64)
    weight_bytes = sum(p.numel() * p.element_size() for p in policy.parameters())
    payload: dict[str, Any] = dict(shape=cfg.shape, device=device_name(cfg.device),
                                   dtype=str(cfg.dtype), torch=torch.__version__,
                                   bandwidth_GBps=bandwidth / 1e9, weight_bytes=weight_bytes,
                                   compile=cfg.compile)
    started = time.perf_counter()

    def done(part: str) -> None:
        print(f"[{part} done at {time.perf_counter() - started:.0f}s]", flush=True)
        if json_path is not None:
            write_json(json_path, payload)

    # The default engine (paged KV, its attention gathering each row's blocks), the paged
    # cache read in place by the Triton kernel, and static slots, side by side.
    for kv, block_size, attention in (("paged", KV_BLOCK_SIZE, "gather"),
                                      ("paged_triton", KV_BLOCK_SIZE, "triton"),
                                      ("static", 0, "gather")):
        if "decode" not in parts and ("generate" not in parts or kv != "paged"):
            continue
        engine = RolloutEngine.from_model(policy, max_batch_size=max(cfg.batch_sizes),
                                          max_seq_len=max_ctx + 8, compile=cfg.compile,
                                          share_weights=True, kv_block_size=block_size,
                                          paged_attention=attention)
        if "generate" in parts and kv == "paged":
            payload["generate"] = _generate_row(cfg, engine, bandwidth, weight_bytes)
            print_table([payload["generate"]], list(payload["generate"]))
            payload["generate_graphs"] = engine.graphs.stats.as_dict()
            done("generate")
        if "decode" in parts:
            payload["decode" if kv == "paged" else f"decode_{kv}"] = _decode_rows(
                cfg, engine, bandwidth, weight_bytes)
            done(f"decode ({kv} KV)")
        del engine
        torch.cuda.empty_cache()
    if "cycle" in parts:
        payload["cycle"] = _cycle_rows(cfg, policy)
        done("cycle")
    if "memory" in parts:
        payload["graph_memory"] = _memory_rows(cfg, policy)
        done("memory")
    if "rows" in parts:
        payload["row_costs"] = _row_cost_rows(cfg, policy)
        done("rows")
    payload["bench_s"] = time.perf_counter() - started
    done("bench")
    return payload

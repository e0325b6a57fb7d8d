"""`fastdraft bench kv`: what the paged KV cache and the prompt sharing save on a recipe's rollout
batch (its prompts x group_size samples, a group's samples together as the RL loop submits
them), what paging costs a decode step, and how many more requests it holds.

Four engines of the recipe's settings roll out the same batch with the same seeds, rounds
interleaved (round 0 warms up):
- `static`: every slot owns a cache region sized for the longest sequence, every row prefills
  its own prompt (the engine before issue 23);
- `static_shared`: static slots, each distinct prompt computed once and its K/V copied to the
  group's rows (engine/prefix_share.py);
- `paged_one_read`: blocks of KV_BLOCK_SIZE cells (engine/paged_kv.py), the group's rows
  holding the prompt's blocks by reference, attention gathering every row to the longest;
- `paged`: the same, attention reading rows in chunks by length (engine/ragged_reads.py, the
  engine's default on the CPU).
Their completions must be token-identical (checked: the bench fails otherwise). Reported:
`prefill_tokens_shared_vs_unshared` (prompt tokens computed, paged / static),
`rollout_time_ratio` (paged / static rollout seconds), the sharing's, the paging's and the
chunked reads' shares of it, the prefill's share of the static rollout, a decode step at batch
64 on each cache (`decode_batch64`: the block-table gather and the per-step block bookkeeping as
a share of the paged step), and `concurrency_ratio` (bench/concurrency.py: requests that fit in
the same KV bytes, paged / static, for --shapes-recipe's shapes and --trace's answer lengths)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from fastdraft.bench.common import write_json
from fastdraft.bench.concurrency import DEFAULT_TRACE, concurrency
from fastdraft.bench.rollout_bench import recipe_batch, recipe_params
from fastdraft.config import load_recipe
from fastdraft.config.engine import KV_BLOCK_SIZE
from fastdraft.engine import RolloutEngine
from fastdraft.engine.envelope import Envelope
from fastdraft.engine.model_runner import ModelRunner
from fastdraft.errors import FastdraftError
from fastdraft.models import CausalLM
from fastdraft.run.inputs import rollout_seq_len
from fastdraft.run.placement import DTYPES

# name: (kv_block_size, prompts shared, paged reads chunked by row length)
ARMS = {"static": (0, False, False), "static_shared": (0, True, False),
        "paged_one_read": (KV_BLOCK_SIZE, True, False), "paged": (KV_BLOCK_SIZE, True, True)}


def run_kv_bench(recipe: Path, overrides: list[str], out_dir: Path,
                 json_path: Path | None = None, cache_dir: Path | None = None,
                 rounds: int = 3, trace: Path | None = None,
                 shapes_recipe: Path = Path("recipes/qwen3-8b-grpo.yaml")) -> dict[str, Any]:
    cfg = load_recipe(recipe, overrides)
    if rounds < 1:
        raise FastdraftError(f"rounds must be >= 1, got {rounds}")
    fits = {"recipe": str(shapes_recipe),
            **concurrency(load_recipe(shapes_recipe, []), trace or DEFAULT_TRACE, KV_BLOCK_SIZE)}
    policy_dir, drafter, prompts = recipe_batch(cfg, cache_dir)
    spec = cfg.rollout.spec
    engines = {}
    for name, (block_size, share, chunked) in ARMS.items():
        engines[name] = RolloutEngine(policy_dir, device=cfg.model.device,
                                      dtype=DTYPES[cfg.model.dtype],
                                      max_batch_size=cfg.rollout.max_batch_size,
                                      max_seq_len=rollout_seq_len(cfg), spec=spec,
                                      drafter=drafter if spec.enabled else None,
                                      kv_block_size=block_size)
        engines[name].share_prompts = share
        if not chunked:   # the engine's own choice otherwise (chunked where it runs eagerly)
            engines[name].runner.ragged_reads = False
    seconds = {name: 0.0 for name in ARMS}
    prefill_s = {name: 0.0 for name in ARMS}
    tokens = {name: [0, 0] for name in ARMS}   # [prompt tokens of every row, computed]
    for round_ in range(rounds + 1):
        params = recipe_params(cfg, cfg.seed * 1_000_003 + round_ * len(prompts))
        answers = {}
        for name, engine in engines.items():
            start = time.perf_counter()
            answers[name] = [c.token_ids for c in engine.generate(prompts, params,
                                                                  use_tqdm=False)]
            elapsed = time.perf_counter() - start
            if round_:
                trace = engine.last_trace
                seconds[name] += elapsed
                prefill_s[name] += _prefill_seconds(trace)
                tokens[name][0] += trace.prefill_tokens
                tokens[name][1] += trace.prefill_computed
        for name in ARMS:
            if answers[name] != answers["static"]:
                raise AssertionError(f"round {round_}: the {name} engine changed a completion")
        print(f"round {round_}/{rounds}" + (" (warm-up)" if not round_ else "") + ": " +
              ", ".join(f"{n} {engines[n].last_trace.time_s:.2f}s" for n in ARMS), flush=True)
    payload = {
        "recipe": str(recipe), "overrides": overrides, "rounds": rounds,
        "num_requests": len(prompts), "group_size": cfg.rollout.group_size,
        "kv_block_size": KV_BLOCK_SIZE, "rollout_s": seconds, "prefill_s": prefill_s,
        "prefill_tokens": {n: {"rows": t[0], "computed": t[1]} for n, t in tokens.items()},
        "prefill_tokens_shared_vs_unshared": tokens["paged"][1] / tokens["static"][1],
        "rollout_time_ratio": seconds["paged"] / seconds["static"],
        "sharing_time_ratio": seconds["static_shared"] / seconds["static"],
        "paging_time_ratio": seconds["paged"] / seconds["static_shared"],
        "chunked_reads_time_ratio": seconds["paged"] / seconds["paged_one_read"],
        "prefill_share_static": prefill_s["static"] / seconds["static"],
        "identical_completions": True,
        "decode_batch64": decode_overhead(engines["static"].model),
        "concurrency": fits, "concurrency_ratio": fits["concurrency_ratio"]}
    out_dir.mkdir(parents=True, exist_ok=True)
    if json_path is not None:
        write_json(json_path, payload)
    return payload


def decode_overhead(model: CausalLM, batch: int = 64, context: int = 256,
                    repeats: int = 20) -> dict[str, float]:
    """One decode step of `batch` rows at `context` cells, on static slots and on a paged cache
    (the rows' blocks gathered in every layer), and the paged cache's bookkeeping of a step
    (growing the rows' tables, trimming them back): ms each and the overhead's share of the
    paged step. context: at most what the model's rotary table covers."""
    context = min(context, model.rope.cos.shape[0] - 2)
    envelope = Envelope(max_seq_len=context + 2)
    runners = {name: ModelRunner(model, envelope, batch, block_size=size)
               for name, size in (("static", 0), ("paged", KV_BLOCK_SIZE))}
    pages = runners["paged"].pages
    assert pages is not None
    for slot in range(batch):
        pages.admit(slot, [0] * context)
    ids = torch.zeros(batch, dtype=torch.long, device=pages.table.device)
    pos = torch.full((batch,), context, device=pages.table.device)

    def bookkeeping() -> None:
        pages.reserve([context + 1] * batch)
        pages.trim({slot: context for slot in range(batch)})
    with torch.inference_mode():
        ms = {f"{name}_ms": _timed(lambda r=runner: r.decode(ids, pos, context + 1), repeats)
              for name, runner in runners.items()}
        ms["bookkeeping_ms"] = _timed(bookkeeping, repeats)
    paged = ms["paged_ms"] + ms["bookkeeping_ms"]
    return {**ms, "batch": batch, "context": context,
            "overhead_share": (paged - ms["static_ms"]) / paged}


def _timed(fn: Any, repeats: int) -> float:
    fn()   # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def _prefill_seconds(trace) -> float:
    """Seconds of the trace's prefill steps (a step lasts until the next one starts)."""
    bounds = [*trace.times[1:], trace.end]
    return sum(stop - start for start, stop, arm in zip(trace.times, bounds, trace.arms)
               if arm == "prefill")


def summary_lines(out: dict[str, Any]) -> list[str]:
    t, s, d = out["prefill_tokens"], out["rollout_s"], out["decode_batch64"]
    c = out["concurrency"]
    return [f"bench kv: {out['num_requests']} requests (groups of {out['group_size']}), "
            f"{out['rounds']} rounds after a warm-up, completions identical",
            f"  prefill tokens computed: paged {t['paged']['computed']} of "
            f"{t['paged']['rows']}, static {t['static']['computed']}: "
            f"prefill_tokens_shared_vs_unshared {out['prefill_tokens_shared_vs_unshared']:.3f}",
            f"  rollout s: paged {s['paged']:.2f}, static shared {s['static_shared']:.2f}, "
            f"static {s['static']:.2f}: rollout_time_ratio {out['rollout_time_ratio']:.3f} "
            f"(sharing {out['sharing_time_ratio']:.3f}, paging {out['paging_time_ratio']:.3f}, of "
            f"which chunked reads {out['chunked_reads_time_ratio']:.3f}; "
            f"prefill was {out['prefill_share_static']:.1%} of the static rollout)",
            f"  decode at batch {d['batch']}, {d['context']} cells: static "
            f"{d['static_ms']:.2f} ms, paged {d['paged_ms']:.2f} ms + bookkeeping "
            f"{d['bookkeeping_ms']:.2f} ms: overhead {d['overhead_share']:.1%} of the step",
            f"  concurrency ({c['recipe']} shapes, answers of {c['trace']}): a static slot "
            f"{c['static_cells_per_request']} cells, a paged request "
            f"{c['paged_cells_per_request']:.0f}: concurrency_ratio {c['concurrency_ratio']:.2f}"]

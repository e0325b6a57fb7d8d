"""`fastdraft bench spec`: plain decoding vs EAGLE vs suffix speculation on the same policy and
prompts, greedy and sampled, at several batch sizes — measured side by side in one run — plus the
unit costs that bound the speedup (one verify pass and one draft step vs one decode step).

Every row rolls out the same prompts, `batch_size` at a time (batch 1 = one after another); the
methods of a row are timed in turn, repeat by repeat, so machine drift hits them alike. The
suffix rows first roll the prompts out once at the same settings (the previous RL step's
rollouts of the same prompts), then measure. Speculative rows also count their verify steps
against the floor their tree depth allows (`min_verify_steps`): the gap is all a better drafter
could still win at this depth."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from fastdraft.bench.common import device_name, interleaved_medians, print_table, write_json
from fastdraft.bench.step_costs import stage_costs
from fastdraft.config.engine import SpecConfig
from fastdraft.engine import RolloutEngine, SamplingParams
from fastdraft.engine.spec.stats import SpecStats
from fastdraft.errors import FastdraftError

METHODS = ("none", "eagle", "suffix")


@dataclass(frozen=True, kw_only=True, slots=True)
class SpecBenchConfig:
    model_dir: Path
    drafter_dir: Path
    prompts: list[list[int]]
    batch_sizes: tuple[int, ...] = (1, 4, 16)
    temperatures: tuple[float, ...] = (0.0, 1.0)
    methods: tuple[str, ...] = METHODS
    depth: int = 6
    topk: int = 3
    tokens_to_verify: int = 12
    max_new_tokens: int = 160
    repeats: int = 3
    compile: bool = False  # torch.compile the policy steps (and the drafter step) of every method
    device: str = "cpu"
    dtype: torch.dtype | None = None  # None: the engine's default (float32 on CPU, bf16 on CUDA)

    def __post_init__(self) -> None:
        unknown = set(self.methods) - set(METHODS)
        if unknown:
            raise FastdraftError(f"unknown methods {sorted(unknown)}; choose from {METHODS}")
        if not self.prompts:
            raise FastdraftError("need at least one prompt")
        if self.repeats < 1:
            raise FastdraftError("repeats must be >= 1")


def _engine(cfg: SpecBenchConfig, method: str, max_batch: int) -> RolloutEngine:
    spec = SpecConfig(method=method, depth=cfg.depth, topk=cfg.topk,
                      tokens_to_verify=cfg.tokens_to_verify)
    max_len = max(map(len, cfg.prompts)) + cfg.max_new_tokens + 1
    return RolloutEngine(cfg.model_dir, device=cfg.device, dtype=cfg.dtype,
                         max_batch_size=max_batch, max_seq_len=max_len, spec=spec,
                         drafter=cfg.drafter_dir if method == "eagle" else None,
                         compile=cfg.compile)


def run_spec_bench(cfg: SpecBenchConfig, json_path: str | Path | None = None) -> dict[str, Any]:
    engines = {m: _engine(cfg, m, max(cfg.batch_sizes)) for m in cfg.methods}
    rows = []
    for temperature in cfg.temperatures:
        params = SamplingParams(temperature=temperature, seed=0,
                                max_new_tokens=cfg.max_new_tokens)
        for bs in cfg.batch_sizes:
            chunks = [cfg.prompts[i: i + bs] for i in range(0, len(cfg.prompts), bs)]
            if "suffix" in engines:  # earlier rollouts of the same prompts (the previous RL
                # step), from other seeds than the measured ones
                _roll_out(engines["suffix"], chunks,
                          replace(params, seed=params.seed + len(cfg.prompts)))
                engines["suffix"].advance_step()
            timed = interleaved_medians(
                {m: (lambda e=e, c=chunks, sp=params: _roll_out(e, c, sp))
                 for m, e in engines.items()}, cfg.repeats, warmup=2 if cfg.compile else 1)
            results = {}
            for method, (seconds, (outs, stats)) in timed.items():
                num_tokens = sum(len(c.token_ids) for c in outs)
                results[method] = (num_tokens / seconds, outs, stats)
            base_tps, base_outs, _ = results.get("none", (None, None, None))
            for method, (tps, outs, stats) in results.items():
                match = None
                if temperature == 0.0 and base_outs is not None:
                    match = [c.token_ids for c in outs] == [c.token_ids for c in base_outs]
                is_spec = method != "none"
                rows.append(dict(method=method, batch_size=bs, temperature=temperature,
                                 tokens_per_s=tps, accept_length=stats.accept_length,
                                 speedup_vs_none=tps / base_tps if base_tps else None,
                                 outputs_match=match,
                                 verify_steps=stats.num_verify_steps if is_spec else None,
                                 min_verify_steps=min_verify_steps(
                                     [len(c.token_ids) for c in outs], cfg.depth)
                                 if is_spec else None))
    print_table(rows, ["method", "batch_size", "temperature", "tokens_per_s", "accept_length",
                       "speedup_vs_none", "outputs_match", "verify_steps", "min_verify_steps"])
    costs = unit_costs(engines["eagle"]) if "eagle" in engines else {}
    for name, value in costs.items():
        print(f"{name}: {value:.3f}")
    payload = dict(rows=rows, unit_costs=costs,
                   spec=dict(depth=cfg.depth, topk=cfg.topk, tokens_to_verify=cfg.tokens_to_verify),
                   compile=cfg.compile, device=device_name(cfg.device),
                   dtype=str(next(engines[cfg.methods[0]].model.parameters()).dtype),
                   model_dir=str(cfg.model_dir), drafter_dir=str(cfg.drafter_dir),
                   repeats=cfg.repeats, torch=torch.__version__,
                   threads=torch.get_num_threads())
    if json_path is not None:
        write_json(json_path, payload)
    return payload


def _roll_out(engine: RolloutEngine, chunks: list[list[list[int]]], params: SamplingParams
              ) -> tuple[list, SpecStats]:
    """All chunks one after another -> (completions, spec stats over all of them). Request j
    of a generate call samples from seed + j, so each chunk starts its seed at its first prompt's
    index: prompt i always samples from seed i, whatever the batch size (with one seed for every
    chunk, batch-1 rows would roll out every prompt with the same random stream)."""
    outs, stats, start = [], SpecStats(), 0
    for chunk in chunks:
        outs += engine.generate(chunk, replace(params, seed=params.seed + start))
        stats.merge(engine.last_stats)
        start += len(chunk)
    return outs, stats


def min_verify_steps(completion_lens: list[int], depth: int) -> int:
    """The fewest verify steps that could produce these completions with trees `depth` deep:
    prefill gives each answer its first token and a step at most depth + 1 (the accepted path
    plus the bonus token). verify_steps / min_verify_steps shows what a perfect drafter would
    still gain at this depth; short answers can sit near the floor with any drafter."""
    return sum(-(-(n - 1) // (depth + 1)) for n in completion_lens if n > 1)


def unit_costs(engine: RolloutEngine, context_len: int = 64, repeats: int = 200
               ) -> dict[str, float]:
    """Batch-1 costs of the EAGLE engine's stages relative to one plain decode step, at
    `context_len` tokens of context (bench/step_costs.py): a draft tree, a verify pass (with
    acceptance and KV compaction), the drafter's commit, and the whole cycle. Each stage is
    measured back to back, warm in cache."""
    return stage_costs(engine, context_len, repeats)

"""`fastdraft bench kv`: what the KV cache's prompt sharing saves on a recipe's rollout batch
(its prompts x group_size samples, a group's samples together as the RL loop submits them).

Two engines of the recipe's settings roll out the same batch with the same seeds, rounds
interleaved (round 0 warms up): `shared` prefills each distinct prompt of a prefill batch once
and copies its K/V to the group's rows (engine/prefix_share.py), `unshared` prefills every row.
Their completions must be token-identical (checked: the bench fails otherwise). Reported:
`prefill_tokens_shared_vs_unshared` (prompt tokens computed), `rollout_time_ratio` (shared /
unshared rollout seconds), and the prefill's share of the unshared rollout steps' time.

Paging (engine/kv_blocks.py, kernels/) is not used by the engine yet: the figures that need it
(paged vs static rollout time, concurrency in the same KV bytes, block-table overhead) are not
measured here."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fastdraft.bench.common import write_json
from fastdraft.bench.rollout_bench import recipe_batch, recipe_params
from fastdraft.config import load_recipe
from fastdraft.engine import RolloutEngine
from fastdraft.rl.run import DTYPES
from fastdraft.rl.run_inputs import rollout_seq_len

ARMS = ("unshared", "shared")


def run_kv_bench(recipe: Path, overrides: list[str], out_dir: Path,
                 json_path: Path | None = None, cache_dir: Path | None = None,
                 rounds: int = 3) -> dict[str, Any]:
    cfg = load_recipe(recipe, overrides)
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    policy_dir, drafter, prompts = recipe_batch(cfg, cache_dir)
    spec = cfg.rollout.spec
    engines = {}
    for name in ARMS:
        engines[name] = RolloutEngine(policy_dir, device=cfg.model.device,
                                      dtype=DTYPES[cfg.model.dtype],
                                      max_batch_size=cfg.rollout.max_batch_size,
                                      max_seq_len=rollout_seq_len(cfg), spec=spec,
                                      drafter=drafter if spec.enabled else None)
        engines[name].share_prompts = name == "shared"
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
        if answers["shared"] != answers["unshared"]:
            raise AssertionError(f"round {round_}: the shared prefill changed a completion")
        print(f"round {round_}/{rounds}" + (" (warm-up)" if not round_ else "") + ": " +
              ", ".join(f"{n} {engines[n].last_trace.time_s:.2f}s" for n in ARMS), flush=True)
    payload = {
        "recipe": str(recipe), "overrides": overrides, "rounds": rounds,
        "num_requests": len(prompts), "group_size": cfg.rollout.group_size,
        "rollout_s": seconds, "prefill_s": prefill_s,
        "prefill_tokens": {n: {"rows": t[0], "computed": t[1]} for n, t in tokens.items()},
        "prefill_tokens_shared_vs_unshared": tokens["shared"][1] / tokens["unshared"][1],
        "rollout_time_ratio": seconds["shared"] / seconds["unshared"],
        "prefill_share_unshared": prefill_s["unshared"] / seconds["unshared"],
        "identical_completions": True,
        "not_measured": ["paged vs static rollout time", "concurrency_ratio",
                         "block-table overhead"]}
    out_dir.mkdir(parents=True, exist_ok=True)
    if json_path is not None:
        write_json(json_path, payload)
    return payload


def _prefill_seconds(trace) -> float:
    """Seconds of the trace's prefill steps (a step lasts until the next one starts)."""
    bounds = [*trace.times[1:], trace.end]
    return sum(stop - start for start, stop, arm in zip(trace.times, bounds, trace.arms)
               if arm == "prefill")


def summary_lines(out: dict[str, Any]) -> list[str]:
    t = out["prefill_tokens"]
    return [f"bench kv: {out['num_requests']} requests (groups of {out['group_size']}), "
            f"{out['rounds']} rounds after a warm-up, completions identical",
            f"  prefill tokens computed: shared {t['shared']['computed']} of "
            f"{t['shared']['rows']}, unshared {t['unshared']['computed']}: "
            f"prefill_tokens_shared_vs_unshared {out['prefill_tokens_shared_vs_unshared']:.3f}",
            f"  rollout s: shared {out['rollout_s']['shared']:.2f}, unshared "
            f"{out['rollout_s']['unshared']:.2f}: rollout_time_ratio "
            f"{out['rollout_time_ratio']:.3f} (prefill was {out['prefill_share_unshared']:.1%} "
            "of the unshared rollout)",
            "  not measured (the engine's cache is not paged yet): "
            + ", ".join(out["not_measured"])]

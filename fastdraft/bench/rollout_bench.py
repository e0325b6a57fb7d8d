"""`fastdraft bench rollout`: one RL rollout batch (the recipe's prompts x group_size samples,
its temperature and answer budget: a long-tailed batch that shrinks to a tail) served with no
speculation, with each static tree of the tuner's arm set, and adaptively (the BEG-MAB tuner
picking an arm per step), side by side.

Each round rolls the same prompts out with every contender in turn, with the same seeds (a new
seed per round, as an RL step draws); round 0 warms up and is not counted. The adaptive engine
keeps its tuner across rounds, as it does across RL steps. Reported: total rollout seconds per
contender, `adaptive_vs_none`, `adaptive_vs_best_static`, the share of the plain rollout spent
in its tail (fewer than half the requests running), and a bound: `oracle_s`, the time if every
step had run at the best rate any contender reached at that number of running requests (steps
grouped by powers of two), which no per-step choice among these arms can beat by much.
With `rollout.budget.enabled=true` the adaptive engine also uses length-aware budgets (the
answer lengths of earlier rounds are its history, as earlier RL steps are in a run), and two
more contenders measure them on / off: the tuner without budgets, and the recipe's static tree
with them (`budget_on_vs_off`, `static_budget_on_vs_off`).
"""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from fastdraft.bench.common import write_json
from fastdraft.bench.row_costs import row_costs
from fastdraft.bench.row_costs import summary_line as row_summary
from fastdraft.config import RunConfig, load_recipe
from fastdraft.config.engine import OFF, SpecConfig, arm_name
from fastdraft.data.prompts import PromptSource
from fastdraft.engine import RolloutEngine, SamplingParams
from fastdraft.engine.trace import RolloutTrace
from fastdraft.errors import FastdraftError
from fastdraft.run.inputs import resolve_drafter, resolve_policy, rollout_seq_len
from fastdraft.run.placement import DTYPES


def run_rollout_bench(recipe: Path, overrides: list[str], out_dir: Path,
                      json_path: Path | None = None, cache_dir: Path | None = None,
                      rounds: int = 3) -> dict[str, Any]:
    cfg = load_recipe(recipe, overrides)
    spec = cfg.rollout.spec
    if not spec.enabled:
        raise FastdraftError(f"{recipe}: rollout.spec.method is none; the bench compares "
                             "speculative arms, set one (e.g. rollout.spec.method=eagle)")
    if rounds < 1:
        raise FastdraftError(f"rounds must be >= 1, got {rounds}")
    policy_dir, drafter, prompts = recipe_batch(cfg, cache_dir)
    max_seq_len = rollout_seq_len(cfg)
    tuner = cfg.rollout.tuner.build(spec, cfg.seed, cfg.rollout.max_batch_size)
    static = {arm_name(a): a for a in tuner.arms if a.enabled}
    budget = cfg.rollout.budget.build() if cfg.rollout.budget.enabled else None
    contenders: dict[str, tuple[SpecConfig, Any, Any]] = {
        "none": (OFF, None, None), **{name: (arm, None, None) for name, arm in static.items()},
        "adaptive": (spec, tuner, budget)}
    if budget is not None:   # budgets on / off, side by side
        contenders[BUDGET_OFF] = (spec, tuner, None)
        contenders[f"{arm_name(spec)}+budget"] = (spec, None, budget)
    engines = {name: RolloutEngine(policy_dir, device=cfg.model.device,
                                   dtype=DTYPES[cfg.model.dtype],
                                   max_batch_size=cfg.rollout.max_batch_size,
                                   max_seq_len=max_seq_len, spec=arm,
                                   drafter=drafter if arm.enabled else None, tuner=tuner_cfg,
                                   budget=budget_cfg)
               for name, (arm, tuner_cfg, budget_cfg) in contenders.items()}
    times: dict[str, list[float]] = defaultdict(list)
    traces: dict[str, list[RolloutTrace]] = defaultdict(list)
    accepts: dict[str, list[float]] = defaultdict(list)
    for round_ in range(rounds + 1):
        params = recipe_params(cfg, cfg.seed * 1_000_003 + round_ * len(prompts))
        for name, engine in engines.items():
            start = time.perf_counter()
            engine.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            engine.advance_step()
            if round_ == 0:
                continue
            times[name].append(elapsed)
            traces[name].append(engine.last_trace)
            accepts[name].append(engine.last_stats.accept_length)
        print(f"round {round_}/{rounds}" + (" (warm-up)" if round_ == 0 else "") + ": " +
              ", ".join(f"{n} {engines[n].last_trace.time_s:.2f}s" for n in engines), flush=True)
    total = {name: sum(t) for name, t in times.items()}
    best = min(static, key=lambda n: total[n])
    budgeted = f"{arm_name(spec)}+budget"
    none_traces = traces["none"]
    payload: dict[str, Any] = {
        "recipe": str(recipe), "overrides": overrides, "rounds": rounds,
        "num_requests": len(prompts), "group_size": cfg.rollout.group_size,
        "temperature": cfg.rollout.temperature,
        "none_s": total["none"], "best_static_s": total[best], "best_static_name": best,
        "adaptive_s": total["adaptive"],
        "adaptive_vs_none": total["adaptive"] / total["none"],
        "adaptive_vs_best_static": total["adaptive"] / total[best],
        "best_static_vs_none": total[best] / total["none"],
        "tail_fraction_of_time": sum(t.tail_time_s() for t in none_traces)
        / max(sum(t.time_s for t in none_traces), 1e-9),
        "oracle_s": oracle_seconds(traces),
        "rates_by_running": rates_by_running(traces),
        "adaptive_arms_by_running": arms_by_running(traces["adaptive"]),
        "contenders": {name: {"time_s": total[name], "round_times_s": times[name],
                              "accept_length": sum(accepts[name]) / len(accepts[name]),
                              "sd_fraction": sum(t.sd_fraction for t in traces[name])
                              / len(traces[name]),
                              "drafting_row_fraction": sum(t.drafting_row_fraction
                                                           for t in traces[name])
                              / len(traces[name])} for name in engines},
        "tuner_median_rewards": engines["adaptive"].tuner.median_rewards()
        if engines["adaptive"].tuner else {},
        "tuner": [{"min_batch": b.min_batch, "arms": [arm_name(a) for a in b.arms]}
                  for b in tuner.buckets]}
    payload["oracle_vs_none"] = payload["oracle_s"] / total["none"]
    if budget is not None:
        payload["budget"] = {"window": budget.window, "margin": budget.margin}
        payload["row_costs"] = _row_costs(engines["adaptive"], prompts,
                                          cfg.rollout.max_new_tokens,
                                          payload["contenders"]["adaptive"])
        payload["budget_on_vs_off"] = total["adaptive"] / total[BUDGET_OFF]
        payload["static_budget_on_vs_off"] = (total[budgeted] / total[arm_name(spec)]
                                              if arm_name(spec) in total else None)
    out_dir.mkdir(parents=True, exist_ok=True)
    payload["plot"] = str(_plot(traces, best, out_dir / "rollout_bench.png"))
    if json_path is not None:
        write_json(json_path, payload)
    return payload


BUDGET_OFF = "adaptive_no_budget"


def recipe_batch(cfg: RunConfig, cache_dir: Path | None
                 ) -> tuple[Path, Path | None, list[list[int]]]:
    """(policy dir, drafter dir, the first RL step's prompts x group_size, groups together) of
    a recipe, as its run would roll them out."""
    from transformers import AutoTokenizer
    policy_dir = resolve_policy(cfg, cache_dir)
    source = PromptSource(cfg.data, AutoTokenizer.from_pretrained(policy_dir),
                          rollout_seq_len(cfg) - cfg.rollout.max_new_tokens)
    prompts = [item.ids for item in source.batch(0, cfg.rollout.prompts_per_step)
               for _ in range(cfg.rollout.group_size)]
    return policy_dir, resolve_drafter(cfg, policy_dir), prompts


def recipe_params(cfg: RunConfig, seed: int) -> SamplingParams:
    """The recipe's rollout sampling, with `seed`."""
    r = cfg.rollout
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                          max_new_tokens=r.max_new_tokens, seed=seed)


def _row_costs(engine: RolloutEngine, prompts: list[list[int]], max_new_tokens: int,
               adaptive: dict[str, Any]) -> dict[str, Any]:
    """Why budgets pay or not here: the unit costs of this policy's forwards at the batch's
    size, at a mid-rollout context, with the drafting share the budgets had."""
    batch = min(len(prompts), engine.max_batch_size)
    width = engine.proposer.draft_width(engine.spec)
    mean_prompt = sum(map(len, prompts)) // len(prompts)
    context = min(mean_prompt + max_new_tokens // 4, engine.envelope.cache_len - width - 3)
    tree_rows = min(max(round(batch * adaptive["drafting_row_fraction"]), 1), batch - 1)
    return row_costs(engine.runner, batch, context, width, tree_rows)


def _by_running(traces: dict[str, list[RolloutTrace]]
                ) -> tuple[dict[str, dict[int, list[float]]], float]:
    """Per contender and group of running requests (g: 2**(g-1) .. 2**g - 1), [tokens,
    seconds] of its decoding steps; and the plain rollouts' prefill seconds."""
    sums: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0., 0.]))
    prefill_s = 0.0
    for name, runs in traces.items():
        for trace in runs:
            ends = [*trace.times[1:], trace.end]
            for start, end, active, arm, n in zip(trace.times, ends, trace.active, trace.arms,
                                                  trace.tokens):
                if arm == "prefill":
                    prefill_s += (end - start) if name == "none" else 0.0
                    continue
                cell = sums[name][active.bit_length()]
                cell[0] += n
                cell[1] += end - start
    return sums, prefill_s


def rates_by_running(traces: dict[str, list[RolloutTrace]]) -> dict[str, dict[str, float]]:
    """{'lo-hi' running requests: {contender: tokens per second}}: where speculation pays."""
    sums, _ = _by_running(traces)
    groups = sorted({g for cells in sums.values() for g in cells})
    return {f"{2 ** (g - 1)}-{2 ** g - 1}": {name: round(cells[g][0] / cells[g][1], 1)
                                             for name, cells in sums.items() if cells[g][1] > 0}
            for g in groups}


def oracle_seconds(traces: dict[str, list[RolloutTrace]]) -> float:
    """Seconds of the plain rollouts' decoding steps if each ran at the best tokens-per-second
    any contender measured at that many running requests (powers-of-two groups), plus the
    prefill steps as plain decoding spent them."""
    sums, prefill_s = _by_running(traces)
    plain = sums["none"]
    best_rate = {g: max(c[g][0] / c[g][1] for c in sums.values() if c[g][1] > 0) for g in plain}
    return prefill_s + sum(plain[g][0] / best_rate[g] for g in plain)


def arms_by_running(traces: list[RolloutTrace]) -> dict[str, dict[str, int]]:
    """{'lo-hi' running requests: {arm: steps}} of the adaptive rollouts."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for trace in traces:
        for active, arm in zip(trace.active, trace.arms):
            if arm != "prefill":
                g = active.bit_length()
                out[f"{2 ** (g - 1)}-{2 ** g - 1}"][arm] += 1
    return {k: dict(v) for k, v in out.items()}


def _plot(traces: dict[str, list[RolloutTrace]], best: str, out: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    for name in ("none", best, "adaptive"):
        seconds, running = traces[name][-1].running_over_time()
        left.step(seconds, running, where="post", label=name)
    left.set(xlabel="seconds into the rollout (last round)", ylabel="running requests",
             title="running requests over time")
    left.legend()
    adaptive = traces["adaptive"][-1]
    seconds, running = adaptive.running_over_time()
    names = sorted({a for a in adaptive.arms if a != "prefill"}, key=lambda a: (a != "off", a))
    for i, arm in enumerate(names):
        xs = [s for s, a in zip(seconds, adaptive.arms) if a == arm]
        right.scatter(xs, [i] * len(xs), s=6, label=arm)
    right.set_yticks(range(len(names)), names)
    twin = right.twinx()
    twin.step(seconds, running, where="post", color="grey", alpha=0.4)
    twin.set_ylabel("running requests")
    right.set(xlabel="seconds into the rollout (last round)", title="arm chosen per step")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def summary_lines(out: dict[str, Any]) -> list[str]:
    lines = [f"{out['num_requests']} requests (groups of {out['group_size']}, T="
             f"{out['temperature']}), {out['rounds']} rounds after a warm-up:"]
    for name, row in out["contenders"].items():
        lines.append(f"  {name:>18}: {row['time_s']:.2f}s  accept length "
                     f"{row['accept_length']:.2f}  speculated on {row['sd_fraction']:.0%} of steps"
                     f", {row['drafting_row_fraction']:.0%} of rows")
    lines += [f"adaptive_vs_none {out['adaptive_vs_none']:.3f}; adaptive_vs_best_static "
              f"{out['adaptive_vs_best_static']:.3f} (best static {out['best_static_name']}: "
              f"{out['best_static_vs_none']:.3f} of none)",
              f"bound: per-bucket oracle {out['oracle_s']:.2f}s = {out['oracle_vs_none']:.3f} of "
              f"none; the tail (< half running) is {out['tail_fraction_of_time']:.0%} of the plain "
              "rollout", f"plot: {out['plot']}"]
    if "budget_on_vs_off" in out:
        static = out["static_budget_on_vs_off"]
        lines.append(f"length-aware budgets on / off: adaptive {out['budget_on_vs_off']:.3f}"
                     + ("" if static is None else f", static tree {static:.3f}"))
        lines.append("unit costs: " + row_summary(out["row_costs"]))
    return lines

"""A discrete-event simulator of one GRPO step on W rollout workers, to see what speculation,
spot training of the drafter and tail consolidation buy at cluster scale before renting the
cluster. A step is a rollout (whole groups dispatched to workers, each running one engine with
continuous batching), the actor's update and the weight push. The rollout ends with its slowest
worker, so the long tail of answer lengths leaves the others idle; the modes differ in what that
idle time costs and whether it is used:

- plain: one token a row an engine step.
- spec_fixed: speculation (`accept_length` tokens a row a verify step) with a drafter trained
  once, whose acceptance decays with its staleness (the step index).
- spec_spot: a worker done with its requests trains the drafter until the rollout ends; enough
  idle worker-seconds (`train_s_per_refresh`) refresh it for the next step (staleness 0).
- spec_consolidated: spec_spot, and a worker whose running rows fall below `consolidate_below`
  hands its requests to the generating worker with the most predicted work left (re-prefilling
  prompt and generated tokens there) and trains instead.

The event loop itself is in rollout_events.py, answer lengths in workload.py, the cost model in
unit_costs.py, and dispatch is the RolloutPool's own (dispatch.py); this module runs modes and
steps and reports. Pure Python, no torch and no ray, so a projection runs on a laptop."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from fastdraft.cluster.rollout_events import Rollout, RolloutSetup
from fastdraft.cluster.unit_costs import UnitCosts
from fastdraft.cluster.workload import StepShape, load_shapes, long_tail_lengths, save_shapes
from fastdraft.config.sections.cluster import DISPATCH
from fastdraft.errors import FastdraftError
from fastdraft.observability.timeline import Span

# Re-exported: the simulator's whole API from one import.
__all__ = ["DISPATCH", "MODES", "SimConfig", "StepResult", "StepShape", "UnitCosts", "WorkerSpan",
           "load_shapes", "long_tail_lengths", "projections", "save_shapes",
           "simulate_run", "simulate_step", "summarize", "timeline_spans"]

MODES = ("plain", "spec_fixed", "spec_spot", "spec_consolidated")
# The modes whose idle workers train the drafter.
_TRAINING_MODES = ("spec_spot", "spec_consolidated")
# Illustrative accept lengths of an EAGLE-style drafter by staleness (RL steps since it was
# trained): the policy drifts away from what the drafter learned. Not measured; pass a table
# measured on your run (e.g. from the tuner's accept-length metric) to projections instead.
DEFAULT_ACCEPT = {0: 3.2, 1: 2.9, 2: 2.7, 4: 2.4, 8: 2.0, 16: 1.6}
# Accept length by staleness: a function, or a {staleness: accept length} table.
AcceptTable = Callable[[int], float] | dict[int, float]


@dataclass(frozen=True)
class SimConfig:
    """workers: engine replicas. max_batch: rows an engine runs at once (the rest queue).
    dispatch: balance | concentrate | round_robin (fastdraft/cluster/dispatch.py).
    consolidate_below: the row count under which spec_consolidated hands a worker's tail off
    (required > 0 for that mode). train_s_per_refresh: idle worker-seconds a drafter refresh
    needs."""

    workers: int
    max_batch: int = 64
    dispatch: str = "balance"
    consolidate_below: int = 0
    train_s_per_refresh: float = 0.0

    def __post_init__(self) -> None:
        for name in ("workers", "max_batch"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise FastdraftError(f"SimConfig.{name} must be an integer >= 1, got {value!r}")
        if self.dispatch not in DISPATCH:
            raise FastdraftError(f"SimConfig.dispatch must be one of {DISPATCH}, got "
                                 f"{self.dispatch!r}")
        if not (isinstance(self.consolidate_below, int) and self.consolidate_below >= 0):
            raise FastdraftError(f"SimConfig.consolidate_below must be an integer >= 0, got "
                                 f"{self.consolidate_below!r}")
        if not (math.isfinite(self.train_s_per_refresh) and self.train_s_per_refresh >= 0):
            raise FastdraftError(f"SimConfig.train_s_per_refresh must be finite and >= 0, got "
                                 f"{self.train_s_per_refresh!r}")


@dataclass
class WorkerSpan:
    """Worker `worker` in `state` (generate | idle | train) from start_s to end_s, seconds since
    the rollout began."""
    worker: int
    state: str
    start_s: float
    end_s: float


@dataclass
class StepResult:
    """One step in one mode. step_s = rollout_s + update_s + push_s. idle_fraction: idle or
    training worker-seconds over workers * rollout_s. train_s: drafter training seconds on
    idle workers (spot modes). migrated: requests handed off. staleness: the drafter's at this
    step; refreshed: whether this step's training refreshed it for the next."""
    mode: str
    step_s: float
    rollout_s: float
    idle_fraction: float
    train_s: float
    spans: list[WorkerSpan]
    accept_length: float
    migrated: int
    staleness: int = 0
    refreshed: bool = False


def simulate_step(shape: StepShape, costs: UnitCosts, cfg: SimConfig, mode: str,
                  accept_length: float = 1.0) -> StepResult:
    """One RL step in `mode` (MODES) at `accept_length` tokens a row a verify step (>= 1; plain
    decoding gains one token a step and does not use it)."""
    if mode not in MODES:
        raise FastdraftError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "spec_consolidated" and cfg.consolidate_below <= 0:
        raise FastdraftError("mode spec_consolidated needs SimConfig.consolidate_below > 0 (the "
                             "row count under which a worker hands its tail off)")
    if not (isinstance(accept_length, int | float) and math.isfinite(accept_length)
            and accept_length >= 1):
        raise FastdraftError("accept_length must be finite and >= 1 (a verify step commits at "
                             f"least one token), got {accept_length!r}")
    accept = 1.0 if mode == "plain" else float(accept_length)
    setup = RolloutSetup(workers=cfg.workers, max_batch=cfg.max_batch, dispatch=cfg.dispatch,
                         speculative=mode != "plain", accept=accept,
                         consolidate_below=cfg.consolidate_below
                         if mode == "spec_consolidated" else 0)
    outcome = Rollout(shape, costs, setup).run()
    return _result(mode, outcome.done_s, outcome.migrated, accept, costs)


def _result(mode: str, done_s: list[float], migrated: int, accept: float,
            costs: UnitCosts) -> StepResult:
    """Spans from each worker's finish time: generating until then, idle (or training, in the
    spot modes) until the slowest worker finishes."""
    rollout_s = max(done_s)
    rest = "train" if mode in _TRAINING_MODES else "idle"
    spans = []
    for worker, end_s in enumerate(done_s):
        if end_s > 0:
            spans.append(WorkerSpan(worker, "generate", 0.0, end_s))
        if end_s < rollout_s:
            spans.append(WorkerSpan(worker, rest, end_s, rollout_s))
    unused = sum(s.end_s - s.start_s for s in spans if s.state != "generate")
    return StepResult(
        mode=mode, step_s=rollout_s + costs.update_s + costs.push_s, rollout_s=rollout_s,
        idle_fraction=unused / (len(done_s) * rollout_s) if rollout_s > 0 else 0.0,
        train_s=unused if rest == "train" else 0.0, spans=spans, accept_length=accept,
        migrated=migrated)


def simulate_run(shapes: list[StepShape], costs: UnitCosts, cfg: SimConfig,
                 accept_by_staleness: AcceptTable | None,
                 modes: Iterable[str] = MODES) -> dict[str, list[StepResult]]:
    """Every mode over the same steps. The drafter's staleness picks each step's accept length
    (`accept_by_staleness`: a function, or a table whose lookups take the largest key <= the
    staleness, clamped to its smallest and largest keys; None only for plain alone):
    spec_fixed's is the step index; the spot modes' starts at 0 and goes back to 0 after a step
    whose idle training reached cfg.train_s_per_refresh (and was not nothing), else grows by 1."""
    modes = tuple(modes)
    if not modes or any(m not in MODES for m in modes):
        raise FastdraftError(f"modes must be a non-empty selection of {MODES}, got {modes!r}")
    lookup = _accept_lookup(accept_by_staleness) if set(modes) - {"plain"} else None
    out: dict[str, list[StepResult]] = {}
    for mode in modes:
        staleness, results = 0, []
        for index, shape in enumerate(shapes):
            if mode == "spec_fixed":
                staleness = index  # trained once, before step 0
            accept = 1.0 if lookup is None or mode == "plain" else lookup(staleness)
            result = simulate_step(shape, costs, cfg, mode, accept)
            result.staleness = staleness
            if mode in _TRAINING_MODES:
                # No idle time trains nothing, even when a refresh is asked to cost nothing.
                result.refreshed = (result.train_s > 0
                                    and result.train_s >= cfg.train_s_per_refresh)
                staleness = 0 if result.refreshed else staleness + 1
            results.append(result)
        out[mode] = results
    return out


def _accept_lookup(table: AcceptTable | None) -> Callable[[int], float]:
    if table is None:
        raise FastdraftError("the speculative modes need accept_by_staleness (a function or a "
                             "{staleness: accept length} table)")
    if callable(table):
        return table
    if not table:
        raise FastdraftError("accept_by_staleness table is empty")
    keys = sorted(table)

    def lookup(staleness: int) -> float:
        at_or_below = [k for k in keys if k <= staleness]
        return table[at_or_below[-1] if at_or_below else keys[0]]
    return lookup


def summarize(results: dict[str, list[StepResult]]) -> dict[str, dict[str, float]]:
    """Per mode with results: steps, mean step_s / rollout_s / idle_fraction / accept_length,
    total train_s / migrated / refreshes, and speedup_vs_plain (plain's total step seconds over
    the mode's, when plain ran the same number of steps)."""
    plain = results.get("plain") or []
    out: dict[str, dict[str, float]] = {}
    for mode, steps in results.items():
        if not steps:
            continue
        n = len(steps)
        row = {"steps": float(n),
               "step_s": sum(r.step_s for r in steps) / n,
               "rollout_s": sum(r.rollout_s for r in steps) / n,
               "idle_fraction": sum(r.idle_fraction for r in steps) / n,
               "accept_length": sum(r.accept_length for r in steps) / n,
               "train_s": sum(r.train_s for r in steps),
               "migrated": float(sum(r.migrated for r in steps)),
               "refreshes": float(sum(r.refreshed for r in steps))}
        total = sum(r.step_s for r in steps)
        if len(plain) == n and total > 0:
            row["speedup_vs_plain"] = sum(r.step_s for r in plain) / total
        out[mode] = row
    return out


def timeline_spans(result: StepResult, costs: UnitCosts) -> list[Span]:
    """The step as fastdraft.observability.timeline spans (the dashboard's Gantt panel): rollout
    worker i is "rollout{i}"; the actor updates after the rollout (costs.update_s), then every
    rollout worker receives the weights (costs.push_s). Zero-length spans are left out."""
    spans = [Span(f"rollout{s.worker}", s.state, s.start_s, s.end_s) for s in result.spans]
    update_end = result.rollout_s + costs.update_s
    if costs.update_s > 0:
        spans.append(Span("actor", "update", result.rollout_s, update_end))
    if costs.push_s > 0:
        workers = sorted({s.worker for s in result.spans})
        spans += [Span(f"rollout{w}", "push", update_end, update_end + costs.push_s)
                  for w in workers]
    return spans


def projections(costs_by_model: dict[str, UnitCosts], workers: Iterable[int] = (8, 64, 256), *,
                steps: int = 6, prompts_per_worker: int = 8, group_size: int = 16,
                mean_tokens: float = 1500.0, p99_over_mean: float = 5.0, max_len: int = 16384,
                prompt_tokens: int = 512, max_batch: int = 128, dispatch: str = "balance",
                consolidate_below: int = 8, train_s_per_refresh: float = 120.0,
                accept_by_staleness: AcceptTable = DEFAULT_ACCEPT,
                tensor_parallel: dict[str, int] | None = None, seed: int = 0) -> list[dict]:
    """Every mode for every model and worker count on synthetic steps, as rows {model, workers,
    mode, step_s, rollout_s, idle_fraction, train_s, accept_length, migrated,
    speedup_vs_plain, label: "projection"} (means over the steps; train_s and migrated per
    step). The defaults are a 7B GRPO run: a step of 8 prompts a worker x groups of 16 (128
    requests a worker, all in one batch of max_batch 128), answers of mean 1500 tokens with
    p99 / mean 5 up to 16384 (`long_tail_lengths`), 512-token prompts, a tail handed off under
    8 rows, and 120 idle GPU-seconds (two GPU-minutes) to refresh the drafter. The same
    synthetic steps go to every model at a worker count. tensor_parallel (model -> k): that
    model's engines span k of the `workers` devices each (its costs those of a k-device
    replica), each running k times the rows."""
    rows = []
    for count in workers:
        shapes = [StepShape(long_tail_lengths(count * prompts_per_worker * group_size,
                                              group_size, mean_tokens, p99_over_mean, max_len,
                                              seed=seed * 1_000_003 + count * 1009 + step),
                            group_size, prompt_tokens) for step in range(steps)]
        for model, costs in costs_by_model.items():
            tp = (tensor_parallel or {}).get(model, 1)
            cfg = SimConfig(workers=max(count // tp, 1), max_batch=max_batch * tp,
                            dispatch=dispatch, consolidate_below=consolidate_below,
                            train_s_per_refresh=train_s_per_refresh)
            summary = summarize(simulate_run(shapes, costs, cfg, accept_by_staleness))
            for mode, row in summary.items():
                rows.append({"model": model, "workers": count, "tensor_parallel": tp,
                             "mode": mode,
                             **{k: row[k] for k in ("step_s", "rollout_s", "idle_fraction",
                                                    "accept_length")},
                             "train_s": row["train_s"] / steps,
                             "migrated": row["migrated"] / steps,
                             "speedup_vs_plain": row["speedup_vs_plain"],
                             "label": "projection"})
    return rows

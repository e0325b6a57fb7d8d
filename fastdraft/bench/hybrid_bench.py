"""`fastdraft bench hybrid`: hybrid workers against the layouts of today, on one recipe, side by
side in one run (steps interleaved A B C A B C ..., the same seeds, step 0 left out as warm-up):

- local: one process (cluster.backend=local): the engine and the actor's rank 0 beside it,
  the weights pushed within the process;
- colocated: Ray rollout workers with the actor's ranks in other processes on their bundles
  (cluster.placement=colocated): rank 0 in this process, the weights through the object store;
- hybrid: `cluster.rollout_workers` hybrid workers (cluster.placement=hybrid), each an actor
  rank beside its engine, the weights loaded from the shards on each worker's device, the
  online drafter's trainer a member inside the last worker;
- local_off / hybrid_off: local and hybrid without online drafter training.

Reported per arm: mean step, rollout, update and push seconds; `hybrid_vs_local` and
`hybrid_vs_colocated` (mean step time ratios; the target <= 1.0; hybrid_vs_local step by step
too, for its spread; per answer token, `hybrid_vs_local_per_token`: the online arms'
drafters differ, and so do their samples and RL runs) and `hybrid_off_vs_local_off` (the same
completions token for token), `push_ms` side by side;
the exposed cost of training the drafter online: `hybrid_exposed_drafter_cost` (hybrid /
hybrid_off) beside `local_exposed_cost` (local / local_off: its trainer process beside the
engine and the actor);
every hybrid worker's generating seconds per step; `sim_error`: the cluster simulator replaying
the hybrid run's steps (|simulated - measured| / measured step time)."""

from __future__ import annotations

from pathlib import Path
from statistics import mean, median
from typing import Any

from fastdraft.bench.cluster_bench import _interleave, _sim_error
from fastdraft.bench.common import fresh_run_dirs, write_json
from fastdraft.config import load_recipe
from fastdraft.run.run import Run

QUIET = ["logging.wandb.mode=disabled", "logging.progress=false", "logging.dashboard=false",
         "drafter.export=false", "checkpoint.every=1000"]


def arms(workers: int) -> dict[str, list[str]]:
    ray = ["cluster.backend=ray", f"cluster.rollout_workers={workers}",
           "cluster.worker_threads=1", f"actor.num_ranks={workers}"]
    local = ["cluster.backend=local", "actor.num_ranks=1"]
    off = "drafter.online.enabled=false"
    return {"local": local, "colocated": [*ray, "cluster.placement=colocated"],
            "hybrid": [*ray, "cluster.placement=hybrid"], "local_off": [*local, off],
            "hybrid_off": [*ray, "cluster.placement=hybrid", off]}


def run_hybrid_bench(recipe: Path, overrides: list[str], out_dir: Path,
                     json_path: Path | None = None, cache_dir: Path | None = None,
                     workers: int = 2) -> dict[str, Any]:
    import ray
    base = load_recipe(recipe, overrides)
    steps = base.algorithm.num_steps
    ray.init(address="local", num_cpus=3 * workers + 2, include_dashboard=False,
             log_to_driver=False,
             _node_ip_address="127.0.0.1")
    runs: dict[str, Run] = {}
    try:
        arm_overrides = arms(workers)
        fresh_run_dirs(out_dir, arm_overrides)
        for name, extra in arm_overrides.items():
            runs[name] = Run(load_recipe(recipe, [*overrides, *QUIET, *extra]), out_dir / name,
                             cache_dir=cache_dir)
        rows, shapes = _interleave(runs, steps)
    finally:
        for run in runs.values():
            run.close_after_failure()
        ray.shutdown()
    timed = slice(1, None) if steps > 1 else slice(None)

    def avg(name: str, key: str) -> float:
        return mean(r[key] for r in rows[name][timed])

    phases = {name: {key: avg(name, f"timing/{key}_s")
                     for key in ("step", "rollout", "update", "push")} for name in runs}
    hybrid = rows["hybrid"][timed]
    payload: dict[str, Any] = {
        "recipe": str(recipe), "overrides": overrides, "workers": workers, "num_steps": steps,
        "phases_s": phases,
        "hybrid_vs_local": phases["hybrid"]["step"] / phases["local"]["step"],
        # each timed step's own ratio (the arms' steps run interleaved): the spread
        "hybrid_vs_local_per_step": [h["timing/step_s"] / loc["timing/step_s"] for h, loc in
                                     zip(hybrid, rows["local"][timed])],
        "hybrid_off_vs_local_off": phases["hybrid_off"]["step"] / phases["local_off"]["step"],
        "hybrid_vs_colocated": phases["hybrid"]["step"] / phases["colocated"]["step"],
        "hybrid_exposed_drafter_cost": phases["hybrid"]["step"] / phases["hybrid_off"]["step"],
        "local_exposed_cost": phases["local"]["step"] / phases["local_off"]["step"],
        "push_ms": {name: 1e3 * p["push"] for name, p in phases.items()},
        "hybrid_generate_s": {f"rollout{k}": [r[f"cluster/rollout{k}/generate_s"]
                                              for r in rows["hybrid"]]
                              for k in range(workers)},
        "answer_tokens": {name: avg(name, "rollout/response_len_mean") for name in runs},
        # Seconds a step per answer token: the online arms' drafters differ, so do their
        # samples (the same law) and from there their RL runs and answer lengths; the off arms
        # run the same completions token for token.
        "step_s_per_token": {name: phases[name]["step"] / avg(name, "rollout/response_len_mean")
                             for name in runs},
        "rewards": {name: [r["reward/mean"] for r in rows[name]] for name in runs},
        "simulation": _sim_error(runs["hybrid"], hybrid, shapes["hybrid"][timed], workers)}
    payload["sim_error"] = payload["simulation"]["step_error"]
    per_token = payload["step_s_per_token"]
    payload["hybrid_vs_local_per_token"] = per_token["hybrid"] / per_token["local"]
    if json_path is not None:
        write_json(json_path, payload)
    return payload


def summary_lines(out: dict[str, Any]) -> list[str]:
    lines = [f"{'arm':<10} {'step s':>8} {'rollout s':>10} {'update s':>9} {'push ms':>8}"]
    for name, p in out["phases_s"].items():
        lines.append(f"{name:<10} {p['step']:>8.3f} {p['rollout']:>10.3f} {p['update']:>9.3f} "
                     f"{1e3 * p['push']:>8.1f}")
    per_step = sorted(out["hybrid_vs_local_per_step"])
    lines += [f"hybrid_vs_local {out['hybrid_vs_local']:.3f} (steps: median "
              f"{median(per_step):.3f}, {per_step[0]:.3f}-{per_step[-1]:.3f})   "
              f"hybrid_vs_colocated {out['hybrid_vs_colocated']:.3f}   (target <= 1.0); "
              f"without online training {out['hybrid_off_vs_local_off']:.3f} (the same "
              f"completions); per answer token {out['hybrid_vs_local_per_token']:.3f} "
              "(online, the arms' RL runs apart: answers "
              f"{out['answer_tokens']['hybrid']:.1f} vs {out['answer_tokens']['local']:.1f} "
              "tokens)",
              f"exposed drafter-training cost: hybrid {out['hybrid_exposed_drafter_cost']:.3f}"
              f"   local {out['local_exposed_cost']:.3f}",
              "hybrid workers' generating seconds per step: " + "  ".join(
                  f"{w}: {' '.join(f'{s:.2f}' for s in v)}"
                  for w, v in out["hybrid_generate_s"].items()),
              f"sim_error (hybrid) {out['sim_error']:.3f}"]
    return lines

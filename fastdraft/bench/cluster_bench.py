"""`fastdraft bench cluster`: what the Ray backend's idle workers buy, side by side in one run.

Six runs of one recipe, steps interleaved (run A step 0, run B step 0, ...) with the same seeds,
so machine drift hits all alike; the Ray runs use `cluster.rollout_workers` workers (default 2)
of one thread each:

- local_off / local_on: today's single process without / with the online drafter trainer (a
  Ray actor beside the engine and the actor: the cost it has on a machine it shares);
- ray_off / ray_on: the Ray backend without / with online training, the trainer promoted only
  while a rollout worker is idle (drafter.online.during_update=false: on this machine the
  actor's update has every core);
- ray_consolidate: ray_on with tail consolidation (cluster.consolidate_below, --consolidate-
  below): a worker's last requests move to the worker still generating, and the donor trains.
- ray_dp: ray_on with cluster.drafter_training=data_parallel: a trainer member on every worker's
  bundle, the idle workers' members training together (workers/trainer_group.py).
--seeds N runs ray_off / ray_on / local_on again with the next N - 1 seeds.

Reported: `exposed_drafter_cost` = ray_on / ray_off mean step time, the mean over the seeds'
pairs (the target: <= 1.10), beside the single process's `local_exposed_cost`, and per answer
token (`exposed_cost_per_token`: the arms' answers differ in length, the same law but
different samples); `adaptive_vs_stale`: every run's engine loads the ray_on run's final
policy, then the same prompts and seeds are rolled out with each run's drafter (bench
drafter's drift evaluation): the accept length of the drafter trained on idle workers over the
warm-up drafter's (ray_off), and over today's (local_on), each seed on its own ray_on
policy, the mean over seeds (`online_vs_today_per_seed`: the same over each run's own accept
length during its steps, where today's trains on its own samples); `dp_vs_one`: ray_dp's over
ray_on's (this evaluation favours ray_on's drafter, whose policy it runs on: `dp_vs_one_online`
is the ratio of each run's own mean accept length over its steps);
`sim_error`: the cluster simulator (cluster/simulator.py) replays each Ray run's steps (its
answer lengths, its engine steps' measured unit costs, its update and push times) and
|simulated - measured| / measured step time is reported, the rollout alone too;
`consolidation_rollout_ratio`: ray_consolidate / ray_on mean rollout time (with the requests
moved per step). Then the simulator's projections for 8 / 64 / 256 GPUs at 7B and 32B shapes,
from `bench gpu` JSON (--gpu-json) or the H100 floors (bench/projections.py), labelled as
projections."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from statistics import mean
from typing import Any

from fastdraft.bench.common import fresh_run_dirs, write_json
from fastdraft.bench.drafter_bench import drift_eval
from fastdraft.bench.projections import model_projections, projection_lines
from fastdraft.cluster.simulator import SimConfig, StepShape, UnitCosts, simulate_step
from fastdraft.config import load_recipe
from fastdraft.engine.request import prompt_key
from fastdraft.errors import FastdraftError
from fastdraft.run.loop import train_step
from fastdraft.run.run import Run

RAY = ["cluster.backend=ray", "cluster.worker_threads=1"]
ARMS = {"local_off": ["drafter.online.enabled=false"],
        "local_on": [],
        "ray_off": [*RAY, "drafter.online.enabled=false"],
        "ray_on": [*RAY, "drafter.online.during_update=false"],
        "ray_consolidate": [*RAY, "drafter.online.during_update=false"],   # + consolidate_below
        "ray_dp": [*RAY, "drafter.online.during_update=false",
                   "cluster.drafter_training=data_parallel"]}
#: The arms repeated with more seeds (--seeds): the ones exposed_drafter_cost and the drafter
#: evaluations (adaptive_vs_stale / _today) compare.
SEEDED = ("ray_off", "ray_on", "local_on")

def run_cluster_bench(recipe: Path, overrides: list[str], out_dir: Path,
                      json_path: Path | None = None, cache_dir: Path | None = None,
                      gpu_json: Path | None = None, consolidate_below: int = 16,
                      seeds: int = 1) -> dict[str, Any]:
    import ray
    if seeds < 1:
        raise FastdraftError(f"--seeds must be >= 1, got {seeds}")
    base = load_recipe(recipe, [*RAY, "cluster.rollout_workers=2", *overrides])
    arms = dict(ARMS)
    for s in range(1, seeds):   # the seeded arms again, each with the next seed
        arms.update({_seeded(name, s): [*ARMS[name], f"seed={base.seed + s}"]
                     for name in SEEDED})
    workers = base.cluster.rollout_workers
    # Logical CPUs for every Ray run's workers at once (a placement group waits for its
    # bundles' CPUs); only one run steps at a time.
    ray_arms = sum("cluster.backend=ray" in extra for extra in arms.values())
    ray.init(address="local", num_cpus=ray_arms * workers + 2, include_dashboard=False,
             log_to_driver=False,   # its own cluster, whatever else runs here
             _node_ip_address="127.0.0.1")
    quiet = ["logging.wandb.mode=disabled", "logging.progress=false", "logging.dashboard=false",
             "drafter.export=false", f"cluster.rollout_workers={workers}"]
    runs: dict[str, Run] = {}
    try:
        fresh_run_dirs(out_dir, arms)
        for name, extra in arms.items():
            local = "cluster.backend=ray" not in extra
            arm = [*overrides, *quiet, *extra]
            if name == "ray_consolidate":
                arm.append(f"cluster.consolidate_below={consolidate_below}")
            if local:   # the local backend runs one engine
                arm = [o for o in arm if not o.startswith("cluster.")]
            runs[name] = Run(load_recipe(recipe, arm), out_dir / name, cache_dir=cache_dir)
        rows, shapes = _interleave(runs, base.algorithm.num_steps)
        # Each seed's drafters on that seed's ray_on policy (seed 0: every arm's).
        drifts = [drift_eval({name: runs[_seeded(name, s)] for name in (ARMS if s == 0
                                                                         else SEEDED)},
                             base.algorithm.num_steps, source="ray_on") for s in range(seeds)]
    finally:
        for run in runs.values():
            run.close_after_failure()
        ray.shutdown()
    steps = slice(1, None) if base.algorithm.num_steps > 1 else slice(None)   # step 0 warms up

    def step_s(name: str) -> float:
        return mean(r["timing/step_s"] for r in rows[name][steps])

    def online(name: str) -> float:
        return mean(r.get("rollout/accept_length", 1.0) for r in rows[name][steps])

    def answer_tokens(name: str) -> float:
        return sum(r["rollout/response_len_mean"] for r in rows[name][steps])

    exposed = [step_s(_seeded("ray_on", s)) / step_s(_seeded("ray_off", s))
               for s in range(seeds)]
    drift = drifts[0]

    def evaluated(over: str) -> list[float]:
        """Per seed: the accept length of ray_on's drafter over `over`'s, on ray_on's policy."""
        return [d["ray_on"]["eval_accept_length"] / d[over]["eval_accept_length"]
                for d in drifts]
    tokens_ratio = [answer_tokens(_seeded("ray_on", s)) / answer_tokens(_seeded("ray_off", s))
                    for s in range(seeds)]
    sims = {name: _sim_error(runs[name], rows[name][steps], shapes[name][steps], workers)
            for name in ("ray_off", "ray_on")}
    payload: dict[str, Any] = {
        "recipe": str(recipe), "overrides": overrides, "rollout_workers": workers,
        "num_steps": base.algorithm.num_steps,
        "step_s": {name: step_s(name) for name in runs},
        "rollout_s": {name: mean(r["timing/rollout_s"] for r in rows[name][steps])
                      for name in runs},
        # The arms' policies drift apart (a drafter changes which samples a seed gives, not
        # their law), so their answers' lengths do, and with them the step times: one seed's
        # ratio moved between 1.00 and 1.18 on the same code. The mean over --seeds pairs,
        # each seed's ratio, and the ratio per answer token beside it.
        "seeds": seeds,
        "exposed_drafter_cost_per_seed": exposed,
        "exposed_drafter_cost": mean(exposed),
        "answer_tokens_ratio": mean(tokens_ratio),
        "exposed_cost_per_token": mean(e / t for e, t in zip(exposed, tokens_ratio)),
        "local_exposed_cost": step_s("local_on") / step_s("local_off"),
        "train_tokens_on_idle": sum(r.get("drafter/train_tokens_on_idle", 0.0)
                                    for r in rows["ray_on"]),
        "train_tokens": {name: rows[name][-1].get("drafter/train_tokens", 0.0)
                         for name in ("local_on", "ray_on")},
        "idle_fraction": {name: mean(r["cluster/idle_fraction"] for r in rows[name][steps])
                          for name in ("ray_off", "ray_on", "ray_consolidate", "ray_dp")},
        "accept_length": {name: drift[name]["eval_accept_length"] for name in drift},
        # What each run's own drafter did on its own policy, step by step (the evaluation
        # above favours ray_on's drafter: it runs on ray_on's policy).
        "online_accept_length": {name: online(name) for name in ARMS},
        # Means over the seeds (each policy drifts its own way: one seed's adaptive_vs_today
        # moved between 0.97 and 1.00 on the same code), each seed's ratio beside.
        "adaptive_vs_stale_per_seed": evaluated("ray_off"),
        "adaptive_vs_stale": mean(evaluated("ray_off")),
        "adaptive_vs_today_per_seed": evaluated("local_on"),
        "adaptive_vs_today": mean(evaluated("local_on")),
        "online_vs_today_per_seed": [online(_seeded("ray_on", s)) / online(_seeded("local_on", s))
                                     for s in range(seeds)],
        "rewards": {name: [r["reward/mean"] for r in rows[name]] for name in runs},
        "simulation": sims,
        "sim_error": max(s["step_error"] for s in sims.values()),
        # Data-parallel training on every idle worker's device vs one trainer fed by all.
        "dp_exposed_drafter_cost": step_s("ray_dp") / step_s("ray_off"),
        "dp_train_tokens_on_idle": sum(r.get("drafter/train_tokens_on_idle", 0.0)
                                       for r in rows["ray_dp"]),
        "dp_idle_promotions": sum(r.get("drafter/idle_promotions", 0.0) for r in rows["ray_dp"]),
        "dp_train_tokens": rows["ray_dp"][-1].get("drafter/train_tokens", 0.0),
        "dp_vs_one": drift["ray_dp"]["eval_accept_length"]
        / drift["ray_on"]["eval_accept_length"],
        "dp_vs_one_online": online("ray_dp") / online("ray_on"),
        "consolidate_below": consolidate_below,
        "consolidation_rollout_ratio": mean(r["timing/rollout_s"] for r in
                                            rows["ray_consolidate"][steps])
        / mean(r["timing/rollout_s"] for r in rows["ray_on"][steps]),
        "migrated_per_step": mean(r["cluster/migrated_requests"]
                                  for r in rows["ray_consolidate"]),
        "projections": model_projections(gpu_json)}
    if json_path is not None:
        write_json(json_path, payload)
    return payload


def _seeded(name: str, seed: int) -> str:
    """Arm `name` run with the recipe's seed + `seed` (0: the arm itself)."""
    return f"{name}+seed{seed}" if seed else name


@dataclass(frozen=True)
class MeasuredStep:
    """A Ray run's rollout as the simulator replays it: its shape (answer lengths in rollout
    order, the lengths dispatch predicted), and the rows and seconds of every decode / verify
    step its workers ran, and prefill seconds per prompt token."""

    shape: StepShape
    rows: list[int]
    seconds: list[float]
    prefill_token_s: float


def _interleave(runs: dict[str, Run], num_steps: int
                ) -> tuple[dict[str, list[dict[str, float]]], dict[str, list[MeasuredStep]]]:
    """Every run's steps, interleaved; for the Ray runs each step's shape (answer lengths in
    rollout order, the lengths dispatch predicted) and the workers' engine steps."""
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in runs}
    shapes: dict[str, list[MeasuredStep]] = {name: [] for name in runs}
    last: dict[str, dict[int, float]] = {name: {} for name in runs}
    for step in range(num_steps):
        for name, run in runs.items():
            rows[name].append(train_step(run, step))
            if run.timeline is not None:
                shapes[name].append(_shape(run, last[name]))
            row = rows[name][-1]
            print(f"step {step + 1}/{num_steps} {name}: step {row['timing/step_s']:.2f}s "
                  f"rollout {row['timing/rollout_s']:.2f}s accept "
                  f"{row.get('rollout/accept_length', 1.0):.2f}", flush=True)
    return rows, shapes


def _shape(run: Run, last: dict[int, float]) -> MeasuredStep:
    """The last rollout as the simulator sees it; `last` (prompt key -> the answers' mean
    length at its previous rollout) is what the pool's dispatch predicted with."""
    completions = sorted((c for part in run.engine.last_parts for c in part.completions),
                         key=lambda c: c.index)
    group = run.cfg.rollout.group_size
    keys = [prompt_key(c.prompt_token_ids) for c in completions]
    guess = mean(last.values()) if last else 1.0
    predicted = [last.get(k, guess) for k in keys]
    lengths = [max(len(c.token_ids), 1) for c in completions]
    for g in range(0, len(keys), group):
        last[keys[g]] = mean(lengths[g:g + group])
    prompt = round(mean(len(c.prompt_token_ids) for c in completions))
    rows, seconds, prefill_s, prefill_tokens = [], [], 0.0, 0
    for part in run.engine.last_parts:
        trace = part.trace
        bounds = [*trace.times[1:], trace.end]
        for start, stop, active, arm in zip(trace.times, bounds, trace.active, trace.arms):
            if arm == "prefill":
                prefill_s += stop - start
            else:
                rows.append(active)
                seconds.append(stop - start)
        prefill_tokens += sum(len(c.prompt_token_ids) for c in part.completions)
    return MeasuredStep(StepShape(lengths, group, prompt, predicted), rows, seconds,
                        prefill_s / max(prefill_tokens, 1))


def _sim_error(run: Run, rows: list[dict[str, float]], steps: list[MeasuredStep], workers: int
               ) -> dict[str, float]:
    """The run's steps replayed by the simulator. Its unit costs are fitted to the run's own
    engine steps (a speculative step's measured time includes its drafting, so verify_factor 1
    and no separate draft levels); each step keeps its measured update and push time and its
    measured accept length. What is predicted is the rollout: from the answer lengths, the
    dispatch and the per-row cost line."""
    all_rows = [r for s in steps for r in s.rows]
    all_seconds = [t for s in steps for t in s.seconds]
    prefill = mean(s.prefill_token_s for s in steps)
    cfg = SimConfig(workers=workers, max_batch=run.cfg.rollout.max_batch_size,
                    dispatch=run.cfg.cluster.dispatch)
    sim_step = sim_rollout = meas_step = meas_rollout = 0.0
    for row, step in zip(rows, steps):
        costs = UnitCosts.fit(all_rows, all_seconds, verify_factor=1.0, draft_levels=0,
                              prefill_token_s=prefill,
                              update_s=row["timing/reward_s"] + row["timing/update_s"],
                              push_s=row["timing/push_s"])
        mode = "spec_fixed" if "rollout/accept_length" in row else "plain"
        result = simulate_step(step.shape, costs, cfg, mode,
                               row.get("rollout/accept_length", 1.0))
        sim_step += result.step_s
        sim_rollout += result.rollout_s
        meas_step += row["timing/step_s"]
        meas_rollout += row["timing/rollout_s"]
    return {"simulated_step_s": sim_step / len(rows), "measured_step_s": meas_step / len(rows),
            "simulated_rollout_s": sim_rollout / len(rows),
            "measured_rollout_s": meas_rollout / len(rows),
            "step_error": abs(sim_step - meas_step) / meas_step,
            "rollout_error": abs(sim_rollout - meas_rollout) / meas_rollout}


def summary_lines(out: dict[str, Any]) -> list[str]:
    sim = out["simulation"]
    lines = [f"bench cluster: {out['num_steps']} steps each, {out['rollout_workers']} Ray rollout "
             "workers of 1 thread (step 0 left out of the means)",
             "  mean step s: " + "  ".join(f"{k} {v:.2f}" for k, v in out["step_s"].items()),
             f"  exposed_drafter_cost (ray_on / ray_off step time, mean of {out['seeds']} "
             f"seed(s): " + " ".join(f"{e:.3f}" for e in out["exposed_drafter_cost_per_seed"])
             + f"): {out['exposed_drafter_cost']:.3f}   (single process, local_on / local_off: "
             f"{out['local_exposed_cost']:.3f})",
             f"  per answer token: {out['exposed_cost_per_token']:.3f} (ray_on wrote "
             f"{out['answer_tokens_ratio']:.3f}x ray_off's answer tokens)",
             f"  drafter tokens trained on idle workers: {out['train_tokens_on_idle']:.0f}; "
             f"idle fraction ray_off {out['idle_fraction']['ray_off']:.3f} ray_on "
             f"{out['idle_fraction']['ray_on']:.3f}",
             "  accept length on ray_on's final policy: " + "  ".join(
                 f"{k} {v:.2f}" for k, v in out["accept_length"].items()),
             f"  adaptive_vs_stale {out['adaptive_vs_stale']:.3f} ("
             + " ".join(f"{r:.3f}" for r in out["adaptive_vs_stale_per_seed"])
             + f")  adaptive_vs_today {out['adaptive_vs_today']:.3f} ("
             + " ".join(f"{r:.3f}" for r in out["adaptive_vs_today_per_seed"])
             + ")  on their own runs vs today: "
             + " ".join(f"{r:.3f}" for r in out["online_vs_today_per_seed"]),
             *(f"  simulated {name}: step {s['simulated_step_s']:.2f}s vs measured "
               f"{s['measured_step_s']:.2f}s (error {s['step_error']:.3f}); rollout "
               f"{s['simulated_rollout_s']:.2f}s vs {s['measured_rollout_s']:.2f}s (error "
               f"{s['rollout_error']:.3f})" for name, s in sim.items()),
             f"  sim_error (worst step-time error): {out['sim_error']:.3f}",
             f"  data-parallel drafter training (ray_dp): exposed cost "
             f"{out['dp_exposed_drafter_cost']:.3f}, {out['dp_train_tokens_on_idle']:.0f} tokens "
             f"on idle workers ({out['dp_idle_promotions']:.0f} promotions, "
             f"{out['dp_train_tokens']:.0f} tokens in all); accept vs one trainer: on "
             f"ray_on's final policy (dp_vs_one) "
             f"{out['dp_vs_one']:.3f}, each on its own run (dp_vs_one_online) "
             f"{out['dp_vs_one_online']:.3f}",
             "  accept length online (each run's own drafter and policy, steps 1-): " + "  ".join(
                 f"{k} {v:.2f}" for k, v in out["online_accept_length"].items()),
             f"  consolidation_rollout_ratio (ray_consolidate / ray_on rollout time, "
             f"consolidate_below={out['consolidate_below']}): "
             f"{out['consolidation_rollout_ratio']:.3f}; {out['migrated_per_step']:.1f} "
             f"requests moved per step; idle fraction "
             f"{out['idle_fraction']['ray_consolidate']:.3f}"]
    return lines + projection_lines(out)

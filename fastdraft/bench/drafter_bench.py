"""`fastdraft bench drafter`: what online drafter training buys and costs.

- packing_speedup: drafter training tokens/s on packed rows over padded ones, on a long-tail
  length mix (the bootstrap task's answer lengths), same samples, same loss.
- preemption latency: SpotTrainer.run stopped at random moments: stop -> return, in seconds.
- ckpt_blocking_ratio: what the loop waits for an async selective drafter checkpoint (host
  copy, then a background write) over a synchronous full save of the same run state.
- the drift experiment: the tiny recipe run three times side by side, steps interleaved, with
  the same seeds: the warm-up drafter kept fixed ("stale"), trained online with plain KD
  (the drafter kind's own loss) and with reward-weighted KD. Then, on the drifted policy of the
  plain-KD run (pushed into all three engines), the same prompts and seeds are rolled out with
  each drafter: accept length and rollout time (`adaptive_accept_length`, `stale_accept_length`,
  `adaptive_vs_stale`), and each run's reward curve. A fourth run trains reward-weighted KD on
  samples from the actor's update forward (drafter.online.source=actor, what a backend without
  hidden-state capture uses): its update, rollout and step time and accept length over the
  engine-capture run's (`actor_source_*`).
- tracking_efficiency: how close online training gets to the best drafter for the drifted
  policy it could have: a drafter warmed up afresh on the KD run's final policy with the run's
  own warm-up budget (drafter.warmup_steps on drafter.warmup_rollouts, the same prompts and
  seed) is the ceiling; the KD drafter's accept length over the ceiling's, evaluated alike.
  Reported beside the tokens the in-flight capture cap dropped (drafter/dropped_tokens).
"""

from __future__ import annotations

import random
import tempfile
import threading
import time
from pathlib import Path
from statistics import median
from typing import Any

import torch

from fastdraft.bench.common import fresh_run_dirs, write_json
from fastdraft.config import load_recipe
from fastdraft.databuffer import DataBuffer, Sample, pack_rows, pad
from fastdraft.engine import SamplingParams
from fastdraft.run.loop import train_step
from fastdraft.run.run import Run
from fastdraft.trainer.collector import SampleCollector
from fastdraft.trainer.losses import compute_drafter_loss
from fastdraft.trainer.spot import PolicyHead, SpotConfig, SpotTrainer, StopEvent, draft_batch

DRIFT_RUNS = {"stale": ["drafter.online.enabled=false"],
              # the drafter kind's own loss (eagle1 / eagle3)
              "kd": ["drafter.online.enabled=true", "drafter.online.loss=null"],
              "reward_kd": ["drafter.online.enabled=true", "drafter.online.loss=reward_kd"],
              # the same, its samples from the actor's update forward, not the engine's capture
              "reward_kd_actor": ["drafter.online.enabled=true", "drafter.online.loss=reward_kd",
                                  "drafter.online.source=actor"]}


def run_drafter_bench(recipe: Path, overrides: list[str], out_dir: Path,
                      json_path: Path | None = None, cache_dir: Path | None = None
                      ) -> dict[str, Any]:
    quiet = ["logging.wandb.mode=disabled", "logging.progress=false", "logging.dashboard=false",
             "drafter.export=false"]
    runs: dict[str, Run] = {}
    fresh_run_dirs(out_dir, DRIFT_RUNS)
    for name, extra in DRIFT_RUNS.items():
        runs[name] = Run(load_recipe(recipe, [*overrides, *quiet, *extra]), out_dir / name,
                         cache_dir=cache_dir)
    base = runs["stale"]
    # (on an online run: its engine captures what the drafter reads, EAGLE-3's aux layers too)
    payload: dict[str, Any] = {"recipe": str(recipe), "overrides": overrides,
                               **unit_costs(runs["kd"])}
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in runs}
    for step in range(base.cfg.algorithm.num_steps):
        for name, run in runs.items():
            rows[name].append(train_step(run, step))
            print(f"step {step + 1}/{base.cfg.algorithm.num_steps} {name}: reward "
                  f"{rows[name][-1]['reward/mean']:.3f} accept "
                  f"{rows[name][-1].get('rollout/accept_length', 1.0):.2f} rollout "
                  f"{rows[name][-1]['rollout/time_s']:.2f}s", flush=True)
    payload["drift"] = drift_eval(runs, base.cfg.algorithm.num_steps)
    payload["ceiling"] = ceiling_eval(runs)
    for name, steps in rows.items():
        payload["drift"][name]["rewards"] = [r["reward/mean"] for r in steps]
        payload["drift"][name]["accept_lengths"] = [r.get("rollout/accept_length", 1.0)
                                                    for r in steps]
        payload["drift"][name]["rollout_time_s"] = sum(r["rollout/time_s"] for r in steps)
        payload["drift"][name]["step_time_s"] = sum(r["timing/step_s"] for r in steps)
        payload["drift"][name]["update_time_s"] = sum(r["timing/update_s"] for r in steps)
    for run in runs.values():
        run.finish()
    drift = payload["drift"]
    payload.update(adaptive_accept_length=drift["kd"]["eval_accept_length"],
                   stale_accept_length=drift["stale"]["eval_accept_length"],
                   adaptive_vs_stale=drift["kd"]["eval_accept_length"]
                   / drift["stale"]["eval_accept_length"],
                   reward_kd_accept_length=drift["reward_kd"]["eval_accept_length"])
    ceiling = payload["ceiling"]["eval_accept_length"]
    payload.update(ceiling_accept_length=ceiling,
                   tracking_efficiency=drift["kd"]["eval_accept_length"] / ceiling,
                   reward_kd_tracking_efficiency=drift["reward_kd"]["eval_accept_length"]
                   / ceiling,
                   dropped_tokens_per_step=[r.get("drafter/dropped_tokens", 0.0)
                                            for r in rows["kd"]])
    # Samples from the actor's forward (drafter.online.source=actor) vs the engine's capture,
    # both reward-weighted KD: what the update pays, what the rollout saves, what is learnt.
    actor, engine = drift["reward_kd_actor"], drift["reward_kd"]
    payload.update(actor_source_update_ratio=actor["update_time_s"] / engine["update_time_s"],
                   actor_source_rollout_ratio=actor["rollout_time_s"] / engine["rollout_time_s"],
                   actor_source_step_ratio=actor["step_time_s"] / engine["step_time_s"],
                   actor_source_vs_engine=actor["eval_accept_length"]
                   / engine["eval_accept_length"],
                   actor_source_vs_engine_online=_mean(actor["accept_lengths"][1:])
                   / _mean(engine["accept_lengths"][1:]))
    if json_path is not None:
        write_json(json_path, payload)
    return payload


def drift_eval(runs: dict[str, Run], num_steps: int, num_seeds: int = 2, source: str = "kd"
               ) -> dict[str, Any]:
    """The source run's final policy in every engine; the same prompts and seeds with each
    drafter."""
    for name, run in runs.items():
        if name != source:
            run.engine.load_weights(runs[source].actor.full_parameters())
    return {name: {**_eval_accept(run, num_seeds), "drafter_version": run.engine.drafter_version}
            for name, run in runs.items()}


def ceiling_eval(runs: dict[str, Run], num_seeds: int = 2, source: str = "kd",
                 host: str = "stale") -> dict[str, Any]:
    """A drafter warmed up afresh on the source run's final policy with the recipe's warm-up
    budget, prompts and seed (what demo.ensure_drafter gave the runs at their start), served by
    the `host` run's engine (which drift_eval gave that policy) and evaluated as drift_eval
    evaluates."""
    from fastdraft.demo import prompt_ids
    from fastdraft.drafter.checkpoint import trainable_named_tensors
    from fastdraft.drafter.warmup import warmup_policy, warmup_positions
    from fastdraft.models import load_model, load_named_tensors
    from fastdraft.run.inputs import recipe_warmup
    cfg, run = runs[source].cfg, runs[host]
    warmup = recipe_warmup(cfg)
    prompts = prompt_ids(run.policy_dir, None, warmup.num_rollouts, heldout=False)
    policy = load_model(run.policy_dir, max_positions=warmup_positions(prompts, warmup))
    load_named_tensors(policy, runs[source].actor.full_parameters())
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        report = warmup_policy(policy, Path(tmp) / "ceiling", prompts, warmup,
                               log=lambda _: None)
        from fastdraft.drafter import load_drafter
        ceiling = load_drafter(Path(tmp) / "ceiling", policy, warmup_positions(prompts, warmup))
    warmup_s = time.perf_counter() - start
    run.engine.load_drafter_weights(trainable_named_tensors(ceiling))
    return {**_eval_accept(run, num_seeds), "warmup_s": warmup_s,
            "warmup_train_tokens": report.train_tokens}


def _eval_accept(run: Run, num_seeds: int) -> dict[str, float]:
    """The run's first prompts, each group_size times, sampled with fixed seeds: accept length
    and time (no hooks: a drafter's buffers stay as training left them)."""
    items = run.prompts.batch(0, run.cfg.rollout.prompts_per_step)
    prompts = [it.ids for it in items for _ in range(run.cfg.rollout.group_size)]
    accepted = steps = 0.0
    start = time.perf_counter()
    for i in range(num_seeds):
        run.engine.generate(prompts, SamplingParams(
            temperature=run.cfg.rollout.temperature, seed=10**6 * (i + 1),
            max_new_tokens=run.cfg.rollout.max_new_tokens), use_tqdm=False)
        stats = run.engine.last_stats
        accepted += stats.num_accepted
        steps += stats.num_verify_steps
    return {"eval_accept_length": 1 + accepted / max(steps, 1),
            "eval_rollout_time_s": time.perf_counter() - start}


def unit_costs(run: Run) -> dict[str, Any]:
    """Packing speedup, preemption latency and checkpoint blocking on the run's policy."""
    policy, drafter = run.engine.model, run.engine.model_drafter
    assert drafter is not None, "bench drafter needs rollout.spec.method=eagle"
    samples = _long_tail_samples(run)
    head = PolicyHead.of(policy).float()   # the drafter trains in fp32 (as SpotTrainer)
    fresh = drafter.detached().attach(head)
    budget = 2048
    packed, padded = _throughput(fresh, head, samples, budget, lambda s, _: pack_rows(s)), \
        _throughput(fresh, head, samples, budget, lambda s, _: pad(s))
    buffer = DataBuffer(2**28)
    for s in samples:
        buffer.add(s)
    trainer = SpotTrainer(fresh, head, buffer, SpotConfig(loss=fresh.kind, token_budget=1024))
    rng = random.Random(0)
    for _ in range(8):
        stop = StopEvent()
        thread = threading.Thread(target=trainer.run, args=(stop,))
        thread.start()
        time.sleep(rng.uniform(0.05, 0.5))
        stop.set()
        thread.join()
    latencies = trainer.stats.preemption_latencies_s
    return {"packing_speedup": packed / padded, "packed_tokens_per_s": packed,
            "padded_tokens_per_s": padded, "preemption_latency_s_median": median(latencies),
            "preemption_latency_s_max": max(latencies), **_ckpt_blocking(run)}


def _long_tail_samples(run: Run, num: int = 128) -> list[Sample]:
    """Rollouts of the run's policy with their hidden states (the recipe's length mix)."""
    buffer = DataBuffer(2**30)
    collector = SampleCollector(buffer)
    items = run.prompts.batch(0, max(num // run.cfg.rollout.group_size, 1))
    prompts = [it.ids for it in items for _ in range(run.cfg.rollout.group_size)]
    run.engine.generate(prompts, SamplingParams(temperature=1.0, seed=12345,
                                                max_new_tokens=run.cfg.rollout.max_new_tokens),
                        on_finish=collector.on_finish, on_hidden=collector.on_hidden)
    return [s.with_reward(1.0) for s in buffer.samples()]


def _throughput(drafter, head, samples, budget, batcher, repeats: int = 2) -> float:
    """Drafter training tokens (forward + backward) per second over all samples."""
    order = sorted(samples, key=lambda s: random.Random(s.request_index).random())
    chunks, current, used = [], [], 0
    for s in order:
        if used + s.num_tokens > budget and current:
            chunks.append(current)
            current, used = [], 0
        current.append(s)
        used += s.num_tokens
    chunks.append(current)
    tokens = sum(s.num_tokens for s in samples)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for chunk in chunks:
            batch = draft_batch(batcher(chunk, budget))
            loss, _ = compute_drafter_loss(drafter.kind, drafter, batch, head.lm_head)
            loss.backward()
        best = min(best, time.perf_counter() - start)
    drafter.zero_grad(set_to_none=True)
    return tokens / best


def _ckpt_blocking(run: Run) -> dict[str, float]:
    """Blocking time of the loop: the drafter's selective state handed to a background writer
    vs the whole run state (actor, its optimizer, the drafter) saved synchronously."""
    from fastdraft.checkpoint import CheckpointManager, TrainState
    from fastdraft.drafter import save_drafter
    drafter = run.engine.model_drafter
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        host = {n: t.detach().to("cpu", copy=True) for n, t in drafter.state_dict().items()}
        writer = threading.Thread(target=lambda: torch.save(host, Path(tmp) / "drafter.pt"))
        writer.start()
        selective = time.perf_counter() - start
        writer.join()
        manager = CheckpointManager(tmp, keep=1)
        start = time.perf_counter()
        with run.actor.full_state() as (model, training):
            manager.save(1, TrainState(model=model, optimizer=training["optimizer"], step=1,
                                       drafter={"tensors": host, "version": 0}), block=True)
        save_drafter(drafter, Path(tmp) / "drafter")
        full = time.perf_counter() - start
        manager.close()
    return {"ckpt_selective_blocking_s": selective, "ckpt_full_sync_s": full,
            "ckpt_blocking_ratio": selective / full}


def _mean(values: list[float]) -> float:
    return sum(values) / max(len(values), 1)


def summary_lines(out: dict[str, Any]) -> list[str]:
    drift = out["drift"]
    lines = [f"packing_speedup {out['packing_speedup']:.2f} ({out['packed_tokens_per_s']:.0f} vs "
             f"{out['padded_tokens_per_s']:.0f} tok/s); preemption latency median "
             f"{out['preemption_latency_s_median'] * 1e3:.0f} ms, max "
             f"{out['preemption_latency_s_max'] * 1e3:.0f} ms; ckpt_blocking_ratio "
             f"{out['ckpt_blocking_ratio']:.3f}",
             f"on the drifted policy: accept length online (KD) "
             f"{out['adaptive_accept_length']:.2f}, reward-weighted KD "
             f"{out['reward_kd_accept_length']:.2f}, stale {out['stale_accept_length']:.2f} "
             f"(adaptive_vs_stale {out['adaptive_vs_stale']:.3f}); eval rollout time stale "
             f"{drift['stale']['eval_rollout_time_s']:.1f}s, online "
             f"{drift['kd']['eval_rollout_time_s']:.1f}s",
             f"tracking_efficiency {out['tracking_efficiency']:.3f} (KD online "
             f"{out['adaptive_accept_length']:.2f} vs a drafter warmed up afresh on the final "
             f"policy {out['ceiling_accept_length']:.2f}; reward-weighted KD "
             f"{out['reward_kd_tracking_efficiency']:.3f}); in-flight cap dropped "
             f"{sum(out['dropped_tokens_per_step']):.0f} tokens over the KD run",
             f"samples from the actor's forward vs the engine's capture (reward-weighted KD): "
             f"update time {out['actor_source_update_ratio']:.3f}x, rollout time "
             f"{out['actor_source_rollout_ratio']:.3f}x, step time "
             f"{out['actor_source_step_ratio']:.3f}x; accept length on the drifted policy "
             f"{out['actor_source_vs_engine']:.3f}x, on its own run "
             f"{out['actor_source_vs_engine_online']:.3f}x"]
    for name in DRIFT_RUNS:
        r = drift[name]["rewards"]
        lines.append(f"{name}: reward first 5 {sum(r[:5]) / len(r[:5]):.3f} last 5 "
                     f"{sum(r[-5:]) / len(r[-5:]):.3f}; rollout "
                     f"{drift[name]['rollout_time_s']:.1f}s, step "
                     f"{drift[name]['step_time_s']:.1f}s")
    return lines


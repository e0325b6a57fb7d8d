"""The GRPO step loop: rollout -> rewards -> advantages -> actor update (its forward pass also
feeds the lossless gate, checked before the optimizer step) -> push weights -> metrics ->
checkpoint. Everything it needs is assembled in run/run.py."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from fastdraft.algo.gate import GateTolerance, LosslessGateError, check_gate
from fastdraft.algo.sequences import SequenceBatch, build_batch
from fastdraft.algo.token_stats import TokenStats
from fastdraft.checkpoint import CheckpointWriteError
from fastdraft.engine import Completion, SamplingParams
from fastdraft.run.stop import StopRequest
from fastdraft.utils.memory import rss_mb

if TYPE_CHECKING:
    from fastdraft.run.run import Run


def train(run: Run) -> None:
    """The run's steps, then its end (drafter saved and exported, dashboard). A SIGTERM or SIGINT
    ends it after the step under way with a checkpoint and RunStopped, or at once when that
    does not fit in checkpoint.stop_grace_s (run/stop.py). A checkpoint write that failed ends
    it at the first step boundary that sees the failure (the write runs beside the next step:
    one still running is seen at the boundary after), or before its end: as a normal end does,
    and then raises the CheckpointWriteError (the newest whole checkpoint is on disk)."""
    last = run.cfg.algorithm.num_steps
    try:
        with StopRequest(run.cfg.checkpoint.stop_grace_s, run.clock.time_to_stop,
                         on_abandon=run.kill_helpers) as stop:
            for step in range(run.start_step, last):
                run.clock.start_step()
                train_step(run, step)
                run.clock.end_step()
                run.check_checkpoint()
                if stop.signum is not None and step + 1 < last:
                    run.stop(step + 1, stop.signum)
            run.finish()
    except CheckpointWriteError:
        run.end_after_write_failure()
        raise


def train_step(run: Run, step: int) -> dict[str, float]:
    """One GRPO step; returns (and logs) its metrics."""
    cfg, timer = run.cfg, _Timer()
    items = run.prompts.batch(step, cfg.rollout.prompts_per_step)
    group = cfg.rollout.group_size
    run.drafter.start_rollout(step, len(items) * group, run.engine)  # trains in the tail
    completions = rollout(run, step, [it.ids for it in items])
    timer.lap("rollout")
    rewards = _score(run, items, completions)
    run.drafter.end_rollout(rewards)
    rollout_metrics = run.rollout_metrics(completions, rewards)   # the step's own rollout
    items, completions, rewards, resampled = _resample(run, step, items, completions, rewards)
    advantages, weights = run.algorithm.advantages(
        rewards, group, [len(c.token_ids) for c in completions],
        [c.finish_reason == "length" for c in completions])
    # Samples of skipped (zero-variance) groups, and with algorithm.overlong_filter answers cut
    # at the budget, carry no gradient: they leave the batch, so the update costs only what it
    # learns from; with resampling, the first prompts_per_step groups that do are kept.
    num = cfg.rollout.prompts_per_step   # (none carries gradient: the first rollout, weight 0)
    keep = _kept(weights, group, num) or list(range(num * group))
    batch = build_batch([items[i // group].ids for i in keep],
                        [completions[i].token_ids for i in keep],
                        [completions[i].logprobs for i in keep],
                        [advantages[i] for i in keep], [weights[i] for i in keep])
    timer.lap("reward")
    gate: dict[str, float] = {}   # the lossless gate, on the first update's forward pass
    run.drafter.start_update()   # the drafter trains beside the actor
    for i in range(cfg.actor.updates_per_step):  # > 1: PPO epochs over the same rollout
        update = run.actor.update(batch,
                                  before_step=None if i else _gate(
                                      batch, run.gate_tolerance, gate, step),
                                  hidden_layers=None if i else run.drafter.actor_hidden_layers)
        if update.hidden:   # drafter.online.source=actor: its samples from these forwards
            _drafter_samples(run, batch, update.hidden, keep, items, completions, rewards)
    run.drafter.end_update()
    timer.lap("update")
    # On the device, one tensor at a time; then the engines' step end (model-free drafters
    # slide their window, budgets their history).
    run.push_weights(advance_step=True)
    drafter_metrics = run.drafter.after_step(run.engine, rollout_metrics.get(
        "rollout/accept_length"))   # health check, then the new drafter into the engine
    timer.lap("push")
    metrics = {**rollout_metrics, **drafter_metrics, **gate, **update.metrics,
               "actor/trained_samples": float(len(keep)), **resampled,
               **timer.metrics(), **run.cluster_metrics(step, timer.laps),
               "timing/last_checkpoint_s": run.last_checkpoint_s,
               "policy/version": float(run.engine.policy_version),
               **run.memory_plan.phases.as_metrics(),   # the plan's per-phase peaks, device 0
               **({"process/rss_mb": rss} if (rss := rss_mb()) is not None else {})}
    # Logged before the checkpoint: a checkpointed step always has its metrics line.
    run.logger.log(step, metrics)
    if (step + 1) % cfg.checkpoint.every == 0 or step + 1 == cfg.algorithm.num_steps:
        run.save_checkpoint(step + 1)
    return metrics


def _score(run: Run, items: list, completions: list[Completion]) -> list[float]:
    group = run.cfg.rollout.group_size
    return [run.prompts.score(items[i // group], run.decode(c.token_ids))
            for i, c in enumerate(completions)]


def _kept(weights: list[float], group: int, num_groups: int) -> list[int]:
    """The samples that carry gradient (weight > 0), of the first num_groups groups that have
    one."""
    groups = [g for g in range(len(weights) // group)
              if any(w > 0 for w in weights[g * group: (g + 1) * group])][:num_groups]
    return [i for g in groups for i in range(g * group, (g + 1) * group) if weights[i] > 0]


def _resample(run: Run, step: int, items: list, completions: list[Completion],
              rewards: list[float]) -> tuple[list, list[Completion], list[float],
                                             dict[str, float]]:
    """DAPO's dynamic sampling (algorithm.resample_rounds): while fewer than prompts_per_step
    groups carry gradient, another rollout of fresh prompts (each round's prompts and random
    streams its own: a resumed run draws them again). The online drafter does not see these
    rollouts (its step's capture is the first rollout's)."""
    cfg, start = run.cfg, time.perf_counter()
    num, group, rounds = cfg.rollout.prompts_per_step, cfg.rollout.group_size, 0
    while rounds < cfg.algorithm.resample_rounds:
        _, weights = run.algorithm.advantages(
            rewards, group, [len(c.token_ids) for c in completions],
            [c.finish_reason == "length" for c in completions])
        if len({i // group for i in _kept(weights, group, num)}) >= num:
            break
        rounds += 1
        more = run.prompts.batch(step, num, round_=rounds)
        outs = rollout(run, step, [it.ids for it in more], train_drafter=False, round_=rounds)
        items, completions = items + more, completions + outs
        rewards = rewards + _score(run, more, outs)
    metrics = ({"rollout/resample_rounds": float(rounds),
                "timing/resample_s": time.perf_counter() - start}
               if cfg.algorithm.resample_rounds else {})
    return items, completions, rewards, metrics


def rollout(run: Run, step: int, prompts: list[list[int]], train_drafter: bool = True,
            round_: int = 0) -> list[Completion]:
    """group_size samples of every prompt (request i of the call draws from seed + i: every
    sample its own stream, every step new ones, the same again after a resume; a resampling
    round_ its own). train_drafter=False: samples the online drafter never sees (an
    evaluation rollout, a resampling round)."""
    cfg = run.cfg.rollout
    group = cfg.group_size
    params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                            max_new_tokens=cfg.max_new_tokens,
                            seed=run.cfg.seed * 1_000_003 + step * len(prompts) * group
                            + round_ * 2**40)
    return run.engine.generate([p for p in prompts for _ in range(group)], params,
                               on_finish=run.on_finish if train_drafter else None,
                               on_hidden=run.drafter.on_hidden if train_drafter else None,
                               use_tqdm=False)


def _drafter_samples(run: Run, batch: SequenceBatch, hidden: dict, keep: list[int],
                     items: list, completions: list[Completion], rewards: list[float]) -> None:
    """drafter.online.source=actor: the drafter's samples of the update batch's rows (from the
    update's forward) and of the rollouts left out of it (skipped groups: a forward without
    gradient), so it learns from every rollout, as with the engine's capture."""
    run.drafter.add_actor_samples(batch, hidden, keep, rewards)
    group, kept = run.cfg.rollout.group_size, set(keep)
    rest = [i for i in range(len(completions)) if i not in kept]
    if rest:
        left = build_batch([items[i // group].ids for i in rest],
                           [completions[i].token_ids for i in rest],
                           [completions[i].logprobs for i in rest], [0.0] * len(rest))
        run.drafter.add_actor_samples(left, run.actor.hidden_states(
            left, run.drafter.actor_hidden_layers), rest, rewards)


def _gate(batch: SequenceBatch, tolerance: GateTolerance, into: dict[str, float], step: int
          ) -> Callable[[TokenStats | torch.Tensor], None]:
    """The lossless gate on the actor's view of the batch: TokenStats [B, L - 1] (with
    entropies: the law statistic too), or its logprobs alone (the per-token checks only)."""
    def check(actor: TokenStats | torch.Tensor) -> None:
        stats = actor if isinstance(actor, TokenStats) else TokenStats(logprob=actor)
        try:
            into.update(check_gate(stats, batch.old_logprobs, batch.mask, tolerance))
        except LosslessGateError as err:
            raise LosslessGateError(f"step {step}: {err} (nothing of this step was applied)"
                                    ) from None
    return check


class _Timer:
    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.laps: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = now - self.last
        self.last = now

    def metrics(self) -> dict[str, float]:
        out = {f"timing/{k}_s": v for k, v in self.laps.items()}
        out["timing/step_s"] = self.last - self.start
        return out


OnFinish = Callable[[Completion], None]

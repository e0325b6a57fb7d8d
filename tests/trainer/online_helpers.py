"""Helpers for the online drafter tests: an EAGLE engine, an OnlineDrafter whose trainer is a
Ray actor of its own (as the local backend places it; Ray up: the local_ray fixture), and one
RL step of the drafter's side without an actor."""

from __future__ import annotations

import time

from fastdraft import RolloutEngine, SamplingParams, SpecConfig
from fastdraft.config.sections import OnlineDrafterConfig
from fastdraft.trainer.online_drafter import OnlineDrafter


def eagle_engine(policy, drafter, aux: tuple[int, ...] = ()) -> RolloutEngine:
    return RolloutEngine(policy, max_batch_size=8, max_seq_len=64, drafter=drafter,
                         spec=SpecConfig(method="eagle", depth=3, topk=2, tokens_to_verify=4),
                         capture_aux_layers=aux)


def start_own_actor(setup, cfg, stats):
    """The local backend's trainer: a Ray actor of its own beside this process."""
    from fastdraft.workers.trainer_actor import RayTrainer, beside
    return RayTrainer(setup, cfg, stats, beside(setup.spot.device))


def online_drafter(cfg: OnlineDrafterConfig, engine, **kwargs) -> OnlineDrafter:
    return OnlineDrafter(cfg, engine, start_trainer=start_own_actor, **kwargs)


PROMPTS = [[5 + i, 9, 11 + 2 * i, 7] for i in range(6)]


def drive_step(online, engine: RolloutEngine, step: int, train_s: float = 1.5,
               accept_length: float | str | None = "measured") -> dict[str, float]:
    """One RL step of the online drafter's side (rollout with its hooks, rewards, a training
    window standing in for the actor update, the step boundary); returns after_step's metrics.
    accept_length: what the health check is told ("measured": the rollout's own)."""
    online.start_rollout(step, len(PROMPTS), engine)
    engine.generate(PROMPTS, SamplingParams(temperature=1.0, seed=step, max_new_tokens=24),
                    on_finish=online.on_finish, on_hidden=online.on_hidden)
    online.end_rollout([float(i % 2) for i in range(len(PROMPTS))])
    online.start_update()
    time.sleep(train_s)
    online.end_update()
    if accept_length == "measured":
        accept_length = (engine.last_stats.as_metrics()["rollout/accept_length"]
                         if engine.spec.enabled else None)
    engine.advance_step()
    return online.after_step(engine, accept_length)

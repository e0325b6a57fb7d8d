"""OnlineDrafter: the RL loop's side of online drafter training. It turns the rollout's hidden
states into DataBuffer samples as requests finish, lets the trainer (a Ray actor of its own, or a
member inside each hybrid worker: workers/trainer_actor.py, workers/trainer_group.py) train while
the step leaves compute idle (the rollout's long tail, the actor update), and publishes the new
drafter into the engine at the step boundary, checksummed and versioned, after a health check
(trainer/drafter_health.py).

The run survives its drafter. A worker that dies, hangs past drafter.online.reply_timeout_s,
raises, or publishes a non-finite drafter is logged (one line, drafter/worker_failures), killed
and restarted from the last good drafter and its last trainer state while
drafter.online.max_restarts allows; after that the run goes on with the last good drafter (or
plain decoding) and captures and trains nothing. A bad publish never reaches the engine.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fastdraft.actor.samples import RowHidden, actor_samples
from fastdraft.algo.sequences import SequenceBatch
from fastdraft.config.sections import OnlineDrafterConfig
from fastdraft.drafter.checkpoint import trainable_named_tensors
from fastdraft.drafter.losses import LOSSES as KIND_LOSSES
from fastdraft.engine import Completion
from fastdraft.engine.rollout import Rollout
from fastdraft.errors import FastdraftError
from fastdraft.trainer.collector import SampleCollector
from fastdraft.trainer.drafter_health import DrafterHealth, published_problem
from fastdraft.trainer.fixed_drafter import engine_drafter_state, load_engine_drafter
from fastdraft.trainer.service import TrainerHandle, TrainerSetup, WorkerFailure
from fastdraft.trainer.spot import HeldOutCheck, SpotConfig, SpotStats


class OnlineDrafter:
    def __init__(self, cfg: OnlineDrafterConfig, engine: Rollout, seed: int = 0,
                 resume: dict | None = None, *, start_trainer: StartTrainer,
                 device: str | None = None) -> None:
        """resume: the checkpoint's drafter state (`state_dict`): the engine's drafter, the
        trainer's state, the health. start_trainer: starts the trainer where the run places
        it (run/placement.trainer_placement: a Ray actor of its own, or members inside the
        hybrid workers); device: where it trains unless drafter.online.device says (default:
        the engine's)."""
        drafter = engine.model_drafter
        if drafter is None:
            raise FastdraftError("drafter.online.enabled needs a drafter in the engine: set "
                                 "rollout.spec.method=eagle")
        self.cfg, self.seed, self.engine = cfg, seed, engine
        # auto: the engine's capture where it has one (fastdraft's engine; vLLM has none)
        self.source = (cfg.source if cfg.source != "auto"
                       else "engine" if engine.captures_hidden else "actor")
        self.loss = online_loss(cfg.loss, drafter.kind)
        self.start_trainer = start_trainer
        self.device = cfg.device or device or str(next(engine.model.parameters()).device)
        self.spot = SpotConfig(loss=self.loss, lr=cfg.lr, lr_warmup_steps=cfg.lr_warmup_steps,
                               token_budget=cfg.token_budget,
                               compute_dtype=cfg.compute_dtype_on(self.device),
                               device=self.device)   # checked here: a bad device fails now
        self.spec = engine.spec   # what a re-probe switches back on after a fallback
        self.health = DrafterHealth()
        self.version = engine.drafter_version or 0   # of the last good drafter
        resume = resume or {}
        self.version = load_engine_drafter(engine, resume, self.version)
        self._trainer_state: dict | None = resume.get("trainer")   # what a restart continues
        self.health.load_state_dict(resume.get("health"), engine)
        self.worker: TrainerHandle | None = self._start_worker(self._trainer_state)
        hidden = engine.config.hidden_size * 2 * (1 + len(drafter.aux_layers))  # bf16 rows
        self.collector = SampleCollector(self, int(cfg.inflight_mb * 2**20), hidden + 16)
        self._remaining, self._threshold = 0, 0.0
        self._steps_at_start = 0
        self._dropped_at_start = self._inbox_dropped = self._inbox_at_start = 0
        self._added_at_start = 0
        self.accept_at_publish: float | None = None
        self.check: HeldOutCheck | None = None   # the last publish's held-out check
        self._answered = False   # the trainer answered a publish at this step boundary
        self.pause_s = 0.0
        self._tokens_at_idle: int | None = None   # trainer tokens when an idle worker freed up
        self.train_tokens_on_idle = 0
        self.idle_promotions = 0   # idle rollout workers promoted to drafter training this step

    def _start_worker(self, state: dict | None) -> TrainerHandle:
        engine, cfg = self.engine, self.cfg
        policy, drafter = engine.model, engine.model_drafter
        tied = policy.config.tie_word_embeddings
        return self.start_trainer(TrainerSetup(
            drafter=drafter.detached(), policy_config=policy.config,
            embed=policy.model.embed_tokens.weight.detach().cpu().clone(),
            lm_head=None if tied else policy.lm_head.weight.detach().cpu().clone(),
            spot=self.spot, buffer_bytes=int(cfg.buffer_mb * 2**20),
            offset_mix=cfg.offset_mix, seed=self.seed, num_threads=cfg.num_threads,
            max_steps_per_step=cfg.max_steps_per_step, max_sample_tokens=cfg.window_tokens,
            window_context=cfg.context_tokens, holdout_every=cfg.holdout_every,
            state=state), cfg, SpotStats.of_state(state))

    # --------------------------------------------------------------- the collector's buffer
    def add(self, sample) -> None:
        if self.worker is not None:
            self.worker.add(sample)

    def add_many(self, samples) -> None:
        """A rollout worker's samples, or a Ray reference to them (passed on unopened)."""
        if self.worker is not None:
            self.worker.add_many(samples)

    def set_reward(self, key: tuple[int, int], reward: float | None) -> None:
        if self.worker is not None:
            self.worker.set_reward(key, reward)

    @property
    def consuming(self) -> bool:
        """Whether anything will use what is captured: a worker, and a drafter that may serve
        again (not a final fallback)."""
        return self.worker is not None and not (self.health.fallback
                                                and self.cfg.reprobe_every == 0)

    @property
    def on_hidden(self) -> SampleCollector | None:
        """The engine's hidden-state sink; None (no capture at all) while nothing consumes, or
        when the samples come from the actor's forward."""
        return self.collector if self.consuming and self.source == "engine" else None

    @property
    def actor_hidden_layers(self) -> tuple[int, ...] | None:
        """What the actor's update forward must hand back for this drafter's samples (the
        inputs of its aux layers, besides the final hidden states); None: nothing."""
        if not self.consuming or self.source != "actor":
            return None
        return tuple(self.engine.model_drafter.aux_layers)

    def add_actor_samples(self, batch: SequenceBatch, hidden: dict[int, RowHidden],
                          requests: list[int], rewards: list[float]) -> None:
        """The samples of the actor's forward over the update batch (row r: rollout request
        requests[r]), each with its request's reward."""
        if not self.consuming:
            return
        samples = actor_samples(batch, hidden, requests, [rewards[i] for i in requests],
                                self.collector.rl_step, self.engine.policy_version)
        self.collector.add_remote(samples, len(samples), 0, sum(s.nbytes for s in samples))

    # ----------------------------------------------------------------------------- rollout
    def start_rollout(self, step: int, num_requests: int, engine: Rollout) -> None:
        if self.worker is not None and not self.worker.alive:
            self._fail(f"the drafter worker died ({self.worker.death})")
        self.collector.start_step(step)
        self.train_tokens_on_idle = self.idle_promotions = 0
        self._remaining, self._threshold = num_requests, self.cfg.tail_fraction * num_requests
        self.pause_s = 0.0
        self._dropped_at_start = self.collector.dropped_tokens
        self._added_at_start = self.collector.num_added
        self._inbox_at_start = self._inbox_dropped_total()
        if self.consuming:
            self.worker.advance_step()
            self.worker.sync_policy(engine.model.named_parameters())
        self._steps_at_start = self._stats().steps

    def on_finish(self, completion: Completion) -> None:
        if not self.consuming:
            return
        self.collector.on_finish(completion)
        self._remaining -= 1
        if self._remaining < self._threshold:
            self.worker.go()   # the long tail: the engine runs few rows

    def on_worker_idle(self, worker: int | None = None) -> bool:
        """Rollout worker `worker` finished its share while others still generate (Ray
        backend): its device is free for the rest of the rollout, so the trainer starts now,
        whatever the tail threshold says (the coordinator's promotion of an idle worker). True
        when this call promoted it: one trainer (fed by every worker's samples) on the first
        idle worker, a data-parallel group (workers/trainer_group.py) on each."""
        if not self.consuming:
            return False
        if self._tokens_at_idle is None:
            self._tokens_at_idle = self._stats().tokens
        elif not self.worker.per_worker:
            return False
        self.worker.go(worker)
        self.idle_promotions += 1
        return True

    def end_rollout(self, rewards: list[float]) -> None:
        self._pause()
        if self.consuming:
            self.collector.set_rewards(rewards)

    def _settle(self) -> None:
        """The last pause in effect (the RayTrainer's pause does not wait for its running
        micro-step), then what the rollout's idle time trained."""
        self._call("settle")
        if self._tokens_at_idle is not None:
            self.train_tokens_on_idle = self._stats().tokens - self._tokens_at_idle
            self._tokens_at_idle = None

    # ------------------------------------------------------------------------ actor update
    def start_update(self) -> None:
        if self.cfg.during_update and self.consuming:
            self._settle()   # the idle time's tokens, before the update's are added
            self._call("go", None, True)   # every worker: none generates now (a trainer
                                           # found dead by the settle is gone by now)

    def end_update(self) -> None:
        self._pause()

    def close(self, timeout_s: float = 30.0) -> None:
        if self.worker is not None:
            self.worker.close(timeout_s)

    def _pause(self) -> None:
        start = time.perf_counter()
        self._call("pause")
        self.pause_s += time.perf_counter() - start

    # ------------------------------------------------------------------- worker failures
    def _call(self, method: str, *args: Any) -> Any:
        """worker.method(*args), or None when there is no worker or it failed (handled)."""
        if self.worker is None:
            return None
        try:
            return getattr(self.worker, method)(*args)
        except WorkerFailure as err:
            self._fail(str(err))
            return None

    def _fail(self, reason: str) -> None:
        """The worker is gone (or must go): kill it, then restart it from the last good
        drafter and the last trainer state, or go on without one."""
        self.health.worker_failures += 1
        self._inbox_dropped += self.worker.inbox_dropped
        self.worker.close(timeout_s=1.0)   # broken: no long goodbye
        stats, self.worker = self.worker.stats, None
        if self.health.restarts >= self.cfg.max_restarts:
            print(f"drafter: {reason.splitlines()[0]}; no restart left (drafter.online."
                  f"max_restarts={self.cfg.max_restarts}): going on with drafter version "
                  f"{self.version}, training and capturing nothing")
            return
        self.health.restarts += 1
        print(f"drafter: {reason.splitlines()[0]}; restarting the worker from drafter version "
              f"{self.version} (restart {self.health.restarts} of {self.cfg.max_restarts})")
        good = dict(trainable_named_tensors(self.engine.model_drafter))
        self.worker = self._start_worker({
            **(self._trainer_state or {}), "drafter": good, "version": self.version,
            "steps": stats.steps, "tokens": stats.tokens, "preemptions": stats.preemptions})

    # --------------------------------------------------------------------- publish, health
    def after_step(self, engine: Rollout, accept_length: float | None
                   ) -> dict[str, float]:
        """At the step boundary: the health check, then (as `refresh` says) the new drafter
        into the engine, or after a fallback (every reprobe_every steps) a re-probe of the
        newest one. Returns the step's drafter metrics."""
        self._settle()
        metrics = self._metrics()
        self.check, self._answered = None, False
        if self.health.observe(engine, accept_length):
            self.health.trainer_steps_at_fallback = self._stats().steps
        elif (self.health.due_for_reprobe(self.cfg.reprobe_every)
              and self._stats().steps > self.health.trainer_steps_at_fallback
              and self._publish(engine)):   # a drafter newer than the one given up on
            self.health.resume_speculation(engine, self.spec)
            print(f"drafter: speculation back on to re-probe drafter version {self.version}")
            self.accept_at_publish = None
            metrics["drafter/reprobed"] = 1.0
        elif (not self.health.fallback and accept_length is not None
              and self._should_refresh(accept_length) and self._publish(engine)):
            self.accept_at_publish = None   # set by the first step on the new drafter
            metrics["drafter/refreshed"] = 1.0
            metrics["drafter/accept_length_before_refresh"] = accept_length
        elif accept_length is not None and self.accept_at_publish is None:
            self.accept_at_publish = accept_length
        if self._answered:   # the publish may have topped the training up
            metrics.update(self._metrics())
        if self.check is not None:
            metrics.update({"drafter/held_out_accept": self.check.candidate,
                            "drafter/held_out_serving_accept": self.check.serving,
                            "drafter/withheld": float(not self.check.passed),
                            "drafter/held_out_check_s": self.check.seconds})
        return {**metrics, **self.health.metrics(),
                "drafter/worker_alive": float(self.worker is not None and self.worker.alive)}

    def _publish(self, engine: Rollout) -> bool:
        """The worker's newest drafter into the engine; False (the engine keeps the last good
        one) when the worker fails or what it sent is not a sound drafter."""
        published = self._call("publish", self.cfg.min_steps_per_step)
        if published is None:
            return False
        self.check, self._answered = published.check, True
        if published.withheld:   # the serving drafter scored higher: it stays
            return False
        problem, diverged = published_problem(published, engine)
        if problem is None:
            try:
                engine.load_drafter_weights(published.tensors, published.version,
                                            checksum=published.checksum,
                                            held_by=published.held_by)
            except ValueError as err:   # corrupted on the way: nothing was loaded
                problem = str(err)
        if problem is not None:
            self.health.rejected += 1
            print(f"drafter: rejected drafter version {published.version}: {problem}; keeping "
                  f"version {self.version}")
            if diverged:   # the trainer itself is broken: start it again from the good drafter
                self._fail(f"the drafter worker published a diverged drafter ({problem})")
            return False
        self.version = published.version
        return True

    def _should_refresh(self, accept_length: float) -> bool:
        if self._stats().steps == 0 and not self.cfg.min_steps_per_step:
            return False   # nothing trained yet: nothing new to publish
        if self.cfg.refresh == "every_step":
            return True
        if self.accept_at_publish is None:
            self.accept_at_publish = accept_length
            return False
        return accept_length <= self.accept_at_publish - self.cfg.refresh_drop

    # ------------------------------------------------------------------ state and metrics
    def trainer_state(self) -> dict | None:
        """The trainer's own state (taken while it is paused); the last one known when the
        worker is gone."""
        state = self._call("state")
        if state is not None:
            self._trainer_state = state
        return self._trainer_state

    def state_dict(self) -> dict[str, Any]:
        """For the run checkpoint: the last good drafter (what the engine serves or, after a
        fallback, would re-probe from), its version, the trainer's state, the health."""
        state = {**engine_drafter_state(self.engine, self.version),
                 "health": self.health.state_dict()}
        trainer = self.trainer_state()
        return state if trainer is None else {**state, "trainer": trainer}

    def _stats(self) -> SpotStats:
        return self.worker.stats if self.worker is not None else SpotStats.of_state(
            self._trainer_state)

    def _inbox_dropped_total(self) -> int:
        return self._inbox_dropped + (self.worker.inbox_dropped if self.worker else 0)

    def _metrics(self) -> dict[str, float]:
        stats, collector = self._stats(), self.collector
        out = {"drafter/train_steps": float(max(stats.steps - self._steps_at_start, 0)),
               "drafter/train_tokens": float(stats.tokens),
               "drafter/preemptions": float(stats.preemptions),
               "drafter/buffer_bytes": float(self.worker.buffer_bytes if self.worker else 0),
               "drafter/cut_samples": float(self.worker.cut_samples if self.worker else 0),
               "drafter/pause_wait_s": self.pause_s,
               "drafter/train_tokens_on_idle": float(self.train_tokens_on_idle),
               "drafter/idle_promotions": float(self.idle_promotions),
               "drafter/dropped_tokens": float(collector.dropped_tokens
                                               - self._dropped_at_start),
               "drafter/inbox_dropped": float(self._inbox_dropped_total()
                                              - self._inbox_at_start),
               "drafter/inflight_mb_peak": collector.peak_bytes / 2**20,
               # rollouts whose samples went to the trainer this step
               "drafter/samples_added": float(collector.num_added - self._added_at_start)}
        if stats.last:
            out.update({"drafter/loss": stats.last["loss"],
                        "drafter/top1_acc": stats.last["top1_acc"],
                        "drafter/top3_acc": stats.last["top3_acc"]})
        if stats.preemption_latencies_s:
            out["drafter/preemption_latency_s"] = stats.preemption_latencies_s[-1]
        if self.worker is not None and self.worker.rss_mb is not None:
            out["drafter/worker_rss_mb"] = self.worker.rss_mb
        return out


# ---------------------------------------------------------------------------------- helpers
StartTrainer = Callable[[TrainerSetup, OnlineDrafterConfig, SpotStats], TrainerHandle]


def online_loss(loss: str | None, kind: str) -> str:
    """drafter.online.loss, or the drafter kind's own loss; a kind's loss for another kind is
    refused here, before the worker would raise on its first micro-step."""
    name = loss or kind
    if name in KIND_LOSSES and name != kind:
        raise FastdraftError(f"drafter.online.loss={name} trains an {name} drafter, but the run's "
                             f"drafter is {kind}: set drafter.online.loss={kind} or reward_kd, or "
                             "leave it unset (the drafter kind's own loss)")
    return name


def trainer_aux_layers(cfg: OnlineDrafterConfig, drafter_dir: Path | None) -> tuple[int, ...]:
    """The policy layers whose inputs the online trainer's drafter reads (EAGLE-3; () for
    EAGLE-1 or when nothing trains online): the engine must capture them for the trainer."""
    if not cfg.enabled or drafter_dir is None:
        return ()
    from fastdraft.drafter import build_drafter
    from fastdraft.drafter.checkpoint import CONFIG_FILE, saved_options
    from fastdraft.models import ModelConfig
    meta = json.loads((Path(drafter_dir) / CONFIG_FILE).read_text())
    with torch.device("meta"):   # only its shape is asked for: no weights allocated
        drafter = build_drafter(meta["kind"], ModelConfig.from_hf_dict(meta["policy_config"]), 1,
                                **saved_options(meta))
    return tuple(drafter.aux_layers)

"""OnlineDrafter: the RL loop's side of online drafter training. It turns the rollout's hidden
states into DataBuffer samples as requests finish, lets the SpotWorker (a process of its own,
trainer/worker.py) train while the step leaves compute idle (the rollout's long tail, the actor
update), and publishes the new drafter into the engine at the step boundary, checksummed and
versioned, after a health check.
"""

from __future__ import annotations

import time

from fastdraft.config.sections import OnlineDrafterConfig
from fastdraft.engine import Completion, RolloutEngine
from fastdraft.trainer.collector import SampleCollector
from fastdraft.trainer.spot import SpotConfig
from fastdraft.trainer.worker import SpotWorker, WorkerSetup, pickle_state

#: Accept length at or below this, over HEALTH_WINDOW steps, means the drafter is broken.
COLLAPSED_ACCEPT_LENGTH, HEALTH_WINDOW = 1.5, 3


class OnlineDrafter:
    def __init__(self, cfg: OnlineDrafterConfig, engine: RolloutEngine, seed: int = 0,
                 resume_state: dict | None = None) -> None:
        drafter = engine.model_drafter
        if drafter is None:
            raise ValueError("drafter.online.enabled needs a drafter in the engine: set "
                             "rollout.spec.method=eagle")
        self.cfg = cfg
        policy = engine.model
        tied = policy.config.tie_word_embeddings
        self.worker = SpotWorker(WorkerSetup(
            drafter=drafter.detached(), policy_config=policy.config,
            embed=policy.model.embed_tokens.weight.detach().cpu().clone(),
            lm_head=None if tied else policy.lm_head.weight.detach().cpu().clone(),
            spot=SpotConfig(loss=cfg.loss, lr=cfg.lr, token_budget=cfg.token_budget),
            buffer_bytes=int(cfg.buffer_mb * 2**20), offset_mix=cfg.offset_mix, seed=seed,
            num_threads=cfg.num_threads, max_steps_per_step=cfg.max_steps_per_step,
            state=None if resume_state is None else pickle_state(resume_state)))
        self.collector = SampleCollector(self.worker)
        self._remaining, self._threshold = 0, 0.0
        self._steps_at_start = 0
        self.accept_history: list[float] = []
        self.accept_at_publish: float | None = None
        self.pause_s = 0.0

    @property
    def on_hidden(self):
        return self.collector.on_hidden

    # ----------------------------------------------------------------------------- rollout
    def start_rollout(self, step: int, num_requests: int, engine: RolloutEngine) -> None:
        self.worker.advance_step()
        self.collector.start_step(step)
        self.worker.sync_policy(engine.model.named_parameters())
        self._remaining, self._threshold = num_requests, self.cfg.tail_fraction * num_requests
        self._steps_at_start = self.worker.stats.steps
        self.pause_s = 0.0

    def on_finish(self, completion: Completion) -> None:
        self.collector.on_finish(completion)
        self._remaining -= 1
        if self._remaining < self._threshold:
            self.worker.go()   # the long tail: the engine runs few rows

    def end_rollout(self, rewards: list[float]) -> None:
        self._pause()
        self.collector.set_rewards(rewards)

    # ------------------------------------------------------------------------ actor update
    def start_update(self) -> None:
        if self.cfg.during_update:
            self.worker.go()

    def end_update(self) -> None:
        self._pause()

    def close(self) -> None:
        self.worker.close()

    def trainer_state(self) -> dict | None:
        """The trainer's own state for the run checkpoint (taken while it is paused)."""
        return self.worker.state()

    def _pause(self) -> None:
        start = time.perf_counter()
        self.worker.pause()
        self.pause_s += time.perf_counter() - start

    # --------------------------------------------------------------------- publish, health
    def after_step(self, engine: RolloutEngine, accept_length: float | None
                   ) -> dict[str, float]:
        """At the step boundary: the health check, then (as `refresh` says) the new drafter
        into the engine. Returns the step's drafter metrics."""
        metrics = self._metrics()
        if accept_length is None:   # speculation is off (or fell back): nothing to refresh
            return metrics
        if health_check(engine, self.accept_history, accept_length):
            return {**metrics, "drafter/fallback": 1.0}
        if self._should_refresh(accept_length):
            published = self.worker.publish()
            engine.load_drafter_weights(published.tensors, published.version,
                                        checksum=published.checksum)
            self.accept_at_publish = None   # set by the first step on the new drafter
            metrics["drafter/refreshed"] = 1.0
            metrics["drafter/accept_length_before_refresh"] = accept_length
        elif self.accept_at_publish is None:
            self.accept_at_publish = accept_length
        return metrics

    def _should_refresh(self, accept_length: float) -> bool:
        if self.worker.stats.steps == 0:
            return False
        if self.cfg.refresh == "every_step":
            return True
        if self.accept_at_publish is None:
            self.accept_at_publish = accept_length
            return False
        return accept_length <= self.accept_at_publish - self.cfg.refresh_drop

    def _metrics(self) -> dict[str, float]:
        stats, last = self.worker.stats, self.worker.stats.last
        out = {"drafter/train_steps": float(stats.steps - self._steps_at_start),
               "drafter/train_tokens": float(stats.tokens),
               "drafter/preemptions": float(stats.preemptions),
               "drafter/buffer_bytes": float(self.worker.buffer_bytes),
               "drafter/pause_wait_s": self.pause_s}
        if last:
            out.update({"drafter/loss": last["loss"], "drafter/top1_acc": last["top1_acc"],
                        "drafter/top3_acc": last["top3_acc"]})
        if stats.preemption_latencies_s:
            out["drafter/preemption_latency_s"] = stats.preemption_latencies_s[-1]
        if self.worker.rss_mb is not None:
            out["drafter/worker_rss_mb"] = self.worker.rss_mb
        return out


def health_check(engine: RolloutEngine, history: list[float], accept_length: float) -> bool:
    """Records the step's accept length; after HEALTH_WINDOW steps at or below
    COLLAPSED_ACCEPT_LENGTH the engine falls back to plain decoding (True): a broken drafter
    (zeroed, misloaded, or for another policy) must never make rollouts slower than plain."""
    history.append(accept_length)
    del history[:-HEALTH_WINDOW]   # all the check reads: a run of days keeps no more
    if len(history) < HEALTH_WINDOW or max(history) > COLLAPSED_ACCEPT_LENGTH:
        return False
    engine.fall_back_to_plain(f"accept length {[round(a, 3) for a in history]} <= "
                              f"{COLLAPSED_ACCEPT_LENGTH} for {HEALTH_WINDOW} steps: the "
                              "drafter is broken")
    print(f"drafter: falling back to plain decoding: {engine.fallback_reason}")
    return True


class FixedDrafter:
    """The loop's drafter side when the drafter is not trained online: the health check."""

    on_hidden = None

    def __init__(self) -> None:
        self.accept_history: list[float] = []

    def start_rollout(self, step: int, num_requests: int, engine: RolloutEngine) -> None: ...
    def on_finish(self, completion: Completion) -> None: ...
    def end_rollout(self, rewards: list[float]) -> None: ...
    def start_update(self) -> None: ...
    def end_update(self) -> None: ...
    def close(self) -> None: ...

    def trainer_state(self) -> dict | None:
        return None

    def after_step(self, engine: RolloutEngine, accept_length: float | None
                   ) -> dict[str, float]:
        if accept_length is not None and health_check(engine, self.accept_history,
                                                      accept_length):
            return {"drafter/fallback": 1.0}
        return {}

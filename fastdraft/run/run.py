"""A GRPO run assembled from its config (its inputs resolved by run/inputs.py): the policy
and its drafter, the rollout engine, the actor, the algorithm, the prompts, the metrics, the
checkpoints; resumed from the newest complete checkpoint when asked. run/loop.py drives it."""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from fastdraft.actor.rank import ActorSpec
from fastdraft.algo.gate import GateTolerance
from fastdraft.algo.objective import Algorithm
from fastdraft.backends import build_rollout
from fastdraft.checkpoint import CheckpointManager, CheckpointWriteError, TrainState
from fastdraft.checkpoint.layout import MODEL_DIR, validate
from fastdraft.checkpoint.sharded import is_sharded, policy_weights
from fastdraft.checkpoint.state import RngState
from fastdraft.cluster.ray_cluster import shutdown
from fastdraft.config import RunConfig, dump_config
from fastdraft.config.recipe import config_dict
from fastdraft.drafter import save_drafter
from fastdraft.engine import Completion
from fastdraft.engine.rollout import Rollout
from fastdraft.errors import FastdraftError, Place
from fastdraft.observability.dashboard import draw_dashboard
from fastdraft.observability.metrics import MetricsLogger
from fastdraft.observability.timeline import Span, TimelineLog, spans_metrics
from fastdraft.run.placement import (
    actor_device,
    actor_ranks,
    build_engine,
    connect_ray,
    trainer_placement,
)
from fastdraft.run.preflight import preflight
from fastdraft.run.resume_check import resume_point
from fastdraft.run.run_dir import RunDirLock
from fastdraft.run.stop import RunStopped, StepClock
from fastdraft.trainer.fixed_drafter import FixedDrafter
from fastdraft.trainer.online_drafter import OnlineDrafter
from fastdraft.utils.atomic import atomic_write_text
from fastdraft.utils.stop_signals import stop_signal_in
from fastdraft.workers.actor import Actor
from fastdraft.workers.pool import RolloutPool


class Run:
    def __init__(self, cfg: RunConfig, run_dir: Path, resume: bool = False,
                 cache_dir: Path | None = None, resume_force: bool = False) -> None:
        self.cfg, self.run_dir = cfg, run_dir
        self.clock = StepClock()   # the step and checkpoint times a stop signal is judged by
        self.checkpoints = CheckpointManager(run_dir, keep=cfg.checkpoint.keep)
        # The checkpoint it resumes from (the dry run's check too), before anything is written.
        latest = resume_point(self.checkpoints, config_dict(cfg), resume, resume_force)
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        # Every check before the first step (the dry run's too), the bootstrap policy and its
        # drafter resolved, the memory plan checked before any allocation.
        inputs = preflight(cfg, None, cache_dir, Place(run_dir, "--run-dir"))
        self.policy_dir, self.tokenizer, self.prompts = (inputs.policy_dir, inputs.tokenizer,
                                                         inputs.prompts)
        drafter_dir, max_seq_len = inputs.drafter_dir, inputs.max_seq_len
        self.memory_plan = inputs.plan
        atomic_write_text(run_dir / "memory_plan.json",
                          json.dumps(self.memory_plan.as_dict(), indent=1))
        self.owns_ray = connect_ray(cfg)   # the roles outside this process live on Ray
        try:
            self._assemble(latest, drafter_dir, max_seq_len)
        except BaseException:
            if self.owns_ray:   # a start that failed leaves no cluster behind
                shutdown()
            raise

    def _assemble(self, latest: Path | None, drafter_dir: Path | None, max_seq_len: int
                  ) -> None:
        """The run's roles built and placed, its state loaded from `latest` (a checkpoint)."""
        cfg, run_dir = self.cfg, self.run_dir
        # The actor scores every position the engine can sample at (its rotary table too); a
        # resumed one starts from the checkpoint's fp32 masters.
        actor_spec = ActorSpec(
            policy_dir=(self.policy_dir if latest is None or is_sharded(latest)
                        else latest / MODEL_DIR),
            reference_dir=self.policy_dir,
            actor=cfg.actor, algorithm=cfg.algorithm, temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
            max_new_tokens=cfg.rollout.max_new_tokens, max_positions=max_seq_len,
            device=cfg.model.device, num_steps=cfg.algorithm.num_steps)
        make_engine = partial(build_engine, cfg, self.policy_dir, drafter_dir, max_seq_len,
                              self.memory_plan.engine_reserve)
        self.engine: Rollout = build_rollout(cfg, make_engine, self.policy_dir, drafter_dir,
                                             run_dir, max_seq_len, actor=actor_spec,
                                             memory_reserve=self.memory_plan.engine_reserve)
        # A Ray pool's own face: its workers' timeline, the hybrid weight sync and ranks.
        self.pool = self.engine if isinstance(self.engine, RolloutPool) else None
        # The checkpoint's state (the RNGs come back here, after the engine's build).
        loaded = self.checkpoints.load(latest) if latest is not None else None
        # Hybrid placement: the rollout workers hold the actor's ranks (and write checkpoints).
        self.worker_ranks = (self.pool.ranks(self.engine.config)
                             if self.pool is not None and self.pool.hybrid else None)
        self.hybrid = self.worker_ranks is not None
        self.actor = Actor(replace(actor_spec, device=actor_device(cfg, self.pool)),
                           ranks=actor_ranks(cfg, self.pool, self.worker_ranks))
        if self.worker_ranks is not None:
            self.checkpoints.pending_elsewhere = self.worker_ranks.wait_checkpoint
            self.checkpoints.poll_elsewhere = self.worker_ranks.poll_checkpoint
        self.algorithm = Algorithm(cfg.algorithm, cfg.rollout.temperature,
                                   max_tokens=cfg.rollout.max_new_tokens)
        # The gate's limits follow the dtypes of both sides' logprobs (the coarser rules).
        self.gate_tolerance = GateTolerance.for_dtypes(cfg.model.dtype, cfg.actor.compute_dtype,
                                                       cfg.algorithm.gate)
        self.start_step = 0
        drafter_resume = None
        if loaded is not None:
            schedule = {"scheduler": loaded.scheduler,
                        "loss_scale": loaded.extra.get("loss_scale")}
            if loaded.sharded:   # hybrid workers wrote it: every rank reads its part
                self.actor.load_shards(latest, schedule)
            else:
                self.actor.load_training_state({"optimizer": loaded.optimizer, **schedule})
            self.start_step = loaded.step
            self.push_weights(version=loaded.step)
            self.engine.load_state_dict(loaded.extra["engine"])
            # The drafter the run served (and trained), its trainer, its health: put back by
            # OnlineDrafter / FixedDrafter below.
            drafter_resume = loaded.drafter
            print(f"resumed from {latest} (step {loaded.step})")
        self.logger = MetricsLogger(run_dir, cfg.logging, config_dict(cfg), cfg.name,
                                    cfg.algorithm.num_steps, self.start_step)
        # Each rollout worker's states per step (cluster_timeline.jsonl: the dashboard's Gantt).
        self.timeline = None if cfg.cluster.backend == "local" else TimelineLog(
            run_dir, self.start_step)
        # Callbacks on every finished rollout (the online drafter trainer listens here).
        self.drafter: OnlineDrafter | FixedDrafter = (
            OnlineDrafter(cfg.drafter.online, self.engine, cfg.seed, drafter_resume,
                          **trainer_placement(cfg, self.pool))
            if cfg.drafter.online.enabled else FixedDrafter(self.engine, drafter_resume))
        self.on_finish_hooks: list[Callable[[Completion], None]] = [self.drafter.on_finish]
        if self.pool is not None and isinstance(self.drafter, OnlineDrafter):
            self.pool.idle_hook = self.drafter.on_worker_idle   # idle workers' time trains it
        self.last_checkpoint_s = 0.0
        self.saved_step = self.start_step   # the step of the newest checkpoint of this run
        # Written once the run is built: a refused or failed start leaves the last one as it was.
        dump_config(cfg, run_dir / "config.yaml")


    def push_weights(self, version: int | None = None, advance_step: bool = False) -> int:
        """The actor's weights into the rollout engine(s): hybrid workers each load their own
        from the shards on the device (advance_step: and end the engines' step, in the same
        call); otherwise streamed from this process's gather. Returns the engine's new policy
        version."""
        if self.pool is not None and self.pool.hybrid:
            return self.pool.sync_weights(version, advance_step)
        version = self.engine.load_weights(self.actor.full_parameters(), version)
        if advance_step:
            self.engine.advance_step()
        return version

    def on_finish(self, completion: Completion) -> None:
        for hook in self.on_finish_hooks:
            hook(completion)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def rollout_metrics(self, completions: list[Completion], rewards: list[float]
                        ) -> dict[str, float]:
        trace, stats = self.engine.last_trace, self.engine.last_stats
        lengths = [len(c.token_ids) for c in completions]
        mean = sum(rewards) / len(rewards)
        out = {"reward/mean": mean,
               "reward/std": (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5,
               "rollout/time_s": trace.time_s, "rollout/tail_time_s": trace.tail_time_s(),
               "rollout/tokens_per_s": sum(lengths) / max(trace.time_s, 1e-9),
               "rollout/response_len_mean": sum(lengths) / len(lengths),
               "rollout/response_len_max": float(max(lengths)),
               # prompt tokens prefilled, and of them computed (a group's prompt once)
               "rollout/prefill_tokens": float(trace.prefill_tokens),
               "rollout/prefill_computed_tokens": float(trace.prefill_computed),
               # requests whose KV blocks ran out and were recomputed (engine/paged_kv.py)
               "rollout/preemptions": float(trace.preemptions),
               # CUDA graphs captured this step and their seconds (all workers; 0 off CUDA)
               "rollout/graph_captures": float(trace.graph_captures),
               "rollout/graph_capture_s": trace.graph_capture_s}
        if self.engine.spec.enabled:   # not after a health fallback
            out.update(stats.as_metrics())
            out["rollout/sd_fraction"] = trace.sd_fraction
            out["drafter/version"] = float(self.engine.drafter_version or 0)
        return out

    def cluster_metrics(self, step: int, laps: dict[str, float]) -> dict[str, float]:
        """A Ray run's per-worker seconds generating / idle this step (and the weight push),
        its timeline line written; {} for a local run. laps: the step's phase seconds."""
        pool = self.pool
        if pool is None or self.timeline is None:
            return {}
        update_start = laps["rollout"] + laps["reward"]
        push_start = update_start + laps["update"]
        updaters = pool.worker_names if pool.hybrid else ["actor"]
        spans = [*pool.last_spans,
                 *(Span(w, "update", update_start, push_start) for w in updaters),
                 *(Span(w, "push", push_start, push_start + laps["push"])
                   for w in pool.worker_names)]
        self.timeline.log(step, spans)
        return {**spans_metrics(spans, pool.worker_names),
                "cluster/push_s": pool.last_push_s,
                "cluster/worker_restarts": float(pool.restarts),
                "cluster/rerun_requests": float(pool.reruns),
                "cluster/migrated_requests": float(pool.last_migrated),
                # colocated placement: what the workers gave back for the actor's update
                "cluster/released_mb": pool.last_released_bytes / 2**20}

    def save_checkpoint(self, step: int) -> None:
        start = time.perf_counter()
        if self.worker_ranks is not None:   # worker 0 writes it: no weight comes here
            # The previous write's failure raised here, before the collective: worker 0 would
            # raise it inside one, and leave its peers waiting there.
            self.worker_ranks.wait_checkpoint()
            _, previous = self.worker_ranks.save_checkpoint(
                str(self.checkpoints.root), self.cfg.checkpoint.keep, step,
                {"config": config_dict(self.cfg), "drafter": self._drafter_state(),
                 "extra": {"engine": self.engine.state_dict()}, "rng": RngState.capture()})
            self.last_checkpoint_s = time.perf_counter() - start
            self.clock.checkpoint_s = self.last_checkpoint_s + previous
            self.saved_step = step
            return
        with self.actor.full_state() as (model, training):
            self.checkpoints.save(step, TrainState(
                model=model, optimizer=training["optimizer"], scheduler=training["scheduler"],
                step=step, config=config_dict(self.cfg), drafter=self._drafter_state(),
                extra={"engine": self.engine.state_dict(),
                       "loss_scale": training["loss_scale"]}))
        self.last_checkpoint_s = time.perf_counter() - start
        self.clock.checkpoint_s = self.last_checkpoint_s + self.checkpoints.last_write_s
        self.saved_step = step

    def check_checkpoint(self) -> None:
        """At a step boundary, without waiting: a checkpoint write that failed raises its
        CheckpointWriteError here; one still running is checked at the next boundary (and at
        the next save, and before the run's end, which wait for it)."""
        self.checkpoints.poll()

    def end_after_write_failure(self) -> None:
        """The run's end after a checkpoint write failed (the caller raises that error, the
        line the user reads): the helpers closed, then the drafter saved and exported and the
        metrics closed as at a normal end, as far as the run directory still takes files (what
        did not is one line); the newest whole checkpoint is what a resume starts from."""
        try:   # failed: hybrid worker 0 may wait in a collective a peer left (bounded wait)
            self._close_helpers(failed=True)
        except CheckpointWriteError:
            pass   # the write being reported (hybrid: worker 0's, seen again), or the next
        except Exception as err:
            print(f"fastdraft: while closing after a failed checkpoint write: {err!r}",
                  file=sys.stderr)
        try:
            self._save_outputs()
        except Exception as err:   # best effort: the failed write is the error to report
            from fastdraft.errors import describe_os_error, os_error_in
            found = os_error_in(err)
            why = describe_os_error(found, [Place(self.run_dir, "--run-dir")]) if found else err
            print(f"fastdraft: warning: the run's drafter, export or dashboard was not written "
                  f"after the failed checkpoint write: {why}", file=sys.stderr)
        finally:
            try:
                self.logger.close()
            except Exception as err:
                print(f"fastdraft: while closing the metrics: {err!r}", file=sys.stderr)

    def stop(self, step: int, signum: int) -> None:
        """Ends the run after `step` steps on a stop signal: a checkpoint of it (unless the loop
        just wrote one) on disk, the helpers closed; raises RunStopped."""
        if self.saved_step != step:
            self.save_checkpoint(step)
        self._close_helpers()
        self.logger.close()
        raise RunStopped(step, signum, self.run_dir)

    def abandon(self, signum: int) -> None:
        """Ends the run at once on a stop signal (the step under way dropped): the helpers closed,
        a checkpoint write under way finished; raises RunStopped naming the newest checkpoint."""
        self.close_after_failure()   # the helpers have nothing to save: the checkpoint has it
        latest = self.checkpoints.latest()
        step = validate(latest) if latest is not None else 0
        raise RunStopped(step, signum, self.run_dir, abandoned=True)

    def kill_helpers(self) -> None:
        """The roles outside this process ended at once (an abandoned step: a collective the
        unwinding reaches then fails at once, its peer gone, instead of meeting a peer that is
        inside another collective); closing them again later is a no-op."""
        self.drafter.close(timeout_s=0.0)
        self.actor.close(timeout_s=0.0)

    def close_after_failure(self) -> None:
        """The helpers ended after an error (raised by the caller); a failure while closing is
        printed, not raised over the error that matters."""
        try:
            self._close_helpers(timeout_s=2.0, failed=True)
            self.logger.close()
        except Exception as err:   # the first error is the one to report
            print(f"fastdraft: while closing after an error: {err!r}", file=sys.stderr)

    def _close_helpers(self, timeout_s: float = 30.0, failed: bool = False) -> None:
        """The drafter trainer and the actor's ranks ended (asked, killed after timeout_s), the
        last checkpoint on disk (first: hybrid workers write it, given FAILED_WRITE_WAIT_S
        after a failure; closed either way)."""
        try:
            if self.worker_ranks is not None:
                self.worker_ranks.wait_checkpoint(FAILED_WRITE_WAIT_S if failed else None)
            self.checkpoints.wait()
        finally:
            self.drafter.close(timeout_s)
            self.actor.close(timeout_s)
            self.engine.close()   # a pool's Ray workers, vLLM's processes
            if self.owns_ray:   # and Ray, when the run started it
                shutdown()
            self.checkpoints.close()

    def _drafter_state(self) -> dict[str, Any] | None:
        """What --resume puts back: the engine's last good drafter (trainable tensors) and its
        version, even after a health fallback; the online trainer's state; the health."""
        return self.drafter.state_dict() or None

    def finish(self) -> None:
        self._close_helpers()
        self._save_outputs()
        self.logger.close()

    def _save_outputs(self) -> None:
        """What a run leaves at its end: its drafter (saved and exported), its dashboard."""
        drafter = self.engine.model_drafter
        if drafter is not None:  # saved even unexported, so `fastdraft export --run` can retry
            from fastdraft.export.run_export import export_run_drafter
            save_drafter(drafter, self.run_dir / "drafter",
                         extra={"drafter_version": self.drafter.version})   # last good
            latest = self.checkpoints.latest() if self.cfg.drafter.export else None
            # a sharded checkpoint's policy consolidated (a temp dir) for the export's head
            with policy_weights(latest) if latest else nullcontext() as policy:
                print(export_run_drafter(self.run_dir, drafter.kind, policy,
                                         export=self.cfg.drafter.export).report())
        if self.cfg.logging.dashboard:
            print(f"dashboard: {draw_dashboard(self.run_dir)}")


def run_recipe(cfg: RunConfig, run_dir: Path, resume: bool = False,
               cache_dir: Path | None = None, resume_force: bool = False,
               overwrite: bool = False) -> Any:
    """Runs the recipe to its end, holding run_dir's lock (run/run_dir.py; `overwrite`: run_dir
    may hold files fastdraft did not write). A run whose actor rank died (a killed process, a
    lost GPU) resumes from its last checkpoint by itself, cluster.max_actor_restarts times."""
    with RunDirLock.claim(Path(run_dir), overwrite=overwrite):
        return _run_to_end(cfg, Path(run_dir), resume, cache_dir, resume_force)


def _run_to_end(cfg: RunConfig, run_dir: Path, resume: bool, cache_dir: Path | None,
                resume_force: bool) -> Run:
    from fastdraft.run.loop import train
    restarts = 0
    while True:
        run = Run(cfg, run_dir, resume, cache_dir, resume_force)
        try:
            train(run)
            return run
        except BaseException as err:
            # A stop signal may surface as the error it caused on its way out (a collective
            # whose peer went away while a `finally` ran): it is still the stop the user asked for.
            signum = stop_signal_in(err)
            if signum is not None:
                run.abandon(signum)
            lost = lost_actor_rank(run, err)
            run.close_after_failure()
            if lost is None:
                raise
            if restarts >= cfg.cluster.max_actor_restarts:
                raise ActorRanksLost(
                    f"{lost}, after {restarts} automatic resume(s) (cluster.max_actor_restarts="
                    f"{cfg.cluster.max_actor_restarts}); the checkpoints in {run_dir} are whole: "
                    "resume with --resume once the machine is sound") from err
        restarts += 1
        resume, resume_force = run.checkpoints.latest() is not None, False
        limit = cfg.cluster.max_actor_restarts
        print(f"fastdraft: {lost}; resuming from "
              f"{'the last checkpoint' if resume else 'the start (no checkpoint yet)'} "
              f"(restart {restarts} of cluster.max_actor_restarts={limit})", flush=True)


FAILED_WRITE_WAIT_S = 10.0   # hybrid worker 0's checkpoint write, after a failure
LOST_RANK_GRACE_S = 5.0   # how long a failed collective waits for its peer's death to show


class ActorRanksLost(FastdraftError):
    """Actor ranks kept dying: more than cluster.max_actor_restarts automatic resumes."""


def lost_actor_rank(run: Run, err: BaseException) -> str | None:
    """What an error means when an actor rank is gone: the rank's own error, or a collective
    that failed because its peer died; None for any other error."""
    from fastdraft.errors import exception_chain
    from fastdraft.workers.ranks import ActorRankError
    for link in exception_chain(err):
        if isinstance(link, ActorRankError):
            return str(link).splitlines()[0]
    if not isinstance(err, Exception) or isinstance(err, CheckpointWriteError):
        return None   # a stop (KeyboardInterrupt and the like), a disk: not a lost rank
    try:   # a collective's error (a RuntimeError) may be seen before its peer's death is
        return run.actor.lost_rank(grace_s=LOST_RANK_GRACE_S if isinstance(err, RuntimeError)
                                   else 0.0)
    except Exception:   # the check itself failed: report the original error
        return None

"""The run survives its drafter: a killed or hung worker, a bad publish, a collapsed drafter.
Each is logged, the engine keeps the last good drafter (or decodes plainly), the worker is
restarted while max_restarts allows, a fallback is re-probed, and nothing waits without bound.
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
import torch

from fastdraft import RolloutEngine, SamplingParams
from fastdraft.config.sections import OnlineDrafterConfig
from fastdraft.drafter.checkpoint import trainable_named_tensors
from fastdraft.observability.metrics import read_metrics
from fastdraft.run.loop import train_step
from fastdraft.run.run import Run
from fastdraft.trainer.drafter_health import HEALTH_WINDOW
from fastdraft.trainer.online_drafter import OnlineDrafter
from fastdraft.trainer.spot import Published
from fastdraft.utils.digest import tensor_digest
from tests.run.test_loop import _cfg
from tests.trainer.online_helpers import drive_step, eagle_engine, online_drafter

ON_RAY = pytest.mark.xdist_group("ray")   # one Ray cluster at a time (the [ray] case only)

ONLINE = ["rollout.spec.method=eagle", "drafter.online.enabled=true",
          "drafter.online.token_budget=64", "drafter.online.tail_fraction=1.0",
          "drafter.export=false"]

# One Ray cluster for the module: the trainers the tests start, and the runs (which join it).
pytestmark = pytest.mark.usefixtures("local_ray")


def _online(engine, **cfg) -> OnlineDrafter:
    return online_drafter(OnlineDrafterConfig(enabled=True, token_budget=64, tail_fraction=1.0,
                                             **cfg), engine)


@pytest.mark.parametrize("cluster", [
    pytest.param([], id="local"),
    pytest.param(["cluster.backend=ray", "cluster.rollout_workers=2"], id="ray", marks=ON_RAY)])
def test_a_killed_worker_is_restarted_and_the_run_goes_on(char_policy, char_drafter, tmp_path,
                                                          cluster):
    run = Run(_cfg(char_policy, *ONLINE, f"drafter.path={char_drafter}", *cluster,
                   "algorithm.num_steps=4", "drafter.online.max_restarts=1"), tmp_path / "run")
    served = []   # the drafter version each rollout's completions carry, and the engine's then
    try:
        train_step(run, 0)
        good = run.engine.drafter_version
        first = run.drafter.worker.pid
        os.kill(first, signal.SIGKILL)
        for step in (1, 2, 3):
            version = run.engine.drafter_version
            train_step(run, step)
            if cluster:   # every Ray rollout worker served the one published version
                served.append(({c.drafter_version for part in run.engine.last_parts
                                for c in part.completions}, version))
    finally:
        run.finish()
    assert all(got == {want} for got, want in served)
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(r["rollout/logprob_diff_max"] < 1e-3 for r in rows)
    assert rows[1]["drafter/worker_failures"] == 1 and rows[-1]["drafter/restarts"] == 1
    assert rows[-1]["drafter/worker_alive"] == 1.0
    assert run.drafter.worker is not None and run.drafter.worker.pid != first
    assert run.engine.drafter_version > good   # the restarted worker published again


def test_without_restarts_the_last_good_drafter_serves_and_nothing_is_captured(
        char_policy, char_drafter):
    engine = eagle_engine(char_policy, char_drafter)
    online = _online(engine, max_restarts=0)
    try:
        drive_step(online, engine, 0)
        good = engine.drafter_version
        tensors = [(n, t.clone()) for n, t in trainable_named_tensors(engine.model_drafter)]
        os.kill(online.worker.pid, signal.SIGKILL)
        for step in (1, 2):
            metrics = drive_step(online, engine, step)
    finally:
        online.close()
    assert online.worker is None and online.on_hidden is None   # capture off: no consumer
    assert metrics["drafter/worker_failures"] == 1 and metrics["drafter/worker_alive"] == 0
    assert engine.drafter_version == good and engine.spec.enabled
    assert tensor_digest(trainable_named_tensors(engine.model_drafter)) == tensor_digest(tensors)


def test_a_worker_that_stops_replying_costs_one_timeout_then_is_restarted(char_policy,
                                                                          char_drafter):
    engine = eagle_engine(char_policy, char_drafter)
    online = _online(engine, reply_timeout_s=2.0, max_restarts=1)
    try:
        drive_step(online, engine, 0)
        hung = psutil.Process(online.worker.pid)
        hung.suspend()   # SIGSTOP: alive, never replies
        start = time.monotonic()
        metrics = drive_step(online, engine, 1, train_s=0.0)
        assert time.monotonic() - start < 30   # one bounded wait, not reply_timeout x calls
        assert metrics["drafter/worker_failures"] == 1 and metrics["drafter/restarts"] == 1
        deadline = time.monotonic() + 30
        while hung.is_running() and hung.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the hung trainer's process was not killed"
            time.sleep(0.1)
        version = engine.drafter_version
        drive_step(online, engine, 2, train_s=4.0)
        assert engine.drafter_version > version   # the new worker trains and publishes
    finally:
        online.close()


def test_a_bad_publish_is_rejected_and_the_engine_keeps_its_drafter(char_policy, char_drafter):
    engine = eagle_engine(char_policy, char_drafter)
    online = _online(engine, max_restarts=1)
    try:
        drive_step(online, engine, 0)
        good_version = engine.drafter_version
        good = tensor_digest(trainable_named_tensors(engine.model_drafter))
        tensors = [(n, t.clone()) for n, t in trainable_named_tensors(engine.model_drafter)]
        first_worker = online.worker
        bad = {   # what the worker might send
            "checksum": Published(9, "0" * 16, tensors),
            "nan": Published(9, "x", [(n, torch.full_like(t, float("nan"))) for n, t in tensors]),
            "names": Published(9, "x", tensors[1:])}
        for case in ("checksum", "names", "nan"):
            online.worker.publish = lambda min_steps=0, published=bad[case]: published
            metrics = online.after_step(engine, 3.0)
            assert "drafter/refreshed" not in metrics, case
            assert engine.drafter_version == good_version, case
            assert tensor_digest(trainable_named_tensors(engine.model_drafter)) == good, case
        assert metrics["drafter/rejected"] == 3
        # A diverged (non-finite) trainer was restarted from the good drafter; the others not.
        assert metrics["drafter/restarts"] == 1 and online.worker is not first_worker
    finally:
        online.close()


def test_after_a_fallback_a_newer_drafter_is_reprobed(char_policy, char_drafter):
    engine = eagle_engine(char_policy, char_drafter)
    online = _online(engine, reprobe_every=2)
    try:
        for step in range(HEALTH_WINDOW):   # the health check sees a collapsed drafter
            metrics = drive_step(online, engine, step, accept_length=1.0)
        assert metrics["drafter/fallback"] == 1.0 and engine.spec.method == "none"
        version = online.version
        metrics = drive_step(online, engine, HEALTH_WINDOW)   # plain; still training
        assert engine.spec.method == "none" and online.on_hidden is not None
        assert metrics["drafter/train_steps"] > 0
        metrics = drive_step(online, engine, HEALTH_WINDOW + 1)
        assert metrics.get("drafter/reprobed") == 1.0
        assert engine.spec.method == "eagle" and engine.drafter_version > version
        metrics = drive_step(online, engine, HEALTH_WINDOW + 2)   # speculating again
        assert metrics["drafter/fallback"] == 0.0 and engine.last_stats.num_drafted > 0
        prompt, greedy = [[5, 9, 11, 7]], SamplingParams(greedy=True, max_new_tokens=12)
        plain = RolloutEngine(char_policy, max_seq_len=64).generate(prompt, greedy)
        assert engine.generate(prompt, greedy)[0].token_ids == plain[0].token_ids
    finally:
        online.close()


def test_a_final_fallback_stops_capture_and_training(char_policy, char_drafter):
    engine = eagle_engine(char_policy, char_drafter)
    online = _online(engine, reprobe_every=0)
    try:
        for step in range(HEALTH_WINDOW):
            drive_step(online, engine, step, accept_length=1.0)
        assert engine.spec.method == "none" and online.on_hidden is None
        metrics = drive_step(online, engine, HEALTH_WINDOW)
        assert metrics["drafter/train_steps"] == 0 and "drafter/reprobed" not in metrics
    finally:
        online.close()


def test_the_health_and_the_trained_drafter_survive_a_checkpoint(char_policy, char_drafter):
    """state_dict -> a new engine and OnlineDrafter (what --resume does): the fallback holds,
    the engine gets the last good drafter, the trainer its state, the counters continue."""
    from fastdraft.checkpoint.tree import flatten, unflatten
    engine = eagle_engine(char_policy, char_drafter)
    online = _online(engine, reprobe_every=5)
    try:
        for step in range(HEALTH_WINDOW):
            drive_step(online, engine, step, accept_length=1.0)
        state = online.state_dict()
        served = tensor_digest(trainable_named_tensors(engine.model_drafter))
        trained = online._stats()
    finally:
        online.close()
    tensors: dict = {}
    state = unflatten(flatten(state, "drafter", tensors), tensors)   # as the checkpoint does
    fresh = eagle_engine(char_policy, char_drafter)
    resumed = online_drafter(online.cfg, fresh, resume=state)
    try:
        assert fresh.spec.method == "none" and resumed.health.fallback
        assert resumed.health.fallbacks == 1 and resumed.version == online.version
        assert tensor_digest(trainable_named_tensors(fresh.model_drafter)) == served
        assert resumed._stats().steps == trained.steps > 0
        assert resumed._stats().preemptions == trained.preemptions > 0
        assert resumed.trainer_state()["steps"] == trained.steps
        assert all(torch.equal(t, state["trainer"]["drafter"][n])
                   for n, t in resumed.trainer_state()["drafter"].items())
    finally:
        resumed.close()

"""The SpotWorker's bounds: its inbox never holds more than inbox_samples samples (the rest are
dropped and counted), every wait for it ends (a dead, hung or failing worker is a
WorkerFailure within the reply timeout, never a hung run), and it trains on the device it is
given."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from fastdraft.trainer.service import TrainerSetup, WorkerFailure
from fastdraft.trainer.spot import SpotConfig
from fastdraft.trainer.worker import SpotWorker
from tests.trainer.test_spot import _samples, _setup


def _worker(tiny_checkpoint, timeout_s: float = 60.0, inbox: int = 0, **spot) -> tuple:
    policy, drafter = _setup(tiny_checkpoint)
    worker = SpotWorker(TrainerSetup(
        drafter=drafter, policy_config=policy.config,
        embed=policy.model.embed_tokens.weight.detach().clone(), lm_head=None,
        spot=SpotConfig(token_budget=64, **spot), buffer_bytes=2**24, offset_mix=0.5, seed=0,
        num_threads=1), reply_timeout_s=timeout_s, inbox_samples=inbox)
    return policy, worker


def _stop(pid: int) -> None:
    """SIGSTOP, and wait until the process is stopped (delivery is asynchronous)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_the_inbox_holds_at_most_its_bound_and_counts_what_it_drops(tiny_checkpoint):
    policy, worker = _worker(tiny_checkpoint, inbox=3)
    try:
        worker.publish()                          # up and serving
        _stop(worker.process.pid)                 # a trainer that reads nothing for now
        for s in _samples(policy, 10):
            worker.add(s)
        assert worker.inbox_dropped == 7          # 3 queued, never more
        os.kill(worker.process.pid, signal.SIGCONT)
        worker.publish()
        assert worker.buffer_bytes == sum(s.nbytes for s in _samples(policy, 10)[:3])
        for s in _samples(policy, 3, step=1):     # drained: room for 3 again, whatever the
            worker.add(s)                         # worker has consumed meanwhile
        assert worker.inbox_dropped == 7
    finally:
        worker.close()


def test_a_batch_waits_for_room_in_the_inbox_and_gives_up_at_the_timeout(tiny_checkpoint):
    """The actor's samples of a step arrive at once: they wait for the trainer to drain the
    inbox (add() would drop all but its bound), and the wait ends at the reply timeout."""
    policy, worker = _worker(tiny_checkpoint, timeout_s=2.0, inbox=3)
    try:
        worker.publish()                          # up and serving
        pid = worker.process.pid
        _stop(pid)                                # reads nothing until resumed
        resume = threading.Timer(0.5, os.kill, (pid, signal.SIGCONT))
        resume.start()
        samples = _samples(policy, 10)
        worker.add_many(samples)                  # 3 at once, the rest as room frees
        resume.join()
        assert worker.inbox_dropped == 0
        worker.publish()
        assert worker.buffer_bytes == sum(s.nbytes for s in samples)
        _stop(pid)                                # never resumed within the timeout
        start = time.monotonic()
        worker.add_many(_samples(policy, 10, step=1))
        assert worker.inbox_dropped == 7          # 3 queued; the rest waited 2 s in all
        assert 1.5 < time.monotonic() - start < 10
        os.kill(pid, signal.SIGCONT)
    finally:
        worker.close()


def test_a_hung_worker_is_a_failure_within_the_timeout_and_close_ends_it(tiny_checkpoint):
    _, worker = _worker(tiny_checkpoint, timeout_s=2.0)
    try:
        worker.publish()
        _stop(worker.process.pid)                 # alive, but never replies
        start = time.monotonic()
        with pytest.raises(WorkerFailure, match="hangs"):
            worker.publish()
        assert time.monotonic() - start < 10
    finally:
        start = time.monotonic()
        worker.close(timeout_s=2.0)
    assert not worker.process.is_alive() and time.monotonic() - start < 10


def test_a_dead_worker_is_a_failure_at_once_and_nothing_is_queued_for_it(tiny_checkpoint):
    policy, worker = _worker(tiny_checkpoint)
    try:
        worker.publish()
        worker.go()
        os.kill(worker.process.pid, signal.SIGKILL)
        worker.process.join(timeout=10)
        start = time.monotonic()
        with pytest.raises(WorkerFailure, match="died"):
            worker.pause()
        assert time.monotonic() - start < 5
        worker.add(_samples(policy, 1)[0])
        assert not worker.alive and worker._inbox.qsize() == 0
    finally:
        worker.close()


def test_an_error_in_the_worker_reaches_the_caller(tiny_checkpoint):
    _, worker = _worker(tiny_checkpoint)
    try:
        worker._put("no_such_method")
        with pytest.raises(WorkerFailure, match="no attribute 'no_such_method'"):
            worker.publish()
    finally:
        worker.close()


def test_the_trainer_is_built_on_the_device_it_is_given(tiny_checkpoint):
    _, worker = _worker(tiny_checkpoint, device="cpu")
    try:
        worker.publish()
        assert worker.stats.device == "cpu"
    finally:
        worker.close()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"drafter\.online\.device=cpu"):
            SpotConfig(device="cuda")

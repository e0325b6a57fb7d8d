"""SIGKILL at random moments while checkpoints are being written: whatever `latest()` returns
afterwards loads completely and holds exactly what the killed process saved for that step."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from fastdraft.checkpoint import CheckpointManager, CheckpointWarning, validate
from fastdraft.checkpoint.layout import step_dirs, temp_dirs
from tests.checkpoint.tiny import tiny_model

REPO = Path(__file__).resolve().parents[2]
KILLS = 3  # each kill costs a fresh process (~3 s of CPU importing torch)


def _start(run_dir: Path, log: Path) -> subprocess.Popen:
    with log.open("w") as err:  # the child keeps its own descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "tests.checkpoint.sigkill_child", str(run_dir)], cwd=REPO,
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err, text=True)


def _newest_step(root: Path) -> int:
    dirs = step_dirs(root)
    return dirs[-1][0] if dirs else 0


def _wait_for_checkpoint_after(child: subprocess.Popen, root: Path, step: int, log: Path) -> None:
    deadline = time.monotonic() + 60
    while _newest_step(root) <= step:
        assert child.poll() is None, f"child died: {log.read_text()[-2000:]}"
        assert time.monotonic() < deadline, f"no checkpoint after 60 s: {log.read_text()[-2000:]}"
        time.sleep(0.01)


def _check_latest(manager: CheckpointManager) -> tuple[int, bool]:
    """Loads latest() into fresh objects and checks every value; returns (step, mid_write)."""
    for _, path in step_dirs(manager.root):  # no partial directory under a final name, ever
        validate(path)
    mid_write = bool(temp_dirs(manager.root))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = manager.latest()
    assert all(issubclass(w.category, CheckpointWarning) and ".step-" in str(w.message)
               for w in caught), [str(w.message) for w in caught]
    assert path is not None
    model = tiny_model(hidden=256, layers=4, seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    loaded = manager.load(path, model, optimizer)
    step = loaded.step
    assert loaded.extra == {"step": step} and path.name == f"step-{step:06d}"
    for name, p in model.named_parameters():
        assert torch.all(p == step), f"{path}: {name} is not {step}"
    for state in optimizer.state.values():
        assert torch.all(state["exp_avg"] == step) and torch.all(state["exp_avg_sq"] == step)
    return step, mid_write


@pytest.fixture
def one_thread():
    """The machine's cores are shared with the children: OMP threads spinning on a busy core make
    the parent's tensor copies crawl."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_sigkill_mid_write_never_exposes_a_partial_checkpoint(tmp_path, one_thread):
    rng = random.Random(1234)
    run_dir = tmp_path / "run"
    manager = CheckpointManager(run_dir, keep=2)
    # All children start now (imports take seconds); each waits for "go" before touching run_dir,
    # so only one of them ever writes.
    logs = [tmp_path / f"child{i}.log" for i in range(KILLS)]
    children = [_start(run_dir, log) for log in logs]
    steps, mid_writes = [0], 0
    try:
        for child, log in zip(children, logs):
            child.stdin.write("go\n")
            child.stdin.flush()
            _wait_for_checkpoint_after(child, manager.root, steps[-1], log)
            time.sleep(rng.uniform(0.0, 0.5))
            child.send_signal(signal.SIGKILL)
            assert child.wait(timeout=10) == -signal.SIGKILL
            step, mid_write = _check_latest(manager)
            assert step > steps[-1]  # each child resumed from its predecessor and moved on
            steps.append(step)
            mid_writes += mid_write
    finally:
        for child in children:
            child.kill()
            child.wait()
            child.stdin.close()
    # Writes dominate the child's time, so kills land mid-write; a test that never did would
    # prove nothing about atomicity.
    assert mid_writes >= 1, f"no kill landed mid-write (steps {steps})"

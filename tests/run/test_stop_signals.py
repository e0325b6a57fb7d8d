"""A run stopped by a signal, as a scheduler or a user stops it, in real processes (the CLI, an
actor rank, the drafter trainer), every wait bounded: SIGTERM / SIGINT finish the step under way,
write its checkpoint, print one line with the resume command and exit 143 / 130, and the run
resumes from there; SIGKILL leaves no orphan helper behind. Slow: each case starts a run."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from fastdraft.checkpoint.layout import step_dirs, validate

pytestmark = pytest.mark.slow
RECIPE = Path(__file__).parents[2] / "recipes" / "tiny-grpo.yaml"
CLI = [sys.executable, "-m", "fastdraft.cli"]


def _start(policy_and_drafter, run_dir: Path) -> subprocess.Popen:
    policy, drafter = policy_and_drafter
    overrides = [f"model.path={policy}", f"drafter.path={drafter}",
                 "data.task_options.max_terms=5", "rollout.prompts_per_step=4",
                 "rollout.group_size=4", "rollout.max_new_tokens=40",
                 "rollout.max_batch_size=16", "algorithm.num_steps=1000", "checkpoint.every=1000",
                 "actor.num_ranks=2", "logging.wandb.mode=disabled", "logging.dashboard=false",
                 "logging.progress=false"]
    return subprocess.Popen([*CLI, "run", str(RECIPE), *overrides, "--run-dir", str(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _helpers_once_stepping(proc: subprocess.Popen, run_dir: Path) -> list[psutil.Process]:
    """Waits (bounded) until the run has logged a step; its helper processes then."""
    deadline = time.monotonic() + 600
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.is_file() and metrics.read_text().strip()):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run logged no step in 600 s"
        time.sleep(0.2)
    helpers = psutil.Process(proc.pid).children(recursive=True)
    assert len(helpers) >= 2   # an actor rank and the drafter trainer (and mp's tracker)
    return helpers


def _gone(processes: list[psutil.Process], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_stop_signal_checkpoints_the_step_prints_the_resume_and_leaves_nothing(
        policy_and_drafter, tmp_path, signum, code):
    run_dir = tmp_path / "run"
    proc = _start(policy_and_drafter, run_dir)
    helpers = _helpers_once_stepping(proc, run_dir)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == code, err
    line = next(x for x in err.splitlines() if "stopped at step" in x)
    step = int(line.split("stopped at step ")[1].split(";")[0])
    assert step >= 1 and "Traceback" not in err
    [(saved, ckpt)] = step_dirs(run_dir / "checkpoints")   # every=1000: the stop wrote it
    assert saved == step and validate(ckpt, digests=True) == step
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(step))
    assert _gone(helpers), [p.pid for p in helpers if p.is_running()]

    command = shlex.split(line.split("resume with: ")[1])
    assert command[:2] == ["fastdraft", "run"] and command[-1] == "--resume"
    resumed = subprocess.run([*CLI, *command[1:], f"algorithm.num_steps={step + 1}"],
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {ckpt} (step {step})" in resumed.stdout
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(step + 1))


def test_a_killed_run_leaves_no_orphans(policy_and_drafter, tmp_path):
    proc = _start(policy_and_drafter, tmp_path / "run")
    helpers = _helpers_once_stepping(proc, tmp_path / "run")
    proc.kill()
    proc.communicate(timeout=60)
    assert _gone(helpers), [(p.pid, p.cmdline()[-2:]) for p in helpers if p.is_running()]


def _stderr_lines(proc: subprocess.Popen, marker: str) -> tuple[list[str], threading.Event,
                                                               threading.Thread]:
    """proc's stderr lines as they come (a thread reads them), and an event set at the first
    line holding `marker`."""
    lines: list[str] = []
    seen = threading.Event()

    def read() -> None:
        for line in proc.stderr:
            lines.append(line.rstrip("\n"))
            if marker in line:
                seen.set()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return lines, seen, reader


@pytest.mark.xdist_group("ray")
@pytest.mark.parametrize("first_after, second_after", [(0.5, 0.1), (0.5, 0.5), (2.0, 0.3)])
def test_two_sigints_while_ray_starts_exit_130_in_one_line_and_leave_nothing(
        policy_and_drafter, tmp_path, first_after, second_after):
    """Ctrl-C twice ~0.5 s after "Started a local Ray instance" (inside ray.init, which builds
    the driver's core worker then; a KeyboardInterrupt there left it half built and the exit
    crashed on its threads: SIGSEGV, 2 of 2 tries), or later in the start-up (the workers'
    placement, with Ray's shutdown in the cleanup the second one meets): the start finishes or
    unwinds, Ray is shut down, one line, exit 130; the second SIGINT is noted, not raised into
    that cleanup; no process of the run (Ray's own among them) is left."""
    from tests.run.test_faults import _none_tagged, _tagged
    policy, drafter = policy_and_drafter
    tag = f"{os.getpid()}-ray-start-{first_after}-{second_after}-{time.monotonic_ns()}"
    overrides = [f"model.path={policy}", f"drafter.path={drafter}",
                 "drafter.online.enabled=false", "data.task_options.max_terms=5",
                 "rollout.prompts_per_step=4", "rollout.group_size=4",
                 "rollout.max_new_tokens=40", "rollout.max_batch_size=16",
                 "algorithm.num_steps=4", "cluster.backend=ray", "cluster.rollout_workers=2",
                 "cluster.worker_threads=1", "logging.wandb.mode=disabled",
                 "logging.dashboard=false", "logging.progress=false"]
    proc = subprocess.Popen([*CLI, "run", str(RECIPE), *overrides, "--run-dir",
                             str(tmp_path / "run")], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "FASTDRAFT_FAULT_TAG": tag})
    lines, started, reader = _stderr_lines(proc, "Started a local Ray instance")
    try:
        assert started.wait(timeout=300), "\n".join(lines)
        time.sleep(first_after)
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)
        time.sleep(second_after)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=10)
    err = "\n".join(lines)
    assert proc.returncode == 130, (proc.returncode, err)   # not -11 (SIGSEGV)
    assert "Traceback" not in err and "Segmentation" not in err, err
    stopped = [x for x in lines if "stopped by SIGINT" in x or "stopped at step" in x]
    assert len(stopped) == 1 and stopped[0].startswith("fastdraft run: stopped by SIGINT; "), err
    assert "start it again" in stopped[0] or "resume with" in stopped[0], err
    left = _none_tagged(tag)
    assert not left, [(p.pid, p.cmdline()[-2:]) for p in left]
    assert not _tagged(tag)

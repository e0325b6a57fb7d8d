"""Fault injection on the CLI in real processes, every wait bounded: the main process signalled
at random points (SIGKILL, SIGTERM, SIGINT; with and without time to finish its step), a full
disk and a read-only run directory (real filesystems: tmpfs mounts in a private mount
namespace). Each ends in one line naming what to do (or, SIGKILL, in silence), no helper process
outlives the run, and the run then resumes (or starts again) to the same metrics as an unbroken
one. Slow: each case starts a run. FASTDRAFT_FAULT_SEED picks other random points."""

from __future__ import annotations

import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from fastdraft.checkpoint.layout import step_dirs, validate
from tests.run.test_stop_signals import CLI, RECIPE

pytestmark = pytest.mark.slow
STEPS = 4
EXACT = ("reward/mean", "actor/loss", "actor/grad_norm", "rollout/response_len_mean",
         "rollout/accept_length")
SEED = int(os.environ.get("FASTDRAFT_FAULT_SEED", "0"))


def _overrides(policy_and_drafter, *extra: str) -> list[str]:
    policy, drafter = policy_and_drafter
    # A fixed drafter (no online training): the steps after a resume equal an unbroken run's.
    return [f"model.path={policy}", f"drafter.path={drafter}", "drafter.online.enabled=false",
            "data.task_options.max_terms=5", "rollout.prompts_per_step=4",
            "rollout.group_size=4", "rollout.max_new_tokens=40", "rollout.max_batch_size=16",
            f"algorithm.num_steps={STEPS}", "checkpoint.every=1", "actor.num_ranks=2",
            "logging.wandb.mode=disabled", "logging.dashboard=false", "logging.progress=false",
            *extra]


def _run(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "run", str(RECIPE), *args], capture_output=True, text=True,
                          timeout=timeout)


def _steps_logged(run_dir: Path) -> int:
    """Lines of metrics.jsonl so far (the file exists from the run's start)."""
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def unbroken(policy_and_drafter, tmp_path_factory) -> tuple[list[dict], float]:
    """An unbroken run's metrics, and its wall time (the signals fall within it)."""
    run_dir = tmp_path_factory.mktemp("unbroken") / "run"
    start = time.monotonic()
    done = _run([*_overrides(policy_and_drafter), "--run-dir", str(run_dir)])
    assert done.returncode == 0, done.stderr
    return _metrics(run_dir), time.monotonic() - start


def _tagged(tag: str) -> list[psutil.Process]:
    """The live processes whose environment carries FASTDRAFT_FAULT_TAG=tag: the run and every
    process it started, however late (a snapshot of its children can miss one spawned just
    before the signal)."""
    found = []
    for process in psutil.process_iter():
        try:
            if (process.status() != psutil.STATUS_ZOMBIE
                    and process.environ().get("FASTDRAFT_FAULT_TAG") == tag):
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []


def _none_tagged(tag: str, timeout: float = 20.0) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while (left := _tagged(tag)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.mark.parametrize("signum, grace", [
    (signal.SIGKILL, 30), (signal.SIGTERM, 30), (signal.SIGINT, 30), (signal.SIGTERM, 0)],
    ids=["kill", "term", "int", "term-no-grace"])
def test_a_signal_at_a_random_point_leaves_nothing_and_the_run_resumes_exactly(
        policy_and_drafter, unbroken, tmp_path, signum, grace):
    args = _overrides(policy_and_drafter, f"checkpoint.stop_grace_s={grace}")
    # Anywhere from the start-up (imports, the engine's build) to the last step.
    _signal_and_resume(args, tmp_path / "run", unbroken, signum, grace, (0.1, 0.9))


HYBRID = ["cluster.backend=ray", "cluster.placement=hybrid", "cluster.rollout_workers=2",
          "cluster.worker_threads=1"]


@pytest.mark.xdist_group("ray")
def test_the_driver_of_hybrid_workers_killed_leaves_no_process_and_resumes_exactly(
        policy_and_drafter, tmp_path):
    """SIGKILL of the driver of 2 hybrid workers (Ray started by the run): the workers, Ray's
    own processes and the run's helpers all end with it; `--resume` continues from the newest
    checkpoint the workers wrote (sharded) to the unbroken run's metrics."""
    args = _overrides(policy_and_drafter, *HYBRID)
    start = time.monotonic()
    done = _run([*args, "--run-dir", str(tmp_path / "unbroken")])
    assert done.returncode == 0, done.stderr
    expected = (_metrics(tmp_path / "unbroken"), time.monotonic() - start)
    # while the workers run: once two steps are logged (and checkpointed), at a random point
    # of the next (a step of this recipe takes well under a second; the run's end, where Ray
    # and its workers are already gone, must not be the point)
    run_dir = tmp_path / "run"
    _signal_and_resume(args, run_dir, expected, signal.SIGKILL, 30, (0.0, 0.01),
                       ready=lambda: _steps_logged(run_dir) >= 2, workers="HybridWorker")


def _signal_and_resume(args: list[str], run_dir: Path, unbroken: tuple[list[dict], float],
                       signum: int, grace: int, window: tuple[float, float],
                       ready: Callable[[], bool] = lambda: True, workers: str = "") -> None:
    """The run signalled at a random point of `window` (fractions of the unbroken run's wall
    time) after `ready()` holds: no process of it left (`workers`: a process whose command
    line names it was among them), one line (or silence) said, what is on disk whole;
    resumed (or started again), its metrics are the unbroken run's."""
    args = [*args, "--run-dir", str(run_dir)]
    expected, wall_s = unbroken
    delay = random.Random(SEED * 100 + signum * 10 + grace).uniform(*window) * wall_s
    tag = f"{os.getpid()}-{signum}-{grace}-{time.monotonic_ns()}"
    proc = subprocess.Popen([*CLI, "run", str(RECIPE), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "FASTDRAFT_FAULT_TAG": tag})
    deadline = time.monotonic() + 300
    while not ready() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    deadline = time.monotonic() + delay
    while time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    where = f"signal {signal.Signals(signum).name} after {delay:.1f} s (seed {SEED})"
    if proc.poll() is not None:
        pytest.skip(f"the run ended before the {where}")
    tree = _tagged(tag)
    assert proc.pid in {p.pid for p in tree}   # the check below sees the run's tree
    assert workers in " ".join(" ".join(_cmdline(p)) for p in tree), where
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    left = _none_tagged(tag)
    assert not left, (where, [(p.pid, p.cmdline()[-2:]) for p in left])
    assert "Traceback" not in err, (where, err)
    if signum == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL
        again = ["--resume"] if step_dirs(run_dir / "checkpoints") else []
    elif proc.returncode == 0 or ("[fastdraft run:" in err and "stopped" not in err):
        again = None   # the signal came in the last step (finished) or as the process exited
    else:
        assert proc.returncode == 128 + signum, (where, err)
        [last] = [x for x in err.splitlines() if x.startswith("fastdraft")
                  and ("stopped at step" in x or "stopped by" in x)] or [err]
        if "resume with: " in last:
            again = shlex.split(last.split("resume with: ")[1])[-1:]
            assert again == ["--resume"]
        else:
            assert "start it again" in last and not step_dirs(run_dir / "checkpoints"), err
            again = []
        if grace == 0:   # nothing waits for the step under way: abandoned, or not begun
            assert "abandoned" in last or "stopped by" in last, (where, last)
    for _, ckpt in step_dirs(run_dir / "checkpoints"):
        validate(ckpt, digests=True)   # whatever is on disk is whole
    if again is not None:
        resumed = _run([*args, *again])
        assert resumed.returncode == 0, (where, resumed.stderr)
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(STEPS)), where
    for got, want in zip(rows, expected):
        for key in EXACT:
            assert (key in got) == (key in want), (where, got["step"], key)
            if key in want:
                assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), (
                    where, got["step"], key)




def _in_namespace(mount: str, command: list[str]) -> subprocess.CompletedProcess:
    """command run as root of a private user + mount namespace where `mount` (shell lines) has
    set up /mnt/fault; needs unprivileged user namespaces (skips without them)."""
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("no unprivileged user namespaces here (unshare -rm)")
    script = f"mkdir -p /mnt/fault && {mount} && exec {shlex.join(command)}"
    return subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True,
                          text=True, timeout=600)


def _one_error_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    [line] = [x for x in done.stderr.splitlines() if x.startswith("fastdraft run: error:")]
    return line


def test_a_read_only_run_dir_is_one_line_before_any_work(policy_and_drafter):
    command = [*CLI, "run", str(RECIPE), *_overrides(policy_and_drafter),
               "--run-dir", "/mnt/fault/run"]
    done = _in_namespace("mount -t tmpfs tmpfs /mnt/fault && mount -o remount,ro /mnt/fault",
                         command)
    line = _one_error_line(done)
    assert "Read-only file system: /mnt/fault/run" in line and "--run-dir" in line, line
    assert "memory plan" not in done.stdout   # nothing was built


def test_a_disk_too_small_for_a_checkpoint_is_one_line_before_any_work(policy_and_drafter):
    command = [*CLI, "run", str(RECIPE), *_overrides(policy_and_drafter),
               "--run-dir", "/mnt/fault/run"]
    done = _in_namespace("mount -t tmpfs -o size=512k tmpfs /mnt/fault", command)
    line = _one_error_line(done)
    assert "--run-dir /mnt/fault/run" in line and "MB free" in line, line
    assert "resumed" not in done.stdout and "step 1/" not in done.stderr


def test_a_disk_that_fills_mid_run_is_one_line_and_keeps_the_last_checkpoint(
        policy_and_drafter, tmp_path):
    """Room for one checkpoint and a bit: the second one's write fails (ENOSPC); the run stops
    with one line naming the file and --run-dir and how to resume, the first is whole."""
    report = tmp_path / "report.json"
    probe = [*CLI, "run", str(RECIPE), *_overrides(policy_and_drafter), "--dry-run", "--json",
             str(report)]
    assert subprocess.run(probe, capture_output=True, timeout=300).returncode == 0
    checkpoint_mb = json.loads(report.read_text())["actor"]["host"] / 1e6
    size = f"{int(checkpoint_mb * 1.5) + 1}m"
    command = [*CLI, "run", str(RECIPE), *_overrides(policy_and_drafter), "--run-dir",
               "/mnt/fault/run"]
    checks = ("python3 -c 'import sys, json; from pathlib import Path; "
              "print(json.dumps(sorted(p.name for p in Path(\"/mnt/fault/run/checkpoints\")"
              ".iterdir())))' >&2")
    script = (f"mount -t tmpfs -o size={size} tmpfs /mnt/fault && "
              f"{shlex.join(command)}; code=$?; {checks}; exit $code")
    done = _in_namespace("true", ["sh", "-c", script])
    line = _one_error_line(done)
    assert "No space left on device: /mnt/fault/run/checkpoints/" in line, line
    assert "--run-dir /mnt/fault/run" in line and line.endswith("--resume"), line
    assert json.loads(done.stderr.strip().splitlines()[-1]) == ["step-000001"]

"""How a run reaches Ray: `cluster.address` joins a cluster started with `ray start --head`
(what a multi-node user does), and a local cluster started for a run leaves no process behind
when the run is SIGKILLed (the reaper)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from fastdraft.config.sections import ClusterConfig

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc"),
              pytest.mark.xdist_group("ray")]   # one Ray cluster at a time

RAY_CLI = str(Path(sys.executable).parent / "ray")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_tmp():
    """A short RAY_TMPDIR of its own (Ray's sockets live there; a unix socket path must stay
    under 108 bytes, which pytest's tmp_path can pass)."""
    path = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_cluster_address_joins_a_cluster_started_with_ray_start_and_only_then(ray_tmp,
                                                                             monkeypatch):
    from fastdraft.cluster.ray_cluster import connect, shutdown
    assert not ray.is_initialized()
    port = _free_port()
    monkeypatch.setenv("RAY_TMPDIR", ray_tmp)
    # --block: this cluster's processes stop with `head` (`ray stop` would stop every Ray
    # cluster of this user on the machine, a run's too).
    head = subprocess.Popen([RAY_CLI, "start", "--head", "--block", f"--port={port}",
                             "--num-cpus=3", "--include-dashboard=false",
                             "--disable-usage-stats"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True,
                            # ray 2.5x's `ray start` turns token authentication on, and this
                            # process's ray read its (default) mode at import: the same here.
                            env={**os.environ, "RAY_AUTH_MODE": os.environ.get(
                                "RAY_AUTH_MODE", "disabled")})
    try:
        _wait_for_port(port, head)
        cfg = ClusterConfig(backend="ray", rollout_workers=2, address=f"127.0.0.1:{port}")
        assert connect(cfg, cpus=2)   # this run connected, so it disconnects at its end
        assert ray.cluster_resources()["CPU"] == 3   # the cluster's own, not a new one's
        shutdown()
        assert not ray.is_initialized()
        # without cluster.address a run starts a cluster of its own, even beside this one
        # (which Ray would otherwise join, refusing the run's CPU count)
        assert connect(ClusterConfig(backend="ray", rollout_workers=2), cpus=5)
        assert ray.cluster_resources()["CPU"] == max(os.cpu_count() or 1, 5)
        shutdown()
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=20)
        except subprocess.TimeoutExpired:   # seen under CI load: the group goes by force
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(timeout=60)


def _wait_for_port(port: int, head: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert head.poll() is None, "ray start --head exited"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                time.sleep(2)   # the GCS answers; the raylet registers just after
                return
        time.sleep(0.5)
    raise TimeoutError(f"no Ray GCS on port {port} after {timeout}s")


DRIVER = """
import sys, time, ray
from fastdraft.cluster.ray_cluster import connect
from fastdraft.config.sections import ClusterConfig
connect(ClusterConfig(backend="ray", rollout_workers=2), 2)
@ray.remote
class Worker:
    def pid(self):
        import os
        return os.getpid()
workers = [Worker.remote() for _ in range(2)]
print("ready", *ray.get([w.pid.remote() for w in workers]), flush=True)
time.sleep(600)
"""


def test_a_sigkilled_run_leaves_no_ray_process_behind(ray_tmp):
    """Ray's GCS and raylet die with their driver by themselves; its agents and idle workers
    do not: the reaper started by connect() kills them."""
    from fastdraft.cluster.reaper import descendants
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "RAY_TMPDIR": ray_tmp})
    try:
        line = driver.stdout.readline().split()
        assert line and line[0] == "ready", "the driver did not start Ray"
        workers = {int(p) for p in line[1:]}
        time.sleep(2)   # Ray's agents are up
        ray_processes = descendants(driver.pid)
        assert workers <= ray_processes and len(ray_processes) > 4
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    deadline = time.time() + 20
    while time.time() < deadline and any(_alive(p) for p in ray_processes):
        time.sleep(0.5)
    left = {p: _name(p) for p in ray_processes if _alive(p)}
    assert not left, f"left running after the run was SIGKILLed: {left}"


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


KEEPS_HANDLER = """
import signal
from fastdraft.cluster.ray_cluster import connect
from fastdraft.config.sections import ClusterConfig
def ours(signum, frame):
    raise SystemExit(143)
signal.signal(signal.SIGTERM, ours)
connect(ClusterConfig(backend="ray", rollout_workers=1), 1)
print("kept" if signal.getsignal(signal.SIGTERM) is ours else "replaced", flush=True)
"""


def test_connecting_ray_keeps_the_runs_sigterm_handler(ray_tmp):
    """ray.init installs sys.exit(15) for SIGTERM; a run's own handler (the one line, the
    checkpoint on stop) must survive it."""
    driver = subprocess.run([sys.executable, "-c", KEEPS_HANDLER], capture_output=True,
                            text=True, timeout=300, env={**os.environ, "RAY_TMPDIR": ray_tmp})
    assert driver.stdout.split() == ["kept"], driver.stderr[-2000:]


def test_a_role_started_while_ray_is_down_is_refused_not_auto_started():
    """Ray's own auto-start would join whatever cluster the environment names (a test once
    hung in it): the run connects Ray first, and a role started without it is a bug."""
    import ray

    from fastdraft.workers.trainer_actor import OwnActor, TrainerActor
    assert not ray.is_initialized()
    with pytest.raises(RuntimeError, match="Ray is not up"):
        OwnActor({"num_cpus": 0}).start(TrainerActor, None, ())
    assert not ray.is_initialized()

"""Joining or starting the Ray cluster a run's roles live on. `cluster.address` joins one that
is running (`ray start --head` on the first node, `ray start --address=HEAD:6379` on the
others); without it a local one is started for the run and shut down with it."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

from fastdraft.config.sections.cluster import ClusterConfig
from fastdraft.errors import FastdraftError
from fastdraft.utils.stop_signals import StopsDeferred

_reaper: int | None = None   # the watcher's pid (cluster/reaper.py)


def connect(cfg: ClusterConfig, cpus: int) -> bool:
    """Ray ready for the run's roles; True when this call started it (the run then shuts it
    down at its end). cpus: the logical CPUs the roles reserve (threads per rollout worker and
    per actor rank); a local cluster gets at least that many, so the placement groups never
    wait for CPUs this machine has but Ray would not count."""
    import ray
    if ray.is_initialized():   # a test's, a bench's, or the user's own driver
        return False
    check_address(cfg)   # before ray.init, which retries a dead address for many minutes
    # A cluster of this run's own lives on this machine: its address is the loopback one
    # (hybrid workers rendezvous where Ray says their rank 0 runs).
    options = {} if cfg.address else {"num_cpus": max(os.cpu_count() or 1, cpus),
                                      "_node_ip_address": "127.0.0.1"}
    if not cfg.address and sys.platform.startswith("linux"):
        # Started first: a run killed while Ray starts leaves nothing behind either.
        global _reaper
        _reaper = int(subprocess.run(
            [sys.executable, "-m", "fastdraft.cluster.reaper", str(os.getpid())],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, check=True,
            start_new_session=True).stdout)   # out of reach of group kills
    # A stop signal is not raised inside ray.init: a KeyboardInterrupt there (seen ~0.5 s after
    # "Started a local Ray instance", in CoreWorker's construction) leaves a half-built core
    # worker that nothing can shut down, whose threads crash the interpreter's exit (SIGSEGV).
    # It is raised once Ray is up, after it is shut down again. ray.init's own SIGTERM handler
    # (sys.exit(15), which would end the run silently and cut the start in half) is kept out.
    with StopsDeferred("Ray's start") as deferred, _ray_keeps_our_sigterm():
        try:
            # "local": a cluster of its own even where another runs on this machine (`ray
            # start`'s, which Ray would otherwise join, refusing this run's CPU count)
            ray.init(address=cfg.address or "local", include_dashboard=False,
                     log_to_driver=True, **options)
        except ConnectionError as err:
            raise FastdraftError(
                f"cluster.address={cfg.address}: could not join that Ray cluster ({err}). Check"
                " that `ray status --address ...` answers there; a cluster started by `ray "
                "start` with token authentication needs RAY_AUTH_MODE=token and its token "
                "(~/.ray/auth_token or RAY_AUTH_TOKEN) in this process's environment") from err
        if deferred.noted:   # a stop came meanwhile: the Ray this call started goes first
            shutdown()
    return True


@contextlib.contextmanager
def _ray_keeps_our_sigterm() -> Iterator[None]:
    """ray.init's SIGTERM handler not installed (Ray's private hook for it; where a Ray
    version lacks it, the handler in force before is put back after ray.init all the same)."""
    import ray._private.utils as ray_utils
    ours = signal.getsignal(signal.SIGTERM)
    real = getattr(ray_utils, "set_sigterm_handler", None)
    if real is not None:
        ray_utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        if real is not None:
            ray_utils.set_sigterm_handler = real
        if ours is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, ours)


def require_ray(role: str) -> None:
    """Ray is up (the run connects it first: run/placement.connect_ray); never Ray's own
    auto-start, which joins whatever cluster its environment names."""
    import ray
    if not ray.is_initialized():
        raise RuntimeError(f"{role} is a Ray actor and Ray is not up: connect it first "
                           "(run/placement.connect_ray)")


def check_address(cfg: ClusterConfig) -> None:
    """cluster.address answers on its port within cluster.connect_timeout_s, or one line says
    what to check: nothing listening there is told at once, an address that never answers (a
    firewall, a wrong host) after the timeout. `auto` (the cluster `ray start` left on this
    machine) is Ray's to find; it says at once when there is none."""
    if cfg.address is None or cfg.address == "auto":
        return
    host, port = _host_port(cfg.address)
    deadline = time.monotonic() + cfg.connect_timeout_s
    why = "no answer"
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port),
                                          timeout=max(0.1, deadline - time.monotonic())):
                return
        except ConnectionRefusedError:
            why = "connection refused: nothing listens on that port"
            break
        except TimeoutError:
            why = f"no answer within cluster.connect_timeout_s={cfg.connect_timeout_s:g} s"
        except OSError as err:   # an unknown host, no route
            why = err.strerror or str(err)
            break
    raise FastdraftError(
        f"cluster.address={cfg.address}: no Ray cluster there ({why}). Check that the head "
        "runs (`ray status` on it), that the address and port are the ones `ray start --head` "
        "printed (default port 6379; ray://HOST:10001 for a Ray client), that no firewall is in "
        "between, and for token authentication RAY_AUTH_MODE=token with its token; or leave "
        "cluster.address unset to start a local cluster")


def _host_port(address: str) -> tuple[str, int]:
    """`HOST:PORT`, `ray://HOST:PORT` or `[IPv6]:PORT` -> (host, port)."""
    parsed = urlsplit(address if "://" in address else f"ray://{address}")
    try:
        port = parsed.port
    except ValueError:
        port = None
    if not parsed.hostname or port is None:
        raise FastdraftError(f"cluster.address={address}: not HOST:PORT (e.g. 10.0.0.1:6379, "
                             "ray://10.0.0.1:10001, or auto)")
    return parsed.hostname, port


def shutdown() -> None:
    """Ray down, and its reaper with it (nothing is left to reap). A stop signal meanwhile is
    raised after it (utils/stop_signals.StopsDeferred): one inside ray.shutdown() leaves Ray's
    threads half torn down, and the interpreter's exit crashes on them."""
    import ray
    global _reaper
    with StopsDeferred("Ray's shutdown"):
        ray.shutdown()
        if _reaper is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(_reaper, signal.SIGKILL)
            _reaper = None


def cuda_name(gpu_id: str, visible: str | None = None) -> str:
    """A GPU as Ray numbers it on the node -> this process's name for it (CUDA numbers the
    devices CUDA_VISIBLE_DEVICES lists, in its order; visible: that variable, default this
    process's)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    if not visible:
        return f"cuda:{int(gpu_id)}"
    listed = [v.strip() for v in visible.split(",")]
    if gpu_id not in listed:
        raise FastdraftError(f"GPU {gpu_id} (rollout worker 0's) is not in this process's "
                             f"CUDA_VISIBLE_DEVICES={visible}")
    return f"cuda:{listed.index(gpu_id)}"

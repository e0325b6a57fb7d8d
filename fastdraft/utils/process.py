"""What every helper process of a run (actor ranks, the drafter trainer) does first: die with the
run's process, and leave the stop signals to it.

A SIGKILLed or crashed run must leave no orphans: each helper asks the kernel for SIGKILL when
its parent dies (Linux's parent-death signal). Ctrl-C reaches the whole foreground process group
and schedulers (SLURM, Kubernetes) signal every process of a job; a helper that died of it would
take the step under way with it. So helpers ignore SIGINT and SIGTERM: the run's process catches
them, finishes its step, writes a checkpoint and then closes its helpers (run/stop.py)."""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (Linux; elsewhere nothing). A parent that died
    before this call (while the helper was still importing) sends no signal: then exit now."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        parent = multiprocessing.parent_process()
        if parent is not None and os.getppid() != parent.pid:
            os._exit(1)


def become_helper() -> None:
    """die_with_parent, and SIGINT / SIGTERM ignored (the run's process decides)."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def kill_helpers(timeout_s: float = 5.0) -> None:
    """SIGKILL every helper process still alive (the last thing a failed command does): a
    helper ignores SIGTERM, so multiprocessing's exit handler, which terminates daemonic children
    and then joins them, would otherwise wait for it forever."""
    children = multiprocessing.active_children()
    for child in children:
        child.kill()
    for child in children:
        child.join(timeout_s)


#: The nice value of work that should only take CPU time nothing else wants (Linux's lowest).
LOWEST_NICE = 19


def run_when_idle() -> None:
    """The calling thread (Linux schedules threads, each with its own nice value) gets the CPU
    only when nothing of normal priority wants it: the online drafter trainer's micro-steps,
    which must use the cores the rollout's tail leaves idle, not slow the tail down. Threads
    it starts later inherit it. A no-op where the OS refuses or has no such call."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST_NICE)

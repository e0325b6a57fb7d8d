"""Scheduling a thread at the lowest priority: the online drafter trainer's micro-steps. (The
run's other processes are Ray's: a SIGKILLed run leaves none, cluster/reaper.py.)"""

from __future__ import annotations

import contextlib
import os
import threading

#: The nice value of work that should only take CPU time nothing else wants (Linux's lowest).
LOWEST_NICE = 19


def run_when_idle() -> None:
    """The calling thread (Linux schedules threads, each with its own nice value) gets the CPU
    only when nothing of normal priority wants it: the online drafter trainer's micro-steps,
    which must use the cores the rollout's tail leaves idle, not slow the tail down. Threads
    it starts later inherit it. A no-op where the OS refuses or has no such call."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST_NICE)

"""Stopping a run on SIGTERM (a scheduler's pre-emption) or SIGINT (Ctrl-C) without losing it.

The first signal asks for a stop: if the step under way and its checkpoint fit in the grace
period (checkpoint.stop_grace_s, judged by the last step's times), the step finishes (its update
is applied whole or not at all), a checkpoint of it is written, the helpers are closed, and the
run ends with RunStopped (the CLI prints `stopped at step N; resume with: ...` and exits 143 /
130, as shells do). If they do not fit, or a second signal comes, the step is abandoned at once
(Interrupted): the newest checkpoint on disk is still whole (checkpoint/ writes atomically), only
the steps after it are lost. Outside the step loop (building the engine, a bootstrap) SIGTERM is
Interrupted too, as SIGINT is KeyboardInterrupt (utils/stop_signals.py: the process-level
handlers, and further signals while a stop is carried out). Helper processes ignore both signals
and die with the run (utils/process.py)."""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from fastdraft.utils.stop_signals import SIGNALS, abandon_now


class RunStopped(Exception):
    """The run stopped on a signal after `step` steps, checkpointed; exit_code 128 + signal."""

    def __init__(self, step: int, signum: int, run_dir: Path, abandoned: bool = False) -> None:
        self.step, self.signum, self.run_dir = step, signum, run_dir
        self.abandoned = abandoned   # the step under way was dropped; `step` is on disk
        self.exit_code = 128 + signum
        super().__init__(f"stopped at step {step} on {signal.Signals(signum).name}")


class StopRequest:
    """A context that turns the first SIGINT / SIGTERM into a flag the loop reads between steps
    (`signum`) when `time_to_stop()` (seconds to finish the step under way and checkpoint it;
    None: not known) fits in `grace_s`, else into Interrupted at once. Outside the main thread,
    or after the context, the handlers are the old ones."""

    def __init__(self, grace_s: float = float("inf"),
                 time_to_stop: Callable[[], float | None] = lambda: 0.0,
                 on_abandon: Callable[[], None] = lambda: None) -> None:
        self.signum: int | None = None
        self.grace_s, self.time_to_stop = grace_s, time_to_stop
        # Runs before Interrupted is raised: the run's helpers killed first, so a collective
        # the unwinding reaches fails at once (its peer is gone) instead of meeting a peer
        # that is inside another collective (gloo aborts the process on that mismatch).
        self.on_abandon = on_abandon
        self._old: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)   # type: ignore[arg-type]
        self._old = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:   # the second signal: stop now
            self.__exit__()
            self.on_abandon()
            raise abandon_now(signum)
        needed = self.time_to_stop()
        if needed is None or needed > self.grace_s:
            known = "unknown" if needed is None else f"~{needed:.0f} s"
            print(f"\nfastdraft: {name}: abandoning the step under way (finishing and "
                  f"checkpointing it takes {known}; checkpoint.stop_grace_s is "
                  f"{self.grace_s:g} s)", file=sys.stderr, flush=True)
            self.__exit__()
            self.on_abandon()
            raise abandon_now(signum)
        self.signum = signum
        print(f"\nfastdraft: {name}: stopping after this step, with a checkpoint (~{needed:.0f} "
              "s; send it again to stop at once)", file=sys.stderr, flush=True)


class StepClock:
    """The times a stop decision needs: how long the last step took, when this one started, and
    what a checkpoint costs (the host copy and the last background write)."""

    def __init__(self) -> None:
        self.started: float | None = None
        self.last_step_s: float | None = None
        self.checkpoint_s = 0.0

    def start_step(self) -> None:
        self.started = time.perf_counter()

    def end_step(self) -> None:
        if self.started is not None:
            self.last_step_s = time.perf_counter() - self.started
        self.started = None

    def time_to_stop(self) -> float | None:
        """Seconds to finish the step under way and checkpoint it; None before a first step
        has been timed (a step's length is not known then)."""
        if self.started is None:
            return self.checkpoint_s
        if self.last_step_s is None:
            return None
        left = self.last_step_s - (time.perf_counter() - self.started)
        return max(0.0, left) + self.checkpoint_s

"""Stopping a run on SIGTERM (a scheduler's pre-emption) or SIGINT (Ctrl-C) without losing it.

The first signal asks for a stop: if the step under way and its checkpoint fit in the grace
period (checkpoint.stop_grace_s, judged by the last step's times), the step finishes (its update
is applied whole or not at all), a checkpoint of it is written, the helpers are closed, and the
run ends with RunStopped (the CLI prints `stopped at step N; resume with: ...` and exits 143 /
130, as shells do). If they do not fit, or a second signal comes, the step is abandoned at once
(Interrupted): the newest checkpoint on disk is still whole (checkpoint/ writes atomically), only
the steps after it are lost. Outside the step loop (building the engine, a bootstrap) SIGTERM is
Interrupted too, as SIGINT is KeyboardInterrupt. Helper processes ignore both signals and die
with the run (utils/process.py)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from fastdraft.errors import exception_chain

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RunStopped(Exception):
    """The run stopped on a signal after `step` steps, checkpointed; exit_code 128 + signal."""

    def __init__(self, step: int, signum: int, run_dir: Path, abandoned: bool = False) -> None:
        self.step, self.signum, self.run_dir = step, signum, run_dir
        self.abandoned = abandoned   # the step under way was dropped; `step` is on disk
        self.exit_code = 128 + signum
        super().__init__(f"stopped at step {step} on {signal.Signals(signum).name}")


class Interrupted(BaseException):
    """A stop signal that ends the work under way at once (SIGINT's is KeyboardInterrupt)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


def stop_signal_in(err: BaseException) -> int | None:
    """The signal of the Interrupted / KeyboardInterrupt in err's chain (itself, its cause or
    its context), if any."""
    for link in exception_chain(err, hidden=True):   # a stop is a stop, even replaced
        if isinstance(link, Interrupted):
            return link.signum
        if isinstance(link, KeyboardInterrupt):
            return signal.SIGINT
    return None


def interrupt_on_sigterm() -> None:
    """SIGTERM raises Interrupted in the main thread (whatever it does), so `finally` blocks
    and the CLI's one line run instead of the silent default death."""
    def handle(signum: int, frame: FrameType | None) -> None:
        raise Interrupted(signum)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handle)
        resend_swallowed_stops()


def resend_swallowed_stops() -> None:
    """A stop raised while Python runs a finalizer (a `__del__` the garbage collector called, a
    weakref callback) cannot leave it: Python prints "Exception ignored in ..." and goes on, and
    the run would finish the work it was told to stop (seen in CI: a SIGTERM landed in a regex
    object's `__del__`). The unraisable hook sends such a stop's signal again from a helper
    thread, so the main thread meets it after the finalizer, where it can unwind."""
    previous = sys.unraisablehook
    if getattr(previous, "resends_stops", False):
        return

    def hook(unraisable: sys.UnraisableHookArgs) -> None:
        err = unraisable.exc_value
        signum = (err.signum if isinstance(err, Interrupted)
                  else signal.SIGINT if isinstance(err, KeyboardInterrupt) else None)
        if signum is None:
            previous(unraisable)
            return
        resend = threading.Timer(0.01, os.kill, (os.getpid(), signum))
        resend.daemon = True
        resend.start()
    hook.resends_stops = True   # type: ignore[attr-defined]
    sys.unraisablehook = hook


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
            raise Interrupted(signum)
        needed = self.time_to_stop()
        if needed is None or needed > self.grace_s:
            known = "unknown" if needed is None else f"~{needed:.0f} s"
            print(f"\nfastdraft: {name}: abandoning the step under way (finishing and "
                  f"checkpointing it takes {known}; checkpoint.stop_grace_s is "
                  f"{self.grace_s:g} s)", file=sys.stderr, flush=True)
            self.__exit__()
            self.on_abandon()
            raise Interrupted(signum)
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

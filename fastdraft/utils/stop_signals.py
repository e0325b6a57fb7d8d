"""Stop signals at the process level: SIGTERM and SIGINT raise in the main thread (SIGTERM as
Interrupted, SIGINT as KeyboardInterrupt) instead of the silent default death, so `finally`
blocks and the CLI's one line run. Once a stop is raised, the process is carrying it out:
further stop signals are noted, not raised into its cleanup (a raise inside ray.shutdown() or a
half-built Ray leaves C++ threads that crash the interpreter's exit: SIGSEGV), and the process
exits with the first stop's code; the FORCE_AFTER-th further one exits at once (os._exit: the
helpers and Ray's processes die with the run all the same). Code that no raise may cut in half
(Ray's start and shutdown) runs under StopsDeferred: a stop that comes meanwhile is raised when
it is done. A stop swallowed by a finalizer is sent again (resend_swallowed_stops). What a run
makes of a stop (finish the step or abandon it) is run/stop.py's."""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType

from fastdraft.errors import exception_chain

SIGNALS = (signal.SIGINT, signal.SIGTERM)
FORCE_AFTER = 3   # stop signals noted while a stop is carried out before the process just exits


class _StopState:
    """The stop this process carries out (the signal of the first one raised), and how many
    stop signals came after it."""
    signum: int | None = None
    further = 0


_STATE = _StopState()


class Interrupted(KeyboardInterrupt):
    """A stop signal that ends the work under way at once (SIGINT's is KeyboardInterrupt). A
    KeyboardInterrupt itself: code that waits in C++ and checks for signals (Ray's ray.wait /
    ray.get) turns only a KeyboardInterrupt into its own end, and prints any other exception a
    handler raises and goes on waiting (seen: an abandoned step of a Ray run went on to the
    run's end). Ray raises a KeyboardInterrupt of its own then: the stop carried out keeps the
    signal (carry_out, stop_signal_in)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


def stop_signal_in(err: BaseException) -> int | None:
    """The signal of the Interrupted / KeyboardInterrupt in err's chain (itself, its cause or
    its context), if any: a bare KeyboardInterrupt is the stop being carried out (Ray's stand-in
    for a SIGTERM's Interrupted), else SIGINT's."""
    for link in exception_chain(err, hidden=True):   # a stop is a stop, even replaced
        if isinstance(link, Interrupted):
            return link.signum
        if isinstance(link, KeyboardInterrupt):
            return _STATE.signum or signal.SIGINT
    return None


def carry_out(signum: int) -> None:
    """From here on the process carries out a stop on `signum` (unless it carries out one
    already): further stop signals are noted, not raised (note_further_stop)."""
    if _STATE.signum is None:
        _STATE.signum = signum


def stop_now(signum: int) -> BaseException:
    """The exception that ends the work under way on stop signal `signum` (KeyboardInterrupt
    for SIGINT, as Python's own, else Interrupted), for the caller to raise; the process then
    carries out that stop (carry_out)."""
    carry_out(signum)
    return KeyboardInterrupt() if signum == signal.SIGINT else Interrupted(signum)


def abandon_now(signum: int) -> Interrupted:
    """stop_now, always as Interrupted (StopRequest's abandoned step, SIGINT's too)."""
    stop_now(signum)
    return Interrupted(signum)


def note_further_stop(signum: int) -> None:
    """A stop signal while a stop is already under way (or deferred): not raised; the
    FORCE_AFTER-th such one ends the process at once with the first stop's code."""
    _STATE.further += 1
    if _STATE.further >= FORCE_AFTER:
        code = 128 + (_STATE.signum or signum)
        print(f"\nfastdraft: {signal.Signals(signum).name} again: exiting at once, "
              "without the rest of the cleanup", file=sys.stderr, flush=True)
        os._exit(code)


def interrupt_on_stop_signals() -> None:
    """SIGTERM raises Interrupted and SIGINT KeyboardInterrupt in the main thread (whatever it
    does), so `finally` blocks and the CLI's one line run instead of the silent default death;
    a stop signal while a stop is carried out is noted, not raised into its cleanup."""
    def handle(signum: int, frame: FrameType | None) -> None:
        if _STATE.signum is not None:
            note_further_stop(signum)
            return
        raise stop_now(signum)
    if threading.current_thread() is threading.main_thread():
        _STATE.signum, _STATE.further = None, 0   # a new command: no stop under way
        for s in SIGNALS:
            signal.signal(s, handle)
        resend_swallowed_stops()


class StopsDeferred:
    """A block that a raise must not cut in half (Ray's start: a KeyboardInterrupt inside
    ray.init leaves a half-built core worker whose threads crash the interpreter's exit). A stop
    signal meanwhile is said in one line and noted; when the block ends, the first is sent again
    to the handler in force before it (which raises it, or, StopRequest's, makes it a stop after
    the step), unless a stop is carried out already (then it is one more noted). `noted`: the
    signals so far (the block may undo its work first, e.g. shut down the Ray it started).
    Outside the main thread, or inside another StopsDeferred, it changes nothing."""

    _active = False

    def __init__(self, what: str) -> None:
        self.what = what
        self.noted: list[int] = []
        self._old: dict[int, object] = {}

    def __enter__(self) -> StopsDeferred:
        if threading.current_thread() is threading.main_thread() and not StopsDeferred._active:
            StopsDeferred._active = True
            self._old = {s: signal.signal(s, self._note) for s in SIGNALS}
        return self

    def __exit__(self, kind: type | None, err: BaseException | None, tb: object) -> None:
        if not self._old:
            return
        for s, handler in self._old.items():
            signal.signal(s, handler)   # type: ignore[arg-type]
        self._old = {}
        StopsDeferred._active = False
        if self.noted and _STATE.signum is None:
            signal.raise_signal(self.noted[0])   # as if it came now (a raise leaves from here)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        if _STATE.signum is not None or self.noted:
            note_further_stop(signum)
        else:
            print(f"\nfastdraft: {signal.Signals(signum).name}: stopping once {self.what} is "
                  "done (it cannot be cut short safely)", file=sys.stderr, flush=True)
        self.noted.append(signum)


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
        _STATE.signum = None   # that stop did not happen: its signal again is the stop
        resend = threading.Timer(0.01, os.kill, (os.getpid(), signum))
        resend.daemon = True
        resend.start()
    hook.resends_stops = True   # type: ignore[attr-defined]
    sys.unraisablehook = hook

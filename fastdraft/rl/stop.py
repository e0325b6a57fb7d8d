"""Stopping a run on SIGTERM (a scheduler's pre-emption) or SIGINT (Ctrl-C) without losing it.

The first signal asks for a stop: the step under way finishes (its update is applied whole or not
at all), a checkpoint of it is written, the helpers are closed, and the run ends with RunStopped
(the CLI prints `stopped at step N; resume with: ...` and exits 143 / 130, as shells do). A
second signal stops at once (SIGINT: KeyboardInterrupt; SIGTERM: the default action): the
newest checkpoint on disk is still whole (checkpoint/ writes atomically), only the steps after it
are lost. Helper processes ignore both signals and die with the run (utils/process.py)."""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from types import FrameType

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RunStopped(Exception):
    """The run stopped on a signal after `step` steps, checkpointed; exit_code 128 + signal."""

    def __init__(self, step: int, signum: int, run_dir: Path) -> None:
        self.step, self.signum, self.run_dir = step, signum, run_dir
        self.exit_code = 128 + signum
        super().__init__(f"stopped at step {step} on {signal.Signals(signum).name}")


class StopRequest:
    """A context that turns the first SIGINT / SIGTERM into a flag the loop reads between steps
    (`signum`); outside the main thread, or after the context, the handlers are the old ones."""

    def __init__(self) -> None:
        self.signum: int | None = None
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
        if self.signum is not None:   # the second signal: stop now
            self.__exit__()
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            signal.raise_signal(signum)
            return
        self.signum = signum
        print(f"\nfastdraft: {signal.Signals(signum).name}: stopping after this step, with a "
              "checkpoint (send it again to stop at once)", file=sys.stderr, flush=True)

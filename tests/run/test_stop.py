"""The stop decision (run/stop.py): the first SIGTERM / SIGINT finishes the step under way when it
and its checkpoint fit in the grace period, else abandons it at once; a second one abandons."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from fastdraft.run.stop import Interrupted, StepClock, StopRequest, stop_signal_in


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_step_that_fits_the_grace_period_is_finished(signum):
    with StopRequest(grace_s=30, time_to_stop=lambda: 2.0) as stop:
        signal.raise_signal(signum)
        assert stop.signum == signum   # a flag for the loop: nothing raised
        with pytest.raises(Interrupted):   # the second signal stops at once
            signal.raise_signal(signum)


@pytest.mark.parametrize("needed", [31.0, None])
def test_a_step_that_does_not_fit_or_is_not_timed_yet_is_abandoned(needed):
    with (StopRequest(grace_s=30, time_to_stop=lambda: needed) as stop,
          pytest.raises(Interrupted) as stopped):
        signal.raise_signal(signal.SIGTERM)
    assert stopped.value.signum == signal.SIGTERM and stop.signum is None


def test_the_handlers_are_restored_after_the_context():
    before = signal.getsignal(signal.SIGTERM)
    with StopRequest():
        assert signal.getsignal(signal.SIGTERM) is not before
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_clock_estimates_what_is_left_of_the_step_and_the_checkpoint():
    clock = StepClock()
    clock.checkpoint_s = 1.5
    assert clock.time_to_stop() == 1.5   # between steps: the checkpoint only
    clock.start_step()
    assert clock.time_to_stop() is None   # no step timed yet
    clock.last_step_s = 10.0
    assert 10.0 < clock.time_to_stop() <= 11.5
    clock.started = time.perf_counter() - 20   # overran the last step's time
    assert clock.time_to_stop() == 1.5


def test_a_stop_is_found_behind_the_error_it_caused():
    try:
        try:
            raise Interrupted(signal.SIGTERM)
        finally:   # a `finally` whose collective fails as the stop unwinds
            raise RuntimeError("a collective's peer went away")
    except RuntimeError as err:
        caused = err
    assert stop_signal_in(caused) == signal.SIGTERM
    assert stop_signal_in(RuntimeError("plain")) is None


def test_an_abandoned_step_kills_the_helpers_before_it_unwinds():
    order = []
    with (StopRequest(grace_s=0, time_to_stop=lambda: 5.0,
                      on_abandon=lambda: order.append("helpers killed")),
          pytest.raises(Interrupted)):
        try:
            signal.raise_signal(signal.SIGTERM)
        finally:
            order.append("unwound")
    assert order == ["helpers killed", "unwound"]


_STOP_IN_A_FINALIZER = """
import gc, os, signal, time
from fastdraft.run.stop import Interrupted, interrupt_on_sigterm
interrupt_on_sigterm()

class Finalized:
    def __del__(self):   # the signal lands here, where a raise cannot leave
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)

try:
    Finalized()
    gc.collect()
    time.sleep(5)
    print("finished")
except Interrupted as stop:
    print("interrupted", stop.signum)
"""


def test_a_stop_that_lands_in_a_finalizer_is_not_lost():
    done = subprocess.run([sys.executable, "-c", _STOP_IN_A_FINALIZER], capture_output=True,
                          text=True, timeout=60)
    assert done.stdout.split() == ["interrupted", str(int(signal.SIGTERM))], done
    assert "Exception ignored" not in done.stderr, done.stderr

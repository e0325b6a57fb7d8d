"""The stop decision (run/stop.py): the first SIGTERM / SIGINT finishes the step under way when it
and its checkpoint fit in the grace period, else abandons it at once; a second one abandons."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from fastdraft.run.stop import StepClock, StopRequest
from fastdraft.utils.stop_signals import (
    SIGNALS,
    Interrupted,
    StopsDeferred,
    interrupt_on_stop_signals,
    stop_signal_in,
)


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
from fastdraft.utils.stop_signals import Interrupted, interrupt_on_stop_signals
interrupt_on_stop_signals()

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


_ABANDON_IN_RAY_WAIT = """
import os, signal, threading, time
import ray
from fastdraft.run.stop import StopRequest
from fastdraft.utils.stop_signals import interrupt_on_stop_signals, stop_signal_in
interrupt_on_stop_signals()
ray.init(address="local", num_cpus=1, include_dashboard=False, _node_ip_address="127.0.0.1")

@ray.remote
def slow():
    time.sleep(30)

task = slow.remote()
ray.wait([task], timeout=1.0)   # the task is under way
threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
start = time.monotonic()
try:
    with StopRequest(grace_s=0, time_to_stop=lambda: None):   # no time: abandoned at once
        ray.wait([task], num_returns=1)
    print("not stopped", flush=True)
except BaseException as err:
    print("stopped", stop_signal_in(err), time.monotonic() - start < 10, flush=True)
ray.shutdown()
"""


@pytest.mark.slow
@pytest.mark.xdist_group("ray")
def test_an_abandoned_step_ends_a_ray_wait_at_once_with_its_signal():
    """Ray's C++ wait turns only a KeyboardInterrupt raised by a signal handler into its end
    (any other it prints and waits on: an abandoned step of a Ray run used to go on to the
    run's end); Interrupted is one, and the signal survives Ray's own KeyboardInterrupt."""
    done = subprocess.run([sys.executable, "-c", _ABANDON_IN_RAY_WAIT], capture_output=True,
                          text=True, timeout=120)
    assert done.stdout.split() == ["stopped", str(int(signal.SIGTERM)), "True"], done


@pytest.fixture
def cli_handlers():
    """The CLI's stop handlers for a test, then the old ones back and no stop under way."""
    import fastdraft.utils.stop_signals as stop_mod
    old = {s: signal.getsignal(s) for s in SIGNALS}
    interrupt_on_stop_signals()
    yield
    for s, handler in old.items():
        signal.signal(s, handler)
    stop_mod._STATE.signum, stop_mod._STATE.further = None, 0


def test_a_stop_in_a_deferred_block_is_raised_when_the_block_is_done(cli_handlers, capsys):
    """Ray's start and shutdown run deferred: a stop signal is noted, the block runs to its end,
    then the stop is raised (to the handler in force: the CLI's Interrupted), once."""
    went_on = []
    with pytest.raises(Interrupted) as stopped, StopsDeferred("the block") as deferred:
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)   # one more: noted too
        went_on.append(True)
    assert went_on and deferred.noted == [signal.SIGTERM] * 2
    assert stopped.value.signum == signal.SIGTERM
    assert capsys.readouterr().err.count("stopping once the block is done") == 1


def test_a_deferred_block_in_a_stop_under_way_raises_nothing(cli_handlers):
    """The cleanup of a stop (Ray's shutdown in it) is not cut short by the next signal."""
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)   # the stop, raised: carried out from here
    with StopsDeferred("Ray's shutdown") as deferred:
        signal.raise_signal(signal.SIGINT)
    signal.raise_signal(signal.SIGINT)   # outside the block too: noted, not raised
    assert deferred.noted == [signal.SIGINT]


_FURTHER_STOPS = """
import signal
from fastdraft.utils.stop_signals import interrupt_on_stop_signals
interrupt_on_stop_signals()
try:
    signal.raise_signal(signal.SIGINT)
except KeyboardInterrupt:
    signal.raise_signal(signal.SIGINT)   # in the cleanup: noted
    signal.raise_signal(signal.SIGTERM)   # noted
    print("cleanup done", flush=True)
    signal.raise_signal(signal.SIGINT)   # the third after the stop: out at once
    print("not reached", flush=True)
"""


def test_further_stops_are_noted_and_the_third_exits_at_once():
    done = subprocess.run([sys.executable, "-c", _FURTHER_STOPS], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 130 and done.stdout.split("\n")[0] == "cleanup done", done
    assert "not reached" not in done.stdout and "Traceback" not in done.stderr, done
    assert "SIGINT again: exiting at once" in done.stderr, done

"""A stop signal stops a server whatever its main thread is doing when it lands.

Python runs a signal handler in the main thread between two bytecodes.  The
serving loop's main thread spends its life in ``stop.wait()``, and for a few
bytecodes of every wake-up it holds the event's own lock; a handler that set
the event there waited for a lock its own thread held, and the process hung
until something killed it (a PS signalled right after its start did not exit
within 30 s, once in a full test run).  These tests deliver the signal at that
moment on purpose, in a child process, with a bounded wait.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.conftest import ROOT, child_env

# The child holds the event's lock, as Event.wait does between waking and returning,
# while the signal is delivered; then it runs the serving loop's stop check.
_HELD_LOCK = textwrap.dedent(
    """
    import signal, sys, threading, time
    from psflow import serving

    stop = threading.Event()
    signalled = serving.install_stop_signals(stop)
    with stop._cond:  # the lock Event.wait holds between its wake-up and its return
        signal.raise_signal(signal.SIGTERM)  # the handler runs here, in this thread
    started = time.monotonic()
    while not serving.stop_requested(stop, signalled, poll=0.05):
        if time.monotonic() - started > 5:
            sys.exit("the stop request was lost")
    print("stopped", stop.is_set(), flush=True)
    """
)


def _run(code: str) -> subprocess.CompletedProcess:
    """Runs ``code`` in a child Python (bounded: a hang fails the test, it never blocks it)."""
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=child_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    return result


def test_a_signal_while_the_main_thread_holds_the_events_lock_stops_without_a_hang():
    result = _run(_HELD_LOCK)
    assert result.stdout.strip() == "stopped True"


def test_a_signal_between_waits_is_seen_within_the_poll():
    code = textwrap.dedent(
        """
        import signal, threading, time
        from psflow import serving

        stop = threading.Event()
        signalled = serving.install_stop_signals(stop)
        signal.raise_signal(signal.SIGINT)
        started = time.monotonic()
        while not serving.stop_requested(stop, signalled, poll=0.05):
            pass
        print(round(time.monotonic() - started, 3) < 1.0, stop.is_set(), flush=True)
        """
    )
    result = _run(code)
    assert result.stdout.split() == ["True", "True"]


def test_without_a_signal_the_event_alone_stops_the_loop():
    import threading

    from psflow import serving

    stop = threading.Event()
    timer = threading.Timer(0.1, stop.set)
    timer.start()
    try:
        rounds = 0
        while not serving.stop_requested(stop, lambda: False, poll=0.05):
            rounds += 1
            assert rounds < 200, "the event never stopped the loop"
    finally:
        timer.cancel()

"""Liveness probes for ``psflow local``: a server that stops answering health checks is failed.

A parameter server that is frozen (stopped, deadlocked, swapping) or cut off
still has a live process, so nothing exits and nothing restarts it; its peers'
calls just run into their deadlines.  Kubernetes answers that with a liveness
probe; so does the launcher: a :class:`LivenessProber` thread asks every
watched server for its standard gRPC health every ``interval`` seconds (each
check bounded by ``interval``) and remembers when each last answered
``SERVING``.  The launcher's own loop asks :meth:`LivenessProber.silent` which
servers have not answered for longer than the grace period, and treats them as
failed (SIGKILL, then its restart policy).

Example:
    >>> prober = LivenessProber(grace=30.0)
    >>> prober.interval
    2.0
    >>> prober.silent()
    []
    >>> prober.stop()
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from psflow.errors import InvalidArgumentError

HealthCheck = Callable[[str, float], str]
"""``(address, timeout) -> status name`` (``"SERVING"`` when healthy)."""


def grpc_health(address: str, timeout: float) -> str:
    """The standard gRPC health status of ``address`` (a failed call: its code's name)."""
    from psflow.cli import health_check

    status, _ = health_check(address, timeout=timeout)
    return status


class LivenessProber:
    """Probes servers' health from one thread; reports those silent for longer than ``grace``.

    Args:
        grace: seconds a server may go without a ``SERVING`` answer.
        check: the health check (the standard gRPC one by default).

    Raises:
        InvalidArgumentError: ``grace`` is not a positive number of seconds.
    """

    def __init__(self, grace: float, check: HealthCheck | None = None) -> None:
        if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not grace > 0:
            raise InvalidArgumentError(f"health grace {grace!r} must be a number of seconds > 0")
        self.grace = float(grace)
        self.interval = min(2.0, self.grace / 3)
        self._check = check or grpc_health
        self._lock = threading.Lock()
        self._watched: dict[str, tuple[str, float]] = {}  # name -> (address, last answer)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, name: str, address: str) -> None:
        """Starts probing ``address`` as ``name`` (its grace period starts now)."""
        with self._lock:
            self._watched[name] = (address, time.monotonic())
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(
                    target=self._run, name="psflow-liveness", daemon=True
                )
                self._thread.start()

    def forget(self, name: str) -> None:
        """Stops probing ``name`` (it exited, or is being restarted)."""
        with self._lock:
            self._watched.pop(name, None)

    def silent(self) -> list[tuple[str, float]]:
        """``(name, seconds since its last answer)`` of every server silent longer than grace."""
        now = time.monotonic()
        with self._lock:
            return [
                (name, now - last)
                for name, (_, last) in self._watched.items()
                if now - last > self.grace
            ]

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with self._lock:
                targets = [(name, address) for name, (address, _) in self._watched.items()]
            for name, address in targets:
                if self._stop.is_set():
                    return
                try:
                    status = self._check(address, self.interval)
                except Exception as e:  # a probe that breaks is a failed probe
                    status = type(e).__name__
                if status == "SERVING":
                    with self._lock:
                        if name in self._watched and self._watched[name][0] == address:
                            self._watched[name] = (address, time.monotonic())

    def stop(self) -> None:
        """Stops the probing thread (bounded join)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval + 5.0)

"""The worker's data plane: ``RunClosure`` over the raw TCP frames of
:mod:`psflow.transport.dataplane`, beside its gRPC port.

A closure that does nothing, sent with gRPC's unary ``RunClosure``, cost the
worker 0.4-0.5 ms of CPU and the chief 0.3-0.4 ms, nearly all of it gRPC's
(the executor's own work is about 0.02 ms); on the data plane 0.13-0.2 ms and
0.1-0.28 ms (``benchmarks/closure_cost.py``, 2-core host).  So the worker also
serves the call on a data plane (the parameter servers' transport: token and TLS
checked as on every port, deadlines, typed errors) and announces it in its
``GetStatus`` reply; the chief uses it where announced (see
``psflow.distribute.coordinator.closure_plane``).  The frame's payload is the
``RunClosureRequest``, the reply's the ``RunClosureResponse``: the same
messages, run by the same :meth:`~worker.servicer.WorkerServicer.run_closure`.

On SIGTERM it behaves as the gRPC server does: a closure that arrives after
the signal is refused (UNAVAILABLE: the chief runs it on another worker), those
running finish within the grace and send their replies, then the plane stops.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator

from psflow import errors, serving
from psflow.security.config import SecurityConfig
from psflow.transport.dataplane import DataPlaneServer, Request
from worker.servicer import WorkerServicer

__all__ = ["WorkerPlane"]

log = logging.getLogger(__name__)


class WorkerPlane:
    """The data plane of one worker process, serving ``servicer``'s closures.

    Args:
        servicer: runs the closures (and records them, as for gRPC's calls).
        bind: the address to listen on (the gRPC server's).
        port: its port (0: any free one; see :attr:`port`).
        security: the token and TLS material callers must present.
        stopping: set once the process is told to stop: new closures are refused.
        advertise: ``host:port`` the chief dials instead of the gRPC host and
            :attr:`port` (NAT, relays), or "".
        max_payload: the largest request accepted (the gRPC server's receive limit).
        on_reject: counts refused connections and frames (the metrics), or None.

    Raises:
        UnavailableError: the port cannot be bound.
    """

    def __init__(
        self,
        servicer: WorkerServicer,
        bind: str,
        port: int,
        security: SecurityConfig,
        stopping: threading.Event,
        *,
        advertise: str = "",
        max_payload: int,
        on_reject: Callable[[str], None] | None = None,
    ) -> None:
        self._servicer = servicer
        self._stopping = stopping
        self._running = 0
        self._idle = threading.Condition()
        self._server = DataPlaneServer(
            bind,
            port,
            security,
            servicer.data_plane_handlers(),
            max_payload=max_payload,
            on_reject=on_reject,
            around=self._call,
        )
        self.port = self._server.port
        self._advertise = advertise
        servicer.announce_data_plane(self.port, advertise, max_payload)

    def start(self) -> WorkerPlane:
        """Starts accepting connections; returns self."""
        self._server.start()
        log.info(
            "closures also on the data plane at %s%s",
            serving.host_port(self._server.host, self.port),
            f" (advertised as {self._advertise})" if self._advertise else "",
        )
        return self

    @contextlib.contextmanager
    def _call(self, request: Request) -> Iterator[None]:
        """Every call's edge: refused once the process is stopping, else counted while
        it runs (its reply is sent inside: a drain waits for it) and recorded."""
        with self._idle:
            if self._stopping.is_set():
                raise errors.UnavailableError(
                    f"{request.method}: the worker is shutting down; run it elsewhere"
                )
            self._running += 1
        try:
            with self._servicer.recorded(request.method, request.peer_gone):
                yield
        finally:
            with self._idle:
                self._running -= 1
                self._idle.notify_all()

    def drain(self, timeout: float) -> bool:
        """Waits (at most ``timeout`` seconds) until no call runs; whether none does.
        Only meaningful once ``stopping`` is set (no new call starts then)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._running == 0, timeout=timeout)

    def stop(self, timeout: float = 5.0) -> None:
        """Stops accepting and closes every connection (bounded by ``timeout``)."""
        self._server.stop(timeout)

"""How the chief sends closures over a worker's data plane, and what a lost worker raises.

A worker serves ``RunClosure`` on a raw TCP data plane beside gRPC (see
``worker.plane``) and says where in its ``GetStatus`` reply.  The chief asks
on a worker's first closure and from then on sends each closure as one
request frame (the serialized ``RunClosureRequest``) and reads one reply
frame (the ``RunClosureResponse``) on a pooled connection: the same messages
and the same outcomes as gRPC's call, for less CPU on both sides.  The
fallback rule is the parameter servers' (:class:`~psflow.transport.core.PlaneLink`):
a worker that announces no plane, or whose plane cannot be connected on first
use, gets its closures over gRPC (one log line); so does a closure above the
plane's payload limit, and every closure once the plane answers that it does
not know ``RunClosure``.

Failures raise what gRPC's path raises (:func:`worker_error`): a worker
unreachable, reset mid-closure or past the deadline is lost
(:class:`~psflow.errors.WorkerUnavailableError`: the coordinator re-queues
the closure); refused credentials are an :class:`~psflow.errors.UnauthenticatedError`.

gRPC's channel pings a worker and drops a connection whose pings go unanswered
(a host gone silent, a partition that keeps TCP up), failing its calls; a
socket waiting for a reply has no such ping.  The coordinator's health probe
(``GetStatus``) is the ping here: when a probe fails and nothing was heard
from the worker for the keepalive timeout, the closures waiting on its plane
are failed as lost (:meth:`ClosurePlane.unanswered`).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from psflow import errors, settings
from psflow.proto import worker_pb2
from psflow.security.config import SecurityConfig
from psflow.transport.core import PlaneLink
from psflow.transport.dataplane import DataPlaneClient

__all__ = ["ClosurePlane", "worker_error"]

log = logging.getLogger(__name__)

_LOST = (errors.UnavailableError, errors.DeadlineExceededError, errors.CancelledError)


def worker_error(error: errors.OpError, task: str, address: str) -> errors.OpError:
    """The error a failed call to worker ``task`` raises, either transport: unavailable,
    past its deadline or cancelled is a lost worker (the coordinator re-queues the
    closure); any other keeps its type."""
    if isinstance(error, _LOST) and not isinstance(error, errors.WorkerUnavailableError):
        return errors.WorkerUnavailableError(
            f"{task} at {address} is unavailable: {error.code.name}: {error.message}", task=task
        )
    return error


class _AbortableClient(DataPlaneClient):
    """A data-plane client whose connections another thread can shut down: a call
    blocked on a reply then fails UNAVAILABLE (``close`` leaves calls in flight be)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._opened: weakref.WeakSet[Any] = weakref.WeakSet()
        self._opened_lock = threading.Lock()

    def _open(self, method: str, deadline: float) -> Any:
        conn = super()._open(method, deadline)
        with self._opened_lock:
            self._opened.add(conn)
        return conn

    def abort(self) -> None:
        """Shuts every connection down (those in use and those pooled)."""
        with self._opened_lock:
            conns = list(self._opened)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)


class ClosurePlane:
    """One worker's closure data plane as the chief reaches it.

    Args:
        address: the worker's gRPC ``host:port``.
        task: its name (``"worker:1"``).
        security: the token and TLS material to present.
        status: its ``GetStatus`` call (seconds -> reply), raising typed errors.
        enabled: False: every closure over gRPC.
    """

    def __init__(
        self,
        address: str,
        task: str,
        security: SecurityConfig,
        status: Callable[[float], worker_pb2.GetStatusResponse],
        *,
        enabled: bool,
    ) -> None:
        self.address, self.task = address, task
        self._link = PlaneLink(
            address,
            task,
            security,
            "chief",
            lambda left: status(left).data_plane,
            enabled=enabled,
            route=dict(settings.current().data_plane_routes).get(address, ""),
            client=_AbortableClient,
            carries="its closures",
        )
        self._lock = threading.Lock()
        self._waiting = 0  # closures sent on the plane whose replies are due
        self._heard = time.monotonic()  # when the worker last answered anything

    def run(
        self, request: worker_pb2.RunClosureRequest, timeout: float
    ) -> worker_pb2.RunClosureResponse | None:
        """``request``'s reply, sent on the plane; None, having sent nothing, where it
        goes over gRPC instead (no plane, or the request is above the plane's limit).

        Raises:
            WorkerUnavailableError: the worker is lost (see the module docstring).
            UnauthenticatedError: it refused our credentials.
            OpError: the worker refused the closure (its typed error).
        """
        try:
            plane = self._link.get(timeout)
        except errors.OpError as e:  # GetStatus, or connecting to a restarted worker's plane
            raise worker_error(e, self.task, self.address) from None
        if plane is None:
            return None
        payload = request.SerializeToString()
        if len(payload) > self._link.max_payload:
            return None
        with self._lock:
            self._waiting += 1
        try:
            _, reply = plane.call("RunClosure", b"", (payload,), timeout)
        except errors.UnimplementedError as e:  # a plane that runs no closures
            log.warning("%s: its data plane runs no closures (%s): gRPC from now on", self.task, e)
            self._link.close()
            return None
        except errors.OpError as e:
            self._link.failed(plane, e)  # a restarted worker listens on a new port
            raise worker_error(e, self.task, self.address) from None
        finally:
            with self._lock:
                self._waiting -= 1
        self.answered()
        return worker_pb2.RunClosureResponse.FromString(reply)

    @property
    def address_in_use(self) -> str | None:
        """The plane's address once closures go over it (None: gRPC, or not asked yet)."""
        plane = self._link.known
        return None if plane is None else plane.address

    def answered(self) -> None:
        """The worker answered (a health probe, a closure)."""
        self._heard = time.monotonic()

    def unanswered(self, keepalive_timeout: float) -> None:
        """A health probe went unanswered: with nothing heard from the worker for
        ``keepalive_timeout`` seconds, the closures waiting on its plane fail as lost."""
        plane = self._link.known
        silent = time.monotonic() - self._heard
        if not isinstance(plane, _AbortableClient) or silent <= keepalive_timeout:
            return
        with self._lock:
            if not self._waiting:
                return
        log.warning(
            "%s: nothing heard for %.1f s; its closures in flight on the data plane are lost",
            self.task,
            silent,
        )
        plane.abort()

    def close(self) -> None:
        """Closes the plane's connections."""
        self._link.close()

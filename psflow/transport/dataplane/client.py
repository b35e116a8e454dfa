"""``DataPlaneClient``: calls over the raw TCP data plane of one server.

Thread-safe: a small pool of connections, one call at a time on each.  Every
call has a deadline, from which each socket operation's timeout is derived.
Failures raise the typed psflow errors the gRPC path raises for the same
failure (one mapping, :func:`psflow.transport.status.status_error`):

* the server unreachable, the connection reset or closed mid-call:
  ``UnavailableError``;
* the deadline passed: ``DeadlineExceededError``;
* the TLS handshake or the token refused: ``UnauthenticatedError``;
* an ERROR frame: the error of its status code, a ``MovedError`` with its
  redirect fields when its metadata carries them.

A connection that failed is dropped; the next call opens a new one (lazily).

Example:
    >>> client = DataPlaneClient("127.0.0.1:4000", SecurityConfig())  # doctest: +SKIP
    >>> header, payload = client.call("Pull", request_bytes, timeout=5.0)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from psflow.errors import Code, InvalidArgumentError, OpError
from psflow.proto import dataplane_pb2
from psflow.security.config import SecurityConfig
from psflow.transport.started import Started
from psflow.transport.status import status_error

from . import auth, frames
from .stream import DIRECT_BYTES, IOV_MAX, FrameStream, readable_now, tune

__all__ = ["DataPlaneClient", "Sink"]

log = logging.getLogger(__name__)

Sink = Callable[[bytes, int], "memoryview | None"]
"""``sink(reply_header, payload_len)``: a writable byte view of exactly
``payload_len`` bytes to receive a reply's payload into, or None (a new buffer)."""

_DEFAULT_MAX_REPLY = 1 << 34


class _Conn(FrameStream):
    """A pooled connection: its frames, and when it was last handed back."""

    last_used = 0.0


class _Sent(Started):
    """A call sent on a pooled connection (:meth:`DataPlaneClient.send`): :meth:`result`
    reads its reply, then hands the connection (kept after an ERROR) and slot back."""

    __slots__ = ("_call",)

    def __init__(self, client: DataPlaneClient, *call: Any) -> None:
        def abandon() -> None:  # its connection is closed, its slot freed
            call[1].close()
            client._slots.release()

        super().__init__(abandon, abandon, call[0])  # ``_read``: set while unread
        self._call = (client, *call)

    def result(self) -> Any:
        """The reply, read once: ``read(reply)``, or ``recover(error)`` (see ``send``)."""
        self._claim()
        client, method, conn, call_id, deadline, sink, read, recover = self._call
        try:
            try:
                with client._failures(method, conn.close, frames.Kind.REQUEST):
                    conn.settimeout(max(deadline - time.monotonic(), 0.001))
                    head = conn.read_head()
                    header = conn.read_bytes(head.header_len)
                    if head.call_id != call_id:
                        raise frames.FrameError(
                            f"a reply to call {head.call_id} where call {call_id}'s was due"
                        )
                    if head.kind is frames.Kind.ERROR:
                        conn.discard(head.payload_len)
                        reply: Any = client._status(method, header)
                    elif head.kind is not frames.Kind.REPLY:
                        raise frames.FrameError(f"a {head.kind.name} frame where REPLY was due")
                    else:
                        dest = None if sink is None else sink(header, head.payload_len)
                        if dest is None:
                            dest = memoryview(np.empty(head.payload_len, np.uint8))
                        elif len(dest) != (n := head.payload_len):
                            raise InvalidArgumentError(f"the sink gave {len(dest)} bytes for {n}")
                        conn.read_into(dest)
                        reply = (header, dest)
                client._give_back(conn)
            finally:
                client._slots.release()  # before a recovery, which may take a slot again
            if isinstance(reply, OpError):
                raise reply
        except OpError as e:
            if recover is None:
                raise
            return recover(e)
        return reply if read is None else read(reply)


class DataPlaneClient:
    """A client of one :class:`~.server.DataPlaneServer`.

    Args:
        address: ``host:port`` of the data plane.
        security: the token and TLS material to present.
        task: the server's task name (``"ps:0"``), used in errors.
        max_connections: connections open at once; more concurrent calls wait.
        max_reply_bytes: the largest reply payload accepted.
        reuse_idle: a pooled connection idle longer than this is replaced
            rather than reused (servers close idle connections).
        client_name: how this client introduces itself (server logs).
    """

    def __init__(
        self,
        address: str,
        security: SecurityConfig | None = None,
        *,
        task: str | None = None,
        max_connections: int = 8,
        max_reply_bytes: int = _DEFAULT_MAX_REPLY,
        reuse_idle: float = 60.0,
        client_name: str = "",
    ) -> None:
        host, sep, port = address.rpartition(":")
        if not sep or not port.isdigit():
            raise InvalidArgumentError(f"data-plane address {address!r} is not host:port")
        self.address = address
        self._host, self._port = host.strip("[]"), int(port)
        self.security = security or SecurityConfig()
        self.task = task
        self.max_reply_bytes = max_reply_bytes
        self.reuse_idle = reuse_idle
        self._hello = auth.hello(self.security, client_name)
        self._tls = None
        if self.security.tls is not None:
            self._tls = auth.client_context(self.security.tls)
        self._server_name = (
            self.security.tls.server_name if self.security.tls is not None else None
        ) or self._host
        self._slots = threading.BoundedSemaphore(max_connections)
        self._lock = threading.Lock()
        self._idle: list[_Conn] = []
        self._ids = itertools.count(1)
        self._closed = False

    def __repr__(self) -> str:
        return f"DataPlaneClient({self.address!r}, task={self.task!r})"

    def __enter__(self) -> DataPlaneClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Closes the pooled connections; calls in flight finish on theirs, later
        calls raise ``UnavailableError``."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    # -- connections ------------------------------------------------------------------
    def _error(self, method: str, code: Code, details: str, metadata=()) -> OpError:
        return status_error(method, self.task, self.address, code, details, metadata)

    def _open(self, method: str, deadline: float) -> _Conn:
        """A new connection, its HELLO accepted."""
        hello, sock = frames.Kind.HELLO, None
        with self._failures(method, lambda: sock is not None and sock.close(), hello):
            if deadline <= time.monotonic():
                raise TimeoutError
            sock = socket.create_connection(
                (self._host, self._port), timeout=deadline - time.monotonic()
            )
            tune(sock)
            if self._tls is not None:
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                sock = self._tls.wrap_socket(sock, server_hostname=self._server_name)
            conn = _Conn(sock, max_header=frames.MAX_HEADER_BYTES, max_payload=self.max_reply_bytes)
            conn.settimeout(max(deadline - time.monotonic(), 0.001))
            conn.send_frame(hello, header=self._hello)
            head = conn.read_head()
            header = conn.read_bytes(head.header_len)
            conn.discard(head.payload_len)
            if head.kind is frames.Kind.ERROR:
                raise self._status(method, header)
            if head.kind is not frames.Kind.WELCOME:
                raise frames.FrameError(f"a {head.kind.name} frame where WELCOME was due")
        return conn

    def _take(self, method: str, deadline: float) -> _Conn:
        with self._lock:
            if self._closed:  # a caller may retry on a new client: as if unreachable
                raise self._error(method, Code.UNAVAILABLE, "the data-plane client is closed")
            while self._idle:
                conn = self._idle.pop()
                if _reusable(conn, self.reuse_idle):
                    return conn
                conn.close()
        return self._open(method, deadline)

    def _give_back(self, conn: _Conn) -> None:
        conn.last_used = time.monotonic()
        with self._lock:
            if not self._closed:
                self._idle.append(conn)
                return
        conn.close()

    def connect(self, timeout: float) -> None:
        """Opens one connection now (and pools it): the server is reachable and accepts us.

        Raises:
            UnavailableError, DeadlineExceededError, UnauthenticatedError: as :meth:`call`.
        """
        deadline = time.monotonic() + timeout
        self._give_back(self._take("connect", deadline))

    # -- calls -----------------------------------------------------------------------
    def call(self, *args: Any, **kwargs: Any) -> tuple[bytes, memoryview]:
        """:meth:`send`'s call, its reply read at once: the reply's header bytes and
        payload, or the failure's typed error raised (see the module docstring)."""
        return self.send(*args, **kwargs).result()

    def send(
        self,
        method: str,
        header: bytes,
        payload: Sequence[Any] = (),
        timeout: float = 60.0,
        *,
        sink: Sink | None = None,
        read: Callable[[tuple[bytes, memoryview]], Any] | None = None,
        recover: Callable[[OpError], Any] | None = None,
    ) -> Started:
        """Sends a call to ``method`` now, its reply left to the started call's
        ``result()`` (``cancel()`` closes its connection): a thread sending to several
        servers before reading a reply has them work at once, with no thread per call.
        The call holds a pooled connection until its result is read or it is cancelled.

        Args:
            method: the method name.
            header: the serialized request header.
            payload: buffers sent back to back (joined to the headers only if small).
            timeout: seconds until the deadline.
            sink: where the reply payload goes (default: a new buffer the view owns).
            read: the result is ``read(reply)`` (default: the reply's header and payload).
            recover: where sending the request or reading the reply failed, the
                result is ``recover(error)`` (it may raise; default: the error
                is raised, by this method where sending failed).

        Raises:
            OpError: the request could not be sent (as :meth:`call`; without ``recover``).
        """
        deadline = time.monotonic() + timeout
        try:
            if not self._slots.acquire(timeout=max(timeout, 0.0)):
                raise self._error(method, Code.DEADLINE_EXCEEDED, "no free data-plane connection")
            try:
                conn = self._take(method, deadline)
                call_id = next(self._ids)
                with self._failures(method, conn.close, frames.Kind.REQUEST):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError
                    conn.settimeout(left)
                    # written here, blocking, nothing to release (the stream's send_frame
                    # serves the replies): one gathered write, a small payload joined
                    views = [memoryview(b).cast("B") for b in payload]
                    n, ms = sum(map(len, views)), frames.timeout_ms(left)
                    fixed = (frames.Kind.REQUEST, frames.method_id(method), call_id, len(header))
                    head = frames.pack(*fixed, ms, n)
                    if n <= DIRECT_BYTES:  # a small payload rides with the headers
                        views = [memoryview(b"".join([head, header, *views]))]
                    else:
                        views.insert(0, memoryview(head + header))
                    sent = conn.sock.sendmsg(views[:IOV_MAX]) if conn.gather else 0
                    for view in views:  # what that left (on TLS: everything), sent whole
                        if sent < len(view):
                            conn.sock.sendall(view[sent:])
                        sent = max(0, sent - len(view))
            except BaseException:
                self._slots.release()
                raise
        except OpError as e:
            if recover is None:
                raise
            return Started(functools.partial(recover, e), what=method)

        return _Sent(self, method, conn, call_id, deadline, sink, read, recover)

    def _status(self, method: str, header: bytes) -> OpError:
        """The typed error an ERROR frame's status header names."""
        status = dataplane_pb2.DataPlaneStatus.FromString(header)
        code = Code.__members__.get(status.code, Code.UNKNOWN)
        metadata = [(m.key, m.value) for m in status.metadata]
        return self._error(method, code, status.message, metadata)

    @contextlib.contextmanager
    def _failures(self, method: str, drop: Callable[[], Any], kind: frames.Kind) -> Iterator[None]:
        """Maps a failure inside to its typed error, calling ``drop`` (the connection is
        unusable after any)."""
        try:
            yield
        except BaseException as e:
            drop()
            if isinstance(e, OpError):
                raise
            if isinstance(e, TimeoutError):
                raise self._error(method, Code.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
            if isinstance(e, ssl.SSLError):
                # TLS 1.3 reports a refused client certificate on the first read, the HELLO's
                code = Code.UNAUTHENTICATED if kind is frames.Kind.HELLO else Code.UNAVAILABLE
                raise self._error(method, code, f"data plane TLS: {e}") from None
            if isinstance(e, (ConnectionError, OSError)):
                raise self._error(method, Code.UNAVAILABLE, f"data plane: {e}") from None
            if isinstance(e, Exception):  # a FrameError, a malformed status header
                raise self._error(method, Code.UNAVAILABLE, f"data plane: bad reply: {e}") from None
            raise


_FRESH = 1.0


def _reusable(conn: _Conn, reuse_idle: float) -> bool:
    """Whether a pooled connection is worth reusing: recently used and not closed by the peer."""
    idle = time.monotonic() - conn.last_used
    if idle > reuse_idle:
        return False
    if idle < _FRESH:  # servers close only connections idle far longer: skip the syscall
        return not conn.pending()
    try:
        readable = readable_now(conn.sock)
    except (OSError, ValueError):
        return False
    # nothing may arrive between calls: readable means closed (EOF) or out of step
    return not readable and not conn.pending()

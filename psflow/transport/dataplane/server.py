"""``DataPlaneServer``: serves calls of the raw TCP data plane.

A connection starts with a HELLO carrying the shared token (see
:mod:`.auth`; TLS first when configured), read by a short-lived thread of its
own within ``hello_timeout`` (see :mod:`.door`); a refused one gets an
UNAUTHENTICATED ERROR frame and is closed.  A welcomed connection, plain or
TLS, then has one request path (:mod:`.loop`): its frames are read into its
own reusable buffers by the threads of the event loop (or, without
``epoll``, by its own thread), and each REQUEST runs the handler its method
id names and is answered with a REPLY whose buffers go out with one
``sendmsg``.  A handler that raises a psflow :class:`OpError` answers an
ERROR frame with the status gRPC would have carried
(:func:`~psflow.errors.status_of`: the code, the message and a
:class:`MovedError`'s redirect); so do an unknown method (UNIMPLEMENTED) and a
call whose deadline passed before it ran (DEADLINE_EXCEEDED, counted from the
frame's first byte).

A frame that breaks the format or the limits closes its connection with a
logged reason before any handler runs; other connections are not affected.
Connections are bounded in number; one idle ``idle_timeout`` seconds, or
mid-frame longer than ``io_timeout``, is closed by the accepting thread's
sweep; :meth:`DataPlaneServer.stop` stops accepting, shuts every connection
down and joins the threads within a timeout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from psflow.errors import (
    Code,
    DeadlineExceededError,
    InternalError,
    InvalidArgumentError,
    OpError,
    UnavailableError,
    UnimplementedError,
    error_class,
    status_of,
)
from psflow.proto import dataplane_pb2
from psflow.security.config import SecurityConfig

from . import auth, door, frames, loop
from .loop import RETIRE_AFTER, Connection, EventLoop, Limits
from .stream import tune

__all__ = ["DataPlaneServer", "Handler", "Reply", "Request"]

log = logging.getLogger(__name__)

DEFAULT_MAX_PAYLOAD = 1 << 30
_ACCEPT_POLL = 0.2
_SWEEP = 0.5
# an authenticated connection idle this long may be closed to make room for a new one
# (clients check a pooled connection idle over a second before they reuse it)
_EVICTABLE_IDLE = 2.0


@dataclasses.dataclass(frozen=True)
class Request:
    """One call as a handler sees it.

    Attributes:
        method: the method name.
        header: the serialized protobuf header the client sent.
        payload: the raw payload; a view of the connection's buffer, valid only
            until the handler returns (copy what must outlive the call).
        peer: ``ipv4:host:port`` of the client (as gRPC names a peer).
        deadline: ``time.monotonic()`` by which the client stops waiting, or None.
        peer_gone: whether the client has left (closed or reset its connection):
            a handler that waits (a synchronous step) asks it now and then and
            stops waiting for nobody.  One system call; cheap, not free.
    """

    method: str
    header: bytes
    payload: memoryview
    peer: str
    deadline: float | None
    peer_gone: Callable[[], bool] = lambda: False

    def time_remaining(self) -> float | None:
        """Seconds until the client's deadline (None: it gave none)."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())


class Reply(NamedTuple):
    """A handler's answer: a header, payload buffers sent as they are, and an
    optional ``release`` called once they are sent (a snapshot's lock, say)."""

    header: bytes = b""
    buffers: Sequence[Any] = ()
    release: Callable[[], None] | None = None


Handler = Callable[[Request], Reply]


class _Accepted:
    """A connection from accept until its handshake ends (its thread's)."""

    __slots__ = ("peer", "sock", "thread")

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.thread: threading.Thread | None = None


class DataPlaneServer:
    """A listening socket serving ``handlers`` over the data-plane frames.

    Args:
        host: the address to bind (the gRPC server's).
        port: the port (0: any free one; see :attr:`port`).
        security: the token and TLS material clients must present.
        handlers: method name -> handler.
        max_connections: authenticated connections served at once; at the limit
            the one idle longest (at least a few seconds) is closed for a new one,
            or else the new one is refused.
        max_pending: connections that have not finished their handshake, at once
            (apart from ``max_connections``); at this budget, or at
            ``max_pending_per_host`` from one address, the oldest handshake is
            closed for the new one (see :mod:`.door`).
        max_pending_per_host: the same budget for one address.
        hello_timeout: seconds from accept by which the HELLO (and the TLS
            handshake) must be done.
        idle_timeout: seconds a connection may wait for its next call.
        io_timeout: seconds a frame may take to arrive (or a reply to leave)
            once it started.
        max_header: the largest protobuf header accepted.
        max_payload: the largest payload accepted.
        retain_bytes: a connection keeps its receive buffer across calls up to
            this size (larger payloads get a buffer of their own each time: with
            many connections, kept 64 MB buffers would add up; a tuned allocator,
            see :mod:`psflow.memory`, reuses the freed ones anyway).
        on_reject: called with a reason for every refused connection or frame
            (``"unauthenticated"``, ``"malformed_frame"``, ``"too_many_connections"``).
        thread_idle_timeout: seconds without an event after which an event-loop
            thread beyond the first two exits.

    Raises:
        InvalidArgumentError: two handler names share a wire id.
        UnavailableError: the address cannot be bound (from :meth:`start`).
    """

    def __init__(
        self,
        host: str,
        port: int,
        security: SecurityConfig,
        handlers: Mapping[str, Handler],
        *,
        max_connections: int = 256,
        max_pending: int = 128,
        max_pending_per_host: int = 64,
        hello_timeout: float = 10.0,
        idle_timeout: float = 300.0,
        io_timeout: float = 60.0,
        max_header: int = frames.MAX_HEADER_BYTES,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        retain_bytes: int = 4 << 20,
        on_reject: Callable[[str], None] | None = None,
        thread_idle_timeout: float = RETIRE_AFTER,
    ) -> None:
        self.host = host
        self.security = security
        self.max_connections = max_connections
        self.idle_timeout = idle_timeout
        self.io_timeout = io_timeout
        self._limits = Limits(max_header, max_payload, retain_bytes, io_timeout)
        self._on_reject = on_reject
        self._handlers: dict[int, tuple[str, Handler]] = {}
        for name, handler in handlers.items():
            self.add_handler(name, handler)
        self._tls = None if security.tls is None else auth.server_context(security.tls)
        self._listener = self._bind(host, port)
        self.port = self._listener.getsockname()[1]
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._handshaking: set[_Accepted] = set()
        self._served: set[Connection] = set()
        self._door = door.Door(
            max_pending=max_pending,
            max_pending_per_host=max_pending_per_host,
            hello_timeout=hello_timeout,
        )
        self._refusals = door.Refusals(log)
        self._accept_thread: threading.Thread | None = None
        self._next_sweep = 0.0
        # welcomed connections, plain and TLS, are read by the event loop's threads
        # (see :mod:`.loop`); where there is no epoll, each by a thread of its own
        self._loop: EventLoop | None = None
        if loop.available():
            self._loop = EventLoop(
                f"dataplane-{self.port}",
                self._call,
                max_threads=max_connections,
                retire_after=thread_idle_timeout,
                on_error=self._read_failed,
                on_close=self._closed,
            )
        else:
            log.info(
                "data plane on %s:%d: no epoll on this platform (%s); "
                "each connection is served on a thread of its own",
                host,
                self.port,
                sys.platform,
            )

    def __repr__(self) -> str:
        return f"DataPlaneServer({self.host!r}, port={self.port})"

    @property
    def loop_threads(self) -> int:
        """Threads of the event loop serving now (two, more while calls block, fewer
        again once those idle; 0 where there is no epoll and each connection has a
        thread of its own)."""
        return 0 if self._loop is None else self._loop.threads

    @staticmethod
    def _bind(host: str, port: int) -> socket.socket:
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((host.strip("[]"), port))
            sock.listen(128)
        except OSError as e:
            sock.close()
            raise UnavailableError(f"data plane cannot bind {host}:{port}: {e}") from e
        sock.settimeout(_ACCEPT_POLL)
        return sock

    def add_handler(self, name: str, handler: Handler) -> None:
        """Serves ``name`` with ``handler`` (before or after :meth:`start`).

        Raises:
            InvalidArgumentError: another method's name has the same wire id.
        """
        mid = frames.method_id(name)
        known = self._handlers.get(mid)
        if known is not None and known[0] != name:
            raise InvalidArgumentError(
                f"data-plane methods {known[0]!r} and {name!r} share wire id {mid}"
            )
        self._handlers[mid] = (name, handler)

    # -- lifecycle --------------------------------------------------------------------
    def start(self) -> DataPlaneServer:
        """Starts accepting connections; returns self."""
        if self._loop is not None:
            self._loop.start()
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name=f"dataplane-accept-{self.port}", daemon=True
        )
        self._accept_thread.start()
        return self

    def __enter__(self) -> DataPlaneServer:
        return self.start() if self._accept_thread is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self, timeout: float = 5.0) -> None:
        """Stops accepting, shuts every connection down, joins the threads (bounded)."""
        self._stopping.set()
        deadline = time.monotonic() + timeout
        if self._accept_thread is not None:
            self._accept_thread.join(max(0.0, deadline - time.monotonic()))
        self._listener.close()
        if self._loop is not None:
            self._loop.stop(deadline)
        with self._lock:
            open_now = [*self._handshaking, *self._served]
        for conn in open_now:
            _shutdown(conn.sock)
        for conn in open_now:
            if conn.thread is not None:
                conn.thread.join(max(0.0, deadline - time.monotonic()))

    @property
    def connections(self) -> int:
        """Connections open now (handshakes under way included)."""
        with self._lock:
            return len(self._handshaking) + len(self._served)

    @property
    def pending_handshakes(self) -> int:
        """Connections that have not finished their handshake."""
        return self._door.pending

    # -- accepting -------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            self._reap()
            try:
                sock, addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if self._stopping.is_set():
                    return
                log.warning("data plane accept failed: %s", e)
                time.sleep(_ACCEPT_POLL)
                continue
            accepted = _Accepted(sock, _peer_name(addr))
            deadline, evicted = self._door.enter(accepted, addr[0])
            for old in evicted:
                self._refused(old.peer, "closed before its handshake ended: a newer one came")
                _shutdown(old.sock)
            with self._lock:
                self._handshaking.add(accepted)
            accepted.thread = threading.Thread(
                target=self._serve,
                args=(accepted, deadline),
                name=f"dataplane-{accepted.peer}",
                daemon=True,
            )
            accepted.thread.start()

    def _reap(self) -> None:
        """Closes the handshakes past their deadline and the connections idle or
        stalled too long; reports counted refusals."""
        for conn in self._door.expired():
            self._refused(conn.peer, f"no handshake within {self._door.hello_timeout:g} s")
            _shutdown(conn.sock)
        self._refusals.flush()
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + _SWEEP
        with self._lock:
            waiting = [c for c in self._served if not c.busy]
        for conn in waiting:  # shut down: whatever waits for its bytes wakes and closes it
            if conn.mid_frame():
                began = conn.last if conn.frame_start is None else conn.frame_start
                if now - began > self.io_timeout:
                    log.debug("data plane: a frame from %s still incomplete: closed", conn.peer)
                    conn.shutdown()
            elif now - conn.last > self.idle_timeout:
                log.debug(
                    "data plane: no call from %s for %.1f s: closed", conn.peer, now - conn.last
                )
                conn.shutdown()

    def _refused(self, peer: str, why: str, reason: str = "handshake_incomplete") -> None:
        """Counts a refused connection (metrics) and logs it, rate-limited."""
        self._rejected(reason)
        self._refusals.refused(peer, why, reason)

    def _admit(self, accepted: _Accepted) -> bool:
        """Whether an authenticated connection fits ``max_connections``; at the limit the
        connection idle longest gives way, or ``accepted`` is refused (False)."""
        for _ in range(3):  # each round admits, or closes one idle connection
            with self._lock:
                open_now = sum(1 for c in self._served if c.authenticated)
                if open_now < self.max_connections:
                    return True
            if not self._close_idlest():
                break
        why = f"{self.max_connections} connections open (the limit), none idle"
        self._refused(accepted.peer, why, "too_many_connections")
        with contextlib.suppress(OSError):
            _send_raw_status(
                accepted.sock,
                Code.RESOURCE_EXHAUSTED,
                f"the data plane serves at most {self.max_connections} connections",
            )
        return False

    def _close_idlest(self) -> bool:
        """Closes the authenticated connection idle longest, if it has been idle
        :data:`_EVICTABLE_IDLE` s at least (a client reuses a fresher one unchecked)."""
        now = time.monotonic()
        with self._lock:
            idle = [
                c
                for c in self._served
                if c.authenticated
                and not c.busy
                and not c.mid_frame()
                and now - c.last >= _EVICTABLE_IDLE
            ]
            if not idle:
                return False
            victim = min(idle, key=lambda c: c.last)
            victim.authenticated = False
        victim.shutdown()
        log.info(
            "data plane: closed the idle connection from %s for a new one (%d open, the limit)",
            victim.peer,
            self.max_connections,
        )
        return True

    def _rejected(self, reason: str) -> None:
        if self._on_reject is not None:
            self._on_reject(reason)

    # -- one connection ---------------------------------------------------------------
    def _serve(self, accepted: _Accepted, deadline: float) -> None:
        """A connection's thread: the handshake by ``deadline``, then the hand-over to
        the event loop (or, without epoll, its calls)."""
        sock, peer = accepted.sock, accepted.peer
        conn = None
        try:
            tune(sock)
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_side=True)
            authenticated = self._authenticate(sock, peer, deadline)
            if not self._door.leave(accepted):
                return  # past its deadline or evicted meanwhile: already shut down
            if not authenticated or not self._admit(accepted) or self._stopping.is_set():
                return
            sock.sendall(frames.pack(frames.Kind.WELCOME))
            # authenticated: only now are a connection's buffers allocated for this peer
            conn = Connection(
                sock,
                peer,
                nonblocking=self._loop is not None,
                limits=self._limits,
            )
            with self._lock:
                self._handshaking.discard(accepted)
                self._served.add(conn)
            if self._loop is not None:
                self._loop.add(conn)
            else:
                conn.thread = accepted.thread
                loop.serve_blocking(conn, self._call, self._read_failed, self._stopping)
                self._closed(conn)
        except frames.FrameError as e:
            self._refused(peer, str(e), "malformed_frame")
        except ssl.SSLError as e:
            self._refused(peer, f"TLS failed: {e}", "unauthenticated")
        except TimeoutError:
            log.debug("data plane handshake from %s stalled: closed", peer)
        except (ConnectionError, OSError) as e:
            log.debug("data plane connection from %s ended: %s", peer, e)
        finally:
            self._door.leave(accepted)
            if conn is None:
                _shutdown(sock)
                sock.close()
                with self._lock:
                    self._handshaking.discard(accepted)

    def _read_failed(self, conn: Connection, error: BaseException) -> None:
        if isinstance(error, frames.FrameError):
            self._rejected("malformed_frame")
            log.warning("data plane closed the connection from %s: %s", conn.peer, error)

    def _closed(self, conn: Connection) -> None:
        with self._lock:
            self._served.discard(conn)

    # -- the handshake ----------------------------------------------------------------
    def _authenticate(self, sock: socket.socket, peer: str, deadline: float) -> bool:
        """Reads the HELLO (at most :data:`auth.HELLO_LIMIT` bytes, by ``deadline``)
        and checks its token; a refused one is answered UNAUTHENTICATED (False)."""
        raw = _read_exact(sock, frames.FIXED.size, deadline)
        head = frames.unpack(raw, max_header=auth.HELLO_LIMIT, max_payload=0)
        if head.kind is not frames.Kind.HELLO:
            raise frames.FrameError(
                f"the first frame is a {head.kind.name}; a HELLO without payload was expected"
            )
        why = auth.check_hello(self.security, _read_exact(sock, head.header_len, deadline))
        if why is not None:
            self._refused(peer, why, "unauthenticated")
            _send_raw_status(sock, Code.UNAUTHENTICATED, f"data plane: {why}")
            return False
        return True

    # -- one call: every connection's --------------------------------------------------
    def _call(
        self, conn: Connection, head: frames.FrameHead, header: bytes, payload: memoryview
    ) -> bool:
        """Runs one request with its handler and sends the reply or the error's status;
        False when the connection is to be closed (its peer is gone, or the server stops)."""
        deadline = None
        if head.timeout_ms:  # the client's time left when it sent the frame's first byte
            deadline = conn.began + head.timeout_ms / 1000.0
        known = self._handlers.get(head.method)
        try:
            try:
                if known is None:
                    raise UnimplementedError(f"data plane: no method with id {head.method}")
                name, handler = known
                if deadline is not None and time.monotonic() >= deadline:
                    raise DeadlineExceededError(
                        f"data plane: {name}'s deadline of {head.timeout_ms} ms passed "
                        "before it ran"
                    )
                request = Request(name, header, payload, conn.peer, deadline, conn.peer_gone)
                reply = Reply(*handler(request))
            except OpError as e:
                status = status_of(e)
            except Exception as e:
                log.exception("data plane %s failed", known[0] if known else head.method)
                status = status_of(InternalError(f"{known[0]}: {type(e).__name__}: {e}"))
            else:
                conn.stream.send_frame(
                    frames.Kind.REPLY,
                    method=head.method,
                    call_id=head.call_id,
                    header=reply.header,
                    buffers=reply.buffers,
                    release=reply.release,
                )
                status = None
            if status is not None:
                header = _status_header(status.code, status.details, status.metadata)
                conn.stream.send_frame(frames.Kind.ERROR, call_id=head.call_id, header=header)
        except (OSError, ValueError) as e:  # ConnectionError, TimeoutError: the peer is gone
            log.debug("data plane connection from %s ended: %s", conn.peer, e)
            return False
        conn.last = time.monotonic()
        return not self._stopping.is_set()


def _read_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    """Exactly ``n`` bytes from ``sock`` by ``deadline`` (no more: nothing of a peer's
    next frame is read, nor anything allocated past ``n``).

    Raises:
        TimeoutError: the deadline passed.
        ConnectionError: the peer closed first.
    """
    buf = bytearray(n)
    view = memoryview(buf)
    pos = 0
    while pos < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{n - pos} of {n} bytes still missing at the deadline")
        sock.settimeout(left)
        got = sock.recv_into(view[pos:])
        if got == 0:
            raise ConnectionError("the data-plane connection was closed by its peer")
        pos += got
    return bytes(buf)


def _status_header(code: Code, message: str, metadata: Sequence[tuple[str, str]] = ()) -> bytes:
    return dataplane_pb2.DataPlaneStatus(
        code=Code(code).name,
        message=message,
        metadata=[dataplane_pb2.DataPlaneMetadata(key=k, value=v) for k, v in metadata],
    ).SerializeToString()


def _send_raw_status(sock: socket.socket, code: Code, message: str) -> None:
    """An ERROR frame sent before (or instead of) a connection's stream exists."""
    header = _status_header(*status_of(error_class(code)(message)))
    sock.sendall(frames.pack(frames.Kind.ERROR, header_len=len(header)) + header)


def _peer_name(addr: Any) -> str:
    host, port = addr[0], addr[1]
    return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)

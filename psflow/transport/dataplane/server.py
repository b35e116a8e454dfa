"""``DataPlaneServer``: serves calls of the raw TCP data plane.

A connection starts with a HELLO carrying the shared token (see
:mod:`.auth`; TLS first when configured), read by a short-lived thread of its
own; a refused one gets an UNAUTHENTICATED ERROR frame and is closed.  A
welcomed plain connection then joins the event loop (:mod:`.loop`: a few
threads for every connection, calls run on the thread that read them); a TLS
one keeps its thread, and so does every connection on a platform without
``epoll`` (macOS, the BSDs, Windows: one log line says so).  It carries calls one at a time: a REQUEST frame whose
payload is received with ``recv_into`` into the
connection's own reusable buffer (no joins, the GIL released while the kernel
copies), the handler named by its method id, and a REPLY frame whose buffers go
out with one ``sendmsg``.  A handler that raises a psflow :class:`OpError`
answers an ERROR frame with the status gRPC would have carried: the code name,
the message and the trailing metadata (a :class:`MovedError`'s redirect).

A frame that breaks the format or the limits closes its connection with a
logged reason before any handler runs; other connections are not affected.
Connections are bounded in number, closed after ``idle_timeout`` seconds
without a call, and :meth:`DataPlaneServer.stop` stops accepting, shuts every
connection down and joins the threads within a timeout.
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

import numpy as np

from psflow.errors import (
    Code,
    InvalidArgumentError,
    MovedError,
    OpError,
    UnavailableError,
)
from psflow.proto import dataplane_pb2
from psflow.security.config import SecurityConfig

from . import auth, frames, loop
from .loop import EventLoop, LoopConnection, ReplyStream
from .stream import FrameStream, tune

__all__ = ["DataPlaneServer", "Handler", "Reply", "Request"]

log = logging.getLogger(__name__)

DEFAULT_MAX_PAYLOAD = 1 << 30
_ACCEPT_POLL = 0.2
_MAX_DETAILS = 4096


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
    """

    method: str
    header: bytes
    payload: memoryview
    peer: str
    deadline: float | None

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


class _Connection:
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
        max_connections: connections served at once; one more is refused.
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
        idle_timeout: float = 300.0,
        io_timeout: float = 60.0,
        max_header: int = frames.MAX_HEADER_BYTES,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        retain_bytes: int = 4 << 20,
        on_reject: Callable[[str], None] | None = None,
    ) -> None:
        self.host = host
        self.security = security
        self.max_connections = max_connections
        self.idle_timeout = idle_timeout
        self.io_timeout = io_timeout
        self.max_header = max_header
        self.max_payload = max_payload
        self.retain_bytes = retain_bytes
        self._on_reject = on_reject
        self._handlers: dict[int, tuple[str, Handler]] = {}
        for name, handler in handlers.items():
            self.add_handler(name, handler)
        self._tls = None if security.tls is None else auth.server_context(security.tls)
        self._listener = self._bind(host, port)
        self.port = self._listener.getsockname()[1]
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._connections: set[_Connection] = set()
        self._accept_thread: threading.Thread | None = None
        # plain-TCP connections are read by one event-loop thread after their HELLO
        # (see :mod:`.loop`); TLS ones keep a thread each (ssl has no cheap non-blocking
        # reads of partial records), and so does every connection where there is no epoll
        self._loop: EventLoop | None = None
        if loop.available():
            self._loop = EventLoop(
                f"dataplane-{self.port}",
                self._loop_call,
                max_threads=max_connections,
                idle_timeout=idle_timeout,
                io_timeout=io_timeout,
                on_error=self._loop_failed,
                on_close=self._loop_closed,
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
        """Threads the event loop started for plain connections (two until calls block;
        0 where there is no epoll and each connection has a thread of its own)."""
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
            connections = list(self._connections)
        for conn in connections:
            _shutdown(conn.sock)
        for conn in connections:
            if conn.thread is not None:
                conn.thread.join(max(0.0, deadline - time.monotonic()))

    @property
    def connections(self) -> int:
        """Connections open now."""
        with self._lock:
            return len(self._connections)

    # -- accepting -------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
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
            peer = _peer_name(addr)
            conn = _Connection(sock, peer)
            with self._lock:
                full = len(self._connections) >= self.max_connections
                if not full:
                    self._connections.add(conn)
            if full:
                self._refuse_full(sock, peer)
                continue
            conn.thread = threading.Thread(
                target=self._serve, args=(conn,), name=f"dataplane-{peer}", daemon=True
            )
            conn.thread.start()

    def _refuse_full(self, sock: socket.socket, peer: str) -> None:
        self._rejected("too_many_connections")
        log.warning(
            "data plane refused a connection from %s: %d connections open (the limit)",
            peer,
            self.max_connections,
        )
        if self._tls is None:  # a TLS client hears nothing before a handshake: just close
            try:
                sock.settimeout(1.0)
                stream = FrameStream(sock, max_header=0, max_payload=0)
                _send_status(
                    stream,
                    0,
                    Code.RESOURCE_EXHAUSTED,
                    f"the data plane serves at most {self.max_connections} connections",
                )
            except OSError:
                pass
        _shutdown(sock)
        sock.close()

    def _rejected(self, reason: str) -> None:
        if self._on_reject is not None:
            self._on_reject(reason)

    # -- one connection ---------------------------------------------------------------
    def _serve(self, conn: _Connection) -> None:
        sock, peer = conn.sock, conn.peer
        handed_over = False
        try:
            sock.settimeout(self.io_timeout)
            tune(sock)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_side=True)
                conn.sock = sock
            stream = FrameStream(sock, max_header=self.max_header, max_payload=self.max_payload)
            if self._welcome(stream, peer):
                if self._loop is not None and self._tls is None and not self._stopping.is_set():
                    self._hand_over(conn, self._loop, stream)
                    handed_over = True
                    return
                self._calls(stream, peer)
        except frames.FrameError as e:
            self._rejected("malformed_frame")
            log.warning("data plane closed the connection from %s: %s", peer, e)
        except ssl.SSLError as e:
            self._rejected("unauthenticated")
            log.warning("data plane TLS with %s failed: %s", peer, e)
        except TimeoutError:
            log.debug("data plane connection from %s idle or stalled: closed", peer)
        except (ConnectionError, OSError) as e:
            log.debug("data plane connection from %s ended: %s", peer, e)
        finally:
            if not handed_over:
                _shutdown(sock)
                sock.close()
                with self._lock:
                    self._connections.discard(conn)

    # -- connections on the event loop ------------------------------------------------
    def _hand_over(self, conn: _Connection, event_loop: EventLoop, stream: FrameStream) -> None:
        """Gives a welcomed plain connection to the event loop."""
        leftover = stream.read_bytes(stream.pending()) if stream.pending() else b""
        looped = LoopConnection(
            conn.sock,
            conn.peer,
            leftover,
            max_header=self.max_header,
            max_payload=self.max_payload,
            retain_bytes=self.retain_bytes,
        )
        looped.stream = ReplyStream(conn.sock, self.io_timeout)
        looped.tag = conn
        event_loop.add(looped)

    def _loop_call(
        self, conn: LoopConnection, head: frames.FrameHead, header: bytes, payload: memoryview
    ) -> bool:
        """Runs one call of a loop connection; False when the connection is done."""
        deadline = None
        if head.timeout_ms:
            deadline = time.monotonic() + head.timeout_ms / 1000.0
        try:
            known = self._handlers.get(head.method)
            if known is None:
                _send_status(
                    conn.stream,
                    head.call_id,
                    Code.UNIMPLEMENTED,
                    f"data plane: no method with id {head.method}",
                )
            else:
                name, handler = known
                request = Request(name, header, payload, conn.peer, deadline)
                self._call(conn.stream, head, request, handler)
        except (OSError, ValueError) as e:  # ConnectionError, TimeoutError: the peer is gone
            log.debug("data plane connection from %s ended: %s", conn.peer, e)
            return False
        conn.last = time.monotonic()
        return not self._stopping.is_set()

    def _loop_failed(self, conn: LoopConnection, error: BaseException) -> None:
        if isinstance(error, frames.FrameError):
            self._rejected("malformed_frame")
            log.warning("data plane closed the connection from %s: %s", conn.peer, error)

    def _loop_closed(self, conn: LoopConnection) -> None:
        with self._lock:
            self._connections.discard(conn.tag)

    def _welcome(self, stream: FrameStream, peer: str) -> bool:
        """Reads the HELLO; answers WELCOME, or UNAUTHENTICATED and False."""
        head = stream.read_head()
        if head.kind is not frames.Kind.HELLO or head.payload_len:
            raise frames.FrameError(
                f"the first frame is a {head.kind.name} with {head.payload_len} payload "
                "bytes; a HELLO without payload was expected"
            )
        why = auth.check_hello(self.security, stream.read_bytes(head.header_len))
        if why is not None:
            self._rejected("unauthenticated")
            log.warning("data plane refused %s: %s", peer, why)
            _send_status(stream, 0, Code.UNAUTHENTICATED, f"data plane: {why}")
            return False
        stream.send_frame(frames.Kind.WELCOME)
        return True

    def _calls(self, stream: FrameStream, peer: str) -> None:
        buffer = np.empty(0, np.uint8)
        while not self._stopping.is_set():
            stream.settimeout(self.idle_timeout)
            head = stream.read_head()
            stream.settimeout(self.io_timeout)
            if head.kind is not frames.Kind.REQUEST:
                raise frames.FrameError(f"a {head.kind.name} frame where a REQUEST was expected")
            header = stream.read_bytes(head.header_len)
            n = head.payload_len
            if n > buffer.size:
                held = np.empty(n, np.uint8)
                if n <= self.retain_bytes:
                    buffer = held
            else:
                held = buffer
            payload = memoryview(held)[:n]
            stream.read_into(payload)
            deadline = None
            if head.timeout_ms:
                deadline = time.monotonic() + head.timeout_ms / 1000.0
            known = self._handlers.get(head.method)
            if known is None:
                _send_status(
                    stream,
                    head.call_id,
                    Code.UNIMPLEMENTED,
                    f"data plane: no method with id {head.method}",
                )
                continue
            name, handler = known
            self._call(stream, head, Request(name, header, payload, peer, deadline), handler)

    def _call(
        self, stream: FrameStream, head: frames.FrameHead, request: Request, handler: Handler
    ) -> None:
        try:
            reply = Reply(*handler(request))
        except OpError as e:
            metadata = e.metadata() if isinstance(e, MovedError) else ()
            _send_status(stream, head.call_id, e.code, e.message, metadata)
            return
        except Exception as e:
            log.exception("data plane %s failed", request.method)
            _send_status(
                stream, head.call_id, Code.INTERNAL, f"{request.method}: {type(e).__name__}: {e}"
            )
            return
        try:
            stream.send_frame(
                frames.Kind.REPLY,
                method=head.method,
                call_id=head.call_id,
                header=reply.header,
                buffers=reply.buffers,
            )
        finally:
            if reply.release is not None:
                reply.release()


def _send_status(
    stream: FrameStream,
    call_id: int,
    code: Code,
    message: str,
    metadata: Sequence[tuple[str, str]] = (),
) -> None:
    if len(message) > _MAX_DETAILS:
        message = f"{message[:_MAX_DETAILS]}... ({len(message)} chars)"
    status = dataplane_pb2.DataPlaneStatus(
        code=Code(code).name,
        message=message,
        metadata=[dataplane_pb2.DataPlaneMetadata(key=k, value=v) for k, v in metadata],
    )
    stream.send_frame(frames.Kind.ERROR, call_id=call_id, header=status.SerializeToString())


def _peer_name(addr: Any) -> str:
    host, port = addr[0], addr[1]
    return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)

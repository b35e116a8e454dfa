"""``DataPlaneServer``: serves calls of the raw TCP data plane.

A connection starts with a HELLO carrying the shared token (see
:mod:`.auth`; TLS first when configured), read by a short-lived thread of its
own within ``hello_timeout`` (see :mod:`.door`); a refused one gets an
UNAUTHENTICATED ERROR frame and is closed.  A welcomed connection, plain or
TLS, then has one request path (:mod:`.loop`): :meth:`DataPlaneServer._call`
reads each REQUEST and runs the handler its method id names (a function, or
a :class:`Route`, inside ``around``, the caller's wrapper of every call); the
REPLY goes out in one ``sendmsg``, sent by the handler or after it.  A psflow
:class:`OpError` answers an ERROR frame with the status gRPC would carry
(:func:`~psflow.errors.status_of`: code, message, a :class:`MovedError`'s
redirect); so do an unknown method (UNIMPLEMENTED) and a call whose deadline
passed before it ran (DEADLINE_EXCEEDED, from the frame's first byte).

A frame that breaks the format or the limits closes its connection with a
logged reason before any handler runs; other connections are not affected.
Connections are bounded in number (see :class:`~.loop.Limits`); idle and
stalled ones are closed by the accepting thread's sweep;
:meth:`DataPlaneServer.stop` stops accepting, shuts every connection down and
joins the threads within a timeout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
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

from . import auth, door, frames
from .loop import Connection, EventLoop, Limits
from .stream import tune

__all__ = ["DataPlaneServer", "Handler", "Limits", "Reply", "Request", "Route"]

log = logging.getLogger(__name__)

_ACCEPT_POLL = 0.2
_SWEEP = 0.5


class Reply(NamedTuple):
    """A handler's answer: a header, payload buffers sent as they are, and an
    optional ``release`` called once they are sent (a snapshot's lock, say)."""

    header: bytes = b""
    buffers: Sequence[Any] = ()
    release: Callable[[], None] | None = None


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
        respond: ``respond(header=, buffers=, release=)``: the data plane's sends the
            REPLY frame now (the handler returns None); by default a :class:`Reply`.
    """

    method: str
    header: bytes
    payload: memoryview
    peer: str
    deadline: float | None
    peer_gone: Callable[[], bool] = lambda: False
    respond: Callable[..., Reply | None] = Reply

    def time_remaining(self) -> float | None:
        """Seconds until the client's deadline (None: it gave none)."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())


class Route(NamedTuple):
    """A handler in steps, a request's data going from its decoder straight to the function
    applying it: ``finish(decoded, apply(*decoded.args))``, ``decoded = decode(request)``."""

    decode: Callable[[Request], Any]
    apply: Callable[..., Any]
    finish: Callable[[Any, Any], Reply | None]


Handler = Callable[[Request], "Reply | None"] | Route


class _Accepted:
    """A connection from accept until its handshake ends (its thread's)."""

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
        handlers: method name -> handler (a function of the request, or a :class:`Route`).
        on_reject: called with a reason for every refused connection or frame
            (``"unauthenticated"``, ``"malformed_frame"``, ``"too_many_connections"``).
        around: ``around(request)``, a context every call runs in (the PS task's
            edge: admission, log context, metrics, typed errors); None: none.
        **limits: the fields of :class:`~.loop.Limits` (its defaults otherwise).

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
        on_reject: Callable[[str], None] | None = None,
        around: Callable[[Request], contextlib.AbstractContextManager[Any]] | None = None,
        **limits: Any,
    ) -> None:
        self.host = host
        self.security = security
        self.limits = Limits(**limits)
        self._on_reject = on_reject or (lambda _reason: None)
        self._around = around or (lambda _request: contextlib.nullcontext())
        self._handlers: dict[int, tuple[str, Handler]] = {}
        for name, handler in handlers.items():
            mid = frames.method_id(name)
            if mid in self._handlers:
                known = self._handlers[mid][0]
                raise InvalidArgumentError(
                    f"data-plane methods {known!r} and {name!r} share wire id {mid}"
                )
            self._handlers[mid] = (name, handler)
        self._tls = None if security.tls is None else auth.server_context(security.tls)
        self._listener = self._bind(host, port)
        self.port = self._listener.getsockname()[1]
        self._stopping = threading.Event()
        self._door = door.Door(
            max_pending=self.limits.max_pending,
            max_pending_per_host=self.limits.max_pending_per_host,
            hello_timeout=self.limits.hello_timeout,
        )
        self._refusals = door.Refusals(log)
        self._accept_thread: threading.Thread | None = None
        self._next_sweep = 0.0
        self._loop = EventLoop(f"dataplane-{self.port}", self._call, self.limits)
        if not self._loop.nonblocking:
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
        return self._loop.threads

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

    # -- lifecycle --------------------------------------------------------------------
    def start(self) -> DataPlaneServer:
        """Starts accepting connections; returns self."""
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
        handshaking = self._door.waiting()
        for accepted in handshaking:
            _shutdown(accepted.sock)
        self._loop.stop(deadline)
        for accepted in handshaking:
            if accepted.thread is not None:
                accepted.thread.join(max(0.0, deadline - time.monotonic()))

    @property
    def connections(self) -> int:
        """Connections open now (handshakes under way included)."""
        return self._door.pending + self._loop.connections

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
            accepted.thread = threading.Thread(
                target=self._serve,
                args=(accepted, deadline),
                name=f"dataplane-{accepted.peer}",
                daemon=True,
            )
            accepted.thread.start()

    def _reap(self) -> None:
        """Closes the handshakes past their deadline and, every ``_SWEEP`` s, the
        connections idle or stalled too long; reports counted refusals."""
        for conn in self._door.expired():
            self._refused(conn.peer, f"no handshake within {self._door.hello_timeout:g} s")
            _shutdown(conn.sock)
        self._refusals.flush()
        if time.monotonic() >= self._next_sweep:
            self._next_sweep = time.monotonic() + _SWEEP
            self._loop.sweep()

    def _refused(self, peer: str, why: str, reason: str = "handshake_incomplete") -> None:
        """Counts a refused connection (metrics) and logs it, rate-limited."""
        self._on_reject(reason)
        self._refusals.refused(peer, why, reason)

    # -- one connection ---------------------------------------------------------------
    def _serve(self, accepted: _Accepted, deadline: float) -> None:
        """A connection's thread: the handshake by ``deadline``, then the hand-over to
        the event loop (which, without epoll, serves its calls on this thread)."""
        sock, peer = accepted.sock, accepted.peer
        welcomed = False
        try:
            tune(sock)
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_side=True)
            authenticated = self._authenticate(sock, peer, deadline)
            if not self._door.leave(accepted):
                return  # past its deadline or evicted meanwhile: already shut down
            if not authenticated or self._stopping.is_set():
                return
            if not self._loop.make_room():
                limit = self.limits.max_connections
                why = f"{limit} connections open (the limit), none idle"
                self._refused(peer, why, "too_many_connections")
                _send_raw_status(
                    sock,
                    Code.RESOURCE_EXHAUSTED,
                    f"the data plane serves at most {limit} connections",
                )
                return
            # authenticated: only now are a connection's buffers allocated for this peer
            conn = Connection(sock, peer, nonblocking=self._loop.nonblocking, limits=self.limits)
            welcomed = True
            self._loop.add(conn)  # counts it, then sends its WELCOME
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
            if not welcomed:
                _shutdown(sock)
                sock.close()

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
    def _call(self, conn: Connection) -> bool | None:
        """Reads the connection's next request, runs it with its handler and sends the
        reply or the error's status.  None: no whole request yet; False: the
        connection is to be closed (a bad frame, its peer gone, the server stopping)."""
        try:
            frame = conn.receive()
        except BaseException as e:  # FrameError, ConnectionError, OSError
            if isinstance(e, frames.FrameError):
                self._on_reject("malformed_frame")
                log.warning("data plane closed the connection from %s: %s", conn.peer, e)
            log.debug("data plane connection from %s ended: %s", conn.peer, e)
            return False
        if frame is None:
            return None
        head, header, payload = frame
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
                respond = functools.partial(
                    conn.send_frame, frames.Kind.REPLY, method=head.method, call_id=head.call_id
                )
                request = Request(
                    name, header, payload, conn.peer, deadline, conn.peer_gone, respond
                )
                with self._around(request):
                    if type(handler) is Route:
                        decoded = handler.decode(request)
                        reply = handler.finish(decoded, handler.apply(*decoded.args))
                    else:
                        reply = handler(request)
            except Exception as e:
                if conn.broken:  # the handler's own reply failed part-way: the peer is gone
                    raise ConnectionError(f"the reply to {conn.peer} failed") from e
                if not isinstance(e, OpError):  # no edge typed it
                    log.exception("data plane %s failed", known[0] if known else head.method)
                    e = InternalError(f"{known[0]}: {type(e).__name__}: {e}")
                status = status_of(e)
            else:
                if reply is not None:  # a handler that did not send its reply itself
                    respond(header=reply.header, buffers=reply.buffers, release=reply.release)
                status = None
            if status is not None:
                header = _status_header(status.code, status.details, status.metadata)
                conn.send_frame(frames.Kind.ERROR, call_id=head.call_id, header=header)
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

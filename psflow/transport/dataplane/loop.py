"""How the data-plane server reads a welcomed connection: one request path, two ways to wait.

A :class:`Connection`, plain or TLS, reads frames into its own buffers (a
small frame in one ``recv``; a large payload straight into a buffer kept
across calls up to ``retain_bytes``) and answers through a :class:`ReplyStream`.
What waits for its bytes depends on the platform, nothing else does:

* :class:`EventLoop` (Linux): a few threads share one ``epoll``; the one woken
  reads the ready connection, runs the call it completes, sends the reply and
  re-arms the connection, with no hand-off between a reading and a working
  thread (a thread per connection woke one thread per call, each then waiting
  for the GIL: p50 10.6 ms for 16 clients pushing small gradients).  Two
  threads wait from the start: on a busy host the one serving a call is often
  descheduled, or inside the ``sendmsg`` that wakes a client (+12% pushes/s
  for 16 processes pushing 4 KB on a shared 2-core host).  A watcher adds a
  thread only when every one has been inside a call for a while without using
  the CPU (synchronous pushes waiting for the others); a thread beyond the
  first two that sees no event for ``retire_after`` seconds exits.
  Connections are ``EPOLLONESHOT``: nothing more is read from one while its
  call runs, so the payload view stays valid until the handler returns.  A TLS
  socket is read until OpenSSL wants bytes from the kernel, so ``epoll`` never
  sleeps on a record already decrypted.
* :func:`serve_blocking` (no ``epoll``: macOS, the BSDs, Windows): the
  connection's own thread reads it with blocking calls.

Idle and stalled connections are closed by the server's sweep: a socket
shutdown wakes either kind of wait.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from . import frames
from .stream import DIRECT_BYTES, IOV_MAX, STAGING_BYTES, FrameStream, drop_sent, readable_now

__all__ = ["Connection", "EventLoop", "Limits", "ReplyStream", "available", "serve_blocking"]

log = logging.getLogger(__name__)

_POLL = 0.25
# a call that kept every thread busy this long: start another so the rest are read
_STALL = 0.02
# CPU seconds a thread may use over one stall check and still count as blocked
_IDLE_CPU = 0.001
RETIRE_AFTER = 30.0
"""Seconds without an event after which an event-loop thread beyond ``min_threads`` exits."""
_WOULD_BLOCK = (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError)

Dispatch = Callable[["Connection", frames.FrameHead, bytes, memoryview], bool]


def available() -> bool:
    """Whether this platform has ``epoll`` (Linux), which :class:`EventLoop` waits in.

    Elsewhere (macOS, the BSDs, Windows) each connection is served by
    :func:`serve_blocking` on a thread of its own.
    """
    return hasattr(select, "epoll")


class ReplyStream(FrameStream):
    """The sending side of a connection.

    On a non-blocking plain socket a reply the kernel takes whole (every small
    one) costs one ``sendmsg``; only when the socket's buffer fills does the
    rest go out blocking, bounded by ``io_timeout`` per operation, and the
    socket is then made non-blocking again (switching around every reply cost
    three system calls per call).  A TLS socket (no ``sendmsg``; a record may
    be half written) or a blocking one sends whole, bounded the same way.

    Args:
        sock: the connection's socket.
        io_timeout: seconds one blocked send may wait.
        nonblocking: the socket is left non-blocking between sends.
    """

    def __init__(self, sock: socket.socket, io_timeout: float, *, nonblocking: bool) -> None:
        super().__init__(sock, max_header=0, max_payload=0)
        self.io_timeout = io_timeout
        self.nonblocking = nonblocking
        self._fast = nonblocking and self._gather

    def _send(self, pieces: list[Any], release: Callable[[], None] | None = None) -> None:
        if not self._fast:
            self.sock.settimeout(self.io_timeout)
            try:
                super()._send(pieces)
            finally:
                self.sock.setblocking(not self.nonblocking)
            return
        views = [memoryview(p).cast("B") for p in pieces]
        blocking = False
        try:
            while views:
                try:
                    drop_sent(views, self.sock.sendmsg(views[:IOV_MAX]))
                except BlockingIOError:  # the kernel's buffer is full: wait, bounded
                    if release is not None:
                        # a slow reader: it waits on a copy, not on the handler's lock
                        views = [memoryview(b"".join(views))]
                        release()
                        release = None
                    self.sock.settimeout(self.io_timeout)
                    blocking = True
        finally:
            if blocking:
                self.sock.setblocking(False)

    def _send_releasing(self, pieces: list[Any], release: Callable[[], None]) -> None:
        if self._fast:
            self._send(pieces, release)
        else:
            super()._send_releasing(pieces, release)


@dataclasses.dataclass(frozen=True)
class Limits:
    """What a welcomed connection may send and hold (the server's, for all of them).

    Attributes:
        max_header: the largest protobuf header accepted.
        max_payload: the largest payload accepted.
        retain_bytes: the payload buffer kept across calls up to this size.
        io_timeout: seconds one blocked send of a reply may wait.
    """

    max_header: int
    max_payload: int
    retain_bytes: int
    io_timeout: float


class Connection:
    """One welcomed connection: the frame being read, its buffers, its reply stream.

    Args:
        sock: the connected socket (plain or TLS), past its HELLO.
        peer: the peer's name.
        nonblocking: read by an :class:`EventLoop` (else by :func:`serve_blocking`).
        limits: what it may send and hold.
    """

    __slots__ = (
        "_buffer",
        "_end",
        "_head",
        "_header",
        "_parts",
        "_payload",
        "_pos",
        "_start",
        "_tls",
        "_view",
        "authenticated",
        "began",
        "busy",
        "closed",
        "frame_start",
        "last",
        "limits",
        "peer",
        "sock",
        "stream",
        "thread",
    )

    def __init__(
        self,
        sock: socket.socket,
        peer: str,
        *,
        nonblocking: bool,
        limits: Limits,
    ) -> None:
        self.sock = sock
        self.peer = peer
        self.limits = limits
        self._tls = isinstance(sock, ssl.SSLSocket)
        self._view = memoryview(bytearray(STAGING_BYTES))
        self._start = self._end = 0
        self._buffer = np.empty(0, np.uint8)
        self._head: frames.FrameHead | None = None
        self._header = bytearray(frames.FIXED.size)
        self._payload = memoryview(b"")
        self._parts: list[memoryview] = [memoryview(self._header)]
        self._pos = 0
        self.last = time.monotonic()  # when bytes last arrived or a call ended
        # when the first bytes of the frame being read arrived (None between frames):
        # its io deadline runs from there, however its bytes trickle in
        self.frame_start: float | None = None
        self.began = self.last  # when the request last returned by receive() began
        self.busy = False  # being read or served (not to be swept or evicted)
        self.authenticated = True  # counted against the server's max_connections
        self.closed = False
        self.thread: threading.Thread | None = None
        self.stream = ReplyStream(sock, limits.io_timeout, nonblocking=nonblocking)
        sock.setblocking(not nonblocking)

    def mid_frame(self) -> bool:
        """Whether part of a frame has arrived and the rest has not."""
        return self._head is not None or self._pos > 0 or self._start < self._end

    def pending(self) -> bool:
        """Whether bytes already received (or decrypted by TLS) wait to be parsed."""
        return self._start < self._end or (self._tls and self.sock.pending() > 0)

    def peer_gone(self) -> bool:
        """Whether the client of a call in progress has left (closed or reset).

        A client sends nothing while its call runs, so a readable socket means
        an end of file, an error, or a peer out of step: the answer has nobody
        to go to.  One system call; cheap, not free.
        """
        try:
            return readable_now(self.sock)
        except (OSError, ValueError):  # closed under us
            return True

    def shutdown(self) -> None:
        """Ends the connection from any thread: whatever waits for its bytes wakes to
        an end of file and closes it (the socket itself is closed by its reader)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> bool:
        """Shuts the socket down and closes it; False if it was closed already."""
        if self.closed:
            return False
        self.closed = True
        self.shutdown()
        self.sock.close()
        return True

    def receive(self) -> tuple[frames.FrameHead, bytes, memoryview] | None:
        """Reads what the socket holds; returns the request it completes, or None
        (a non-blocking socket would block first).

        Raises:
            FrameError: a frame breaks the format or the limits.
            ConnectionError: the peer closed the connection.
            OSError: the socket failed (``ssl.SSLError`` included).
        """
        while True:
            if self._fill_parts():
                request = self._advance()
                if request is not None:
                    return request
                continue
            # everything staged is consumed and the current part is not full
            part = self._parts[0]
            try:
                if len(part) - self._pos >= DIRECT_BYTES:
                    n = self.sock.recv_into(part[self._pos :])
                    self._pos += n
                else:
                    n = self.sock.recv_into(self._view)
                    self._start, self._end = 0, n
            except _WOULD_BLOCK:
                return None
            if n == 0:
                raise ConnectionError("the data-plane connection was closed by its peer")
            self.last = time.monotonic()
            if self.frame_start is None:
                self.frame_start = self.last

    def _fill_parts(self) -> bool:
        """Copies staged bytes into the current part; True once it is full."""
        part = self._parts[0]
        have = min(len(part) - self._pos, self._end - self._start)
        if have:
            part[self._pos : self._pos + have] = self._view[self._start : self._start + have]
            self._start += have
            self._pos += have
        return self._pos == len(part)

    def _advance(self) -> tuple[frames.FrameHead, bytes, memoryview] | None:
        """The current part is full: the next part, or the finished request."""
        self._parts.pop(0)
        self._pos = 0
        if self._parts:
            return None
        if self._head is None:
            limits = self.limits
            head = frames.unpack(
                bytes(self._header), max_header=limits.max_header, max_payload=limits.max_payload
            )
            if head.kind is not frames.Kind.REQUEST:
                raise frames.FrameError(f"a {head.kind.name} frame where a REQUEST was expected")
            self._head = head
            self._header = bytearray(head.header_len)
            n = head.payload_len
            if n > self._buffer.size:
                held = np.empty(n, np.uint8)
                if n <= limits.retain_bytes:
                    self._buffer = held
            else:
                held = self._buffer
            self._payload = memoryview(held)[:n]
            self._parts = [p for p in (memoryview(self._header), self._payload) if len(p)]
            if self._parts:
                return None
        head, header, payload = self._head, bytes(self._header), self._payload
        self.began = self.last if self.frame_start is None else self.frame_start
        # the next frame's clock starts with its first bytes (already here if pipelined)
        self.frame_start = self.last if self._start < self._end else None
        self._head = None
        self._header = bytearray(frames.FIXED.size)
        self._parts = [memoryview(self._header)]
        self._payload = memoryview(b"")
        return head, header, payload


def serve_blocking(
    conn: Connection,
    dispatch: Dispatch,
    on_error: Callable[[Connection, BaseException], None],
    stopping: threading.Event,
) -> None:
    """Serves ``conn`` on the calling thread (blocking reads) until it ends; closes it."""
    try:
        while not stopping.is_set():
            request = conn.receive()
            if request is None:  # a blocking socket does not report "would block"
                continue
            conn.busy = True
            keep = dispatch(conn, *request)
            conn.busy = False
            if not keep:
                break
    except BaseException as e:  # FrameError, ConnectionError, OSError
        on_error(conn, e)
        log.debug("data plane connection from %s ended: %s", conn.peer, e)
    finally:
        conn.close()


def _own_cpu_clock() -> int | None:
    """The calling thread's CPU clock id (taken by the thread itself, while it
    surely lives), None where the platform has none."""
    try:
        return time.pthread_getcpuclockid(threading.get_ident())
    except (AttributeError, OSError):
        return None


def _all_idle(clock_ids: list[int | None], clocks: dict[int, float]) -> bool:
    """Whether no thread (by CPU clock id) used the CPU since the last call,
    which recorded their clocks in ``clocks``.  A thread descheduled by a busy
    host or computing is not idle; one waiting on a lock or condition is.
    Without per-thread clocks every thread counts as idle (the timer decides)."""
    idle = True
    for clock_id in clock_ids:
        if clock_id is None:
            continue
        try:
            now = time.clock_gettime(clock_id)
        except OSError:  # the thread ended
            continue
        before = clocks.get(clock_id)
        clocks[clock_id] = now
        if before is None or now - before > _IDLE_CPU:
            idle = False
    return idle


class EventLoop:
    """Serves registered connections from a few threads sharing one ``epoll``.

    Args:
        name: names the threads.
        dispatch: runs one request and sends its reply; False when the
            connection is to be closed.
        max_threads: the bound on threads (blocked handlers hold theirs).
        min_threads: threads started at once and never retired (at most ``max_threads``).
        retire_after: seconds without an event after which a thread beyond
            ``min_threads`` exits.
        on_error: called with (connection, exception) when reading fails;
            the loop then closes the connection.
        on_close: called with each connection the loop closes.
    """

    def __init__(
        self,
        name: str,
        dispatch: Dispatch,
        *,
        max_threads: int,
        min_threads: int = 2,
        retire_after: float = RETIRE_AFTER,
        on_error: Callable[[Connection, BaseException], None],
        on_close: Callable[[Connection], None],
    ) -> None:
        self.name = name
        self._dispatch = dispatch
        self.max_threads = max(1, max_threads)
        self.min_threads = min(max(1, min_threads), self.max_threads)
        self.retire_after = retire_after
        self._on_error = on_error
        self._on_close = on_close
        self._epoll = select.epoll()
        self._conns: dict[int, Connection] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._clock_ids: dict[threading.Thread, int | None] = {}  # each thread's CPU clock
        self._waiting = 0  # threads in (or on their way back to) epoll
        self._starved_since: float | None = None  # since when none waits
        self._monitor = threading.Thread(target=self._watch, name=f"{name}-watch", daemon=True)

    def start(self) -> None:
        """Starts ``min_threads`` threads and the one that adds threads when calls block."""
        with self._lock:
            for _ in range(self.min_threads):
                self._spawn()
        self._monitor.start()

    def add(self, conn: Connection) -> None:
        """Takes over a welcomed connection (the caller's thread serves what already
        followed the HELLO, if anything)."""
        fd = conn.sock.fileno()
        conn.busy = True
        with self._lock:
            self._conns[fd] = conn
        if conn.pending():
            self._serve(conn)
        else:
            self._arm(conn)

    def close(self, conn: Connection, why: BaseException | None = None) -> None:
        """Closes a connection (idempotent)."""
        with self._lock:
            if conn.closed:
                return
            fd = conn.sock.fileno()
            if self._conns.get(fd) is conn:
                del self._conns[fd]
            with contextlib.suppress(OSError, ValueError):
                self._epoll.unregister(fd)
            conn.close()  # under the lock: the fd number is not reused before it is gone
        if why is not None:
            log.debug("data plane connection from %s ended: %s", conn.peer, why)
        self._on_close(conn)

    def stop(self, deadline: float) -> None:
        """Stops the threads (bounded by ``deadline``), closing every connection."""
        self._stopping.set()
        with self._lock:
            conns = list(self._conns.values())
        for conn in conns:
            self.close(conn)
        with self._lock:
            threads = list(self._threads)
        for thread in [*threads, self._monitor]:
            if thread.is_alive():
                thread.join(max(0.0, deadline - time.monotonic()))
        with contextlib.suppress(OSError):
            self._epoll.close()

    @property
    def threads(self) -> int:
        """Threads serving now (retired ones not counted)."""
        with self._lock:
            return len(self._threads)

    # -- threads ------------------------------------------------------------------------
    def _spawn(self) -> None:
        """Starts one more thread (under the lock)."""
        thread = threading.Thread(target=self._run, name=f"{self.name}-io", daemon=True)
        self._threads.append(thread)
        self._clock_ids[thread] = None
        self._waiting += 1
        self._starved_since = None
        thread.start()

    def _retire(self) -> bool:
        """Whether the calling thread, idle ``retire_after`` s, may exit (then forgotten)."""
        with self._lock:
            if len(self._threads) <= self.min_threads or self._waiting <= 1:
                return False
            me = threading.current_thread()
            self._threads.remove(me)
            del self._clock_ids[me]
            self._waiting -= 1
        log.debug("%s: a thread idle %.0f s retired", self.name, self.retire_after)
        return True

    def _watch(self) -> None:
        """Starts a thread when every one has been blocked inside a call for ``_STALL`` s.

        Checking on a timer rather than starting a spare thread before each call
        keeps one thread doing all the work while calls are short: a spare one
        would take every other event and the two would contend for the GIL.
        """
        clocks: dict[int, float] = {}  # CPU clock id -> its seconds at the last tick
        while not self._stopping.wait(_STALL):
            with self._lock:
                since = self._starved_since
                started = len(self._threads)
                clock_ids = list(self._clock_ids.values())
            if since is None or time.monotonic() - since < _STALL or started >= self.max_threads:
                clocks.clear()
                continue
            if not _all_idle(clock_ids, clocks):
                continue
            with self._lock:
                if self._starved_since == since:  # still the same stall
                    self._spawn()
            clocks.clear()

    def _arm(self, conn: Connection) -> None:
        flags = select.EPOLLIN | select.EPOLLONESHOT | select.EPOLLRDHUP
        with self._lock:  # not after a close: the fd number may already be another's
            if conn.closed:
                return
            conn.busy = False
            fd = conn.sock.fileno()
            try:
                try:
                    self._epoll.modify(fd, flags)
                except FileNotFoundError:
                    self._epoll.register(fd, flags)
                return
            except (OSError, ValueError) as e:
                error = e
        self.close(conn, error)

    def _run(self) -> None:
        with self._lock:
            self._clock_ids[threading.current_thread()] = _own_cpu_clock()
        idle_since = time.monotonic()
        while not self._stopping.is_set():
            try:
                events = self._epoll.poll(_POLL, 1)
            except (OSError, ValueError) as e:  # closed under us by stop()
                if self._stopping.is_set():
                    return
                log.warning("data plane event loop: %s", e)
                time.sleep(_POLL)
                continue
            if not events:
                if time.monotonic() - idle_since > self.retire_after and self._retire():
                    return
                continue
            idle_since = time.monotonic()
            for fd, _ in events:
                with self._lock:
                    conn = self._conns.get(fd)
                    if conn is not None and conn.busy:
                        conn = None  # being served already (a stale event)
                    if conn is not None:
                        conn.busy = True
                if conn is not None:
                    self._serve(conn)

    def _serve(self, conn: Connection) -> None:
        """Reads a ready connection; runs each request it completes; re-arms it."""
        while not self._stopping.is_set():
            try:
                request = conn.receive()
            except BaseException as e:  # FrameError, ConnectionError, OSError
                self._on_error(conn, e)
                self.close(conn, e)
                return
            if request is None:
                break
            with self._lock:
                self._waiting -= 1
                if self._waiting == 0:
                    self._starved_since = time.monotonic()
            try:
                keep = self._dispatch(conn, *request)
            except Exception as e:
                log.exception("data plane call from %s failed", conn.peer)
                keep = False
                self.close(conn, e)
            finally:
                with self._lock:
                    self._waiting += 1
                    self._starved_since = None
            if not keep:
                self.close(conn)
                return
            if not conn.pending():
                break
        if self._stopping.is_set():
            self.close(conn)
            return
        self._arm(conn)

"""The data plane's event loop: a few threads share one ``epoll`` of every plain connection.

With one thread per connection, every call woke its own thread, and a thread
back from ``recv`` waited for the GIL while another one computed; with 16
client processes pushing small gradients the PS sat mostly idle while each
push waited (p50 10.6 ms at 25% of a core).  Here the threads of an
:class:`EventLoop` wait in one ``epoll``; the one woken reads the ready
connection (non-blocking, into that connection's own buffers), runs the call
it completes, sends the reply, re-arms the connection and waits again, with
no hand-off between a reading and a working thread.  Two threads wait from
the start (``min_threads``): on a busy host the thread serving a call is
often descheduled - or inside ``sendmsg``, whose reply wakes a client that
then runs first - and the other serves the next ready connection meanwhile
(16 client processes pushing 4 KB to one PS on a shared 2-core host: +12%
pushes/s over one thread, ahead in 8 of 11 alternated runs; one client alone:
no difference).  A watcher adds more only when every thread has been inside a
call for a while and none of them used the CPU meanwhile (synchronous pushes
waiting for the others), so blocked calls never stop the rest from being
read.  Threads are never retired, so a call that is merely slow (computing,
or descheduled) gets no extra thread.

A connection is registered ``EPOLLONESHOT``: while its call runs nothing more
is read from it (a client has one call in flight per connection), so the
payload view handed to the handler stays valid until the handler returns.  A
slow or stalled sender only fills its own connection's buffers: no thread
blocks on its socket, and a connection that stays mid-frame longer than
``io_timeout`` (or idle longer than ``idle_timeout``) is closed.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from . import frames
from .stream import IOV_MAX, FrameStream, drop_sent

__all__ = ["EventLoop", "LoopConnection", "ReplyStream", "available"]

log = logging.getLogger(__name__)

_STAGING = 64 << 10
# at least this many bytes still to come: read them straight into their destination
_DIRECT = 16 << 10
_POLL = 0.25
_SWEEP = 1.0
# a call that kept every thread busy this long: start another so the rest are read
_STALL = 0.02
# CPU seconds a thread may use over one stall check and still count as blocked
_IDLE_CPU = 0.001

Dispatch = Callable[["LoopConnection", frames.FrameHead, bytes, memoryview], bool]


def available() -> bool:
    """Whether this platform has ``epoll`` (Linux), which :class:`EventLoop` waits in.

    Elsewhere (macOS, the BSDs, Windows) the data-plane server serves each
    connection on a thread of its own, as it does TLS connections everywhere.
    """
    return hasattr(select, "epoll")


class ReplyStream(FrameStream):
    """The sending side of a loop connection, whose socket stays non-blocking.

    A reply the kernel takes whole (every small one) costs one ``sendmsg``;
    only when the socket's buffer fills does the rest go out blocking, bounded
    by ``io_timeout`` per operation (``TimeoutError`` past it), and the socket
    is then made non-blocking again.  Switching the socket to blocking and
    back around every reply cost three system calls per call.

    Args:
        sock: the connection's (non-blocking, plain TCP) socket.
        io_timeout: seconds one blocked send may wait.
    """

    def __init__(self, sock: socket.socket, io_timeout: float) -> None:
        super().__init__(sock, max_header=0, max_payload=0)
        self.io_timeout = io_timeout

    def _send(self, pieces: list[Any], release: Callable[[], None] | None = None) -> None:
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
        self._send(pieces, release)


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


class LoopConnection:
    """One connection's receive state: the frame being read and its buffers.

    Args:
        sock: the connected (plain TCP) socket; made non-blocking.
        peer: the peer's name.
        leftover: bytes read past the HELLO before the loop took over.
        max_header: the largest protobuf header accepted.
        max_payload: the largest payload accepted.
        retain_bytes: the payload buffer kept across calls up to this size.
    """

    __slots__ = (
        "_buffer",
        "_end",
        "_head",
        "_header",
        "_parts",
        "_payload",
        "_pos",
        "_staging",
        "_start",
        "_view",
        "closed",
        "frame_start",
        "last",
        "max_header",
        "max_payload",
        "peer",
        "retain_bytes",
        "sock",
        "stream",
        "tag",
    )

    def __init__(
        self,
        sock: socket.socket,
        peer: str,
        leftover: bytes,
        *,
        max_header: int,
        max_payload: int,
        retain_bytes: int,
    ) -> None:
        self.sock = sock
        self.peer = peer
        self.max_header = max_header
        self.max_payload = max_payload
        self.retain_bytes = retain_bytes
        self._staging = bytearray(max(_STAGING, len(leftover)))
        self._view = memoryview(self._staging)
        self._view[: len(leftover)] = leftover
        self._start, self._end = 0, len(leftover)
        self._buffer = np.empty(0, np.uint8)
        self._head: frames.FrameHead | None = None
        self._header = bytearray(frames.FIXED.size)
        self._payload = memoryview(b"")
        self._parts: list[memoryview] = [memoryview(self._header)]
        self._pos = 0
        self.last = time.monotonic()
        # when the first bytes of the frame being read arrived (None between frames):
        # a frame's deadline runs from there, however its bytes trickle in
        self.frame_start: float | None = self.last if leftover else None
        self.closed = False
        self.stream: Any = None  # the owner's sending side
        self.tag: Any = None  # the owner's record of this connection
        sock.setblocking(False)

    def mid_frame(self) -> bool:
        """Whether part of a frame has arrived and the rest has not."""
        return self._head is not None or self._pos > 0 or self._start < self._end

    def pending(self) -> bool:
        """Whether bytes already received wait to be parsed."""
        return self._start < self._end

    def receive(self) -> tuple[frames.FrameHead, bytes, memoryview] | None:
        """Reads what the socket holds; returns the request it completes, or None
        (the socket would block first).

        Raises:
            FrameError: a frame breaks the format or the limits.
            ConnectionError: the peer closed the connection.
            OSError: the socket failed.
        """
        while True:
            if self._fill_parts():
                request = self._advance()
                if request is not None:
                    return request
                continue
            # everything staged is consumed and the current part is not full
            part = self._parts[0]
            left = len(part) - self._pos
            try:
                if left >= _DIRECT:
                    n = self.sock.recv_into(part[self._pos :])
                    if n:
                        self._pos += n
                else:
                    n = self.sock.recv_into(self._view)
                    self._start, self._end = 0, n
            except (BlockingIOError, InterruptedError):
                return None
            if n == 0:
                raise ConnectionError("the data-plane connection was closed by its peer")
            self.last = time.monotonic()
            if self.frame_start is None:
                self.frame_start = self.last

    def _fill_parts(self) -> bool:
        """Copies staged bytes into the current part; True once it is full."""
        part = self._parts[0]
        want = len(part) - self._pos
        have = min(want, self._end - self._start)
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
            head = frames.unpack(
                bytes(self._header), max_header=self.max_header, max_payload=self.max_payload
            )
            if head.kind is not frames.Kind.REQUEST:
                raise frames.FrameError(f"a {head.kind.name} frame where a REQUEST was expected")
            self._head = head
            self._header = bytearray(head.header_len)
            n = head.payload_len
            if n > self._buffer.size:
                held = np.empty(n, np.uint8)
                if n <= self.retain_bytes:
                    self._buffer = held
            else:
                held = self._buffer
            self._payload = memoryview(held)[:n]
            self._parts = [p for p in (memoryview(self._header), self._payload) if len(p)]
            if self._parts:
                return None
        head, header, payload = self._head, bytes(self._header), self._payload
        # the next frame's clock starts with its first bytes (already here if pipelined)
        self.frame_start = self.last if self._start < self._end else None
        self._head = None
        self._header = bytearray(frames.FIXED.size)
        self._parts = [memoryview(self._header)]
        self._payload = memoryview(b"")
        return head, header, payload


class EventLoop:
    """Serves registered connections from a few threads sharing one ``epoll``.

    Every thread waits in ``epoll`` for one ready connection, reads it and, when a
    request is complete, runs it itself (``dispatch``: the handler and the
    reply), re-arms the connection and waits again: no hand-off between a
    reading thread and a working one.  Before a thread runs a call it makes
    sure another one is waiting (one more is started when none is), so a call
    that blocks (a synchronous push waiting for the others) never stops the
    rest from being read; the threads stay few (those computing, plus one).

    Args:
        name: names the threads.
        dispatch: runs one request and sends its reply; False when the
            connection is to be closed.
        max_threads: the bound on threads (blocked handlers hold theirs).
        min_threads: threads started at once (at most ``max_threads``).
        idle_timeout: seconds a connection may wait for its next call.
        io_timeout: seconds a frame may take to arrive once it started.
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
        idle_timeout: float,
        io_timeout: float,
        on_error: Callable[[LoopConnection, BaseException], None],
        on_close: Callable[[LoopConnection], None],
    ) -> None:
        self.name = name
        self._dispatch = dispatch
        self.max_threads = max(1, max_threads)
        self.min_threads = min(max(1, min_threads), self.max_threads)
        self.idle_timeout = idle_timeout
        self.io_timeout = io_timeout
        self._on_error = on_error
        self._on_close = on_close
        self._epoll = select.epoll()
        self._conns: dict[int, LoopConnection] = {}
        self._busy: set[int] = set()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._clock_ids: list[int | None] = []  # each started thread's CPU clock
        self._waiting = 0  # threads in (or on their way back to) epoll
        self._starved_since: float | None = None  # since when none waits
        self._next_sweep = time.monotonic() + _SWEEP
        self._monitor = threading.Thread(target=self._watch, name=f"{name}-watch", daemon=True)

    def start(self) -> None:
        """Starts ``min_threads`` threads and the one that adds threads when calls block."""
        with self._lock:
            for _ in range(self.min_threads):
                self._spawn()
        self._monitor.start()

    def add(self, conn: LoopConnection) -> None:
        """Takes over a connection whose handshake is done (the caller's thread
        serves the bytes that already followed the HELLO, if any)."""
        fd = conn.sock.fileno()
        with self._lock:
            self._conns[fd] = conn
            self._busy.add(fd)
        if conn.pending():
            self._serve(conn)
        else:
            self._arm(conn)

    def close(self, conn: LoopConnection, why: BaseException | None = None) -> None:
        """Closes a connection (idempotent)."""
        with self._lock:
            if conn.closed:
                return
            conn.closed = True
            fd = conn.sock.fileno()
            if self._conns.get(fd) is conn:
                del self._conns[fd]
            self._busy.discard(fd)
        with contextlib.suppress(OSError, ValueError):
            self._epoll.unregister(fd)
        with contextlib.suppress(OSError):
            conn.sock.shutdown(socket.SHUT_RDWR)
        conn.sock.close()
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
        """Threads started so far."""
        with self._lock:
            return len(self._threads)

    # -- threads ------------------------------------------------------------------------
    def _spawn(self) -> None:
        """Starts one more thread (under the lock)."""
        thread = threading.Thread(target=self._run, name=f"{self.name}-io", daemon=True)
        self._threads.append(thread)
        self._waiting += 1
        self._starved_since = None
        thread.start()

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
                clock_ids = list(self._clock_ids)
            if since is None or time.monotonic() - since < _STALL or started >= self.max_threads:
                clocks.clear()
                continue
            if not _all_idle(clock_ids, clocks):
                continue
            with self._lock:
                if self._starved_since == since:  # still the same stall
                    self._spawn()
            clocks.clear()

    def _arm(self, conn: LoopConnection) -> None:
        flags = select.EPOLLIN | select.EPOLLONESHOT | select.EPOLLRDHUP
        with self._lock:  # not after a close: the fd number may already be another's
            if conn.closed:
                return
            fd = conn.sock.fileno()
            self._busy.discard(fd)
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
        clock_id = _own_cpu_clock()
        with self._lock:
            self._clock_ids.append(clock_id)
        while not self._stopping.is_set():
            try:
                events = self._epoll.poll(_POLL, 1)
            except (OSError, ValueError) as e:  # closed under us by stop()
                if self._stopping.is_set():
                    return
                log.warning("data plane event loop: %s", e)
                time.sleep(_POLL)
                continue
            now = time.monotonic()
            with self._lock:
                sweep = now >= self._next_sweep
                if sweep:
                    self._next_sweep = now + _SWEEP
            if sweep:
                self._sweep(now)
            for fd, _ in events:
                with self._lock:
                    conn = self._conns.get(fd)
                    if conn is not None and fd in self._busy:
                        conn = None  # being served already (a stale event)
                    if conn is not None:
                        self._busy.add(fd)
                if conn is not None:
                    self._serve(conn)

    def _serve(self, conn: LoopConnection) -> None:
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

    def _sweep(self, now: float) -> None:
        """Closes the connections idle or stalled too long (not those being served)."""
        with self._lock:
            waiting = [c for fd, c in self._conns.items() if fd not in self._busy]
        for conn in waiting:
            if conn.mid_frame():
                started = conn.last if conn.frame_start is None else conn.frame_start
                if now - started > self.io_timeout:
                    why = f"a frame still incomplete {now - started:.1f} s after it began"
                    self.close(conn, TimeoutError(why))
            elif now - conn.last > self.idle_timeout:
                self.close(conn, TimeoutError(f"no call for {now - conn.last:.1f} s"))

    def close_idlest(self, min_idle: float) -> LoopConnection | None:
        """Closes the connection waiting longest for its next call, if it has waited
        ``min_idle`` seconds at least (not one being served or mid-frame); returns it."""
        now = time.monotonic()
        with self._lock:
            waiting = [
                c
                for fd, c in self._conns.items()
                if fd not in self._busy and not c.mid_frame() and now - c.last >= min_idle
            ]
        if not waiting:
            return None
        conn = min(waiting, key=lambda c: c.last)
        self.close(conn, TimeoutError(f"idle {now - conn.last:.1f} s: made room for another"))
        return conn

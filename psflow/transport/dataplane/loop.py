"""How the data-plane server reads its welcomed connections: one request path, two ways to wait.

A :class:`Connection`, plain or TLS, is a :class:`~.stream.FrameStream` that
reads its requests into its own buffers (a small frame in one ``recv``; a large
payload straight into a buffer kept across calls up to ``retain_bytes``) and
sends the replies.  An :class:`EventLoop` holds every welcomed connection and
runs the same :meth:`EventLoop._serve` for each; what waits for its bytes
depends on the platform, nothing else does:

* Linux: a few threads share one ``epoll``; the one woken reads the ready
  connection, runs the call it completes, sends the reply and re-arms the
  connection, with no hand-off between a reading and a working thread (a
  thread per connection woke one thread per call, each then waiting for the
  GIL: p50 10.6 ms for 16 clients pushing small gradients).  Two threads wait
  from the start: on a busy host the one serving a call is often descheduled,
  or inside the ``sendmsg`` that wakes a client (+12% pushes/s for 16
  processes pushing 4 KB on a shared 2-core host).  A watcher adds a thread
  only when every one has been inside a call for a while without using the
  CPU (synchronous pushes waiting for the others); a thread beyond the first
  two that sees no event for ``thread_idle_timeout`` seconds exits.
  Connections are ``EPOLLONESHOT``: nothing more is read from one while its
  call runs, so the payload view stays valid until the handler returns.  A TLS
  socket is read until OpenSSL wants bytes from the kernel, so ``epoll`` never
  sleeps on a record already decrypted.
* no ``epoll`` (macOS, the BSDs, Windows): the connection's own thread reads
  it with blocking calls.

Idle and stalled connections of either kind are closed by :meth:`EventLoop.sweep`:
a socket shutdown wakes either wait.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import select
import socket
import threading
import time
from collections.abc import Callable

import numpy as np

from . import frames
from .stream import FrameStream, readable_now

__all__ = ["Connection", "EventLoop", "Limits"]

log = logging.getLogger(__name__)

_POLL = 0.25
# a call that kept every thread busy this long: start another so the rest are read
_STALL = 0.02
# CPU seconds a thread may use over one stall check and still count as blocked
_IDLE_CPU = 0.001
# stall checks in a row that must find every thread idle before a thread is added, and how
# late (in stall periods) a check may run before its window says the process was descheduled
_STALL_WINDOWS = 3
_LATE = 2.5
# an authenticated connection idle this long may be closed to make room for a new one
# (clients check a pooled connection idle over a second before they reuse it)
_EVICTABLE_IDLE = 2.0

Frame = tuple[frames.FrameHead, bytes, memoryview]
"""A whole request: its fixed header, its protobuf header, its payload."""
Dispatch = Callable[["Connection"], "bool | None"]


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the data-plane server allows, for every connection (each field documented
    where it is set)."""

    max_connections: int = 256
    """Authenticated connections served at once; at the limit the one idle longest
    (at least a few seconds) is closed for a new one, or else the new one is refused."""
    max_pending: int = 128
    """Connections that have not finished their handshake, at once (apart from
    ``max_connections``); at this budget, or at ``max_pending_per_host`` from one
    address, the oldest handshake is closed for the new one (see :mod:`.door`)."""
    max_pending_per_host: int = 64
    """The same budget for one address."""
    hello_timeout: float = 10.0
    """Seconds from accept by which the HELLO (and the TLS handshake) must be done."""
    idle_timeout: float = 300.0
    """Seconds a connection may wait for its next call."""
    io_timeout: float = 60.0
    """Seconds a frame may take to arrive once it started, and one blocked send of a
    reply may wait."""
    thread_idle_timeout: float = 30.0
    """Seconds without an event after which an event-loop thread beyond the first two
    exits."""
    max_header: int = frames.MAX_HEADER_BYTES
    """The largest protobuf header accepted."""
    max_payload: int = 1 << 30
    """The largest payload accepted."""
    retain_bytes: int = 4 << 20
    """A connection keeps its receive buffer across calls up to this size (larger
    payloads get a buffer of their own each time: with many connections, kept 64 MB
    buffers would add up; a tuned allocator, see :mod:`psflow.memory`, reuses the
    freed ones anyway)."""


class Connection(FrameStream):
    """One welcomed connection: the request being read, its buffers, its replies.

    Args:
        sock: the connected socket (plain or TLS), past its HELLO.
        peer: the peer's name.
        nonblocking: read by the event loop's threads (else by its own).
        limits: what it may send and hold.
    """

    def __init__(self, sock: socket.socket, peer: str, *, nonblocking: bool, limits: Limits):
        sock.setblocking(not nonblocking)
        super().__init__(
            sock,
            max_header=limits.max_header,
            max_payload=limits.max_payload,
            io_timeout=limits.io_timeout,
        )
        self.peer = peer
        self.retain_bytes = limits.retain_bytes
        self._buffer = np.empty(0, np.uint8)
        self._head: frames.FrameHead | None = None
        self._header = bytearray(frames.FIXED.size)
        self._parts: list[memoryview] = [memoryview(self._header)]
        self._payload = memoryview(b"")
        self._pos = 0
        self.last = time.monotonic()  # when bytes last arrived or a call ended
        # when the first bytes of the frame being read arrived (None between frames):
        # its io deadline runs from there, however its bytes trickle in
        self.frame_start: float | None = None
        self.began = self.last  # when the request last returned by receive() began
        self.busy = False  # being read or served (not to be swept or evicted)
        self.authenticated = True  # counted against max_connections
        self.closed = False
        self.thread: threading.Thread | None = None  # its own, where there is no epoll

    def mid_frame(self) -> bool:
        """Whether part of a frame has arrived and the rest has not."""
        return self._head is not None or self._pos > 0 or self._start < self._end

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
        an end of file and closes it."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Shuts the socket down and closes it (idempotent)."""
        if not self.closed:
            self.closed = True
            self.shutdown()
            self.sock.close()

    def _recv(self, view: memoryview) -> int:
        n = super()._recv(view)
        self.last = time.monotonic()
        if self.frame_start is None:
            self.frame_start = self.last
        return n

    def receive(self) -> Frame | None:
        """Reads what the socket holds; returns the request it completes, or None
        (a non-blocking socket has no more now).

        Raises:
            FrameError: a frame breaks the format or the limits.
            ConnectionError: the peer closed the connection.
            OSError: the socket failed (``ssl.SSLError`` included).
        """
        while self._parts:
            part = self._parts[0]
            self._pos = self.read_into(part, self._pos)
            if self._pos < len(part):
                return None
            self._parts.pop(0)
            self._pos = 0
            if self._head is None:  # the fixed header is whole: what follows it
                head = frames.unpack(
                    self._header, max_header=self.max_header, max_payload=self.max_payload
                )
                if head.kind is not frames.Kind.REQUEST:
                    raise frames.FrameError(
                        f"a {head.kind.name} frame where a REQUEST was expected"
                    )
                self._head = head
                self._header = bytearray(head.header_len)
                held, n = self._buffer, head.payload_len
                if n > held.size:
                    held = np.empty(n, np.uint8)
                    if n <= self.retain_bytes:
                        self._buffer = held
                self._payload = memoryview(held)[:n]
                self._parts = [p for p in (memoryview(self._header), self._payload) if len(p)]
        request = (self._head, bytes(self._header), self._payload)
        self.busy = True  # served now: not swept, not evicted
        self.began = self.last if self.frame_start is None else self.frame_start
        # the next frame's clock starts with its first bytes (already here if pipelined)
        self.frame_start = self.last if self._start < self._end else None
        self._head, self._payload = None, memoryview(b"")  # a large one is not kept
        self._header = bytearray(frames.FIXED.size)
        self._parts = [memoryview(self._header)]
        return request


class EventLoop:
    """Serves the welcomed connections: a few threads sharing one ``epoll``, or,
    where there is none, a thread each.

    Args:
        name: names the threads.
        call: reads a connection's next request (:meth:`Connection.receive`) and runs it:
            None when none is whole yet, False when the connection is to be closed.
        limits: the server's limits.
        min_threads: event-loop threads started at once and never retired.
    """

    def __init__(
        self,
        name: str,
        call: Dispatch,
        limits: Limits,
        min_threads: int = 2,
    ) -> None:
        self.name = name
        self.limits = limits
        self._call = call
        self.max_threads = max(1, limits.max_connections)
        self.min_threads = min(max(1, min_threads), self.max_threads)
        # epoll: Linux; elsewhere (macOS, the BSDs, Windows) a thread per connection
        self._epoll = select.epoll() if hasattr(select, "epoll") else None
        self.nonblocking = self._epoll is not None  # its connections' sockets
        self._conns: dict[int, Connection] = {}  # by file descriptor
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._clock_ids: dict[threading.Thread, int | None] = {}  # each thread's CPU clock
        self._waiting = 0  # threads in (or on their way back to) epoll
        self._starved_since: float | None = None  # since when none waits
        self._monitor = threading.Thread(target=self._watch, name=f"{name}-watch", daemon=True)

    def start(self) -> None:
        """Starts ``min_threads`` threads and the one that adds threads when calls block
        (none without epoll)."""
        if self._epoll is None:
            return
        with self._lock:
            for _ in range(self.min_threads):
                self._spawn()
        self._monitor.start()

    @property
    def threads(self) -> int:
        """Event-loop threads serving now (retired ones not counted; 0 without epoll)."""
        with self._lock:
            return len(self._threads)

    @property
    def connections(self) -> int:
        """Welcomed connections open now."""
        with self._lock:
            return len(self._conns)

    def add(self, conn: Connection) -> None:
        """Takes over an authenticated connection: counts it, then sends its WELCOME
        (a client that has it sees it counted) and serves what follows.  The
        calling thread serves what already came, if anything; without epoll,
        every call until the connection ends."""
        conn.busy = True
        if self._epoll is None:
            conn.thread = threading.current_thread()  # which alone closes its socket
        with self._lock:
            self._conns[conn.sock.fileno()] = conn
        try:
            conn.send_frame(frames.Kind.WELCOME)
        except (OSError, ValueError) as e:
            self.close(conn, e)
            return
        if self._epoll is None or conn.pending():
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
            if self._epoll is not None:
                with contextlib.suppress(OSError, ValueError):
                    self._epoll.unregister(fd)
            conn.close()  # under the lock: the fd number is not reused before it is gone
        if why is not None:
            log.debug("data plane connection from %s ended: %s", conn.peer, why)

    def stop(self, deadline: float) -> None:
        """Stops the threads (bounded by ``deadline``), closing every connection."""
        self._stopping.set()
        with self._lock:
            conns = list(self._conns.values())
            threads = [*self._threads, *(c.thread for c in conns if c.thread is not None)]
        for conn in conns:
            if conn.thread is None:
                self.close(conn)
            else:  # its own thread, woken, closes it
                conn.shutdown()
        if self._monitor.is_alive():
            threads.append(self._monitor)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
        if self._epoll is not None:
            self._epoll.close()

    def sweep(self) -> None:
        """Shuts down the connections idle ``idle_timeout`` s, or mid-frame longer than
        ``io_timeout`` s: whatever waits for their bytes wakes and closes them."""
        now = time.monotonic()
        with self._lock:
            waiting = [c for c in self._conns.values() if not c.busy]
        for conn in waiting:
            if conn.mid_frame():
                began = conn.last if conn.frame_start is None else conn.frame_start
                if now - began > self.limits.io_timeout:
                    log.debug("data plane: a frame from %s still incomplete: closed", conn.peer)
                    conn.shutdown()
            elif now - conn.last > self.limits.idle_timeout:
                log.debug(
                    "data plane: no call from %s for %.1f s: closed", conn.peer, now - conn.last
                )
                conn.shutdown()

    def make_room(self) -> bool:
        """Whether one more authenticated connection fits ``max_connections``; at the
        limit the one idle longest gives way, if it has been idle
        :data:`_EVICTABLE_IDLE` s at least (a client reuses a fresher one unchecked)."""
        now = time.monotonic()
        with self._lock:
            counted = [c for c in self._conns.values() if c.authenticated]
            if len(counted) < self.limits.max_connections:
                return True
            idle = [c for c in counted if not c.busy and not c.mid_frame()]
            idle = [c for c in idle if now - c.last >= _EVICTABLE_IDLE]
            if not idle:
                return False
            victim = min(idle, key=lambda c: c.last)
            victim.authenticated = False  # no longer counted, from now on
        victim.shutdown()
        log.info(
            "data plane: closed the idle connection from %s for a new one (%d open, the limit)",
            victim.peer,
            self.limits.max_connections,
        )
        return True

    # -- serving -----------------------------------------------------------------------
    def _serve(self, conn: Connection) -> None:
        """Runs the calls a connection's bytes complete (the dispatch reads each frame):
        on epoll, until it has nothing more now (then re-armed); without, until it ends."""
        while not self._stopping.is_set():
            with self._lock:
                self._waiting -= 1
                if self._waiting == 0:
                    self._starved_since = time.monotonic()
            try:
                keep = self._call(conn)
            except Exception:
                log.exception("data plane call from %s failed", conn.peer)
                keep = False
            finally:
                with self._lock:
                    self._waiting += 1
                    self._starved_since = None
            if keep is False:
                break
            if self._epoll is None:  # its own thread: it reads on, blocking
                conn.busy = False
            elif keep is None or not conn.pending():
                self._arm(conn)  # nothing more now: epoll wakes a thread for the rest
                return
        self.close(conn)

    def _arm(self, conn: Connection) -> None:
        flags = select.EPOLLIN | select.EPOLLONESHOT | select.EPOLLRDHUP
        with self._lock:  # not after a close: the fd number may already be another's
            if conn.closed:
                return
            conn.busy = False
            fd = conn.sock.fileno()
            try:
                if self._stopping.is_set():  # stop() may have listed the connections already
                    raise ConnectionAbortedError("the data plane is stopping")
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
                idle = time.monotonic() - idle_since
                if idle > self.limits.thread_idle_timeout and self._retire():
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
        """Whether the calling thread, idle ``thread_idle_timeout`` s, may exit (then forgotten)."""
        with self._lock:
            if len(self._threads) <= self.min_threads or self._waiting <= 1:
                return False
            me = threading.current_thread()
            self._threads.remove(me)
            del self._clock_ids[me]
            self._waiting -= 1
        log.debug("%s: a thread idle %.0f s retired", self.name, self.limits.thread_idle_timeout)
        return True

    def _watch(self) -> None:
        """Starts a thread when every one has been blocked inside a call for ``_STALL`` s.

        Checking on a timer rather than starting a spare thread before each call
        keeps one thread doing all the work while calls are short: a spare one
        would take every other event and the two would contend for the GIL.
        """
        judge = _StallJudge(_read_cpu_clock)
        while not self._stopping.wait(_STALL):
            with self._lock:
                since = self._starved_since
                started = len(self._threads)
                clock_ids = list(self._clock_ids.values())
            if since is None or time.monotonic() - since < _STALL or started >= self.max_threads:
                judge.reset()
                continue
            if not judge.blocked(time.monotonic(), clock_ids):
                continue
            with self._lock:
                if self._starved_since == since:  # still the same stall
                    self._spawn()
            judge.reset()


class _StallJudge:
    """Whether the loop's threads are blocked (waiting on a lock or a condition inside
    a call), not computing nor descheduled by a busy host.

    A thread that used under ``_IDLE_CPU`` of CPU over a check's window counts
    as idle. One window is not enough on a loaded host: the scheduler can keep
    the whole process off the CPU for longer than a window (seen as an extra
    thread started for two computing calls, with four test processes on two
    cores). So the threads must be idle over ``_STALL_WINDOWS`` windows in a
    row, each of about its nominal length: a check that itself ran late (its
    window over ``_LATE`` times ``_STALL``) says the process was descheduled,
    and starts the count again.
    """

    def __init__(self, read_clock: Callable[[int], float | None]) -> None:
        self._read = read_clock  # CPU clock id -> its seconds, or None for an ended thread
        self._clocks: dict[int, float] = {}  # clock id -> its seconds at the last check
        self._last: float | None = None  # time.monotonic() of the last check
        self._idle_windows = 0

    def reset(self) -> None:
        """Forgets the windows seen (a stall ended, or a thread was started)."""
        self._clocks.clear()
        self._last = None
        self._idle_windows = 0

    def blocked(self, now: float, clock_ids: list[int | None]) -> bool:
        """One check at ``now``: whether every thread was idle over the last windows."""
        late = self._last is not None and now - self._last > _LATE * _STALL
        first = self._last is None
        self._last = now
        idle = _all_idle(clock_ids, self._clocks, self._read)
        if first or late or not idle:
            self._idle_windows = 0
            return False
        self._idle_windows += 1
        return self._idle_windows >= _STALL_WINDOWS


def _own_cpu_clock() -> int | None:
    """The calling thread's CPU clock id (taken by the thread itself, while it
    surely lives), None where the platform has none."""
    try:
        return time.pthread_getcpuclockid(threading.get_ident())
    except (AttributeError, OSError):
        return None


def _read_cpu_clock(clock_id: int) -> float | None:
    """A thread's CPU seconds by its clock id; None once the thread ended."""
    try:
        return time.clock_gettime(clock_id)
    except OSError:
        return None


def _all_idle(
    clock_ids: list[int | None],
    clocks: dict[int, float],
    read: Callable[[int], float | None],
) -> bool:
    """Whether no thread (by CPU clock id) used the CPU since the last call,
    which recorded their clocks in ``clocks`` (a thread first seen is not idle).
    A computing thread is not idle; one waiting on a lock or condition is, and
    so is one the host keeps off the CPU (:class:`_StallJudge` tells them apart).
    Without per-thread clocks every thread counts as idle (the timer decides)."""
    idle = True
    for clock_id in clock_ids:
        if clock_id is None:
            continue
        now = read(clock_id)
        if now is None:  # the thread ended
            continue
        before = clocks.get(clock_id)
        clocks[clock_id] = now
        if before is None or now - before > _IDLE_CPU:
            idle = False
    return idle

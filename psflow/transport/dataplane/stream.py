"""Frames over one socket: buffered reads into caller buffers, gathered writes.

Small frames cost one ``recv`` (the fixed header, the protobuf header and a
small payload arrive together in the staging buffer); a large payload is read
with ``recv_into`` straight into the caller's destination, and writes hand the
header and every payload buffer to one ``sendmsg`` without joining them.  Both
release the GIL while the kernel copies.  The same reads serve a blocking
socket (the client's, a collective's) and a non-blocking one (the server's
event loop): :meth:`FrameStream.read_into` then stops where the kernel has no more.

Failures surface as Python's own: ``ConnectionError`` (the peer closed or
reset), ``TimeoutError`` (the socket's timeout passed), ``ssl.SSLError``;
the client and the server turn them into their own outcomes.
"""

from __future__ import annotations

import contextlib
import functools
import select
import socket
import ssl
import time
from collections.abc import Callable, Sequence
from typing import Any

from . import frames

__all__ = [
    "DIRECT_BYTES",
    "IOV_MAX",
    "SOCKET_BUFFER_BYTES",
    "STAGING_BYTES",
    "FrameStream",
    "readable_now",
    "tune",
]

STAGING_BYTES = 64 << 10
"""The buffer a reader receives small frames into (several arrive in one ``recv``)."""
DIRECT_BYTES = 16 << 10
"""At least this many bytes still to read go straight into their destination; fewer
refill the staging buffer, so that one system call may also bring the next frame.
A payload up to this size also rides in one piece with its frame's headers."""
IOV_MAX = 512
"""Buffers one ``sendmsg`` takes at most (the kernel's ``UIO_MAXIOV`` is 1024)."""
SOCKET_BUFFER_BYTES = 8 << 20
"""Kernel send/receive buffer asked for (the kernel caps it at its ``*mem_max``):
a 64 MB payload crossed loopback in 87 ms with the defaults, in 29-42 ms with this."""
_WOULD_BLOCK = (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError)


def tune(sock: socket.socket) -> None:
    """Sets the options every data-plane socket runs with: no Nagle delay, large buffers."""
    with contextlib.suppress(OSError):  # not a TCP socket (tests), or a kernel that refuses
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)


def readable_now(sock: socket.socket) -> bool:
    """Whether ``sock`` has bytes, an end of file or an error to report, without waiting.

    ``poll`` where the platform has it: ``select`` refuses descriptors from
    1024 up (``FD_SETSIZE``), which a process with many open files reaches.
    Windows has no ``poll``, and its ``select`` takes any socket.
    """
    if hasattr(select, "poll"):
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        return bool(poller.poll(0))  # POLLHUP / POLLERR / POLLNVAL come unasked
    readable, _, _ = select.select([sock], [], [], 0)
    return bool(readable)


class FrameStream:
    """Reads and writes frames on ``sock`` (plain or TLS, blocking or not).

    Args:
        sock: a connected socket.
        max_header: the largest protobuf header accepted.
        max_payload: the largest payload accepted.
        io_timeout: seconds one blocked send may wait; the socket's own timeout
            is put back after it (None: sends keep the socket's timeout).
    """

    def __init__(
        self,
        sock: socket.socket,
        *,
        max_header: int,
        max_payload: int,
        io_timeout: float | None = None,
    ) -> None:
        self.sock = sock
        self.max_header = max_header
        self.max_payload = max_payload
        self.io_timeout = io_timeout
        self._tls = isinstance(sock, ssl.SSLSocket)
        # TLS sockets have no sendmsg: their pieces go through sendall
        self.gather = hasattr(sock, "sendmsg") and not self._tls
        self._view = memoryview(bytearray(STAGING_BYTES))
        self._start = self._end = 0
        self.broken = False  # whether the last send failed
        self.deadline: float | None = None
        """``time.monotonic()`` by which every read must be done (None: each read
        waits up to the socket's timeout): a frame's absolute deadline, which a
        peer dripping its bytes cannot extend."""

    def close(self) -> None:
        """Closes the socket (idempotent)."""
        with contextlib.suppress(OSError):
            self.sock.close()

    def settimeout(self, seconds: float | None) -> None:
        """The timeout of each following socket operation (None: block)."""
        self.sock.settimeout(seconds)

    def pending(self) -> bool:
        """Whether bytes already received (or decrypted by TLS) wait to be read."""
        return self._start < self._end or (self._tls and self.sock.pending() > 0)

    # -- reading -------------------------------------------------------------------
    def _recv(self, view: memoryview) -> int:
        while self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the rest of the frame did not arrive in time")
            # the socket's timeout is reset only when it would overshoot the deadline or
            # has shrunk far below it: a settimeout is a system call, and a collective's
            # many small receives share one far deadline.  An early timeout reads again.
            # (A quarter, not a half: a ring's frame heads wait up to its silence bound,
            # its payloads up to twice that, and with a half every frame reset it twice.)
            current = self.sock.gettimeout()
            if current is None or current > left or current < left / 4:
                self.sock.settimeout(left * 0.9)
            try:
                n = self.sock.recv_into(view)
                break
            except TimeoutError:
                if time.monotonic() >= self.deadline:
                    raise
        else:
            n = self.sock.recv_into(view)
        if n == 0:
            raise ConnectionError("the data-plane connection was closed by its peer")
        return n

    def read_into(self, dest: memoryview, pos: int = 0) -> int:
        """Fills ``dest[pos:]`` (a writable byte view): staged bytes first, then a
        large rest straight from the socket, a small one through the staging
        buffer (which may then hold the next frame's first bytes too).  Returns
        how far ``dest`` is filled: all of it, unless a non-blocking socket has
        nothing more now."""
        n = len(dest)
        while pos < n:
            have = min(n - pos, self._end - self._start)
            if have:
                dest[pos : pos + have] = self._view[self._start : self._start + have]
                self._start += have
                pos += have
                continue
            try:
                if n - pos >= DIRECT_BYTES:
                    pos += self._recv(dest[pos:])
                else:  # the staging buffer is empty: refill it
                    self._start, self._end = 0, self._recv(self._view)
            except _WOULD_BLOCK:
                break
        return pos

    def wait_for_bytes(self) -> None:
        """Returns once a next frame's first bytes are here (within the socket's timeout).

        Raises:
            TimeoutError: none came in time.
            ConnectionError: the peer closed the connection.
        """
        if self._start == self._end:
            self._start, self._end = 0, self._recv(self._view)

    def read_bytes(self, n: int, *, alone: bool = False) -> bytes:
        """The next ``n`` bytes (``alone``: if nothing is staged, read only these, so
        the large payload after a frame's head skips the staging buffer)."""
        if self._start == self._end and 0 < n < DIRECT_BYTES:  # refill: no copy of its own
            self._start, self._end = 0, self._recv(self._view[:n] if alone else self._view)
        if self._end - self._start >= n:
            out = bytes(self._view[self._start : self._start + n])
            self._start += n
            return out
        buf = bytearray(n)
        self.read_into(memoryview(buf))
        return bytes(buf)

    def read_head(self) -> frames.FrameHead:
        """The next frame's fixed header, checked against the limits.

        Raises:
            FrameError: the header breaks the format or the limits.
        """
        raw = self.read_bytes(frames.FIXED.size)
        return frames.unpack(raw, max_header=self.max_header, max_payload=self.max_payload)

    def discard(self, n: int) -> None:
        """Reads and drops ``n`` bytes."""
        while n > 0:
            if self._start == self._end:
                self._start, self._end = 0, self._recv(self._view)
            take = min(n, self._end - self._start)
            self._start += take
            n -= take

    # -- writing -------------------------------------------------------------------
    def send_frame(
        self,
        kind: frames.Kind,
        *,
        method: int = 0,
        call_id: int = 0,
        header: bytes = b"",
        buffers: Sequence[Any] = (),
        timeout_ms: int = 0,
        release: Callable[[], None] | None = None,
    ) -> None:
        """Sends one frame whole: its fixed header, ``header`` and ``buffers`` back to back.

        ``release`` (a snapshot's lock, say) is called once ``buffers`` may change:
        after the send, or as soon as the send might wait for a slow reader,
        which then gets a copy instead (a reader never holds a lock).

        A non-blocking plain socket (the event loop's) sends what the kernel
        takes at once, one ``sendmsg`` for every small reply; when its buffer is
        full the rest goes from a copy, ``release``d, blocking, each operation
        bounded by ``io_timeout`` (switching modes around every reply cost three
        system calls per call).  Any other socket waits from the start, copying
        first what might not fit the kernel's buffer.  The socket's timeout is
        put back afterwards.
        """
        views = [memoryview(b).cast("B") for b in buffers]
        views = [v for v in views if len(v)]
        fixed = frames.pack(
            kind,
            method=method,
            call_id=call_id,
            header_len=len(header),
            timeout=timeout_ms,
            payload_len=sum(len(v) for v in views),
        )
        small = [fixed, header] if header else [fixed]
        if views and len(views[0]) <= DIRECT_BYTES:
            small.append(views.pop(0))  # a small payload rides in the same piece
        views.insert(0, memoryview(b"".join(small)))
        once = None if release is None else functools.cache(release)  # early, or last
        release, mode = once, self.sock.gettimeout()
        waiting = not (self.gather and mode == 0.0)
        if waiting and release is not None and sum(map(len, views)) > _send_buffer(self.sock) // 2:
            views = [memoryview(b"".join(views))]  # a copy: the reader may take its time
            release()
        if waiting and self.io_timeout is not None:
            self.sock.settimeout(self.io_timeout)
        else:
            waiting = False  # nothing to put back
        try:
            while views:
                if not self.gather:
                    self.sock.sendall(views[0])
                    del views[0]  # only once sent: a failed send leaves the stream broken
                    continue
                try:
                    sent = self.sock.sendmsg(views[:IOV_MAX])
                except BlockingIOError:  # the kernel's buffer is full: wait, bounded
                    if release is not None:  # a slow reader waits on a copy, not on a lock
                        views = [memoryview(b"".join(views))]
                        release()
                        release = None
                    waiting = True
                    self.sock.settimeout(self.io_timeout)  # a non-blocking stream has one
                    continue
                while sent:  # drop what the kernel took
                    if sent >= len(views[0]):
                        sent -= len(views.pop(0))
                    else:
                        views[0], sent = views[0][sent:], 0
        finally:
            self.broken = bool(views)  # a send failed: the stream may hold part of a frame
            if waiting:
                self.sock.settimeout(mode)
            if once is not None:
                once()


def _send_buffer(sock: socket.socket) -> int:
    """The kernel's send buffer of ``sock`` in bytes (Linux reports twice what it
    uses for data; the caller halves it)."""
    try:
        return int(sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF))
    except (OSError, ValueError):
        return 0

"""The links of a cross-process ring: one framed TCP connection to each neighbour.

Worker ``r`` of ``N`` listens on its own address (its TF_CONFIG port), dials
its right neighbour ``r+1`` and accepts its left neighbour ``r-1`` (mod N).
Data only flows rightwards: ``r`` writes to the right socket and reads from
the left one, so neither socket is ever used by two threads at once (TLS
sockets cannot be).

Both links speak the data plane's frames (:mod:`psflow.transport.dataplane.frames`):

* the dialler sends a HELLO (the cluster token, and ``client = "worker:r"``);
  the listener checks the token in constant time before it reads or
  allocates anything else, and that the caller is the left neighbour it
  expects, then answers WELCOME, or an ERROR (UNAUTHENTICATED,
  INVALID_ARGUMENT) and closes;
* a collective's payloads are REQUEST frames numbered by a per-link counter
  whose upper 32 bits are the ring's membership *generation* (a frame out of
  step is an ``InternalError``, one of another generation an ``AbortedError``);
* an elastic ring (``incoming`` given) takes its left neighbour from the
  worker's :class:`~psflow.collective.door.Door` instead of its own listener,
  and its HELLO says ``worker:ID/gen:G``: the door refuses a stale generation;
* a worker that fails forwards one ERROR frame naming the failed peer to its
  right, so the failure travels round the ring and every survivor reports
  the same peer instead of the neighbour that merely went quiet.

Every wait has the collective's deadline; a peer that closes or resets gives
``UnavailableError``, a silent one ``DeadlineExceededError``, both naming the
peer as ``worker:i at host:port``.
"""

from __future__ import annotations

import contextlib
import os
import queue
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from psflow import errors
from psflow.errors import Code
from psflow.proto import dataplane_pb2
from psflow.security.config import SecurityConfig, check_bind, is_loopback
from psflow.transport.dataplane import auth, frames
from psflow.transport.dataplane.stream import IOV_MAX, FrameStream, tune

__all__ = ["PeerLinks", "listen", "peer_name", "split_address"]

_METHOD = frames.method_id("psflow.collective.ring")
_HEARTBEAT = frames.method_id("psflow.collective.heartbeat")
_FIXED = frames.FIXED
_WRITEV = hasattr(os, "writev")
# A plain left link is read blocking with MSG_WAITALL: one receive takes a frame's head or a
# whole payload piece, the kernel waiting for its bytes (a socket with a Python timeout polls
# before every receive and hands each arrival back to a Python loop)
_WAITALL = getattr(socket, "MSG_WAITALL", 0)
_TICK_SECONDS = 0.25  # the most a blocked receive sleeps before it looks at the clock
_REQUEST = int(frames.Kind.REQUEST)
_MAGIC, _VERSION = frames.MAGIC, frames.VERSION
_MAX_PAYLOAD = 1 << 40
_RETRY_SECONDS = 0.05
_FORWARD_SECONDS = 2.0  # how long a failing worker tries to tell its right neighbour
_LINGER_SECONDS = 2.0  # how long a refused worker still answers its left neighbour
_HELLO_SECONDS = 5.0  # how long an incoming connection has to authenticate
_INLINE_BYTES = 64 << 10  # sends up to this size go out from the caller's thread
# Sends up to this size start from the caller's thread without waiting (the rest, if the
# kernel takes less, from the sender thread): a hand-over to the sender thread costs a
# wake-up per frame and another for its "sent" event, ~50-60 us of CPU per frame on
# 2 cores, which dominated 1 MB all-reduces (256 kB steps of 4 workers, 512 kB of 2).
# Up to 2 MB a send buffer as large as tune() asks takes a frame whole at once, so the caller's
# copy into it replaces the sender thread's at no wait: A/B alternated in one run,
# 2 and 4 workers, loopback and veth, CPU per call per worker fell 15-21 % at 1 MB with
# 2 workers, 6-11 % at 4 MB with 2 (2 MB frames), 14-15 % at 4 MB with 4 (1 MB frames).
# Larger frames (4 MB, from 16 MB calls) keep the sender thread, whose copy into the
# kernel then overlaps this thread's receive of the next one.
_NOW_BYTES = 2 << 20
# Payloads from this size on are received with their frame's head read alone: the head's
# receive would otherwise bring up to 64 kB of the payload into the stream's staging
# buffer, copied again from there (the same two receives, one copy of 64 kB less)
_ALONE_BYTES = 256 << 10


def peer_name(rank: int, address: str) -> str:
    """How errors name a peer: ``worker:1 at 127.0.0.1:23456``."""
    return f"worker:{rank} at {address}"


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) as a pair.

    Raises:
        InvalidArgumentError: no port, or a port that is not a number.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise errors.InvalidArgumentError(f"peer address {address!r} has no numeric port")
    return host.strip("[]") or "127.0.0.1", int(port)


def listen(address: str, security: SecurityConfig, who: str) -> socket.socket:
    """A listening socket on ``address``'s port (loopback stays loopback, else all interfaces).

    Raises:
        UnavailableError: the port cannot be bound (names ``who`` and the address).
    """
    host, port = split_address(address)
    bind = host if is_loopback(host) else "0.0.0.0"
    check_bind(bind, security)
    sock = socket.socket(socket.AF_INET6 if ":" in bind else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((bind, port))
    except OSError as e:
        sock.close()
        raise errors.UnavailableError(
            f"collective: cannot listen on {bind}:{port} for {who} at {address}: {e.strerror or e}"
        ) from None
    sock.listen(8)
    return sock


def _writable(sock: socket.socket) -> bool:
    """Whether a small frame can be written now without waiting (a heartbeat must never block)."""
    try:
        if hasattr(select, "poll"):  # select() refuses descriptors >= FD_SETSIZE
            poller = select.poll()
            poller.register(sock, select.POLLOUT)
            return bool(poller.poll(0))
        return bool(select.select([], [sock], [], 0)[1])
    except (OSError, ValueError):
        return False


def _writable_check(sock: socket.socket) -> Callable[[], bool]:
    """:func:`_writable` for one socket, its ``poll`` object made once (one system call a look).

    Only for one thread at a time (a poll object refuses concurrent polls): the caller's,
    under the links' write lock.
    """
    if not hasattr(select, "poll"):
        return lambda: _writable(sock)
    poller = select.poll()
    try:
        poller.register(sock, select.POLLOUT)
    except (OSError, ValueError):
        return lambda: False

    def writable() -> bool:
        try:
            return bool(poller.poll(0))
        except (OSError, ValueError):
            return False

    return writable


_SENT = threading.Event()  # what send() returns for a frame already written (never cleared)
_SENT.set()


def _bound(stream: FrameStream, deadline: float) -> None:
    """Bounds the stream's blocking sends by ``deadline``, keeping a timeout that already does.

    A ``settimeout`` is a system call, and a collective's many small sends share one
    far deadline: the timeout is reset only when it would overshoot the deadline or
    has shrunk below 85% of what is left (a send then fails at the latest that much
    before the deadline, never after it).
    """
    left = max(deadline - time.monotonic(), 0.001)
    current = stream.sock.gettimeout()
    if current is None or current > left or current < 0.85 * left:
        stream.settimeout(0.95 * left)


def _status(code: Code, message: str, failed: str = "") -> bytes:
    metadata = [dataplane_pb2.DataPlaneMetadata(key="failed-peer", value=failed)] if failed else []
    return dataplane_pb2.DataPlaneStatus(
        code=code.name, message=message[:4096], metadata=metadata
    ).SerializeToString()


def _parse_status(raw: bytes) -> tuple[Code, str, str]:
    try:
        status = dataplane_pb2.DataPlaneStatus.FromString(raw)
        code = Code[status.code] if status.code in Code.__members__ else Code.UNKNOWN
        failed = next((m.value for m in status.metadata if m.key == "failed-peer"), "")
        return code, status.message, failed
    except Exception:  # a malformed status is itself a failure of that peer
        return Code.INTERNAL, "malformed error frame", ""


def _read_payload(
    stream: FrameStream,
    dest: memoryview,
    on_segment: Callable[[int, int], None] | None,
    segment: int,
) -> None:
    """Reads ``len(dest)`` payload bytes into ``dest``, calling ``on_segment`` per piece read."""
    if on_segment is None or segment <= 0:
        stream.read_into(dest)
        return
    size = len(dest)
    for lo in range(0, size, segment):
        hi = min(lo + segment, size)
        stream.read_into(dest[lo:hi])
        on_segment(lo, hi)


class PeerLinks:
    """This worker's two ring links, their handshake, and framed sends and receives.

    Args:
        rank: this worker's index in ``addresses``.
        addresses: every worker's ``host:port``, in ring order.
        security: the token and TLS material (as every psflow port).
        listener: an already bound, listening socket for this worker (tests);
            by default one is bound on this worker's port.
        silence_seconds: how long the left neighbour may stay silent (no data,
            no heartbeat) inside a collective before it is blamed.
        generation: the membership generation this ring belongs to (elastic training).
        ids: every worker's stable id, in ring order (default: its rank); errors name it.
        incoming: where the left neighbour's authenticated stream comes from
            (``incoming(expected_client, deadline)``), instead of a listener.

    Raises:
        InvalidArgumentError: a bad rank or address.
        UnavailableError: this worker's port cannot be bound (names it).
    """

    def __init__(
        self,
        rank: int,
        addresses: Sequence[str],
        security: SecurityConfig,
        listener: socket.socket | None = None,
        silence_seconds: float = 300.0,
        *,
        generation: int = 0,
        ids: Sequence[int] | None = None,
        incoming: Callable[[str, float], FrameStream | None] | None = None,
    ) -> None:
        n = len(addresses)
        if not 0 <= rank < n:
            raise errors.InvalidArgumentError(f"rank {rank} is not in [0, {n})")
        self.rank, self.size = rank, n
        self.addresses = list(addresses)
        self.security = security
        self.generation = int(generation)
        self.ids = list(ids) if ids is not None else list(range(n))
        self.left_rank, self.right_rank = (rank - 1) % n, (rank + 1) % n
        self.left_id, self.right_id = self.ids[self.left_rank], self.ids[self.right_rank]
        self.left_name = peer_name(self.left_id, self.addresses[self.left_rank])
        self.right_name = peer_name(self.right_id, self.addresses[self.right_rank])
        self._left_task, self._right_task = f"worker:{self.left_id}", f"worker:{self.right_id}"
        self._incoming = incoming
        self._listener = (
            None if incoming is not None else listener if listener is not None else self._bind()
        )
        self._left: FrameStream | None = None
        self._right: FrameStream | None = None
        self._sent = self._received = 0  # frame counters of the two links
        self._broken: errors.OpError | None = None
        self._sends: queue.Queue[Any] = queue.Queue()
        self._writing = threading.Lock()  # one writer at a time on the right socket
        self._queued = 0  # sends handed to the sender thread and not done yet
        self._counting = threading.Lock()  # guards _queued (two threads change it)
        self._sender: threading.Thread | None = None
        self.silence = float(silence_seconds)
        self.heartbeat = min(1.0, self.silence / 4)
        # inside a collective: heartbeats flow rightwards.  A plain flag, read by the sender
        # thread only when its queue stays empty for a heartbeat interval (an Event's set
        # and clear take its lock and condition on every call)
        self._active = False
        self._partial = False  # a frame's rest waits for the sender thread (guarded by _writing)
        self._plain = False  # the right link is a plain socket: frames may start without waiting
        self._writable_right: Callable[[], bool] = lambda: False  # set by connect()
        self._heard = 0.0  # when the left neighbour last sent a frame
        self._plain_left = False  # the left link is read blocking, by _fill (set by connect())
        self._rcvtimeo = 0.0  # the left socket's SO_RCVTIMEO now (0: none set)
        self._head = bytearray(_FIXED.size)  # where _receive_plain reads a frame's head

    @property
    def port(self) -> int:
        """The port this worker listens on."""
        assert self._listener is not None
        return self._listener.getsockname()[1]

    @property
    def elastic(self) -> bool:
        """Whether the left neighbour comes through a door (an elastic ring)."""
        return self._incoming is not None

    def client_name(self, rank: int) -> str:
        """What worker ``rank`` says in its HELLO (with the generation on an elastic ring)."""
        name = f"worker:{self.ids[rank]}"
        return f"{name}/gen:{self.generation}" if self._incoming is not None else name

    def _call_id(self, counter: int) -> int:
        return (self.generation << 32) | (counter & 0xFFFFFFFF)

    def _bind(self) -> socket.socket:
        return listen(self.addresses[self.rank], self.security, f"worker:{self.ids[self.rank]}")

    # -- handshake ---------------------------------------------------------------------
    def connect(self, timeout: float) -> None:
        """Dials the right neighbour and accepts the left one, both by ``timeout`` seconds.

        Raises:
            UnauthenticatedError: the right neighbour refused this worker's token.
            DeadlineExceededError: a neighbour did not come in time (named).
            UnavailableError: a neighbour failed during the handshake (named).
        """
        deadline = time.monotonic() + timeout
        accepted: list[Any] = []
        incoming = self._incoming
        take = (
            (lambda: incoming(self.client_name(self.left_rank), deadline))
            if incoming is not None
            else (lambda: self._accept_left(deadline))
        )
        acceptor = threading.Thread(
            target=lambda: accepted.append(take()),
            name="psflow-ring-accept",
            daemon=True,
        )
        acceptor.start()
        try:
            self._right = self._dial_right(deadline)
        except errors.UnauthenticatedError:
            # refused: answer a neighbour dialling us meanwhile (it learns why, instead of
            # finding no listener), briefly; the acceptor ends when close() closes the listener
            acceptor.join(min(_LINGER_SECONDS, max(0.0, deadline - time.monotonic())))
            raise
        acceptor.join(max(0.0, deadline - time.monotonic()) + 1.0)
        outcome = accepted[0] if accepted else None
        if isinstance(outcome, BaseException):
            raise outcome
        if outcome is None:
            raise errors.DeadlineExceededError(
                f"collective: {self.left_name} did not connect within {timeout:g}s",
                task=f"worker:{self.left_id}",
            )
        self._left = outcome
        self._plain_left = (
            bool(_WAITALL)
            and hasattr(socket, "MSG_DONTWAIT")  # not Windows: its SO_RCVTIMEO is a DWORD
            and not isinstance(outcome.sock, ssl.SSLSocket)
        )
        sock = self._right.sock
        self._plain = hasattr(socket, "MSG_DONTWAIT") and not isinstance(sock, ssl.SSLSocket)
        self._writable_right = _writable_check(sock)
        if self._listener is not None:
            with contextlib.suppress(OSError):  # both links are up: nobody else may connect
                self._listener.close()
        self._sender = threading.Thread(
            target=self._send_loop, name="psflow-ring-send", daemon=True
        )
        self._sender.start()

    def _wrap(self, sock: socket.socket, *, server: bool, host: str) -> socket.socket:
        tls = self.security.tls
        if tls is None:
            return sock
        if server:
            return auth.server_context(tls).wrap_socket(sock, server_side=True)
        return auth.client_context(tls).wrap_socket(sock, server_hostname=tls.server_name or host)

    def _dial_right(self, deadline: float) -> FrameStream:
        host, port = split_address(self.addresses[self.right_rank])
        who, task = self.right_name, f"worker:{self.right_id}"
        last: BaseException | None = None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise errors.DeadlineExceededError(
                    f"collective: cannot reach {who} (last error: {last})", task=task
                )
            try:
                sock = socket.create_connection((host, port), timeout=min(left, 5.0))
            except OSError as e:  # not listening yet: the peer is still starting
                last = e
                time.sleep(_RETRY_SECONDS)
                continue
            break
        try:
            tune(sock)
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                sock = self._wrap(sock, server=False, host=host)
            except ssl.SSLError as e:
                raise errors.UnauthenticatedError(
                    f"collective: TLS handshake with {who} failed: {e}", task=task
                ) from None
            stream = FrameStream(sock, max_header=auth.HELLO_LIMIT, max_payload=_MAX_PAYLOAD)
            stream.send_frame(
                frames.Kind.HELLO, header=auth.hello(self.security, self.client_name(self.rank))
            )
            stream.deadline = deadline
            head = stream.read_head()
            header = stream.read_bytes(head.header_len)
            stream.deadline = None
        except errors.OpError:
            sock.close()
            raise
        except (OSError, frames.FrameError) as e:
            sock.close()
            # TLS 1.3 reports a refused client certificate only at the first read
            cls = errors.UnauthenticatedError if isinstance(e, ssl.SSLError) else None
            raise (cls or errors.UnavailableError)(
                f"collective: handshake with {who} failed: {e}", task=task
            ) from None
        if head.kind is frames.Kind.WELCOME:
            return stream
        stream.close()
        code, message, _ = (
            _parse_status(header)
            if head.kind is frames.Kind.ERROR
            else (
                Code.INTERNAL,
                f"unexpected {head.kind.name} frame",
                "",
            )
        )
        raise errors.error_class(code)(f"collective: {who} refused this worker: {message}", task)

    def _accept_left(self, deadline: float) -> FrameStream | BaseException | None:
        """The left neighbour's authenticated stream (None when it did not come in time)."""
        assert self._listener is not None
        expected = self.client_name(self.left_rank)  # its id: a sub-ring's are the global ones
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                self._listener.settimeout(min(left, 0.5))
                sock, _addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if self._broken is not None:  # closed meanwhile: nobody waits for this any more
                    return None
                return errors.UnavailableError(f"collective: accept failed: {e}")
            try:
                stream = self._admit(sock, deadline, expected)
            except (OSError, frames.FrameError):
                stream = None
            if stream is not None:
                return stream
            with contextlib.suppress(OSError):
                sock.close()

    def _admit(self, sock: socket.socket, deadline: float, expected: str) -> FrameStream | None:
        """Checks one incoming connection's HELLO; refuses (ERROR frame) all but the left peer."""
        tune(sock)
        # a caller that says nothing must not hold the door until the deadline
        deadline = min(deadline, time.monotonic() + _HELLO_SECONDS)
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            sock = self._wrap(sock, server=True, host="")
        except ssl.SSLError:
            return None
        stream = FrameStream(sock, max_header=auth.HELLO_LIMIT, max_payload=0)
        stream.deadline = deadline
        head = stream.read_head()  # limits checked before any allocation
        if head.kind is not frames.Kind.HELLO:
            return None
        raw = stream.read_bytes(head.header_len)
        why = auth.check_hello(self.security, raw)
        if why is not None:
            stream.send_frame(frames.Kind.ERROR, header=_status(Code.UNAUTHENTICATED, why))
            return None
        client = dataplane_pb2.DataPlaneHello.FromString(raw).client
        if client != expected:  # a worker of another ring order (a bad TF_CONFIG)
            why = f"this is worker:{self.ids[self.rank]}; its left neighbour is {expected}, not {client!r}"
            stream.send_frame(frames.Kind.ERROR, header=_status(Code.INVALID_ARGUMENT, why))
            return None
        stream.deadline = None
        stream.send_frame(frames.Kind.WELCOME)
        stream.max_payload = _MAX_PAYLOAD
        stream.max_header = frames.MAX_HEADER_BYTES
        return stream

    # -- framed traffic -----------------------------------------------------------------
    @property
    def failure(self) -> errors.OpError | None:
        """The error that broke these links (None while they work)."""
        return self._broken

    def check(self) -> None:
        """Raises the error that broke these links, if any."""
        if self._broken is not None:
            raise self._broken

    def send(self, buffers: Sequence[Any], deadline: float) -> threading.Event:
        """Queues one frame of ``buffers`` for the right neighbour; the event is set when sent.

        The buffers must not change until the event is set (see :meth:`wait_sent`).
        """
        if self._broken is not None:
            raise self._broken
        self._sent += 1
        if len(buffers) == 1:  # the ring's frames: one array each
            nbytes = memoryview(buffers[0]).nbytes
        else:
            nbytes = sum(memoryview(b).nbytes for b in buffers)
        if not self._queued and self._plain and nbytes <= _NOW_BYTES:
            # mid-sized: what the kernel takes at once goes from this thread (never waiting,
            # so two neighbours cannot block on each other); only a rest, if any, is handed
            # to the sender thread, as the frame's continuation
            rest = self._send_now(buffers, nbytes)
            if rest is None:
                return _SENT
            return self._hand_over(None, rest, deadline)
        if self._queued == 0 and nbytes <= _INLINE_BYTES and not self._plain:
            # small (a flag, a count) on TLS: written from this thread, which saves a wake-up
            # of the sender thread per hop; the kernel takes it whole at once, so it cannot
            # block on a neighbour that is itself sending (on a plain socket _send_now below
            # does the same with less: one writev, no polls, no frame builder)
            self._send_inline(buffers, deadline)
            return _SENT  # an Event costs a lock and a condition: the sent ones share one
        return self._hand_over(frames.Kind.REQUEST, buffers, deadline)

    def _hand_over(
        self, kind: frames.Kind | None, buffers: Sequence[Any], deadline: float
    ) -> threading.Event:
        """Queues a frame (or, ``kind`` None, a frame's rest) for the sender thread."""
        done = threading.Event()
        with self._counting:
            self._queued += 1
        self._sends.put((kind, self._call_id(self._sent), b"", list(buffers), deadline, done))
        return done

    def _send_now(self, buffers: Sequence[Any], nbytes: int) -> list[memoryview] | None:
        """Writes the frame's start without waiting; returns the rest (None: all of it went).

        Called with no send queued.  When a rest remains, the right link is marked as
        inside a frame (no heartbeat may go in between) until the sender thread wrote it.
        """
        right = self._right
        assert right is not None
        call_id = (self.generation << 32) | (self._sent & 0xFFFFFFFF)
        fixed = _FIXED.pack(_MAGIC, _VERSION, _REQUEST, 0, _METHOD, call_id, 0, 0, nbytes)
        # writev and sendmsg take any contiguous buffer; byte views only for a rest
        views: list[Any] = (
            [fixed, *buffers] if len(buffers) < IOV_MAX else [fixed, *buffers][:IOV_MAX]
        )
        sock = right.sock
        with self._writing:
            sent = 0
            try:
                if _WRITEV and sock.gettimeout() is not None:
                    # a socket with a timeout is non-blocking at the OS level (Python's
                    # timeouts are polls around non-blocking calls): writev takes what the
                    # kernel takes now, or raises BlockingIOError, without the two polls
                    # (the writable check and Python's own) a sendmsg costs here
                    sent = os.writev(sock.fileno(), views)
                elif self._writable_right():  # so the send below returns at once
                    sent = sock.sendmsg(views, [], socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as e:
                self.fail(
                    errors.UnavailableError(
                        f"collective: {self.right_name} is unavailable: {e}",
                        task=self._right_task,
                    ),
                    forward=False,
                )
            if sent == nbytes + _FIXED.size:  # all of it (mostly): nothing to hand over
                return None
            views = [memoryview(fixed)]
            views += [v for v in (memoryview(b).cast("B") for b in buffers) if len(v)]
            while sent:
                if sent >= len(views[0]):
                    sent -= len(views.pop(0))
                else:
                    views[0], sent = views[0][sent:], 0
            if not views:
                return None
            self._partial = True
        return views

    def _send_inline(self, buffers: Sequence[Any], deadline: float) -> None:
        right = self._right
        assert right is not None
        try:
            with self._writing:
                _bound(right, deadline)
                right.send_frame(
                    frames.Kind.REQUEST,
                    method=_METHOD,
                    call_id=self._call_id(self._sent),
                    buffers=buffers,
                )
        except OSError as e:
            cls = errors.DeadlineExceededError if isinstance(e, TimeoutError) else None
            self.fail(
                (cls or errors.UnavailableError)(
                    f"collective: {self.right_name} is unavailable: {e}",
                    task=f"worker:{self.right_id}",
                ),
                forward=False,
            )

    def wait_sent(self, done: threading.Event, deadline: float) -> None:
        """Waits for a queued send (by ``deadline``).

        Raises:
            DeadlineExceededError / UnavailableError naming the right neighbour.
        """
        while not done.wait(0.05):
            self.check()
            if time.monotonic() > deadline:
                self.fail(
                    errors.DeadlineExceededError(
                        f"collective: {self.right_name} did not take data in time",
                        task=f"worker:{self.right_id}",
                    )
                )
        self.check()

    def hung_up(self) -> str | None:
        """The neighbour (named) whose end of a link has closed, looking without reading.

        For waits outside the ring (an NCCL collective): a neighbour whose
        process died has closed its sockets.  None where no link has closed, or
        where the platform cannot tell without reading (no ``POLLRDHUP``).
        """
        rdhup = getattr(select, "POLLRDHUP", 0)
        if not rdhup or not hasattr(select, "poll"):
            return None
        for stream, name in ((self._left, self.left_name), (self._right, self.right_name)):
            if stream is None:
                continue
            try:
                fd = stream.sock.fileno()
                if fd < 0:
                    return name
                poller = select.poll()
                poller.register(fd, rdhup | select.POLLHUP | select.POLLERR)
                if poller.poll(0):
                    return name
            except (OSError, ValueError):
                return name
        return None

    def begin(self) -> None:
        """A collective starts: heartbeats tell the right neighbour this worker is in it."""
        self._heard = time.monotonic()
        self._active = True

    def end(self) -> None:
        """The collective is over: no more heartbeats until the next one."""
        self._active = False

    def _send_loop(self) -> None:
        right = self._right
        assert right is not None  # started after connect
        while True:
            try:
                item = self._sends.get(timeout=self.heartbeat)
            except queue.Empty:
                if self._active and self._broken is None and _writable(right.sock):
                    with contextlib.suppress(OSError), self._writing:  # failures show on next send
                        if not self._partial:  # never inside another frame
                            right.settimeout(self.heartbeat)
                            right.send_frame(frames.Kind.REQUEST, method=_HEARTBEAT)
                continue
            if item is None:
                return
            kind, call_id, header, buffers, deadline, done = item
            try:
                with self._writing:
                    _bound(right, deadline)
                    if kind is None:  # the rest of a frame whose start went from the caller
                        for view in buffers:
                            right.sock.sendall(view)
                        self._partial = False
                    else:
                        right.send_frame(
                            kind, method=_METHOD, call_id=call_id, header=header, buffers=buffers
                        )
            except OSError as e:
                if kind is not frames.Kind.ERROR:
                    gone = isinstance(e, TimeoutError)
                    cls = errors.DeadlineExceededError if gone else errors.UnavailableError
                    # recorded for the caller, which raises it; this thread goes on serving the
                    # queue (a failure forwarded meanwhile must not wait for a dead sender)
                    with contextlib.suppress(errors.OpError):
                        self.fail(
                            cls(
                                f"collective: {self.right_name} is unavailable: {e}",
                                task=f"worker:{self.right_id}",
                            ),
                            forward=False,
                        )
            finally:
                if kind is not frames.Kind.ERROR:
                    with self._counting:
                        self._queued -= 1
                done.set()
            # drop the sent views now, not when the next item comes: a collective's result
            # buffer is reused only once nothing holds a view of it
            item = buffers = None

    def receive_into(
        self,
        dest: memoryview,
        deadline: float,
        on_segment: Callable[[int, int], None] | None = None,
        segment: int = 0,
    ) -> None:
        """Fills ``dest`` with the left neighbour's next frame (of exactly ``len(dest)`` bytes).

        With ``on_segment`` the payload is read in pieces of ``segment`` bytes
        and ``on_segment(start, end)`` is called on each byte range as soon as
        it is in ``dest`` (a reduction then works on data still in the cache
        while the kernel goes on receiving the rest).

        The left neighbour is blamed when it stays silent (no data, no
        heartbeat) for :attr:`silence` seconds.  One that keeps sending
        heartbeats is alive and itself waiting for a peer further left: this
        worker waits (until ``deadline``) for the error it will forward, which
        names the peer that failed.

        Raises:
            UnavailableError: the left neighbour closed, or reported a failed peer.
            DeadlineExceededError: the left neighbour was silent, or ``deadline`` passed.
            InternalError: a frame out of step (the ring's workers disagree).
        """
        if self._broken is not None:
            raise self._broken
        stream = self._left
        assert stream is not None
        if self._plain_left and not stream.pending():
            self._receive_plain(stream, dest, deadline, on_segment, segment)
            return
        nbytes = dest.nbytes
        # the fixed header the next data frame must have, compared as one tuple: the common
        # case then costs one unpack and one comparison, not the checks of frames.unpack
        expected = (
            frames.MAGIC,
            frames.VERSION,
            _REQUEST,
            0,
            _METHOD,
            self._call_id(self._received + 1),
            0,
            0,
            nbytes,
        )
        large = nbytes >= _ALONE_BYTES
        try:
            while True:
                self._heard_if_queued(stream)
                stream.deadline = min(deadline, self._heard + self.silence)
                try:
                    # a large payload is read straight into dest, none through staging
                    raw = stream.read_bytes(_FIXED.size, alone=large)
                except TimeoutError:
                    self._fail_silent()
                self._heard = time.monotonic()
                if _FIXED.unpack(raw) == expected:
                    break
                if not self._unusual(stream, raw, nbytes, deadline):  # a heartbeat: read on
                    continue
            stream.deadline = deadline
            self._received += 1
            if on_segment is None:
                stream.read_into(dest.cast("B") if nbytes else dest)
            else:
                _read_payload(stream, dest.cast("B") if nbytes else dest, on_segment, segment)
            self._heard = time.monotonic()
        except errors.OpError:  # raised by fail() above (some are TimeoutError/OSError too)
            raise
        except (OSError, frames.FrameError) as e:  # TimeoutError is an OSError
            self.fail(self._left_error(e))
        finally:
            stream.deadline = None

    def _receive_plain(
        self,
        stream: FrameStream,
        dest: memoryview,
        deadline: float,
        on_segment: Callable[[int, int], None] | None,
        segment: int,
    ) -> None:
        """:meth:`receive_into` on a plain link with nothing staged: the head and each
        payload piece in one blocking receive each, straight into their places."""
        sock = stream.sock
        if sock.gettimeout() is not None:
            sock.settimeout(None)  # blocking (a TLS link, or a staged rest, reads as before)
        nbytes = dest.nbytes
        call_id = (self.generation << 32) | ((self._received + 1) & 0xFFFFFFFF)
        expected = _FIXED.pack(_MAGIC, _VERSION, _REQUEST, 0, _METHOD, call_id, 0, 0, nbytes)
        head = self._head
        try:
            while True:
                self._heard_if_queued(stream)
                try:
                    quiet = self._heard + self.silence
                    self._fill(sock, head, _FIXED.size, deadline if deadline < quiet else quiet)
                except TimeoutError:
                    self._fail_silent()
                self._heard = time.monotonic()
                if head == expected:
                    break
                stream.deadline = deadline  # a heartbeat has no body; an ERROR frame's is read
                self._unusual(stream, bytes(head), nbytes, deadline)  # returns on a heartbeat
                if sock.gettimeout() is not None:
                    sock.settimeout(None)
            self._received += 1
            if on_segment is None:
                self._fill(sock, dest, nbytes, deadline)
            else:
                view = dest.cast("B")
                for lo in range(0, nbytes, segment):
                    hi = min(lo + segment, nbytes)
                    self._fill(sock, view[lo:hi], hi - lo, deadline)
                    on_segment(lo, hi)
            self._heard = time.monotonic()
        except errors.OpError:  # raised by fail() above (some are TimeoutError/OSError too)
            raise
        except (OSError, frames.FrameError) as e:  # TimeoutError is an OSError
            self.fail(self._left_error(e))
        finally:
            stream.deadline = None

    def _heard_if_queued(self, stream: FrameStream) -> None:
        """A link left unread past the silence bound (this worker was busy elsewhere: on
        another link set, in a long sum) whose neighbour's bytes wait to be read: the
        neighbour spoke meanwhile, so its silence counts from now, not from the last read.
        (The bytes are its heartbeats or its frame; a neighbour that died after sending
        them is then blamed one silence bound later.)"""
        now = time.monotonic()
        if now < self._heard + self.silence:
            return  # the common case: one comparison
        if stream.pending():
            self._heard = now
            return
        with contextlib.suppress(OSError, ValueError):  # a closed socket: the read will say
            if select.select([stream.sock], [], [], 0)[0]:
                self._heard = now

    def _fill(self, sock: socket.socket, dest: Any, size: int, limit: float) -> None:
        """Fills ``dest`` (any writable buffer) from the blocking left socket by ``limit``.

        One ``recv`` with ``MSG_WAITALL`` takes it whole in the common case.  The
        socket's ``SO_RCVTIMEO`` (a tick, or what is left before ``limit`` if less)
        wakes a receive that waits long, so that ``limit`` is kept.

        Raises:
            TimeoutError: ``limit`` passed first.  ConnectionError: the peer closed.
        """
        got, view = 0, None
        if self._rcvtimeo == _TICK_SECONDS and time.monotonic() + _TICK_SECONDS < limit:
            # the common case: a full tick before the limit, so one receive cannot pass it
            try:
                got = sock.recv_into(dest, size, _WAITALL)
            except BlockingIOError:  # a tick with nothing
                got = -1
            if got == size:
                return
            if not got:
                raise ConnectionError("the data-plane connection was closed by its peer")
            got = max(got, 0)
        while got < size:
            left = limit - time.monotonic()
            if left <= 0:
                raise TimeoutError("the rest of the frame did not arrive in time")
            tick = left if left < _TICK_SECONDS else _TICK_SECONDS
            if tick != self._rcvtimeo:  # only near a limit, or after one
                sec = int(tick)
                usec = max(1, int((tick - sec) * 1e6)) if sec == 0 else int((tick - sec) * 1e6)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", sec, usec))
                self._rcvtimeo = tick
            try:
                if got:  # the rest of a receive the tick cut short
                    view = view or memoryview(dest).cast("B")
                    k = sock.recv_into(view[got:], size - got, _WAITALL)
                else:
                    k = sock.recv_into(dest, size, _WAITALL)
            except BlockingIOError:  # a tick passed with nothing: look at the clock again
                continue
            if not k:
                raise ConnectionError("the data-plane connection was closed by its peer")
            got += k

    def _unusual(self, stream: FrameStream, raw: bytes, nbytes: int, deadline: float) -> bool:
        """A fixed header that is not the expected data frame's: False for a heartbeat
        (read and dropped), else raises what it means (fail() names the left neighbour).

        Raises:
            FrameError: a header that breaks the format or the limits.
            UnavailableError and others: an ERROR frame forwarded from the left.
            AbortedError: a frame of another generation.
            InternalError: a frame out of step (the workers run different collectives).
        """
        head = frames.unpack(raw, max_header=stream.max_header, max_payload=stream.max_payload)
        who, task = self.left_name, self._left_task
        if head.kind is frames.Kind.REQUEST and head.method == _HEARTBEAT:
            stream.discard(head.header_len + head.payload_len)
            return False
        stream.deadline = deadline
        if head.kind is frames.Kind.ERROR:
            code, message, failed = _parse_status(stream.read_bytes(head.header_len))
            self.fail(errors.error_class(code)(message, failed or task))
        received = self._received + 1
        if head.kind is frames.Kind.REQUEST and head.call_id >> 32 != self.generation:
            self.fail(
                errors.AbortedError(
                    f"collective: {who} sent a frame of generation {head.call_id >> 32}; "
                    f"this ring is generation {self.generation}",
                    task=task,
                )
            )
        self.fail(
            errors.InternalError(
                f"collective: frame {head.call_id & 0xFFFFFFFF} of {head.payload_len} bytes "
                f"from {who}, expected frame {received} of {nbytes} bytes: the workers "
                "are running different collectives",
                task=task,
            )
        )
        return False  # not reached: fail() raises

    def _fail_silent(self) -> None:
        """Fails the links for a frame head that did not come: the left neighbour either
        sent nothing for ``silence`` seconds or, heard from, missed the deadline."""
        if time.monotonic() >= self._heard + self.silence:
            why = f"{self.left_name} sent nothing for {self.silence:g}s"
        else:
            why = f"{self.left_name} is alive but its data did not come before the deadline"
        self.fail(errors.DeadlineExceededError(f"collective: {why}", task=self._left_task))

    def _left_error(self, e: OSError | frames.FrameError) -> errors.OpError:
        """The typed error for a failed read from the left neighbour."""
        if isinstance(e, TimeoutError):
            return errors.DeadlineExceededError(
                f"collective: the data from {self.left_name} did not arrive in time",
                task=self._left_task,
            )
        return errors.UnavailableError(
            f"collective: {self.left_name} is unavailable: {e}", task=self._left_task
        )

    def fail(self, error: errors.OpError, *, forward: bool = True) -> None:
        """Marks the links broken with ``error``, tells the right neighbour, raises ``error``.

        The first failure wins: later calls raise it again.
        """
        if self._broken is None:
            self._broken = error
            if forward and self._right is not None:
                done = threading.Event()
                header = _status(error.code, error.message, error.task or "")
                deadline = time.monotonic() + _FORWARD_SECONDS
                self._sends.put((frames.Kind.ERROR, 0, header, [], deadline, done))
                done.wait(_FORWARD_SECONDS)
        raise self._broken

    def close(self) -> None:
        """Closes both links and the listener (idempotent)."""
        if self._broken is None:
            self._broken = errors.CancelledError("collective: the ring was closed")
        self._sends.put(None)
        for stream in (self._left, self._right):
            if stream is not None:
                stream.close()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.close()

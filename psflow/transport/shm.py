"""Shared memory between processes of one host: the fast data path of the wire.

gRPC carries control; when a parameter server and its client run on the same
machine (loopback addresses), bulk bytes can skip it:

* **pulls**: the PS mirrors each dense variable into a shared-memory segment
  after every change; a client on the same host copies the value out under a
  *seqlock* (a counter that is odd while the PS writes: a read that saw the
  counter change retries), so a pull is one ``memcpy`` and no RPC.  Mirrors
  are lazy: a PS copies a value into its mirror only while some reader asks
  for it (each read stamps the segment); a mirror nobody read for
  ``idle`` seconds goes *dormant* and its variable's updates cost no copy.  A
  read of a dormant mirror fails (:class:`MirrorDormantError`) and the reader
  pulls over gRPC instead; that pull (:meth:`Mirror.wake`) brings the mirror
  back, so the next read is served from shared memory again.  Once a live
  mirror holds its variable's current value, the variable's value *moves into
  the segment*: each update is applied there in place, the whole update inside
  the seqlock's odd phase (:meth:`Mirror.begin_update`), so no copy follows it
  (a reader waits for the apply, not for a copy).  It stays there, written under
  the seqlock, while the mirror is dormant (a wake then copies nothing); it
  moves out again (one copy) when a reader on the PS's side would hold it past
  the variable's lock (a pull over gRPC), and before the segment is retired,
  which is never written again;
* **pushes**: a client writes its gradients into a segment of its own and the
  Push RPC names the segment instead of carrying the bytes; the PS reads them
  in place, applies them, and only then replies, so the client may reuse the
  segment after the reply.

Segments are files under ``/dev/shm`` (mode 0600: only this user's processes
can map them), named ``psflow-<pid>-<token>-...`` so that segments left by a
killed process can be recognised and removed (:func:`remove_stale`).

``/dev/shm`` is writable by every user, so a segment someone else named is
never trusted: an existing segment is opened without following symbolic
links and without blocking (a FIFO would otherwise hang the open), and is
used only if it is a regular file of this user with no access for others.
A push segment must also prove that the client created it: its name ends in
a random 128-bit token that its 64-byte header repeats after the magic, which
a link to any other file (or another user's planted file) does not hold. Set
``PSFLOW_SHM=0`` to turn the fast path off; it is also off wherever
``/dev/shm`` is missing (then everything travels over gRPC).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import mmap
import os
import platform
import re
import secrets
import stat
import threading
import time
import uuid
import weakref
from typing import Any

import numpy as np

from psflow import errors, settings

SHM_DIR = "/dev/shm"
# magic, sequence, version, data bytes, writer's pid, when a reader last asked for the
# value (CLOCK_MONOTONIC ns, one clock for every process of the host), live (1: the
# writer copies every change in), values copied in so far
HEADER_BYTES = 64
_SEQ, _VERSION, _NBYTES, _PID, _ASKED, _LIVE, _COPIES = 1, 2, 3, 4, 5, 6, 7
MAGIC = 0x7073666C6F770002  # "psflow" + format 2 (lazy: a reader must see it live)
#: seconds a mirror keeps following its variable after its last read
MIRROR_IDLE_SECONDS = 10.0
PAYLOAD_MAGIC = 0x7073666C6F770101  # "psflow" + push payload, format 1
_NAME = re.compile(r"^psflow-(?P<pid>\d+)-[0-9a-f]{8}-[A-Za-z0-9_.-]{1,160}$")
_PAYLOAD_TOKEN = re.compile(r"-(?P<token>[0-9a-f]{32})$")
# getattr: Windows has none of these (and no /dev/shm: the path is off there anyway)
_OPEN_EXISTING = (
    getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
)
# a read spins this many times on a writer, then yields the CPU between tries, and
# after this long falls back to gRPC (a PS stopped half-way through a write)
_SPINS = 100
_READ_PATIENCE_NS = 1_000_000_000


def enabled() -> bool:
    """Whether the shared-memory path may be used in this process."""
    return unavailable_reason() is None


def unavailable_reason() -> str | None:
    """Why the shared-memory path may not be used in this process; None when it may."""
    why = sharing_unavailable_reason()
    if why is not None:
        return why
    # The seqlock relies on x86's store and load ordering (no reordering of stores
    # with stores, nor loads with loads); elsewhere the data goes over the wire.
    machine = platform.machine()
    if machine.lower() not in ("x86_64", "amd64"):
        return f"it needs x86-64 (Linux), this machine is {machine or 'unknown'}"
    return None


def sharing_unavailable_reason() -> str | None:
    """Why this process may not share segments with the others of its host at all;
    None when it may.

    :func:`unavailable_reason` without the seqlock's x86 rule: for users whose
    readers wait for a socket round trip (which orders memory on every CPU)
    instead of reading a counter, such as the workers' same-host all-reduce.
    """
    if not settings.current().shm:
        return "turned off (PSFLOW_SHM=0)"
    if not (os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)):
        return f"{SHM_DIR} is not a writable directory on this platform"
    return None


def is_local_address(address: str) -> bool:
    """Whether ``host:port`` names this host through loopback."""
    host = address.rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def new_prefix() -> str:
    """A fresh segment-name prefix for this process: ``psflow-<pid>-<random>``."""
    return f"psflow-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def check_name(name: str) -> str:
    """Returns ``name`` if it is a psflow segment name (no path, no traversal).

    Raises:
        InvalidArgumentError: anything else, quoted.
    """
    if not isinstance(name, str) or not _NAME.match(name):
        raise errors.InvalidArgumentError(f"{name!r} is not a psflow shared-memory segment name")
    return name


def _open_existing(name: str, flags: int) -> int:
    """Opens segment ``name`` only if it is a regular file of ours, closed to others.

    Never follows a symbolic link and never blocks (``O_NONBLOCK``: a FIFO
    opens at once and is then refused by type).

    Raises:
        FileNotFoundError: no such segment.
        InvalidArgumentError: a link, FIFO, directory, socket... (quoted).
        PermissionDeniedError: another user's file, or one others may access.
    """
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, flags | _OPEN_EXISTING)
    except FileNotFoundError:
        raise
    except OSError as e:  # ELOOP: a symbolic link; EISDIR, ENXIO: not a file
        raise errors.InvalidArgumentError(
            f"shared-memory segment {name!r} cannot be used: {e.strerror}"
        ) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise errors.InvalidArgumentError(
                f"shared-memory segment {name!r} is not a regular file"
            )
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise errors.PermissionDeniedError(
                f"shared-memory segment {name!r} belongs to uid {st.st_uid} with mode "
                f"{stat.S_IMODE(st.st_mode):o}; only this user's mode-0600 segments are used"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


class Segment:
    """A shared-memory file mapped into this process.

    ``reserve`` (a new segment): its pages are allocated at once, so that a
    ``/dev/shm`` too small for it is an ``OSError`` here, not a ``SIGBUS`` later.

    Raises:
        FileNotFoundError, InvalidArgumentError, PermissionDeniedError: opening
            an existing segment that is missing or not to be trusted (see
            :func:`_open_existing`).
    """

    def __init__(
        self, name: str, size: int, *, create: bool, writable: bool = True, reserve: bool = False
    ) -> None:
        self.name = check_name(name)
        flags = os.O_RDWR if writable else os.O_RDONLY
        if create:
            fd = os.open(os.path.join(SHM_DIR, name), flags | os.O_CREAT | os.O_EXCL, 0o600)
        else:
            fd = _open_existing(name, flags)
        try:
            if create:
                os.ftruncate(fd, size)
                if reserve and size and hasattr(os, "posix_fallocate"):
                    # the pages now: a full /dev/shm (a container's 64 MB) fails here with
                    # ENOSPC instead of killing the process with SIGBUS at a later touch
                    os.posix_fallocate(fd, 0, size)
            else:
                size = os.fstat(fd).st_size
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, prot) if size else None
        except BaseException:
            if create and reserve:  # nothing half-made is left behind
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(SHM_DIR, name))
            raise
        finally:
            os.close(fd)
        self.size = size
        self.owner = create

    def view(self) -> memoryview:
        """The whole segment as bytes."""
        if self._mmap is None:
            return memoryview(b"")
        return memoryview(self._mmap)

    def array(self, dtype: Any, shape: tuple[int, ...], offset: int = 0) -> np.ndarray:
        """A NumPy view of part of the segment."""
        count = int(np.prod(shape, dtype=np.int64))
        return np.frombuffer(self._mmap, dtype=dtype, count=count, offset=offset).reshape(shape)

    def unlink(self) -> None:
        """Removes the file (idempotent); the mappings of it, here and elsewhere, stay."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, self.name))

    def close(self, unlink: bool = False) -> None:
        """Unmaps (views still alive keep the mapping until they go); optionally removes the file."""
        if self._mmap is not None:
            with contextlib.suppress(BufferError):
                self._mmap.close()
        if unlink:
            self.unlink()


class Mirror:
    """A variable's value published for readers on this host (PS side).

    Layout: a 64-byte header (see :data:`HEADER_BYTES`) then the value's
    bytes.  Every method that writes is called with the variable's lock held
    (one writer at a time).

    Two ways in: :meth:`publish` copies a changed value in; an update taken
    *in place* writes the segment itself (:meth:`begin_update`, then
    :meth:`end_update`), the variable's value being :attr:`array` from then
    on.  A version names one value: the mirror remembers which version its
    bytes hold, so a value it already holds is never copied in again.

    Args:
        name: the segment's name.
        value: the variable's value now (its size and first content).
        idle: seconds the mirror keeps copying changes in after the last read;
            ``None``: always (an eager mirror, live from the start).  A lazy
            mirror starts dormant: nothing is copied before a reader asks.
    """

    def __init__(self, name: str, value: np.ndarray, idle: float | None = None) -> None:
        if idle is not None and not idle > 0:
            raise errors.InvalidArgumentError(f"mirror idle time must be > 0 s, got {idle!r}")
        self.segment = Segment(name, HEADER_BYTES + value.nbytes, create=True)
        # the header's fields as Python ints: every update reads and writes several,
        # and a NumPy scalar per access cost more than the rest of a small update
        self._header = memoryview(self.segment.array(np.int64, (8,)))
        self._data = self.segment.array(np.uint8, (value.nbytes,), HEADER_BYTES)
        #: the segment's bytes as the variable's array (what an update in place writes)
        self.array = self.segment.array(value.dtype, value.shape, HEADER_BYTES)
        self._held: int | None = None  # the version whose bytes the segment holds
        self._header[_NBYTES] = value.nbytes
        self._header[_PID] = os.getpid()
        self._idle_ns = None if idle is None else int(idle * 1e9)
        if idle is None:
            self._copy(value, 0)
        self._header[0] = MAGIC  # valid from now on

    @property
    def name(self) -> str:
        """The segment's name, for clients."""
        return self.segment.name

    @property
    def copies(self) -> int:
        """Values the mirror took in while live (each copy in, update in place or
        wake): what it cost its PS."""
        return int(self._header[_COPIES])

    @property
    def live(self) -> bool:
        """Whether the segment follows the variable (readers may use it)."""
        return bool(self._header[_LIVE])

    def _asked(self) -> bool:
        """Whether a reader asked for the value within the idle time (always, if eager)."""
        if self._idle_ns is None:
            return True
        asked = int(self._header[_ASKED])
        return asked != 0 and time.monotonic_ns() - asked <= self._idle_ns

    def _copy(self, value: np.ndarray, version: int) -> None:
        """Copies ``value`` in under the seqlock; the mirror is live afterwards."""
        header = self._header
        header[_SEQ] += 1  # odd: a write is in progress
        np.copyto(self._data, value.reshape(-1).view(np.uint8))
        self._held = version
        self._taken(version)
        header[_SEQ] += 1  # even again: consistent

    def _taken(self, version: int) -> None:
        """Inside the seqlock's odd phase: the segment holds ``version``, live."""
        header = self._header
        header[_VERSION] = version
        header[_LIVE] = 1
        header[_COPIES] += 1

    def publish(self, value: np.ndarray, version: int) -> bool:
        """After a change: copies ``value`` in if a reader asked lately; returns whether it did.

        A mirror no reader asked for within the idle time goes dormant (its
        readers are told so, under the seqlock) and stops copying.
        """
        if self._asked():
            self._copy(value, version)
            return True
        header = self._header
        if header[_LIVE]:
            header[_SEQ] += 1
            header[_LIVE] = 0
            header[_SEQ] += 1
        return False

    def wake(self, value: np.ndarray, version: int) -> bool:
        """A dormant mirror a reader asked for copies ``value`` in (the PS calls this on a
        pull over gRPC, which is how a reader of a dormant mirror gets its value);
        returns whether it did.  A segment that holds ``version`` already (the value
        lived in it while the mirror was dormant) is only marked live."""
        header = self._header
        if header[_LIVE] or not self._asked():
            return False
        if self._held != version:
            self._copy(value, version)
            return True
        header[_SEQ] += 1
        self._taken(version)
        header[_SEQ] += 1
        return True

    def begin_update(self, value: np.ndarray, version: int) -> np.ndarray | None:
        """Starts an update of the variable in place: returns :attr:`array`, which
        the caller writes and keeps as the variable's value, with the seqlock odd
        until :meth:`end_update` (or :meth:`abandon_update`); None where the
        update must go to ``value`` and :meth:`publish` instead.

        In place when ``value`` is :attr:`array` already (it is written under the
        seqlock, live or not: a reader may be copying it), or when a reader asked
        lately and the segment holds ``version`` (the value moves in, no copy).
        Nobody asking, or a segment behind: None (the next :meth:`publish` copies).
        """
        if value is not self.array and (self._held != version or not self._asked()):
            return None
        self._held = None  # the bytes change: no version until end_update names one
        self._header[_SEQ] += 1  # odd: readers retry until end_update
        return self.array

    def end_update(self, version: int) -> bool:
        """Ends an update begun by :meth:`begin_update`: the segment holds ``version``;
        live if a reader asked lately (dormant otherwise, as after :meth:`publish`).
        Returns whether it is live."""
        header = self._header
        self._held = version
        live = self._asked()
        if live:
            self._taken(version)
        else:
            header[_LIVE] = 0
        header[_SEQ] += 1  # even again: consistent
        return live

    def abandon_update(self) -> None:
        """Ends an update begun by :meth:`begin_update` that failed part way: the
        bytes match no version, so the mirror goes dormant (a reader pulls over
        gRPC, whose :meth:`wake` copies the value in again)."""
        header = self._header
        header[_LIVE] = 0
        header[_SEQ] += 1

    def backs(self, value: np.ndarray) -> bool:
        """Whether ``value`` is the segment's own array (the variable lives in it)."""
        return value is self.array

    def close(self) -> None:
        """Retires the mirror (readers still mapping it see that) and removes the segment.

        A variable whose value :meth:`backs` must have moved it out first: the
        segment is never written again.
        """
        self._header[0] = 0
        self._held = None
        self.segment.close(unlink=True)


@dataclasses.dataclass(frozen=True)
class MirrorState:
    """What a mirror's header says (see :func:`peek`)."""

    live: bool  # it follows its variable: readers may use it
    copies: int  # values its writer took in so far (each update while live, each wake)
    version: int  # the variable's version it holds


def peek(name: str) -> MirrorState:
    """The state of mirror ``name``, read without asking for the value (a reader's
    :meth:`MirrorReader.read` asks, which keeps the mirror live).

    Raises:
        FileNotFoundError, InvalidArgumentError, PermissionDeniedError: as
            :class:`Segment` (missing, or not to be trusted).
        FailedPreconditionError: not a mirror (or a retired one).
    """
    segment = Segment(name, 0, create=False, writable=False)
    try:
        if segment.size < HEADER_BYTES:
            raise errors.FailedPreconditionError(f"segment {name!r} is not a mirror")
        header = segment.array(np.int64, (8,)).copy()
    finally:
        segment.close()
    if int(header[0]) != MAGIC:
        raise errors.FailedPreconditionError(f"segment {name!r} is not a live psflow mirror")
    return MirrorState(bool(header[_LIVE]), int(header[_COPIES]), int(header[_VERSION]))


class SegmentUnreachableError(errors.UnimplementedError):
    """The PS cannot see a push's shared-memory segment (it runs on another host or
    in another container): the push must travel over gRPC instead.

    Its status code is the contract: a push is answered ``UNIMPLEMENTED`` for
    nothing else, so a client that gets :class:`~psflow.errors.UnimplementedError`
    from a shared-memory push resends it over gRPC; nothing was applied.
    """


class MirrorRetiredError(errors.FailedPreconditionError):
    """A mirror was retired (its variable restored or removed, or its PS process gone)."""


class MirrorDormantError(errors.UnavailableError):
    """A mirror does not follow its variable now (no reader asked lately): pull over
    gRPC, which makes the PS copy the value in again (the read asked for it)."""


class MirrorSet:
    """The mirrors of one PS process's variables (dense ones up to ``max_bytes``).

    ``idle``: seconds each mirror follows its variable after its last read
    (lazy mirrors, see :class:`Mirror`).
    """

    def __init__(self, max_bytes: int = 256 << 20, idle: float = MIRROR_IDLE_SECONDS) -> None:
        if not idle > 0:
            raise errors.InvalidArgumentError(f"mirror idle time must be > 0 s, got {idle!r}")
        self.prefix = new_prefix()
        self.max_bytes = max_bytes
        self.idle = idle
        self._count = 0
        self._lock = threading.Lock()
        remove_stale()

    def attach(self, variable: Any) -> None:
        """Gives a store variable a (dormant) mirror, if it qualifies."""
        value = variable.value
        if value.nbytes > self.max_bytes or value.dtype.kind not in "fiub":
            variable.mirror = None
            return
        with self._lock:
            self._count += 1
            name = f"{self.prefix}-v{self._count}"
        variable.mirror = Mirror(name, value, idle=self.idle)

    def detach(self, variable: Any) -> None:
        """Removes a variable's mirror (its lock held), moving its value out of the
        segment first if it lives there."""
        mirror = getattr(variable, "mirror", None)
        if mirror is not None:
            variable.mirror = None
            if mirror.backs(variable.value):
                variable.value = variable.value.copy()
            mirror.close()


class MirrorReader:
    """A client's mapping of one PS variable's mirror.

    It maps the segment writable to stamp it when it reads (:meth:`ask`); it
    never writes the value.
    """

    def __init__(self, name: str, dtype: np.dtype, shape: tuple[int, ...]) -> None:
        self.segment = Segment(name, 0, create=False, writable=True)
        self._header = self.segment.array(np.int64, (8,))
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if int(self._header[0]) != MAGIC or int(self._header[3]) != nbytes:
            raise errors.FailedPreconditionError(
                f"shared-memory segment {name} does not hold this variable"
            )
        self._data = self.segment.array(np.uint8, (nbytes,), HEADER_BYTES)
        self.dtype, self.shape = np.dtype(dtype), tuple(shape)
        self._writer = int(self._header[4])

    def ask(self) -> None:
        """Tells the PS a reader wants the value (it keeps, or starts, copying it in)."""
        self._header[_ASKED] = time.monotonic_ns()

    def read(self) -> tuple[np.ndarray, int]:
        """A consistent copy of the value and its version (asking for the next ones).

        Raises:
            MirrorRetiredError: the mirror no longer follows the variable (map it again).
            MirrorDormantError: no reader asked lately, so the PS stopped copying
                (pull over gRPC: the PS copies the value in again then).
            UnavailableError: the PS kept writing for too long (the caller falls back to gRPC).
        """
        if int(self._header[0]) != MAGIC or not _pid_alive(self._writer):
            raise MirrorRetiredError(f"shared-memory mirror {self.segment.name} was retired")
        self.ask()
        out = np.empty(self.shape, self.dtype)
        flat = out.reshape(-1).view(np.uint8)
        header = self._header
        retries, deadline = 0, 0
        while True:
            before = int(header[_SEQ])
            if not before & 1:
                # read under the seqlock too: a mirror that went dormant mid-copy is
                # retried and then refused, never returned stale
                if not header[_LIVE]:
                    raise MirrorDormantError(
                        f"shared-memory mirror {self.segment.name} is dormant (no reader lately)"
                    )
                np.copyto(flat, self._data)
                version = int(header[_VERSION])
                if int(header[_SEQ]) == before:
                    return out, version
            # the PS is writing: an update applied in place holds the seqlock for the
            # whole apply, so the patience is a time, not a number of tries
            retries += 1
            if retries > _SPINS:
                now = time.monotonic_ns()
                if not deadline:
                    deadline = now + _READ_PATIENCE_NS
                elif now > deadline:
                    raise errors.UnavailableError("shared-memory read kept racing with the writer")
                time.sleep(0)

    def close(self) -> None:
        """Unmaps."""
        self.segment.close()


class PayloadBuffer:
    """A client's segment for push payloads; grows (as a new segment) when a payload is larger.

    Layout: a 64-byte header (:data:`PAYLOAD_MAGIC`, then the 16-byte token
    that ends the segment's name), then the payload.
    """

    def __init__(self) -> None:
        self._prefix = new_prefix()
        self._segment: Segment | None = None
        self._count = 0
        self._finalizer = weakref.finalize(self, _unlink_quietly, [])

    def write(self, arrays: list[np.ndarray]) -> str:
        """Copies the arrays back to back into the segment; returns its name."""
        total = sum(a.nbytes for a in arrays)
        if self._segment is None or self._segment.size < HEADER_BYTES + total:
            if self._segment is not None:
                self._segment.close(unlink=True)
            self._count += 1
            size = max(total, 1 << 20)
            token = secrets.token_bytes(16)
            self._segment = Segment(
                f"{self._prefix}-p{self._count}-{token.hex()}",
                HEADER_BYTES + size + size // 4,
                create=True,
            )
            header = self._segment.array(np.uint8, (HEADER_BYTES,))
            header[8:24] = np.frombuffer(token, np.uint8)
            header[:8] = np.frombuffer(np.int64(PAYLOAD_MAGIC).tobytes(), np.uint8)
            # removed at interpreter exit too, if nobody closed the buffer
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, _unlink_quietly, [self._segment.name])
        view = self._segment.array(np.uint8, (self._segment.size,))
        offset = HEADER_BYTES
        for a in arrays:
            n = a.nbytes
            np.copyto(view[offset : offset + n], a.reshape(-1).view(np.uint8))
            offset += n
        return self._segment.name

    def close(self) -> None:
        """Removes the segment."""
        if self._segment is not None:
            self._segment.close(unlink=True)
            self._segment = None


class SegmentCache:
    """Push segments a PS opened to read from (read-only, by name; past ``limit`` open, the
    one opened first is closed: a client whose segment it was opens it again on its next push).

    Opening happens outside the cache's lock, so a slow or hostile file never
    stalls the pushes of other clients.
    """

    def __init__(self, limit: int = 256) -> None:
        self._segments: dict[str, Segment] = {}
        self._lock = threading.Lock()
        self._limit = limit

    def view(self, name: str, nbytes: int) -> memoryview:
        """The ``nbytes`` of payload in push segment ``name``.

        Raises:
            InvalidArgumentError: a bad name, a segment that is not a regular
                file, whose header does not hold its name's token, or smaller
                than ``nbytes``.
            PermissionDeniedError: a segment of another user, or open to others.
            SegmentUnreachableError: no such segment on this host.
        """
        with self._lock:
            # a name found here passed the checks below when its segment was opened
            # (a client pushes through the same segment every step)
            seg = self._segments.get(name)
        if seg is None:
            check_name(name)
            token = _PAYLOAD_TOKEN.search(name)
            if token is None:
                raise errors.InvalidArgumentError(
                    f"{name!r} is not a push segment name (no token at its end)"
                )
            try:
                seg = Segment(name, 0, create=False, writable=False)
            except FileNotFoundError:
                raise SegmentUnreachableError(
                    f"shared-memory segment {name!r} does not exist on this host"
                ) from None
            _check_payload_header(seg, bytes.fromhex(token.group("token")))
            with self._lock:
                if len(self._segments) >= self._limit:
                    self._segments.pop(next(iter(self._segments))).close()
                seg = self._segments.setdefault(name, seg)
        if seg.size < HEADER_BYTES + nbytes:
            raise errors.InvalidArgumentError(
                f"segment {name!r} holds {max(seg.size - HEADER_BYTES, 0)} payload bytes, "
                f"the push needs {nbytes}"
            )
        return seg.view()[HEADER_BYTES : HEADER_BYTES + nbytes]


def _check_payload_header(seg: Segment, token: bytes) -> None:
    """Refuses a segment whose header does not carry the token its name ends in."""
    header = bytes(seg.view()[:HEADER_BYTES])
    magic = int.from_bytes(header[:8], "little") if len(header) == HEADER_BYTES else 0
    if magic != PAYLOAD_MAGIC or header[8:24] != token:
        seg.close()
        raise errors.InvalidArgumentError(
            f"shared-memory segment {seg.name!r} was not written as a psflow push payload "
            "(its header does not hold its name's token)"
        )


def _unlink_quietly(names: list[str]) -> None:
    for name in names:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(SHM_DIR, name))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as e:
        return e.errno == errno.EPERM
    return True


def remove_stale() -> int:
    """Removes segments of psflow processes that no longer run; returns how many."""
    if not os.path.isdir(SHM_DIR):
        return 0
    removed = 0
    for entry in os.listdir(SHM_DIR):
        m = _NAME.match(entry)
        if m and not _pid_alive(int(m.group("pid"))):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(SHM_DIR, entry))
                removed += 1
    return removed

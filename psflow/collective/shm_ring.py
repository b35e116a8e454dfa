"""The workers' all-reduce through shared memory, when every worker runs on this host.

A ring whose peers all have loopback addresses (the path ``psflow local --mode
multi-worker`` and every one-host job take) moves an all-reduce's bytes
through shared memory instead of TCP, as NCCL does inside a node: each worker
maps one segment of its own (writable) and every other worker's (read-only);
only tiny barrier frames travel over the ring's links.

One all-reduce of ``S`` bytes on ``N`` workers, in pieces of at most a slot,
each piece split into ``N`` chunks, chunk ``c`` owned by worker ``c``:

1. **stage**: worker ``r`` copies its part of every chunk but its own into
   its segment's slot (a call of several arrays straight from the arrays, a
   :class:`Packed`: no packing copy into one buffer first); *barrier*;
2. **sum**: the owner of chunk ``r`` adds the ``N`` parts in rank order (its
   own straight from its input arrays, the others' from their segments), divides a
   mean once, and writes the sum into its slot and its output; *barrier*;
3. **gather**: it copies every other chunk's sum from its owner's slot.

Each chunk is summed by one worker and then copied, so every worker ends with
the same bits.  A segment has two slots, used by alternate pieces: a worker
stages piece ``k+1`` while the others may still gather piece ``k`` from the
other slot, and no worker stages piece ``k+2`` before the stage barrier of
``k+1``, which every worker reaches only after gathering ``k``; so two
barriers a piece suffice.

A barrier is ``N-1`` rounds of one small frame right and one from the left
over the ring's :class:`~psflow.collective.peer_link.PeerLinks` (a round's
frame leaves only after the previous round's came, so after the last one
every worker has heard, through its neighbours, from every other).  The
frames say which piece of which size each worker is at, so workers running
different collectives fail with ``InternalError``; and the links' deadlines,
heartbeats and error forwarding apply unchanged: a worker killed or frozen
mid-call gives every survivor the typed error naming it, never a hang.
Nothing spins on shared memory: the socket round trips order the copies.

The path is on only where every worker can take it, agreed before the first
all-reduce: each worker whose own rules allow it (``PSFLOW_SHM`` on, a
writable ``/dev/shm``, every peer on loopback) creates its segment (mode
0600) holding a random token and sends its name and token over its
authenticated link; every other worker opens it with :mod:`psflow.transport.shm`'s
safe open (no symbolic link, this user's, closed to others) and checks the
token; a second round tells every worker whether all of them succeeded.  Each
name is unlinked as soon as that round is over (the mappings stay), so a
killed worker leaves nothing in ``/dev/shm``.  Otherwise every worker stays
on TCP, and says why in one log line.  Segments start small and grow (the
same exchange) when a call needs a larger slot, up to a cap.  Buffers under
128 kB take the TCP ring even then: its frames carry them in as many round
trips as the barriers take.

Example (a single worker has no peers: the path stays off and nothing is mapped):
    >>> SharedMemoryRing(None).active is None
    True
"""

from __future__ import annotations

import bisect
import logging
import secrets
import struct
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from psflow import errors
from psflow.transport import shm

__all__ = ["Packed", "SharedMemoryRing", "by_size"]

log = logging.getLogger(__name__)

# The slots' size: the smallest (what the agreement reserves before the first call), and
# the cap (a call larger than a slot goes in pieces).  Each worker's segment holds two.
# 4 MB pieces cost the same CPU per call as 16 MB ones (2 workers, 16 and 64 MB calls,
# alternated) and keep 4 workers' segments (32 MB) inside a container's default 64 MB.
_MIN_SLOT_BYTES = 1 << 20
_MAX_SLOT_BYTES = 4 << 20
# Buffers (or packs) under this size take the TCP ring: its 2(N-1) frames carry them in as
# many round trips as the two barriers take, with less Python (2 workers on loopback: CPU
# per call even at 64 kB, shared memory ahead from 256 kB).  The same on every worker.
_SMALL_BYTES = 128 << 10
# The slots start one page in: a header (magic, token, slot size), page-aligned copies.
_HEADER_BYTES = 4096
_MAGIC = b"psflowR1"
# A piece of the owner's sum: small enough that its N-1 additions and its copy out read
# it from a core's cache, large enough that it costs far more than the Python around it.
_TILE_BYTES = 512 << 10
# One agreement round's record: ok, slot bytes, token, segment name, why not (text).
_RECORD = struct.Struct("<B7xQ16s64s160s")
# One barrier frame: phase, the dtype's character, the piece's number and bytes.
_BARRIER = struct.Struct("<2s2sIQ")
_CLOSE_WAIT_SECONDS = 5.0


def _bounds(length: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges covering ``[0, length)``, sizes differing by at most one."""
    edges = [length * i // parts for i in range(parts + 1)]
    return list(zip(edges[:-1], edges[1:]))


def _slot_size(nbytes: int) -> int:
    """The slot a call of ``nbytes`` asks for: a power of two, between the floor and the cap."""
    size = _MIN_SLOT_BYTES
    while size < nbytes and size < _MAX_SLOT_BYTES:
        size *= 2
    return size


def _text(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode("utf-8", "replace")


def by_size(
    large: Callable[[Any, np.ndarray, int | None, float], None], fallback: Callable[..., None]
) -> Callable[..., None]:
    """What all-reduces one buffer of a call: ``large(src, dst, divisor, deadline)`` from
    :data:`_SMALL_BYTES` up, the TCP ring's ``fallback`` (which also takes the call's
    ``sending`` list) under it and for Python objects (they live in no byte buffer)."""

    def reduce(
        src: np.ndarray | Packed, dst: np.ndarray, divisor: int | None, dl: float, sending: list
    ) -> None:
        if src.nbytes < _SMALL_BYTES or src.dtype.hasobject:
            if isinstance(src, Packed):  # a call's last, short pack of several arrays
                src = src.concatenate()  # the sender holds it while it is sent
            fallback(src, dst, divisor, dl, sending)
        else:
            large(src, dst, divisor, dl)

    return reduce


class _Segments:
    """One agreed set of segments: this worker's (writable) and every other's (read-only)."""

    def __init__(self, segments: list[shm.Segment], slot_bytes: int) -> None:
        self.segments = segments
        self.slot_bytes = slot_bytes
        # slots[k][p]: worker k's slot p as bytes (read-only but this worker's own)
        self.slots = [
            [
                np.frombuffer(s.view(), np.uint8, slot_bytes, _HEADER_BYTES + p * slot_bytes)
                for p in (0, 1)
            ]
            for s in segments
        ]

    def close(self) -> None:
        self.slots = []
        for s in self.segments:
            s.close(unlink=s.owner)  # this worker's was unlinked already: a no-op then
        self.segments = []


class Packed:
    """Arrays of one dtype read as their concatenation, without copying them into one buffer.

    What :class:`~psflow.collective.cross_host.CrossHostRing` hands this path for a call of
    several arrays: each piece's stage copies its arrays' slices straight into the slot.
    Sliced as the one buffer would be (``packed[lo:hi]``, a step of one).

    Args:
        parts: one-dimensional contiguous arrays, all of one dtype (at least one).

    Example:
        >>> p = Packed([np.arange(3.0), np.arange(2.0)])[2:4]
        >>> [(start, view.tolist()) for start, view in p.views(0, p.size)]
        [(0, [2.0]), (1, [0.0])]
    """

    __slots__ = ("dtype", "itemsize", "nbytes", "parts", "size", "starts")

    def __init__(self, parts: list[np.ndarray]) -> None:
        self.dtype = parts[0].dtype
        self.itemsize = self.dtype.itemsize
        self.parts = [p for p in parts if p.size] or parts[:1]
        self.starts = [0]
        for p in self.parts:
            self.starts.append(self.starts[-1] + p.size)
        self.size = self.starts[-1]
        self.nbytes = self.size * self.itemsize

    def __getitem__(self, key: slice) -> Packed:
        lo, hi, _ = key.indices(self.size)
        views = [v for _, v in self.views(lo, hi)]
        return Packed(views or [self.parts[0][:0]])

    def views(self, lo: int, hi: int) -> list[tuple[int, np.ndarray]]:
        """The arrays' slices covering ``[lo, hi)``: (start in the concatenation, view)."""
        out = []
        starts = self.starts
        i = bisect.bisect_right(starts, lo) - 1
        while i < len(self.parts) and starts[i] < hi:
            s = starts[i]
            a, b = max(lo - s, 0), min(hi - s, self.parts[i].size)
            if b > a:
                out.append((s + a, self.parts[i][a:b]))
            i += 1
        return out

    def concatenate(self) -> np.ndarray:
        """The arrays copied into one new buffer."""
        out = np.empty(self.size, self.dtype)
        np.concatenate(self.parts, out=out)
        return out


class SharedMemoryRing:
    """The all-reduce of a :class:`~psflow.collective.cross_host.CrossHostRing` through
    shared memory, on when every worker of the ring is on this host.

    Used by the ring's ``all_reduce`` only, under its lock, inside its calls (heartbeats
    on, the call's deadline given).

    Also one host's part of :mod:`psflow.collective.shm_hier`'s all-reduce: ``members``
    then names the workers of this host (their segments are mapped, the others' are not),
    ``barrier_links`` their own ring, and a ``hook`` of :meth:`reduce` all-reduces each
    owner's chunk across the hosts between the sum and the gather.

    Args:
        links: the ring's connected links (None: a single worker, never on); the
            agreement's records go round them.
        members: the ranks (in ``links``) whose segments this one maps, in order
            (default: all); this worker must be one.
        barrier_links: the members' own ring, for the barriers (default: ``links``).
    """

    def __init__(
        self, links: Any, *, members: list[int] | None = None, barrier_links: Any = None
    ) -> None:
        self.links = links
        self.members = members if members is not None or links is None else list(range(links.size))
        self.barrier_links = barrier_links if barrier_links is not None else links
        #: None until the first all-reduce agreed; then whether the path is on
        self.active: bool | None = None
        #: why the path is off (None while on or not agreed yet)
        self.reason: str | None = None
        self._set: _Segments | None = None
        self._grows = True  # False once a larger segment could not be had: pieces instead
        self._pieces = 0  # pieces so far: their parity picks the slot
        self._made = 0  # segments this worker made (their names' suffix)
        self._lock = threading.Lock()  # a call against close()
        self._frame = bytearray(_BARRIER.size)
        self._record = bytearray(_RECORD.size)
        self._reduce: Callable[..., None] | None = None  # what reducer() hands out when on

    # -- agreement --------------------------------------------------------------------------
    def reducer(self, deadline: float, fallback: Callable[..., None]) -> Callable[..., None]:
        """What all-reduces one buffer in this call: this path's :meth:`reduce` when on,
        else ``fallback`` (the TCP ring's).  The first call agrees on the path.

        Raises:
            UnavailableError / DeadlineExceededError: a peer failed during the agreement.
        """
        if self.links is None:
            return fallback
        if self.active is None:
            self._agree(deadline)
        if not self.active:
            return fallback
        if self._reduce is None:
            self._reduce = by_size(self.reduce, fallback)
        return self._reduce

    def _local_reason(self) -> str | None:
        """Why this worker cannot take the path, by its own rules (None: it can)."""
        why = shm.sharing_unavailable_reason()
        if why is not None or len(self.members) < self.links.size:
            return why  # a host's group: its members' host keys said they share this host
        links = self.links
        for rank, address in enumerate(links.addresses):
            if not shm.is_local_address(address):
                return f"worker:{links.ids[rank]} at {address} is not on this host's loopback"
        return None

    def join(self, deadline: float) -> str | None:
        """Agrees on the path with every worker of ``links`` (each must call it); None when
        it is on (the members' segments mapped), else why it is off, on every worker."""
        made, why = self._exchange(_MIN_SLOT_BYTES, self._local_reason(), deadline)
        self.active = made is not None
        self._set = made
        self.reason = why
        return why

    def _agree(self, deadline: float) -> None:
        """Every worker decides the same: the path on (segments mapped) or off (one log line)."""
        why = self.join(deadline)
        n = self.links.size
        if why is None:
            log.debug("collective: the %d workers' all-reduces go through shared memory", n)
            return
        log.info(
            "collective: all-reduces between the %d workers stay on TCP, not shared memory: %s",
            n,
            why,
        )

    def _exchange(
        self, slot_bytes: int, why: str | None, deadline: float
    ) -> tuple[_Segments | None, str | None]:
        """Makes, shares and maps one segment per worker; the set, or None and why not.

        ``why``: why this worker cannot take part (it still takes part in both rounds).
        Two rounds of every worker's record around the ring: the segments' names and
        tokens (or why a worker has none), then whether each worker mapped every other
        one.  Every worker sees every record, so all decide the same.  Each worker's
        name is unlinked once the second round is over: every peer has mapped it.
        Only :attr:`members`' segments are opened (every worker's flag counts).
        """
        links = self.links
        r = links.rank
        place = {k: i for i, k in enumerate(self.members)}
        token = secrets.token_bytes(16)
        segments: list[shm.Segment | None] = [None] * len(self.members)
        own = place[r]
        try:
            if why is None:
                self._made += 1
                name = f"{shm.new_prefix()}-ring{r}-{self._made}"
                try:
                    mine = shm.Segment(
                        name, _HEADER_BYTES + 2 * slot_bytes, create=True, reserve=True
                    )
                except OSError as e:
                    why = f"no room for {2 * slot_bytes} bytes in {shm.SHM_DIR} ({e})"
                else:
                    segments[own] = mine
                    head = struct.pack("<8s16sQ", _MAGIC, token, slot_bytes)
                    mine.view()[: len(head)] = head
                    record = _RECORD.pack(1, slot_bytes, token, name.encode(), b"")
            if why is not None:
                record = _RECORD.pack(0, 0, b"", b"", why.encode()[:160])
            for k, raw in enumerate(self.all_gather(record, deadline)):
                ok, size, tok, seg_name, text = _RECORD.unpack(raw)
                if k == r or k not in place or why is not None:
                    continue
                if not ok:
                    why = f"off on worker:{links.ids[k]} ({_text(text)})"
                    continue
                try:
                    segments[place[k]] = self._open(_text(seg_name), tok, size, slot_bytes)
                except (OSError, errors.OpError) as e:
                    why = f"worker:{links.ids[k]}'s segment cannot be used here ({e})"
            flag = _RECORD.pack(why is None, 0, b"", b"", (why or "").encode()[:160])
            flags = [_RECORD.unpack(raw) for raw in self.all_gather(flag, deadline)]
        except BaseException:
            for seg in segments:
                if seg is not None:
                    seg.close(unlink=seg.owner)
            raise
        if segments[own] is not None:
            segments[own].unlink()  # every peer has mapped it (or given up): the mappings stay
        refused = [k for k, f in enumerate(flags) if not f[0]]
        if not refused:
            return _Segments(segments, slot_bytes), None  # type: ignore[arg-type]
        for seg in segments:
            if seg is not None:
                seg.close()
        if why is None:
            k = refused[0]
            why = f"not usable by worker:{links.ids[k]} ({_text(flags[k][4])})"
        return None, why

    def _open(self, name: str, token: bytes, size: int, slot_bytes: int) -> shm.Segment:
        """A peer's segment, read-only, if it is what that peer said it made."""
        seg = shm.Segment(name, 0, create=False, writable=False)
        header = bytes(seg.view()[:32]) if seg.size >= 32 else b""
        if (
            header[:8] != _MAGIC
            or header[8:24] != token
            or size != slot_bytes
            or seg.size < _HEADER_BYTES + 2 * slot_bytes
        ):
            seg.close()
            raise errors.PermissionDeniedError(
                f"shared-memory segment {name!r} does not hold the token its worker sent"
            )
        return seg

    def all_gather(self, record: bytes, deadline: float) -> list[bytes]:
        """Every worker's ``record`` (each of the same size), in rank order, through
        ``links`` (one round of ``N-1`` small frames; every worker must call it)."""
        links = self.links
        n, r = links.size, links.rank
        got: list[bytes] = [b""] * n
        got[r] = record
        sent = []
        inbox = self._record if len(record) == _RECORD.size else bytearray(len(record))
        for s in range(n - 1):  # pass every record once round the ring
            sent.append(links.send([got[(r - s) % n]], deadline))
            links.receive_into(memoryview(inbox), deadline)
            got[(r - s - 1) % n] = bytes(inbox)
        for done in sent:
            links.wait_sent(done, deadline)
        return got

    # -- the all-reduce -------------------------------------------------------------------
    def packs(self, nbytes: int, dtype: np.dtype, bytes_per_pack: int) -> bool:
        """Whether a call's ``nbytes`` of ``dtype`` in several arrays should come as a
        :class:`Packed` (each piece's arrays written straight into the slot) rather than
        packed into one buffer first: the path is on and its packs take it."""
        return (
            self.active is True
            and nbytes >= _SMALL_BYTES
            and not dtype.hasobject
            and (bytes_per_pack <= 0 or bytes_per_pack >= _SMALL_BYTES)
        )

    def reduce(
        self,
        src: np.ndarray | Packed,
        dst: np.ndarray,
        divisor: int | None,
        deadline: float,
        hook: Callable[[np.ndarray, np.ndarray], None] | None = None,
    ) -> None:
        """All-reduces ``src`` into ``dst`` (same size and dtype, not overlapping).

        A mean (``divisor``) of floats is divided once, by each chunk's owner; integers
        are summed only, as on the TCP ring.  ``hook(chunk, out)``, where given, runs on
        each owner's non-empty chunk once summed (in its slot, not yet in ``dst``): it
        must leave the chunk's final value in both (what the others gather is ``chunk``).

        Raises:
            UnavailableError / DeadlineExceededError: a peer failed (named).
            InternalError: the workers called different collectives.
            CancelledError: the ring was closed.
        """
        with self._lock:
            if self._set is None:
                self.links.check()
                raise errors.CancelledError("collective: the ring was closed")
            if self._grows and _slot_size(src.nbytes) > self._set.slot_bytes:
                self._grow(_slot_size(src.nbytes), deadline)
            scale = None
            if divisor is not None and divisor != 1 and src.dtype.kind not in "iu":
                scale = src.dtype.type(divisor)
            step = self._set.slot_bytes // src.itemsize
            if step >= src.size:  # one piece (mostly): no slicing
                self._piece(src, dst, scale, deadline, hook)
                return
            for lo in range(0, src.size, step):
                self._piece(src[lo : lo + step], dst[lo : lo + step], scale, deadline, hook)

    def _grow(self, slot_bytes: int, deadline: float) -> None:
        """Larger segments for every worker (every worker asks at the same call: the sizes
        are the same everywhere); where one cannot have them, all keep theirs, for good."""
        made, why = self._exchange(slot_bytes, None, deadline)
        if made is None:
            self._grows = False
            log.info(
                "collective: shared-memory all-reduces stay in pieces of %d bytes (%s)",
                self._set.slot_bytes if self._set is not None else 0,
                why,
            )
            return
        if self._set is not None:
            self._set.close()
        self._set = made

    def _piece(
        self,
        src: np.ndarray | Packed,
        dst: np.ndarray,
        scale: Any,
        deadline: float,
        hook: Callable[[np.ndarray, np.ndarray], None] | None = None,
    ) -> None:
        """One piece (of at most a slot): stage, barrier, sum, (hook,) barrier, gather."""
        n, r = len(self.members), self.members.index(self.links.rank)
        dtype, size = src.dtype, src.size
        slot = self._pieces & 1
        self._pieces += 1
        nbytes = src.nbytes
        slots = [per[slot][:nbytes].view(dtype) for per in self._set.slots]
        bounds = _bounds(size, n)
        lo, hi = bounds[r]
        mine = slots[r]
        # stage: this worker's part of every other worker's chunk (the chunks before and
        # after its own), straight from its arrays into its slot
        if isinstance(src, Packed):
            staged, owned = src.views(0, lo) + src.views(hi, size), src.views(lo, hi)
        else:  # one array (most calls): its slices, with no Packed's Python
            staged = [(0, src[:lo])] if lo else []
            if hi < size:
                staged.append((hi, src[hi:]))
            owned = [(lo, src[lo:hi])]
        for start, part in staged:
            np.copyto(mine[start : start + part.size], part)
        self._barrier(b"S1", dtype, nbytes, deadline)
        # sum chunk r in rank order, a cache-sized tile at a time (and never across one of
        # its arrays' ends): the tile's N-1 additions, division and copy out read it from
        # the cache.  This worker's own part is read from its arrays.
        tile = max(1, _TILE_BYTES // src.itemsize)
        others = slots[:r], slots[r + 1 :]
        for start, own in owned:
            for a in range(start, start + own.size, tile):
                b = min(a + tile, start + own.size)
                parts = [s[a:b] for s in others[0]]
                parts.append(own[a - start : b - start])
                parts.extend(s[a:b] for s in others[1])
                t = mine[a:b]
                np.add(parts[0], parts[1], out=t)
                for k in range(2, n):
                    np.add(t, parts[k], out=t)
                if scale is not None:
                    np.divide(t, scale, out=t)
                if hook is None:  # else the hook's result lands in both
                    np.copyto(dst[a:b], t)
        if hook is not None and hi > lo:
            hook(mine[lo:hi], dst[lo:hi])
        self._barrier(b"S2", dtype, nbytes, deadline)
        # gather: every other chunk's sum from its owner's slot
        for c, (clo, chi) in enumerate(bounds):
            if c != r and chi > clo:
                np.copyto(dst[clo:chi], slots[c][clo:chi])

    def _barrier(self, phase: bytes, dtype: np.dtype, nbytes: int, deadline: float) -> None:
        """Returns once every worker has reached this point of this piece (N-1 rounds).

        Raises:
            InternalError: the left neighbour is at another point (a different collective).
        """
        links = self.barrier_links
        mine = _BARRIER.pack(phase, dtype.char.encode(), self._pieces & 0xFFFFFFFF, nbytes)
        inbox = self._frame
        for _ in range(links.size - 1):
            done = links.send([mine], deadline)
            links.receive_into(memoryview(inbox), deadline)
            if inbox != mine:
                step, kind, piece, size = _BARRIER.unpack(bytes(inbox))
                links.fail(
                    errors.InternalError(
                        f"collective: {links.left_name} is at shared-memory all-reduce step "
                        f"{_text(step)!r} of piece {piece} ({size} bytes of {_text(kind)!r}), "
                        f"this worker at {_text(phase)!r} of piece {self._pieces} ({nbytes} "
                        f"bytes of {dtype.char!r}): the workers are running different "
                        "collectives",
                        task=f"worker:{links.left_id}",
                    )
                )
            if not done.is_set():
                links.wait_sent(done, deadline)

    def close(self) -> None:
        """Unmaps every segment (idempotent); a call still under way is waited for, briefly."""
        got = self._lock.acquire(timeout=_CLOSE_WAIT_SECONDS)
        try:
            if self._set is not None:
                self._set.close()
                self._set = None
        finally:
            if got:
                self._lock.release()

"""Collectives between worker processes: a ring over :class:`~.peer_link.PeerLinks`.

When every worker is on this host, an all-reduce of 128 kB or more goes through
shared memory instead (:mod:`psflow.collective.shm_ring`: a call's arrays are
written straight into the segments there); when several hosts have several
workers each, through shared memory inside each host and this ring's steps
across them (:mod:`psflow.collective.shm_hier`).  Otherwise:

All-reduce, for each dtype of a call (its arrays flattened into one buffer,
cut into packs of at most ``bytes_per_pack`` when that is set), on ``N``
workers, each pack split into ``N`` chunks:

* **reduce-scatter** (N-1 steps): at step ``s`` worker ``r`` sends chunk
  ``(r-s) % N`` to its right and adds the chunk ``(r-s-1) % N`` from its left
  into its own.  After the last step it holds the full sum of chunk
  ``(r+1) % N``; a mean is divided there, once.
* **all-gather** (N-1 steps): at step ``s`` it sends chunk ``(r+1-s) % N`` and
  receives chunk ``(r-s) % N`` straight into its buffer.

Each chunk is summed by one worker and then copied, so every worker ends with
the same bits; each sends ``2(N-1)/N`` of the buffer.  A step's chunk travels
in frames of at most 4 MiB, and every frame a step receives (and, in the
reduce-scatter, sums) is queued at once as a frame of the next step: the
steps overlap, frame by frame, instead of each waiting for the previous
one's whole chunk.  The bytes go from the arrays to the socket and from the
socket into the result buffer (``recv_into``; on a plain link a frame's head and
each payload piece come in one blocking receive each, on a TLS link only what
comes in with a small frame's header passes through the stream's staging
buffer); the result
buffers are reused once the caller has dropped the results.  A frame of
up to 2 MB starts from this thread without waiting (what the kernel does not
take at once, and every larger frame, goes from the links' sender thread
while this one receives), so two neighbours never wait on each other's full
socket buffers.  Inside a call each worker sends
heartbeats to its right: a worker blames its left neighbour when it stays
silent for ``timeout`` seconds, and otherwise (the neighbour is alive and
itself waiting) waits for the error that neighbour forwards, so every
survivor names the peer that died or froze.  No call outlasts ``2 * timeout``.

Example (one worker: the arrays themselves, copied):
    >>> import numpy as np
    >>> CrossHostRing(None).all_reduce([np.ones(2, np.float32)])[0]
    array([1., 1.], dtype=float32)
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from psflow import errors
from psflow.collective.buffers import BufferPool
from psflow.collective.options import DEFAULT_TIMEOUT_SECONDS
from psflow.collective.peer_link import PeerLinks
from psflow.collective.shm_hier import HostHierarchy
from psflow.collective.shm_ring import Packed, SharedMemoryRing

__all__ = ["CrossHostRing"]

# Pieces in which a reduce-scatter step's incoming chunk is summed as it arrives: small
# enough to be summed while still in a core's L2 cache, large enough that a piece costs
# far more than the Python call around it.  A multiple of every dtype's item size.
_SEGMENT_BYTES = 256 << 10
# The most payload one frame of a step carries.  A step's chunk goes in frames of this
# size, each forwarded by the next step as soon as it is summed (or has arrived), so the
# links never wait for a whole large chunk.  Each frame costs ~0.1-0.2 ms of CPU per
# worker (its Python, the hand-over to the sender thread): on 2 cores a 16 MB
# all-reduce took 1.3x the CPU with 1 MiB frames and the same as whole chunks with
# 4 MiB ones, which still keep 2-8 frames in flight per step from 16 MB up.
# A multiple of every dtype's item size.
_FRAME_BYTES = 4 << 20
# The most memory the reused packing and result buffers take (in use or free): room
# for the buffers of a few hundred MB of gradients; larger calls allocate as before.
_CACHE_BYTES = 256 << 20


def _frames(flat: np.ndarray) -> list[np.ndarray]:
    """``flat`` cut into the views sent one frame each (one empty view for an empty array)."""
    step = max(1, _FRAME_BYTES // max(1, flat.itemsize))
    if flat.size <= step:  # one frame (a call of up to a few MB): no slicing
        return [flat]
    return [flat[lo : lo + step] for lo in range(0, flat.size, step)] or [flat]


def _adder(into: np.ndarray, own: np.ndarray) -> Callable[[int, int], None]:
    """What sums ``own`` into the byte range ``[lo, hi)`` of ``into`` once it has arrived.

    Summed a cache-sized piece at a time, while the kernel receives on; a + b == b + a
    bit for bit, and each chunk is summed by one worker and then copied, so every
    worker ends with the same bits.
    """
    item = into.itemsize

    def add(lo: int, hi: int) -> None:
        part = into[lo // item : hi // item]
        np.add(part, own[lo // item : hi // item], out=part)

    return add


def _bounds(length: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges covering ``[0, length)``, sizes differing by at most one."""
    edges = [length * i // parts for i in range(parts + 1)]
    return list(zip(edges[:-1], edges[1:]))


class CrossHostRing:
    """The workers' collectives; one call at a time, called by every worker in the same order.

    Args:
        links: this worker's connected :class:`PeerLinks`, or None for a single worker.
        timeout: how long a neighbour may stay silent inside a call before it is
            blamed (every worker's error names the peer that failed).
    """

    def __init__(self, links: PeerLinks | None, timeout: float = DEFAULT_TIMEOUT_SECONDS) -> None:
        self.links = links
        self.size = 1 if links is None else links.size
        self.rank = 0 if links is None else links.rank
        self.timeout = timeout
        if links is not None:
            links.silence = timeout
            links.heartbeat = min(1.0, timeout / 4)
        self._lock = threading.Lock()
        # the results are views of these buffers: one comes back once the caller drops them
        self._pool = BufferPool(_CACHE_BYTES)
        #: all-reduces through shared memory when every worker is on this host (shm_ring.py)
        self.shm = SharedMemoryRing(links)
        #: through shared memory inside each host, TCP across them, where several hosts
        #: have several workers each (shm_hier.py); else :attr:`shm`'s rules
        self.hier = HostHierarchy(links, self.shm, timeout, CrossHostRing)

    @contextlib.contextmanager
    def _call(self) -> Iterator[float]:
        """One collective: its lock, heartbeats on, and its hard deadline."""
        with self._lock:
            if self.links is None:
                yield time.monotonic() + 2 * self.timeout
                return
            self.links.begin()
            try:
                yield time.monotonic() + 2 * self.timeout
            finally:
                self.links.end()

    # -- all-reduce ---------------------------------------------------------------------
    def all_reduce(
        self,
        arrays: Sequence[Any],
        *,
        divisor: int | None = None,
        bytes_per_pack: int = 0,
    ) -> list[np.ndarray]:
        """Sums each array over the workers (then divides by ``divisor``, if given).

        Args:
            arrays: this worker's NumPy arrays; the same shapes and dtypes on every worker.
            divisor: for a mean: the sum is divided by it (once, before it is copied).
            bytes_per_pack: cut each dtype's buffer into packs of at most this many bytes.

        Returns:
            New arrays, bitwise equal on every worker.

        Raises:
            UnavailableError / DeadlineExceededError: a peer died or stalled (named).
            InternalError: the workers called different collectives.
        """
        arrays = [np.asarray(a) for a in arrays]
        groups: dict[str, list[int]] = {}
        for i, a in enumerate(arrays):
            groups.setdefault(a.dtype.str, []).append(i)
        out: list[Any] = [None] * len(arrays)
        with self._call() as deadline:
            # frames still in the sender's queue: a pack's last ones leave while the next
            # pack starts; the call returns once none is left (they are views of the inputs)
            sending: list[threading.Event] = []
            reduce = self.hier.reducer(deadline, self._ring_reduce)  # or TCP's, per the agreement
            for dtype, members in groups.items():
                kind = np.dtype(dtype)
                src: Any
                if len(members) == 1:  # one array: read in place, no packing copy
                    src = np.ascontiguousarray(arrays[members[0]]).reshape(-1)
                    if src.dtype != kind:
                        src = src.astype(kind)
                else:
                    parts = [np.ascontiguousarray(arrays[i]).reshape(-1) for i in members]
                    total = sum(p.size for p in parts)
                    if self.hier.packs(total * kind.itemsize, kind, bytes_per_pack):
                        # through shared memory: each piece's arrays go straight into the
                        # slot, with no packing copy before it
                        src = Packed(parts)
                    else:
                        src = self._empty(total, kind)
                        np.concatenate(parts, out=src)
                if self.size > 1 and src.size:
                    flat = self._empty(src.size, kind)  # the sums land here; src is only read
                    step = src.size
                    if bytes_per_pack > 0:
                        step = max(1, bytes_per_pack // src.itemsize)
                    if step >= src.size:  # one pack (mostly): no slicing
                        reduce(src, flat, divisor, deadline, sending)
                    else:
                        for lo in range(0, src.size, step):
                            hi = lo + step
                            reduce(src[lo:hi], flat[lo:hi], divisor, deadline, sending)
                else:
                    flat = src.copy() if len(members) == 1 else src  # new arrays, always
                    if divisor is not None and divisor != 1:
                        flat = self._divide(flat, divisor)
                pos = 0
                for i in members:
                    size = arrays[i].size
                    out[i] = flat[pos : pos + size].reshape(arrays[i].shape)
                    pos += size
            if self.links is not None:
                for done in sending:
                    self.links.wait_sent(done, deadline)
        return out

    def _empty(self, size: int, dtype: np.dtype) -> np.ndarray:
        """An uninitialised buffer, reused from :attr:`_pool` once nothing else holds it.

        A fresh buffer of many megabytes is faulted in on its first touch, the
        kernel zeroing every page: about a tenth of a 64 MB all-reduce's CPU on
        2 cores went to clearing pages.
        """
        if dtype.hasobject:  # Python objects live in no byte buffer
            return np.empty(size, dtype)
        return self._pool.take(size * dtype.itemsize).view(dtype)

    @staticmethod
    def _divide(x: np.ndarray, divisor: int) -> np.ndarray:
        if x.dtype.kind in "iu":
            return x / divisor  # true division, as TF's mean of integers
        np.divide(x, x.dtype.type(divisor), out=x)
        return x

    def _ring_reduce(
        self,
        src: np.ndarray,
        dst: np.ndarray,
        divisor: int | None,
        deadline: float,
        sending: list[threading.Event],
    ) -> None:
        """All-reduces ``src`` into ``dst`` (same size, not overlapping).

        Returns once ``dst`` holds the result; the sends of this worker's last frames
        may still be under way: their events are added to ``sending``, and ``src``
        must stay unchanged until they are set.

        Step ``t`` of the ``2(N-1)`` steps forwards what step ``t-1`` received: each
        frame of it is queued for the right neighbour as soon as it is summed (or,
        in the all-gather, as soon as it is here), so the right link carries step
        ``t+1``'s first frame while step ``t``'s last ones still arrive.  A step never
        waits for its whole chunk, and the links stay busy across the steps.
        """
        links = self.links
        assert links is not None
        n, r = self.size, self.rank
        bounds = _bounds(src.size, n)
        scale = None
        if divisor is not None and divisor != 1 and src.dtype.kind not in "iu":
            scale = src.dtype.type(divisor)  # a mean: divided once, by the worker that sums
        if -(-src.size // n) * src.itemsize <= _FRAME_BYTES:  # every chunk one frame
            self._one_frame_steps(src, dst, bounds, scale, deadline, sending)
            return
        mine = [_frames(src[lo:hi]) for lo, hi in bounds]
        sums = [_frames(dst[lo:hi]) for lo, hi in bounds]
        last = 2 * n - 3
        # sent[t]: step t's frames in the sender's queue; step 0 sends this worker's chunk r
        sent = [[links.send([piece], deadline) for piece in mine[r]]]
        for t in range(2 * n - 2):
            reducing = t < n - 1
            # reduce-scatter step t receives chunk r-t-1 and adds this worker's part into
            # it; all-gather step s = t-(n-1) receives chunk r-s straight into place
            c = (r - t - 1) % n if reducing else (r - t + n - 1) % n
            if t >= n:  # all-gather step s >= 1 overwrites chunk r-s: reduce-scatter step s
                for done in sent[t - n + 1]:  # sent it, long ago; make sure it has left
                    links.wait_sent(done, deadline)
            forward = []
            for k, piece in enumerate(sums[c]):
                if reducing and piece.nbytes <= _SEGMENT_BYTES:  # one piece: summed once here
                    links.receive_into(memoryview(piece), deadline)
                    np.add(piece, mine[c][k], out=piece)
                    if t == n - 2 and scale is not None:
                        np.divide(piece, scale, out=piece)
                elif reducing:
                    add = _adder(piece, mine[c][k])
                    links.receive_into(memoryview(piece), deadline, add, _SEGMENT_BYTES)
                    if t == n - 2 and scale is not None:  # chunk r+1 is complete here
                        np.divide(piece, scale, out=piece)
                else:
                    links.receive_into(memoryview(piece), deadline)
                if t < last:  # step t+1 forwards it
                    forward.append(links.send([piece], deadline))
            sent.append(forward)
        for step in sent:
            for done in step:
                if not done.is_set():
                    sending.append(done)

    def _one_frame_steps(
        self,
        src: np.ndarray,
        dst: np.ndarray,
        bounds: list[tuple[int, int]],
        scale: Any,
        deadline: float,
        sending: list[threading.Event],
    ) -> None:
        """:meth:`_ring_reduce` where each chunk is one frame: the same steps and frames,
        with a step's frame handled inline (a 1 MB call of 4 workers has 6 such steps, and
        their Python was a third of its CPU)."""
        links = self.links
        assert links is not None
        n, r = self.size, self.rank
        send, receive = links.send, links.receive_into
        mine = [src[lo:hi] for lo, hi in bounds]
        sums = [dst[lo:hi] for lo, hi in bounds]
        last = 2 * n - 3
        sent = [send((mine[r],), deadline)]  # sent[t]: step t's frame; step 0 sends chunk r
        for t in range(last + 1):
            if t < n - 1:  # reduce-scatter: receive chunk r-t-1 and add this worker's part
                c = (r - t - 1) % n
                piece, own = sums[c], mine[c]
                if piece.nbytes <= _SEGMENT_BYTES:  # summed once, still in the cache
                    receive(memoryview(piece), deadline)
                    np.add(piece, own, out=piece)
                else:
                    receive(memoryview(piece), deadline, _adder(piece, own), _SEGMENT_BYTES)
                if t == n - 2 and scale is not None:  # chunk r+1 is complete here
                    np.divide(piece, scale, out=piece)
            else:  # all-gather step s = t-(n-1): receive chunk r-s straight into place
                if t >= n:  # it overwrites what reduce-scatter step s sent: that has left
                    done = sent[t - n + 1]
                    if not done.is_set():
                        links.wait_sent(done, deadline)
                piece = sums[(r - t + n - 1) % n]
                receive(memoryview(piece), deadline)
            if t < last:  # step t+1 forwards it
                sent.append(send((piece,), deadline))
        sending.extend(done for done in sent if not done.is_set())

    # -- all-gather and broadcast ----------------------------------------------------------
    def all_gather(
        self, array: Any, axis: int = 0, lengths: Sequence[int] | None = None
    ) -> np.ndarray:
        """Concatenates every worker's ``array`` along ``axis``, in worker order.

        The workers' arrays may differ in size along ``axis`` only.  ``lengths``
        (each worker's size along ``axis``, agreed beforehand) saves the
        all-reduce that learns them.

        Raises:
            InvalidArgumentError: ``axis`` is out of range, or ``lengths`` does not
                have one entry per worker or misstates this worker's size.
            UnavailableError / DeadlineExceededError: as :meth:`all_reduce`.
        """
        x = np.asarray(array)
        if x.ndim == 0 or not -x.ndim <= axis < x.ndim:
            raise errors.InvalidArgumentError(
                f"all_gather axis {axis} is out of range for a value of shape {x.shape}"
            )
        if self.size == 1:
            return x.copy()
        axis %= x.ndim
        if lengths is not None:
            lengths = np.asarray(lengths, np.int64)
            if lengths.shape != (self.size,) or lengths[self.rank] != x.shape[axis]:
                raise errors.InvalidArgumentError(
                    f"all_gather lengths {lengths.tolist()} must give {self.size} workers' "
                    f"sizes, this one's ({self.rank}) being {x.shape[axis]}"
                )
        else:
            lengths = np.zeros(self.size, np.int64)
            lengths[self.rank] = x.shape[axis]
            lengths = self.all_reduce([lengths])[0]
        moved = np.ascontiguousarray(np.moveaxis(x, axis, 0))
        rest = moved.shape[1:]
        blocks = [np.empty((int(k), *rest), x.dtype) for k in lengths]
        blocks[self.rank][...] = moved
        links = self.links
        assert links is not None
        n, r = self.size, self.rank
        with self._call() as deadline:
            for s in range(n - 1):  # pass every block once round the ring
                send_b, recv_b = (r - s) % n, (r - s - 1) % n
                sent = links.send([blocks[send_b]], deadline)
                links.receive_into(memoryview(blocks[recv_b]), deadline)
                links.wait_sent(sent, deadline)
        return np.moveaxis(np.concatenate(blocks, axis=0), 0, axis)

    def broadcast(self, arrays: Sequence[np.ndarray], root: int = 0) -> list[np.ndarray]:
        """Every worker gets ``root``'s ``arrays`` (the others pass arrays of the same shapes).

        Returns:
            ``root``'s arrays (its own, unchanged, on ``root``; new arrays elsewhere).
        """
        if self.size == 1:
            return list(arrays)
        links = self.links
        assert links is not None
        n, r = self.size, self.rank
        last = (root - 1) % n  # the worker whose right neighbour is the root: it only receives
        out = [a if r == root else np.empty(np.shape(a), np.asarray(a).dtype) for a in arrays]
        with self._call() as deadline:
            sent = []
            for a in out:
                # frame by frame: each is forwarded while the next one arrives, so the
                # root's bytes reach the last worker about one frame after the first
                for piece in _frames(np.ascontiguousarray(a).reshape(-1)):
                    if r != root:
                        links.receive_into(memoryview(piece), deadline)
                    if r != last:
                        sent.append(links.send([piece], deadline))
            for done in sent:
                links.wait_sent(done, deadline)
        return out

    def close(self) -> None:
        """Closes the links (the ring cannot be used afterwards)."""
        if self.links is not None:
            self.links.close()
        self.hier.close()
        self.shm.close()  # after the links: a call still under way fails first
        self._pool.clear()  # results still held stay valid; free buffers are released

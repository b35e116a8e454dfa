"""NCCL across worker processes: one communicator per GPU, every GPU of every worker a rank.

:func:`connect` builds the group once the workers' TCP ring is up:

1. the workers agree, in one all-gather over the ring, whether every one of
   them can take part (CuPy with NCCL, only GPUs, one replica per GPU, the
   same number of GPUs each).  With ``implementation=NCCL`` a worker that
   cannot gives every worker a ``FailedPreconditionError`` naming it and what
   it lacks; with ``AUTO`` the group keeps the TCP ring (one log line).
2. worker 0 makes the NCCL unique id (``nccl.get_unique_id()``) and it reaches
   the others in a ring broadcast: over the links every worker already shares,
   authenticated by the cluster's token (or TLS) like every psflow port, so no
   new port and no unauthenticated path carries it.
3. each worker creates its ``L`` communicators at once (one thread per GPU,
   since each creation waits for every rank): ``NcclCommunicator(W * L, id,
   worker * L + device)``.

Every collective has a deadline.  NCCL's calls return at once and the GPU
waits for the peers, for good if one is gone; so after enqueueing a
collective a replica records an event on its stream and polls it (``done``)
until the deadline, looking meanwhile (without reading) for a ring neighbour
whose connection closed.  When either happens the worker aborts its
communicators (``comm.abort()`` ends the pending work) and names the failure
with one small all-reduce over the TCP ring, the ring's own machinery: a
dead peer is named on every survivor as the ring names it, and a group where
every worker answers (a GPU that stalled) gets a ``DeadlineExceededError``
naming the NCCL group.  No call outlasts twice the timeout; a neighbour that
died is seen at once.  Aborted communicators stay aborted: later calls raise
the same error (continuing without the peer is elastic training's business).

CPU (NumPy) arrays never go through NCCL: callers keep the TCP ring for them.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from psflow import backend, errors
from psflow.collective.arrays import is_cupy_array
from psflow.collective.cross_host import CrossHostRing
from psflow.collective.nccl import import_nccl, nccl_dtype
from psflow.collective.options import CommunicationImplementation, CommunicationOptions
from psflow.collective.peer_link import peer_name

__all__ = ["NcclGroup", "connect"]

logger = logging.getLogger(__name__)

_READY, _NO_NCCL, _NOT_GPU, _SHARED_GPU, _ELASTIC = range(5)
_WHY = {
    _NO_NCCL: "has no CuPy with NCCL",
    _NOT_GPU: "has CPU replicas (NCCL reduces GPU memory only)",
    _SHARED_GPU: "has two replicas on one GPU (NCCL takes one rank per GPU)",
    _ELASTIC: "is elastic (its ring re-forms; NCCL communicators do not)",
}
_WATCH_SECONDS = 0.05  # how often a wait looks for a neighbour that hung up
_MAX_PAUSE = 0.002  # the longest sleep between two polls of a collective's event


def _local_status(devices: Sequence[Any]) -> tuple[int, str]:
    """Whether this worker can join an NCCL group, and why not."""
    try:
        import_nccl()
    except errors.FailedPreconditionError as e:
        return _NO_NCCL, f"{_WHY[_NO_NCCL]} ({e.message})"
    if not all(d.is_gpu for d in devices):
        return _NOT_GPU, _WHY[_NOT_GPU]
    physical = [backend.physical_gpu(d.index) for d in devices]
    if len(set(physical)) != len(physical):
        return _SHARED_GPU, f"{_WHY[_SHARED_GPU]}: GPUs {physical}"
    return _READY, ""


def connect(
    ring: CrossHostRing,
    devices: Sequence[Any],
    options: CommunicationOptions,
    addresses: Sequence[str],
    *,
    elastic: bool = False,
) -> NcclGroup | None:
    """The NCCL group of these workers, or None where the TCP ring stays.

    Every worker must call it at the same point (it runs collectives on ``ring``).

    Raises:
        FailedPreconditionError: ``implementation=NCCL`` and some worker cannot
            take part (each worker's error names that worker and what it lacks).
        UnimplementedError: ``implementation=NCCL`` in an elastic group.
        DeadlineExceededError / UnavailableError: a worker did not take part in time.
    """
    impl = options.implementation
    if impl is CommunicationImplementation.RING or ring.size == 1:
        return None
    if elastic:  # every worker of an elastic group is elastic: no round needed to agree
        if impl is CommunicationImplementation.NCCL:
            raise errors.UnimplementedError(
                f"CommunicationOptions(implementation=NCCL): this worker {_WHY[_ELASTIC]}"
            )
        return None
    status, why = _local_status(devices)
    mine = np.asarray([[status, len(devices)]], np.int64)
    rows = ring.all_gather(mine, axis=0)
    counts = {int(k) for k in rows[:, 1]}
    problem = None
    for w, (code, _) in enumerate(rows):
        if code != _READY:
            text = why if w == ring.rank else _WHY[int(code)]
            problem = f"{peer_name(w, addresses[w])} {text}"
            break
    if problem is None and len(counts) > 1:
        problem = f"the workers have different numbers of GPUs ({rows[:, 1].tolist()})"
    if problem is not None:
        if impl is CommunicationImplementation.NCCL:
            raise errors.FailedPreconditionError(
                f"CommunicationOptions(implementation=NCCL): {problem}"
            )
        # a cluster without any GPU needs no word; a GPU worker that will not use NCCL does
        some_gpu = any(int(code) != _NOT_GPU for code, _ in rows)
        logger.log(
            logging.INFO if some_gpu else logging.DEBUG,
            "cross-host collectives: the TCP ring, not NCCL (%s)",
            problem,
        )
        return None
    cupy, nccl = import_nccl()
    uid = np.zeros(128, np.int64)
    if ring.rank == 0:
        uid[:] = np.asarray(nccl.get_unique_id(), np.int64)
    (uid,) = ring.broadcast([uid], root=0)  # the ring's authenticated links, nothing else
    return NcclGroup(
        cupy,
        nccl,
        tuple(int(v) for v in uid),
        [backend.physical_gpu(d.index) for d in devices],
        ring,
        addresses,
        options.timeout,
    )


class NcclGroup:
    """This worker's NCCL communicators (one per local GPU) and the collectives on them.

    Args:
        cupy, nccl: the modules (``import_nccl()``).
        uid: the unique id worker 0 made.
        gpus: this worker's CUDA device of each local replica.
        ring: the workers' TCP ring (it names a failed peer; host arrays use it).
        addresses: every worker's ``host:port`` (errors name them).
        timeout: seconds a collective may take.

    Raises:
        DeadlineExceededError: not every rank joined within ``timeout``.
        UnavailableError: NCCL refused to create a communicator (its error quoted).
    """

    def __init__(
        self,
        cupy: Any,
        nccl: Any,
        uid: tuple[int, ...],
        gpus: list[int],
        ring: CrossHostRing,
        addresses: Sequence[str],
        timeout: float,
    ) -> None:
        self.cupy, self.nccl = cupy, nccl
        self.gpus = list(gpus)
        self.ring = ring
        self.timeout = timeout
        self.num_local = len(gpus)
        self.num_ranks = ring.size * self.num_local
        first = f"{peer_name(0, addresses[0])}"
        last = f"{peer_name(ring.size - 1, addresses[-1])}"
        self.name = f"the NCCL group of {ring.size} workers ({first} .. {last})"
        self._error: errors.OpError | None = None
        self._fail_lock = threading.Lock()
        self.comms = self._create(uid)

    def _create(self, uid: tuple[int, ...]) -> list[Any]:
        """One communicator per local GPU, created together (each waits for all ranks)."""
        comms: list[Any] = [None] * self.num_local
        failures: list[BaseException] = []
        base = self.ring.rank * self.num_local

        def create(q: int) -> None:
            try:
                with self.cupy.cuda.Device(self.gpus[q]):
                    comms[q] = self.nccl.NcclCommunicator(self.num_ranks, uid, base + q)
            except Exception as e:  # NcclError, CUDA errors: reported below
                failures.append(e)

        threads = [
            threading.Thread(target=create, args=(q,), name=f"psflow-nccl-init-{q}", daemon=True)
            for q in range(self.num_local)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + self.timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if failures:
            self._abort([c for c in comms if c is not None])
            e = failures[0]
            raise errors.UnavailableError(
                f"{self.name}: creating this worker's communicators failed: {type(e).__name__}: {e}"
            )
        if any(t.is_alive() for t in threads):  # a rank never joined: the threads stay blocked
            raise errors.DeadlineExceededError(
                f"{self.name}: not every rank joined within {self.timeout:.1f} s"
            )
        return comms

    # -- waiting with a deadline -----------------------------------------------------------
    def _record(self) -> Any:
        """An event after what this thread's current stream has queued."""
        event = self.cupy.cuda.Event(disable_timing=True)
        event.record(self.cupy.cuda.get_current_stream())
        return event

    def wait(self, events: list[Any], what: str, deadline: float) -> None:
        """Polls ``events`` until done; past ``deadline``, or when a ring neighbour hung up,
        aborts the communicators and raises the failure (named).

        Raises:
            UnavailableError / DeadlineExceededError: a peer died or stalled (named), or
                the group made no progress in time (named).
            CancelledError: a local replica failed meanwhile (:meth:`close`).
        """
        pause = 20e-6
        watch = time.monotonic() + _WATCH_SECONDS
        links = self.ring.links
        while not all(e.done for e in events):
            if self._error is not None:
                break
            now = time.monotonic()
            if now >= deadline:
                self._fail(what, f"made no progress in {self.timeout:.1f} s")
                break
            if links is not None and now >= watch:
                watch = now + _WATCH_SECONDS
                gone = links.hung_up()
                if gone is not None:
                    self._fail(what, f"{gone} closed its connection")
                    break
            time.sleep(pause)
            pause = min(2 * pause, _MAX_PAUSE)
        self.check()

    def check(self) -> None:
        """Raises the error that aborted the communicators, if they were."""
        e = self._error
        if e is not None:
            raise type(e)(e.message, e.task)

    def _fail(self, what: str, reason: str) -> None:
        """Aborts the communicators once; the ring names the peer that failed."""
        with self._fail_lock:
            if self._error is not None:
                return
            self._abort(self.comms)
            try:  # every survivor comes here: a dead peer is named as the ring names it
                self.ring.all_reduce([np.zeros(1, np.int32)])
            except errors.OpError as e:
                self._error = type(e)(f"NCCL {what} across {self.name}: {e.message}", e.task)
                return
            self._error = errors.DeadlineExceededError(
                f"NCCL {what} across {self.name} {reason}; every worker still answers on "
                "the ring (a GPU stalled?); the communicators were aborted"
            )

    def _abort(self, comms: list[Any]) -> None:
        for comm in comms:
            try:
                comm.abort()
            except Exception as e:  # aborting is best effort; the error raised says why
                logger.debug("NCCL abort: %s", e)

    def close(self) -> None:
        """Aborts the communicators (a local replica failed, or the strategy is gone):
        replicas waiting in a collective get ``CancelledError``."""
        with self._fail_lock:
            if self._error is None:
                self._error = errors.CancelledError(
                    f"{self.name}: the communicators were closed (a replica failed)"
                )
                self._abort(self.comms)

    # -- collectives (each called by the replica thread of local GPU q) --------------------
    def all_reduce(
        self, q: int, arrays: Sequence[Any], mean: bool, present: Sequence[bool] | None = None
    ) -> list[Any]:
        """Sums replica ``q``'s CuPy arrays over every GPU of every worker (a mean: / ranks).

        Returns:
            New arrays, equal on every rank; ``None`` where no rank had the array
            (with ``present``).
        """
        self.check()
        cp, nccl = self.cupy, self.nccl
        comm = self.comms[q]
        deadline = time.monotonic() + self.timeout
        groups: dict[str, list[int]] = {}
        for i, a in enumerate(arrays):
            groups.setdefault(a.dtype.str, []).append(i)
        out: list[Any] = [None] * len(arrays)
        with cp.cuda.Device(self.gpus[q]):
            stream = cp.cuda.get_current_stream()
            plan = []
            for members in groups.values():
                kind = arrays[members[0]].dtype
                name, per = nccl_dtype(kind)
                if len(members) == 1:
                    src = cp.ascontiguousarray(arrays[members[0]]).reshape(-1)
                else:
                    src = cp.concatenate([arrays[i].reshape(-1) for i in members])
                dst = cp.empty_like(src)
                plan.append((members, src, dst))  # src too: NCCL reads it until the event
                if src.size:
                    comm.allReduce(
                        src.data.ptr,
                        dst.data.ptr,
                        src.size * per,
                        getattr(nccl, name),
                        nccl.NCCL_SUM,
                        stream.ptr,
                    )
            flags = None
            if present is not None:
                mine = cp.asarray(np.asarray(present, np.int32))
                flags = cp.empty_like(mine)
                comm.allReduce(
                    mine.data.ptr, flags.data.ptr, mine.size, nccl.NCCL_INT32, nccl.NCCL_SUM,
                    stream.ptr,
                )  # fmt: skip
            self.wait([self._record()], "all-reduce", deadline)
            for members, _, dst in plan:
                if mean:  # a true division, once (integers give floats, as TF's mean)
                    dst = dst / dst.dtype.type(self.num_ranks)
                pos = 0
                for i in members:
                    size = math.prod(arrays[i].shape)
                    out[i] = dst[pos : pos + size].reshape(arrays[i].shape)
                    pos += size
            if flags is not None:
                had = flags.get()
                out = [o if f > 0 else None for o, f in zip(out, had)]
        return out

    def all_gather(self, q: int, array: Any, axis: int = 0) -> Any:
        """Replica ``q``'s part of an all-gather along ``axis``, in global rank order.

        The ranks' sizes along ``axis`` may differ: they are gathered first, and
        every rank's block padded to the largest.

        Raises:
            InvalidArgumentError: ``axis`` out of range for the array.
        """
        self.check()
        cp, nccl = self.cupy, self.nccl
        comm = self.comms[q]
        x = array
        if x.ndim == 0 or not -x.ndim <= axis < x.ndim:
            raise errors.InvalidArgumentError(
                f"all_gather axis {axis} is out of range for a value of shape {x.shape}"
            )
        axis %= x.ndim
        n = self.num_ranks
        deadline = time.monotonic() + self.timeout
        with cp.cuda.Device(self.gpus[q]):
            stream = cp.cuda.get_current_stream()
            moved = cp.ascontiguousarray(cp.moveaxis(x, axis, 0))
            rest = moved.shape[1:]
            mine = cp.asarray(np.asarray([moved.shape[0]], np.int64))
            sizes = cp.empty(n, np.int64)
            comm.allGather(mine.data.ptr, sizes.data.ptr, 1, nccl.NCCL_INT64, stream.ptr)
            self.wait([self._record()], "all-gather", deadline)
            lengths = [int(k) for k in sizes.get()]
            top = max(lengths)
            padded = cp.zeros((top, *rest), moved.dtype)
            padded[: moved.shape[0]] = moved
            gathered = cp.empty((n * top, *rest), moved.dtype)
            if padded.nbytes:  # bytes are bytes: any dtype travels as uint8
                comm.allGather(
                    padded.data.ptr, gathered.data.ptr, padded.nbytes, nccl.NCCL_UINT8, stream.ptr
                )
                self.wait([self._record()], "all-gather", deadline)
            blocks = [gathered[r * top : r * top + k] for r, k in enumerate(lengths)]
            return cp.moveaxis(cp.concatenate(blocks, axis=0), 0, axis)

    def broadcast(self, copies: Sequence[Any]) -> None:
        """Overwrites every local copy (one per GPU, contiguous) with global rank 0's, in place.

        Called by one thread for all local GPUs: NCCL's group calls issue them together.
        """
        self.check()
        cp, nccl = self.cupy, self.nccl
        deadline = time.monotonic() + self.timeout
        streams = []
        nccl.groupStart()
        try:
            for q, c in enumerate(copies):
                with cp.cuda.Device(self.gpus[q]):
                    stream = cp.cuda.get_current_stream()
                    streams.append(stream)
                    ptr = c.data.ptr
                    self.comms[q].broadcast(ptr, ptr, c.nbytes, nccl.NCCL_UINT8, 0, stream.ptr)
        finally:
            nccl.groupEnd()
        events = []
        for q, stream in enumerate(streams):  # after groupEnd: the calls are on the streams now
            with cp.cuda.Device(self.gpus[q]):
                event = cp.cuda.Event(disable_timing=True)
                event.record(stream)
                events.append(event)
        self.wait(events, "broadcast", deadline)

    def destroy(self) -> None:
        """Frees the communicators (the group cannot be used afterwards)."""
        with self._fail_lock:
            if self._error is None:
                self._error = errors.CancelledError(f"{self.name} was destroyed")
                for comm in self.comms:
                    try:
                        comm.destroy()
                    except Exception as e:  # freeing is best effort at teardown
                        logger.debug("NCCL destroy: %s", e)


def all_device_arrays(arrays: Sequence[Any]) -> bool:
    """Whether every array is a CuPy array (those go through NCCL; the rest through the ring)."""
    return bool(arrays) and all(is_cupy_array(a) for a in arrays)

"""Collective calls from replica threads: rendezvous, then each thread does its share.

Each of N replica threads calls, say, ``comm.all_reduce(rank, grads)``.  The
calls meet (a barrier bounded by the timeout); the last to arrive validates all
N calls together and prepares the job; then every thread runs its own rank's
program (see :mod:`.job`) and returns its own result.

Calls are matched by sequence number: the k-th call of every rank forms the
k-th collective.  A collective that fails (a rank did not arrive in time,
replicas passed inconsistent arrays, ranks called different collectives, a rank
failed during the work) fails on every rank, including a rank that arrives
late for it, which gets the same error at once.  The communicator itself stays
usable: the next call of every rank forms the next collective.

Example:
    >>> import threading
    >>> import numpy as np
    >>> from psflow.collective import Communicator
    >>> comm = Communicator(2)
    >>> results = [None, None]
    >>> def replica(rank):
    ...     results[rank] = comm.all_reduce(rank, [np.full(3, rank + 1.0)])
    >>> threads = [threading.Thread(target=replica, args=(r,)) for r in range(2)]
    >>> for t in threads: t.start()
    >>> for t in threads: t.join()
    >>> results[0][0]
    array([3., 3., 3.])
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from psflow import errors
from psflow.collective import absent
from psflow.collective import arrays as arr
from psflow.collective.api import CrossDeviceOps
from psflow.collective.executor import drive
from psflow.collective.job import Job
from psflow.collective.options import CommunicationOptions
from psflow.collective.reduce_op import ReduceOp
from psflow.collective.session import Session, TrafficCounter

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Collective:
    """The k-th collective: who arrived with what, and what became of it."""

    kind: str
    payloads: dict[int, Any] = dataclasses.field(default_factory=dict)
    job: Job | None = None
    session: Session | None = None
    error: errors.OpError | None = None
    left: int = 0  # ranks that have finished with it
    ready: bool = False  # the others may proceed (a small job: its work is done too)
    drive_error: BaseException | None = None  # the leader's own error doing a small job


class Communicator:
    """N replicas' meeting point for collective calls.

    Args:
        num_replicas: N, the number of replica threads that take part.
        ops: the cross-device ops that do the work: an instance, a registered
            name (``"ring"``, ``"reduce_to_one"``, ``"nccl"``), or None for the ring.
        options: ``timeout_seconds`` bounds the wait for the other replicas and
            for their progress; ``bytes_per_pack`` packs all-reduces.

    Attributes:
        traffic: bytes each rank sent in this communicator's collectives.
    """

    def __init__(
        self,
        num_replicas: int,
        ops: CrossDeviceOps | str | None = None,
        options: CommunicationOptions | None = None,
    ) -> None:
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
            raise errors.InvalidArgumentError(
                f"num_replicas must be an int >= 1, got {num_replicas!r}"
            )
        if options is not None and not isinstance(options, CommunicationOptions):
            raise errors.InvalidArgumentError(
                f"options must be a CommunicationOptions, got {options!r}"
            )
        if ops is None or isinstance(ops, str):
            from psflow.collective.registry import create_cross_device_ops

            ops = create_cross_device_ops(ops or "ring")
        if not isinstance(ops, CrossDeviceOps):
            raise errors.InvalidArgumentError(f"ops must be a CrossDeviceOps, got {ops!r}")
        self.num_replicas = num_replicas
        self.ops = ops
        self.options = ops.options.merge(options)
        self.traffic = TrafficCounter()
        self._cond = threading.Condition(threading.Lock())
        self._calls = [0] * num_replicas
        self._collectives: dict[int, _Collective] = {}
        self._closed = False

    @property
    def timeout(self) -> float:
        """Seconds a replica waits for the others."""
        return self.options.timeout

    # -- the collectives -------------------------------------------------------------------
    def all_reduce(
        self,
        rank: int,
        arrays: Sequence[Any],
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        out: Sequence[Any] | None = None,
        present: Sequence[bool] | None = None,
    ) -> list[Any]:
        """Reduces this replica's ``arrays`` with the other replicas' (called by all N).

        Args:
            rank: this replica's index, 0 <= rank < N.
            arrays: this replica's arrays; the same shapes and dtypes on every rank.
            op: ``SUM`` or ``MEAN``; every rank must pass the same.
            out: optional arrays to write the result into (``arrays`` for in place).
            present: ``present[i] = False`` says this rank has nothing for array ``i``
                (it passes zeros there); see :mod:`.absent`.

        Returns:
            This replica's copy of the reduced arrays (bitwise equal on every rank),
            ``None`` for an array no rank had (with ``present``).

        Raises:
            DeadlineExceededError: some rank did not arrive (or progress) within
                the timeout; the message names the missing rank(s).
            InvalidArgumentError: inconsistent arrays or ops across ranks.
        """
        try:  # a bad argument fails the collective on every rank, not only here
            payload: Any = (
                arr.check_sequence(arrays, f"arrays of rank {rank}"),
                ReduceOp.parse(op),
                out,
                absent.check_present(present, len(arrays), f"all_reduce of rank {rank}"),
            )
        except errors.OpError as exc:
            payload = exc

        def build(payloads: list[Any]) -> Job:
            ops = {p[1] for p in payloads}
            if len(ops) > 1:
                raise errors.InvalidArgumentError(
                    f"ranks disagree on the reduce op: {[p[1].name for p in payloads]}"
                )
            outs = [p[2] for p in payloads]
            if any(o is None for o in outs) and any(o is not None for o in outs):
                raise errors.InvalidArgumentError(
                    f"ranks {[r for r, o in enumerate(outs) if o is not None]} passed out= "
                    "but the others did not"
                )
            out_rows = None if outs[0] is None else outs
            rows = [p[0] for p in payloads]
            flags = [p[3] for p in payloads]
            if all(f is None for f in flags) or len({len(r) for r in rows}) > 1:
                return self.ops.build_all_reduce(rows, payloads[0][1], out_rows, self.options)
            kept = absent.agreed(flags, len(rows[0]))
            if out_rows is not None:
                out_rows = [[o[i] for i in kept] for o in out_rows]
            inner = self.ops.build_all_reduce(
                [[r[i] for i in kept] for r in rows], payloads[0][1], out_rows, self.options
            )
            return absent.SubsetJob(inner, kept, len(rows[0]))

        return self._collective(rank, "all_reduce", payload, build)

    def reduce_and_update(
        self,
        rank: int,
        arrays: Sequence[Any],
        update: Callable[[int, int, int, Any], None],
        present: Sequence[bool] | None = None,
    ) -> list[bool]:
        """Sums the replicas' ``arrays`` and hands each summed range to an update (called by all N).

        The flattened arrays are split into one contiguous range per rank; this
        rank sums its range over every replica and calls its own
        ``update(index, lo, hi, summed)`` for each piece, which must apply
        ``summed`` (elements ``lo:hi`` of array ``index``, flattened) to every
        replica's state.  Returns once every rank is done.  See
        :mod:`psflow.collective.reduce_update`.  With ``present`` (as for
        :meth:`all_reduce`) an array no rank has is neither summed nor updated.

        Returns:
            For each array, whether it was summed and updated.

        Raises:
            DeadlineExceededError: some rank did not arrive within the timeout.
            InvalidArgumentError: inconsistent arrays across ranks, or not NumPy arrays.
        """
        from psflow.collective.reduce_update import ReduceUpdateJob

        try:
            payload: Any = (
                arr.check_sequence(arrays, f"arrays of rank {rank}"),
                update,
                absent.check_present(present, len(arrays), f"reduce_and_update of rank {rank}"),
            )
        except errors.OpError as exc:
            payload = exc

        def build(payloads: list[Any]) -> Job:
            rows = [list(p[0]) for p in payloads]
            if len({len(r) for r in rows}) > 1:  # the job names the mismatch
                return ReduceUpdateJob(rows, [p[1] for p in payloads])
            kept = absent.agreed([p[2] for p in payloads], len(rows[0]))
            updates = [functools.partial(_update_at, kept, p[1]) for p in payloads]
            inner = ReduceUpdateJob([[r[i] for i in kept] for r in rows], updates)
            return absent.SubsetJob(inner, kept, len(rows[0]))

        done = self._collective(rank, "reduce_and_update", payload, build)
        return [d is not None for d in done]

    def all_gather(self, rank: int, array: Any, axis: int = 0) -> Any:
        """Concatenates every replica's ``array`` along ``axis`` (called by all N).

        Returns:
            A new array, the same on every rank.

        Raises:
            DeadlineExceededError: some rank did not arrive within the timeout.
            InvalidArgumentError: dtypes or shapes (off ``axis``) differ, bad axis.
        """
        from psflow.collective.copies import AllGatherJob

        def build(payloads: list[Any]) -> Job:
            axes = {p[1] for p in payloads}
            if len(axes) > 1:
                raise errors.InvalidArgumentError(
                    f"ranks disagree on the axis: {[p[1] for p in payloads]}"
                )
            return AllGatherJob.create([p[0] for p in payloads], payloads[0][1])

        return self._collective(rank, "all_gather", (array, axis), build)

    def broadcast(self, rank: int, arrays: Sequence[Any] | None, source_rank: int = 0) -> list[Any]:
        """Copies ``source_rank``'s arrays to every replica (called by all N).

        Args:
            rank: this replica's index.
            arrays: the arrays to send on the source; ignored (may be None) elsewhere.
            source_rank: the rank whose arrays are sent; every rank passes the same.

        Returns:
            New copies on this replica (also on the source: never its own arrays).
            For CuPy arrays, each rank's copies go to the thread's current GPU.
        """
        from psflow.collective.copies import BroadcastJob

        cupy = sys.modules.get("cupy")
        device = int(cupy.cuda.runtime.getDevice()) if cupy is not None else 0
        payload = (arrays, source_rank, device)

        def build(payloads: list[Any]) -> Job:
            sources = {p[1] for p in payloads}
            if len(sources) > 1:
                raise errors.InvalidArgumentError(
                    f"ranks disagree on the source rank: {[p[1] for p in payloads]}"
                )
            src = arr.check_rank(payloads[0][1], self.num_replicas)
            values = payloads[src][0]
            if values is None:
                raise errors.InvalidArgumentError(f"source rank {src} passed no arrays")
            vals = [
                arr.as_array(v, f"arrays[{i}]")
                for i, v in enumerate(arr.check_sequence(values, f"arrays of source rank {src}"))
            ]
            gpu = bool(vals) and arr.is_cupy_array(vals[0])
            devices = [("GPU", p[2]) if gpu else ("CPU", 0) for p in payloads]
            return BroadcastJob.for_devices(vals, devices, src)

        return self._collective(rank, "broadcast", payload, build)

    # -- the machinery -----------------------------------------------------------------------
    def _collective(
        self, rank: int, kind: str, payload: Any, build: Callable[[list[Any]], Job]
    ) -> Any:
        rank = arr.check_rank(rank, self.num_replicas)
        coll, seq, leader = self._rendezvous(rank, kind, payload, build)
        job, session = coll.job, coll.session
        assert job is not None and session is not None  # set together by _rendezvous
        try:
            # On failure, drive fails the session, which wakes and fails every rank.
            if self._shares_work(job):
                drive(job, session, [rank])  # each replica thread does its own share
            else:
                # Small: the last rank to arrive did every rank's share inside the
                # rendezvous (see there); it raises its own error, the others the session's.
                if leader and coll.drive_error is not None:
                    raise coll.drive_error
                job.finish(session, rank)
            return job.result(rank)
        finally:
            self._leave(seq, coll, session)

    def _rendezvous(
        self, rank: int, kind: str, payload: Any, build: Callable[[list[Any]], Job]
    ) -> tuple[_Collective, int, bool]:
        """Registers this rank's call; returns the collective, its number, and whether
        this rank was the last to arrive (the one that prepared the job)."""
        n = self.num_replicas
        arrived = time.monotonic()
        with self._cond:
            if self._closed:
                raise errors.FailedPreconditionError("the communicator is closed")
            seq = self._calls[rank]
            self._calls[rank] += 1
            coll = self._collectives.get(seq)
            if coll is None:
                coll = self._collectives[seq] = _Collective(kind)
            coll.payloads[rank] = payload
            if coll.error is None and isinstance(payload, errors.OpError):
                coll.error = type(payload)(
                    f"{kind} #{seq}: rank {rank}: {payload.message}", payload.task
                )
                self._cond.notify_all()
            if coll.error is None and coll.kind != kind:
                coll.error = errors.InvalidArgumentError(
                    f"collective #{seq}: rank {rank} called {kind} but another rank "
                    f"called {coll.kind}"
                )
                self._cond.notify_all()
            leader = False
            if coll.error is None and coll.job is None and len(coll.payloads) == n:
                leader = True
                try:
                    job = build([coll.payloads[r] for r in range(n)])
                    coll.session = Session(
                        n, self.timeout, getattr(job.kernels, "device_sync", None)
                    )
                    coll.job = job
                    if not self._shares_work(job):
                        # Small: handing units between threads would cost more than the
                        # work, so this thread does every rank's share (as a batch call
                        # would) before waking the others, who then wake once, at the end.
                        self._cond.release()
                        try:
                            drive(job, coll.session, list(range(n)), finish=False)
                        except BaseException as exc:  # drive failed the session: all see it
                            coll.drive_error = exc
                        finally:
                            self._cond.acquire()
                    coll.ready = True
                except errors.OpError as exc:
                    coll.error = exc
                except Exception as exc:  # a bug: fail every rank, not only this one
                    logger.exception("preparing %s #%d failed", kind, seq)
                    coll.error = errors.InternalError(
                        f"{kind} #{seq}: preparing the collective failed: "
                        f"{type(exc).__name__}: {exc}"
                    )
                coll.payloads = dict.fromkeys(coll.payloads)  # the job holds what it needs
                self._cond.notify_all()
            deadline = arrived + self.timeout
            while not coll.ready and coll.error is None and not self._closed:
                if coll.job is not None:  # everyone came; a small job's work is under way
                    self._cond.wait(self.timeout)  # its units are bounded by the session
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(range(n)) - set(coll.payloads))
                    coll.error = errors.DeadlineExceededError(
                        f"{kind} #{seq}: replica rank(s) {missing} did not arrive within "
                        f"{self.timeout:g} s"
                    )
                    self._cond.notify_all()
                    break
                self._cond.wait(remaining)
            if coll.error is None and coll.job is None:  # closed while waiting
                coll.error = errors.CancelledError(f"{kind} #{seq}: the communicator was closed")
            if coll.error is not None:
                err = coll.error
                coll.payloads = dict.fromkeys(coll.payloads)  # keep who came, not their data
                self._forget(seq, coll)
                raise type(err)(err.message, err.task)
            return coll, seq, leader

    def _shares_work(self, job: Job) -> bool:
        """Whether each replica thread runs its own rank (else one runs them all)."""
        return job.kernels.is_gpu or job.nbytes >= self.ops.replica_parallel_threshold_bytes

    def _leave(self, seq: int, coll: _Collective, session: Session) -> None:
        with self._cond:
            coll.left += 1
            if coll.left == self.num_replicas:
                self.traffic.add(session.bytes_sent())
                self._collectives.pop(seq, None)

    def _forget(self, seq: int, coll: _Collective) -> None:
        """Leaves a failed collective (call under the lock).

        A failed collective is kept until every rank has arrived at it, so that a
        late rank gets its error instead of waiting for partners that left.
        """
        coll.left += 1
        if coll.left >= self.num_replicas:
            self._collectives.pop(seq, None)
        oldest = min(self._calls)  # every rank has arrived at collectives before this
        for s in [s for s, c in self._collectives.items() if s < oldest and c.error]:
            self._collectives.pop(s, None)

    # -- counters and lifetime ---------------------------------------------------------------
    @property
    def bytes_sent(self) -> list[int]:
        """Bytes each rank sent in this communicator's collectives since the last reset."""
        return self.traffic.bytes_sent

    def reset_bytes_sent(self) -> None:
        """Sets the byte counters back to zero."""
        self.traffic.reset()

    def close(self) -> None:
        """Fails the calls now waiting to meet (``CancelledError``) and refuses new ones."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def _update_at(
    kept: list[int], update: Callable[[int, int, int, Any], None], k: int, lo: int, hi: int, s: Any
) -> None:
    """Calls a caller's update with its own index of the ``k``-th agreed array."""
    update(kept[k], lo, hi, s)

"""Two-level collectives: inside the process first, then across the workers.

A worker with ``L`` local replicas (threads) reduces their arrays with the
in-process :class:`~.communicator.Communicator` (the ring over local
devices); its local replica 0 then runs the cross-process ring
(:class:`~.cross_host.CrossHostRing`) on that partial sum, and hands the
result back to the other local replicas with a local broadcast.  Every
replica of every worker thus holds the same bits.  With one local replica
the local steps are skipped.

It answers the calls a mirrored strategy's replica context makes of its
communicator (``all_reduce`` with ``present`` flags, ``all_gather``,
``close``, ``timeout``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from psflow import backend
from psflow.collective.communicator import Communicator
from psflow.collective.cross_host import CrossHostRing
from psflow.collective.reduce_op import ReduceOp

__all__ = ["HierarchicalCommunicator"]


class HierarchicalCommunicator:
    """Collective calls from ``local.num_replicas`` threads, reduced over all workers.

    Args:
        local: this worker's in-process communicator.
        ring: the cross-process ring (shared with the strategy's cross-replica calls).
        bytes_per_pack: packing of the cross-process all-reduce.
    """

    def __init__(self, local: Communicator, ring: CrossHostRing, bytes_per_pack: int = 0) -> None:
        self.local = local
        self.ring = ring
        self.bytes_per_pack = bytes_per_pack
        self.num_local = local.num_replicas
        self.num_replicas = self.num_local * ring.size

    @property
    def timeout(self) -> float:
        """Seconds a replica waits for the others (each level has this bound)."""
        return self.local.timeout

    def _share(self, rank: int, arrays: list[Any] | None) -> list[Any]:
        """Local replica 0's ``arrays``, copied to every local replica."""
        if self.num_local == 1:
            assert arrays is not None
            return arrays
        return self.local.broadcast(rank, arrays, 0)

    def all_reduce(
        self,
        rank: int,
        arrays: Sequence[Any],
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        present: Sequence[bool] | None = None,
    ) -> list[Any]:
        """Reduces ``arrays`` over every replica of every worker (called by all local replicas).

        Returns:
            This replica's copy, bitwise equal everywhere; ``None`` for an array
            no replica of any worker had (with ``present``).

        Raises:
            UnavailableError / DeadlineExceededError: a worker died or stalled (named).
            CancelledError: another local replica failed meanwhile.
        """
        op = ReduceOp.parse(op)
        arrays = list(arrays)
        if self.num_local > 1:
            partial = self.local.all_reduce(rank, arrays, ReduceOp.SUM, present=present)
        elif present is not None:
            partial = [a if p else None for a, p in zip(arrays, present)]
        else:
            partial = arrays
        shared: list[Any] | None = None
        if rank == 0:
            host = [
                np.zeros(np.shape(a), np.asarray(backend.to_numpy(a)).dtype)
                if p is None
                else np.asarray(backend.to_numpy(p))
                for a, p in zip(arrays, partial)
            ]
            flags = np.asarray([p is not None for p in partial], np.int32)
            dtypes = {h.dtype for h in host}
            (common,) = dtypes if len(dtypes) == 1 else (None,)
            if common is not None and common.kind == "f" and common.itemsize >= 4:
                # the flags ride in the arrays' own pass (a 0/1 count per worker is exact
                # in float32 up to 2**24 workers): one ring pass per step instead of two
                *summed, flags = self.ring.all_reduce(
                    [*host, flags.astype(common)], bytes_per_pack=self.bytes_per_pack
                )
            else:
                *summed, flags = self.ring.all_reduce(
                    [*host, flags], bytes_per_pack=self.bytes_per_pack
                )
            if op is ReduceOp.MEAN:
                summed = [s / s.dtype.type(self.num_replicas) for s in summed]
            kept = [s for s, f in zip(summed, flags) if f > 0]
            shared = [flags, *kept]
        flags, *kept = self._share(rank, shared)
        it = iter(kept)
        return [next(it) if f > 0 else None for f in flags]

    def all_gather(
        self, rank: int, array: Any, axis: int = 0, lengths: Sequence[int] | None = None
    ) -> Any:
        """Concatenates every replica's ``array`` along ``axis``, in global replica order.

        ``lengths``: each worker's size along ``axis`` (its local replicas' together),
        when agreed beforehand (see :meth:`CrossHostRing.all_gather`).
        """
        local = array if self.num_local == 1 else self.local.all_gather(rank, array, axis)
        shared = None
        if rank == 0:
            shared = [self.ring.all_gather(np.asarray(backend.to_numpy(local)), axis, lengths)]
        return self._share(rank, shared)[0]

    def close(self) -> None:
        """Wakes local replicas waiting in a call (another replica failed)."""
        self.local.close()

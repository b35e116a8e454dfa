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
from psflow.collective.arrays import is_cupy_array
from psflow.collective.communicator import Communicator
from psflow.collective.cross_host import CrossHostRing
from psflow.collective.reduce_op import ReduceOp

__all__ = ["HierarchicalCommunicator", "NcclRoutedCommunicator"]


def _back(result: Any, like: Any) -> Any:
    """``result`` (reduced on the host by the TCP ring) on the GPU of ``like``, if a GPU's."""
    if is_cupy_array(like) and not is_cupy_array(result):
        return backend.place(result, backend.device_of(like))
    return result


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
        return [_back(next(it), a) if f > 0 else None for f, a in zip(flags, arrays)]

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
        return _back(self._share(rank, shared)[0], array)

    def close(self) -> None:
        """Wakes local replicas waiting in a call (another replica failed)."""
        self.local.close()


class NcclRoutedCommunicator(HierarchicalCommunicator):
    """As :class:`HierarchicalCommunicator`, with CuPy arrays reduced by NCCL across every GPU.

    Each local replica's CuPy arrays go through its own communicator of the
    :class:`~psflow.collective.nccl_cross_host.NcclGroup` (every GPU of every
    worker a rank); NumPy arrays of the same call keep the two-level path
    over the TCP ring.  Every worker's program makes the same calls with the
    same kinds of arrays, so every rank takes the same branch.

    Args:
        local, ring, bytes_per_pack: as :class:`HierarchicalCommunicator`.
        group: this worker's NCCL communicators.
    """

    def __init__(
        self, local: Communicator, ring: CrossHostRing, bytes_per_pack: int, group: Any
    ) -> None:
        super().__init__(local, ring, bytes_per_pack)
        self.group = group

    def all_reduce(
        self,
        rank: int,
        arrays: Sequence[Any],
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        present: Sequence[bool] | None = None,
    ) -> list[Any]:
        """Reduces ``arrays`` over every replica of every worker: CuPy ones by NCCL."""
        op = ReduceOp.parse(op)
        arrays = list(arrays)
        on_gpu = [i for i, a in enumerate(arrays) if is_cupy_array(a)]
        if not on_gpu:
            return super().all_reduce(rank, arrays, op, present=present)
        on_host = [i for i in range(len(arrays)) if not is_cupy_array(arrays[i])]
        out: list[Any] = [None] * len(arrays)
        for part, reduce in ((on_gpu, self._nccl), (on_host, super().all_reduce)):
            if not part:
                continue
            sub = None if present is None else [present[i] for i in part]
            for i, r in zip(part, reduce(rank, [arrays[i] for i in part], op, present=sub)):
                out[i] = r
        return out

    def _nccl(
        self, rank: int, arrays: list[Any], op: ReduceOp, present: Sequence[bool] | None
    ) -> list[Any]:
        return self.group.all_reduce(rank, arrays, op is ReduceOp.MEAN, present)

    def all_gather(
        self, rank: int, array: Any, axis: int = 0, lengths: Sequence[int] | None = None
    ) -> Any:
        """Concatenates every replica's ``array`` along ``axis``; a CuPy array by NCCL."""
        if is_cupy_array(array):
            return self.group.all_gather(rank, array, axis)
        return super().all_gather(rank, array, axis, lengths)

    def close(self) -> None:
        """Wakes local replicas waiting in a call; NCCL's are aborted (see ``NcclGroup.close``)."""
        super().close()
        self.group.close()

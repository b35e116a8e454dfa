"""The cross-device op interface: how replicas' arrays are reduced, gathered, broadcast.

A :class:`CrossDeviceOps` (TensorFlow's ``tf.distribute.CrossDeviceOps``) has
two call styles:

1. **Batch calls** from one thread, on every replica's arrays at once:
   :meth:`~CrossDeviceOps.all_reduce`, :meth:`~CrossDeviceOps.reduce`,
   :meth:`~CrossDeviceOps.broadcast`, :meth:`~CrossDeviceOps.all_gather`.
2. **Collective calls** from N replica threads, through a
   :class:`~psflow.collective.communicator.Communicator` built on an ops object.

Both build the same :class:`~psflow.collective.job.Job` with the ``build_*``
methods and run its per-rank programs, so they compute bitwise the same
results.  Implementations only say how to build an all-reduce job; reduce,
broadcast and all-gather have shared defaults.

Example:
    >>> import numpy as np
    >>> from psflow.collective import RingAllReduce
    >>> ops = RingAllReduce()
    >>> grads = [[np.ones(3, np.float32)], [np.full(3, 2, np.float32)]]
    >>> ops.all_reduce(grads, "sum")[1][0]
    array([3., 3., 3.], dtype=float32)
"""

from __future__ import annotations

import abc
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from psflow import errors, memory
from psflow.collective import arrays as arr
from psflow.collective.buffers import BufferPool
from psflow.collective.executor import Executor
from psflow.collective.job import Job
from psflow.collective.layout import Layout, build_layout
from psflow.collective.options import CommunicationOptions
from psflow.collective.reduce_op import ReduceOp
from psflow.collective.session import Session, TrafficCounter

_LAYOUT_CACHE_SIZE = 64


class CrossDeviceOps(abc.ABC):
    """Base of the cross-device ops; see the module docstring.

    Args:
        options: default :class:`CommunicationOptions` of every call (a call's
            own ``options`` override them field by field).
        max_workers: threads a batch call uses at most (default: the CPU count);
            a collective call always uses the replicas' own threads.
        parallel_threshold_bytes: batch calls on less data than this (per
            replica) run on the calling thread alone (measured crossover on 2
            cores: ~2 MB, where waking pool threads stops costing more).
        replica_parallel_threshold_bytes: the same for collective calls from
            replica threads, which are running already: below it the last
            replica to arrive does every rank's share (crossover ~32-64 KB).
        subchunk_bytes: size of the unit of work, chosen so that a sub-chunk stays
            in a core's cache between being reduced and being forwarded.
        buffer_cache_bytes: bound of the NumPy result-buffer cache
            (:class:`~psflow.collective.buffers.BufferPool`); 0 disables it.

    Attributes:
        traffic: bytes each rank sent in this object's batch calls.
    """

    name: ClassVar[str] = ""
    #: Whether a strategy may fuse this all-reduce with the optimizer's update on host
    #: arrays (:meth:`Communicator.reduce_and_update`, each rank updating its range).
    fuses_updates: ClassVar[bool] = False

    def __init__(
        self,
        *,
        options: CommunicationOptions | None = None,
        max_workers: int | None = None,
        parallel_threshold_bytes: int = 4 << 20,
        replica_parallel_threshold_bytes: int = 64 << 10,
        subchunk_bytes: int = 512 << 10,
        buffer_cache_bytes: int = 1 << 30,
    ) -> None:
        if options is not None and not isinstance(options, CommunicationOptions):
            raise errors.InvalidArgumentError(
                f"options must be a CommunicationOptions, got {options!r}"
            )
        for label, value, least in (
            ("max_workers", max_workers, 1),
            ("parallel_threshold_bytes", parallel_threshold_bytes, 0),
            ("replica_parallel_threshold_bytes", replica_parallel_threshold_bytes, 0),
            ("subchunk_bytes", subchunk_bytes, 1),
            ("buffer_cache_bytes", buffer_cache_bytes, 0),
        ):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < least
            ):
                raise errors.InvalidArgumentError(
                    f"{label} must be an integer >= {least}, got {value!r}"
                )
        self.options = options or CommunicationOptions()
        self.max_workers = max_workers or os.cpu_count() or 1
        self.parallel_threshold_bytes = parallel_threshold_bytes
        self.replica_parallel_threshold_bytes = replica_parallel_threshold_bytes
        self.subchunk_bytes = subchunk_bytes
        self.pool = BufferPool(buffer_cache_bytes)
        self.traffic = TrafficCounter()
        self._executor = Executor(f"psflow-{self.name or 'collective'}")
        self._layouts: OrderedDict[tuple, Layout] = OrderedDict()
        self._layouts_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(options={self.options!r})"

    # -- batch calls -----------------------------------------------------------------------
    def all_reduce(
        self,
        per_replica: Sequence[Sequence[Any]],
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        out: Sequence[Sequence[Any]] | None = None,
        options: CommunicationOptions | None = None,
    ) -> list[list[Any]]:
        """Reduces each tensor across replicas; every replica gets the result.

        Args:
            per_replica: ``per_replica[r]`` is replica ``r``'s list of arrays
                (e.g. its gradients); the same shapes and dtypes on every replica.
            op: ``SUM`` or ``MEAN`` (or its name).
            out: optional arrays to write the results into, shaped like
                ``per_replica``; passing ``per_replica`` itself reduces in place
                (the fastest: no new memory is touched).
            options: overrides of this object's options for this call.

        Returns:
            ``result[r][i]``: replica ``r``'s copy of the reduced tensor ``i``,
            bitwise identical on every replica.  Without ``out`` these are new
            arrays (views of one new buffer per dtype and replica), never the
            inputs, even with one replica.

        Raises:
            InvalidArgumentError: replicas disagree on the number, shapes or
                dtypes of their arrays; ``op`` is unknown; MEAN of an integer dtype.
            DeadlineExceededError: the work stalled for ``timeout_seconds``.
        """
        opts = self.options.merge(options)
        job = self.build_all_reduce(per_replica, op, out, opts)
        self._run(job, opts)
        return [job.result(r) for r in range(job.num_ranks)]

    def reduce(
        self,
        per_replica: Sequence[Sequence[Any]],
        op: ReduceOp | str = ReduceOp.SUM,
        destination_replica: int = 0,
        *,
        options: CommunicationOptions | None = None,
    ) -> list[Any]:
        """Reduces each tensor across replicas onto one replica.

        Returns:
            The reduced tensors, new arrays on ``destination_replica``'s device.

        Raises:
            InvalidArgumentError: as :meth:`all_reduce`, or a bad destination.
        """
        from psflow.collective.reduce_to_one import ReduceToOneJob

        opts = self.options.merge(options)
        rows, op, layout = self.check_reduction(per_replica, op, None, opts)
        dest = arr.check_rank(destination_replica, len(rows))
        job = ReduceToOneJob(
            layout, rows, op, dest, None, self.pool, arr.kernels_for(rows), broadcast=False
        )
        self._run(job, opts)
        return job.result(dest)

    def broadcast(
        self,
        values: Sequence[Any],
        destinations: int | Sequence[Any],
        *,
        options: CommunicationOptions | None = None,
    ) -> list[list[Any]]:
        """Copies ``values`` (one replica's arrays) to every destination.

        Args:
            values: the arrays to copy.
            destinations: the number of (CPU) replicas, or a device per replica
                (``"/cpu:0"``, ``"GPU:1"``, or an object with ``device_type`` and
                ``index``); GPU destinations need CuPy.

        Returns:
            ``result[r]``: new arrays on destination ``r``.
        """
        from psflow.collective.copies import BroadcastJob

        opts = self.options.merge(options)
        job = BroadcastJob.create(values, destinations)
        self._run(job, opts)
        return [job.result(r) for r in range(job.num_ranks)]

    def all_gather(
        self,
        per_replica_arrays: Sequence[Any],
        axis: int = 0,
        *,
        options: CommunicationOptions | None = None,
    ) -> list[Any]:
        """Concatenates one array per replica along ``axis``; every replica gets it.

        Returns:
            ``result[r]``: a new array on replica ``r``'s device.

        Raises:
            InvalidArgumentError: dtypes differ, shapes differ off ``axis``, bad axis.
        """
        from psflow.collective.copies import AllGatherJob

        opts = self.options.merge(options)
        job = AllGatherJob.create(per_replica_arrays, axis)
        self._run(job, opts)
        return [job.result(r) for r in range(job.num_ranks)]

    # -- building jobs (shared with Communicator) -----------------------------------------
    def build_all_reduce(
        self,
        per_replica: Any,
        op: Any,
        out: Any,
        options: CommunicationOptions,
    ) -> Job:
        """Validates an all-reduce call and prepares its job (no data is reduced yet).

        Raises:
            InvalidArgumentError: see :meth:`all_reduce`.
        """
        memory.ensure_tuned()  # an all-reduce means training: reuse freed result buffers
        rows, op, layout = self.check_reduction(per_replica, op, out, options)
        out_rows = None if out is None else arr.check_out(out, rows)
        return self._all_reduce_job(layout, rows, op, out_rows, options)

    @abc.abstractmethod
    def _all_reduce_job(
        self,
        layout: Layout,
        rows: list[list[Any]],
        op: ReduceOp,
        out: list[list[Any]] | None,
        options: CommunicationOptions,
    ) -> Job:
        """The implementation's all-reduce job for validated arrays."""

    def check_reduction(
        self, per_replica: Any, op: Any, out: Any, options: CommunicationOptions
    ) -> tuple[list[list[Any]], ReduceOp, Layout]:
        """Validates a reduction's arrays and op; returns them with the call's layout.

        Raises:
            InvalidArgumentError: naming the bad replica, tensor or value.
        """
        op = ReduceOp.parse(op)
        rows = arr.check_per_replica(per_replica)
        if op is ReduceOp.MEAN:
            for i, x in enumerate(rows[0]):
                if x.dtype.kind in "iu":
                    raise errors.InvalidArgumentError(
                        f"ReduceOp.MEAN of per_replica[0][{i}] with integer dtype {x.dtype} "
                        "is not exact; reduce with SUM and divide"
                    )
        return rows, op, self.layout_for(rows, options.bytes_per_pack)

    def layout_for(self, rows: list[list[Any]], bytes_per_pack: int) -> Layout:
        """The (cached) layout for these arrays' shapes and dtypes."""
        first = rows[0]
        key = (
            len(rows),
            tuple(x.shape for x in first),
            tuple(x.dtype.str for x in first),
            bytes_per_pack,
            self.subchunk_bytes,
        )
        with self._layouts_lock:
            layout = self._layouts.get(key)
            if layout is not None:
                self._layouts.move_to_end(key)
                return layout
        layout = build_layout(
            [x.shape for x in first],
            [np.dtype(x.dtype) for x in first],
            len(rows),
            bytes_per_pack=bytes_per_pack,
            subchunk_bytes=self.subchunk_bytes,
        )
        with self._layouts_lock:
            self._layouts[key] = layout
            while len(self._layouts) > _LAYOUT_CACHE_SIZE:
                self._layouts.popitem(last=False)
        return layout

    # -- running ---------------------------------------------------------------------------
    def _run(self, job: Job, options: CommunicationOptions) -> None:
        session = Session(job.num_ranks, options.timeout, getattr(job.kernels, "device_sync", None))
        workers = self.max_workers if job.nbytes >= self.parallel_threshold_bytes else 1
        try:
            self._executor.run(job, session, workers)
        finally:
            self.traffic.add(session.bytes_sent())

    @property
    def bytes_sent(self) -> list[int]:
        """Bytes each rank sent in this object's batch calls since the last reset."""
        return self.traffic.bytes_sent

    def reset_bytes_sent(self) -> None:
        """Sets the batch calls' byte counters back to zero."""
        self.traffic.reset()

    def close(self) -> None:
        """Stops this object's worker threads and drops its cached buffers."""
        self._executor.close()
        self.pool.clear()

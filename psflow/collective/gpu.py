"""The collectives' kernels on CuPy arrays: one stream per replica's GPU.

The algorithms are the same as on NumPy; only the kernels differ.  Each rank
works on its own device through its own (blocking) stream; data on another
device is first copied into a scratch array on the rank's device (peer copy,
``cudaMemcpyAsync`` with unified addressing).  The host-side progress counters
of :class:`~psflow.collective.session.Session` say *when* a unit was enqueued;
a CUDA event recorded per unit lets the reading rank's stream wait for it.

Before a collective starts, every replica's device is synchronised, so inputs
produced on any stream are complete; each rank synchronises its stream before
it returns, so results are ready on any stream.

This module imports CuPy; it is only imported when CuPy arrays are seen.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import cupy
import numpy as np

from psflow import errors


class CupyKernels:
    """``add``/``copy``/``divide``/``empty`` on the replicas' GPUs, plus stream ordering.

    Args:
        devices: GPU ordinal of each rank.
    """

    is_gpu = True

    def __init__(self, devices: list[int]) -> None:
        self.devices = [int(d) for d in devices]
        self.streams = []
        for d in dict.fromkeys(self.devices):
            cupy.cuda.Device(d).synchronize()
        for d in self.devices:
            with cupy.cuda.Device(d):
                self.streams.append(cupy.cuda.Stream(non_blocking=False))
        self._events: list[list[Any]] = [[] for _ in self.devices]
        self.device_sync = self

    @contextlib.contextmanager
    def on_rank(self, rank: int) -> Iterator[None]:
        """Makes rank's GPU and stream current (a context manager)."""
        with cupy.cuda.Device(self.devices[rank]), self.streams[rank]:
            yield

    def _local(self, rank: int, x: Any) -> Any:
        """``x`` on ``rank``'s device (a peer copy into scratch when it is elsewhere)."""
        if int(x.device.id) == self.devices[rank]:
            return x
        if not x.flags.c_contiguous:
            with cupy.cuda.Device(x.device.id):
                x = cupy.ascontiguousarray(x)
                cupy.cuda.get_current_stream().synchronize()
        tmp = cupy.empty(x.shape, x.dtype)
        if x.nbytes:
            tmp.data.copy_from_device_async(x.data, x.nbytes, self.streams[rank])
        return tmp

    def add(self, rank: int, out: Any, a: Any, b: Any) -> None:
        """``out = a + b`` on ``rank``'s device (``out`` must be there)."""
        with self.on_rank(rank):
            cupy.add(self._local(rank, a), self._local(rank, b), out=out)

    def copy(self, rank: int, dst: Any, src: Any) -> None:
        """``dst[...] = src`` on ``rank``'s stream; either may be on another GPU, or
        ``src`` a NumPy array."""
        with self.on_rank(rank):
            if isinstance(src, np.ndarray):
                if dst.flags.c_contiguous:
                    dst.set(np.ascontiguousarray(src), self.streams[rank])
                else:
                    cupy.copyto(dst, cupy.asarray(src))
            elif dst.flags.c_contiguous and src.flags.c_contiguous and dst.nbytes:
                dst.data.copy_from_device_async(src.data, src.nbytes, self.streams[rank])
            elif int(dst.device.id) == self.devices[rank]:
                cupy.copyto(dst, self._local(rank, src))
            else:  # the algorithms only push contiguous slices
                raise errors.InternalError(
                    f"cannot copy into a non-contiguous array on GPU {dst.device.id}"
                )

    def divide(self, rank: int, x: Any, n: int) -> None:
        """``x /= n`` in place (floating and complex dtypes, as the NumPy kernel).

        Raises:
            InvalidArgumentError: ``x`` has an integer dtype, where an in-place
                division cannot hold the mean (the API refuses integer MEAN first).
        """
        if x.dtype.kind not in "fc":
            raise errors.InvalidArgumentError(
                f"ReduceOp.MEAN cannot divide a {x.dtype} array in place; reduce with SUM"
            )
        with self.on_rank(rank):
            cupy.divide(x, n, out=x)

    def empty(self, rank: int, size: int, dtype: np.dtype) -> Any:
        """A new 1-D array on ``rank``'s device."""
        with self.on_rank(rank):
            return cupy.empty(size, dtype)

    def concatenate(self, rank: int, parts: list[Any], size: int, dtype: np.dtype) -> Any:
        """The parts flattened one after the other, on ``rank``'s device."""
        with self.on_rank(rank):
            out = cupy.empty(size, dtype)
            pos = 0
            for p in parts:
                cupy.copyto(out[pos : pos + p.size], p.reshape(-1))
                pos += p.size
            return out

    def synchronize(self, rank: int) -> None:
        """Waits for everything queued on ``rank``'s stream."""
        self.streams[rank].synchronize()

    def prepared(self) -> None:
        """Waits for the setup work (staging copies) of every rank."""
        for s in self.streams:
            s.synchronize()

    # -- device_sync hooks for Session -------------------------------------------------------
    def record(self, rank: int) -> None:
        """Records an event after ``rank``'s latest unit."""
        with cupy.cuda.Device(self.devices[rank]):
            ev = cupy.cuda.Event(block=False, disable_timing=True)
            ev.record(self.streams[rank])
        self._events[rank].append(ev)

    def wait(self, rank: int, other: int, unit: int) -> None:
        """Makes ``rank``'s stream wait for ``other``'s unit ``unit``."""
        if other != rank:
            self.streams[rank].wait_event(self._events[other][unit])

"""All-reduce through NCCL (``cupy.cuda.nccl``), for CuPy arrays on distinct GPUs.

One NCCL communicator per replica's GPU, created once per set of devices with
``ncclCommInitAll`` and cached.  Each dtype's tensors are packed into one
contiguous buffer per replica (large single tensors are used as they are),
all-reduced with ``ncclAllReduce`` on the replica's stream, and MEAN divides
once.  NCCL does its own chunking and pipelining, so ``bytes_per_pack`` and
the byte counters do not apply.

Constructing :class:`NcclAllReduce` imports CuPy; without it (or without a
NCCL build) the constructor raises ``FailedPreconditionError``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from psflow import errors
from psflow.collective.api import CrossDeviceOps
from psflow.collective.arrays import replica_devices
from psflow.collective.job import Job, tensor_views
from psflow.collective.layout import Layout
from psflow.collective.options import CommunicationOptions
from psflow.collective.reduce_op import ReduceOp
from psflow.collective.session import Session

_NCCL_TYPES = {
    "float16": "NCCL_FLOAT16",
    "float32": "NCCL_FLOAT32",
    "float64": "NCCL_FLOAT64",
    "int8": "NCCL_INT8",
    "uint8": "NCCL_UINT8",
    "int32": "NCCL_INT32",
    "uint32": "NCCL_UINT32",
    "int64": "NCCL_INT64",
    "uint64": "NCCL_UINT64",
}


def nccl_dtype(dtype: np.dtype) -> tuple[str, int]:
    """NCCL's type name for ``dtype`` and NCCL elements per array element.

    Complex numbers are summed as pairs of reals.

    Raises:
        InvalidArgumentError: NCCL has no such type (e.g. int16).
    """
    dtype = np.dtype(dtype)
    if dtype.kind == "c":
        name = _NCCL_TYPES[np.dtype(f"f{dtype.itemsize // 2}").name]
        return name, 2
    if dtype.name not in _NCCL_TYPES:
        raise errors.InvalidArgumentError(f"NCCL cannot reduce dtype {dtype}")
    return _NCCL_TYPES[dtype.name], 1


def import_nccl() -> tuple[Any, Any]:
    """Returns ``(cupy, cupy.cuda.nccl)``.

    Raises:
        FailedPreconditionError: CuPy does not import or was built without NCCL.
    """
    try:
        import cupy
        from cupy.cuda import nccl
    except Exception as exc:  # ImportError, or CUDA libraries that fail to load
        raise errors.FailedPreconditionError(
            "NcclAllReduce needs CuPy with NCCL (pip install 'psflow[gpu]'); "
            f"importing cupy.cuda.nccl failed: {type(exc).__name__}: {exc}"
        ) from exc
    if not getattr(nccl, "available", False):
        raise errors.FailedPreconditionError("NcclAllReduce: this CuPy was built without NCCL")
    return cupy, nccl


class NcclAllReduce(CrossDeviceOps):
    """All-reduce with NCCL; psflow's default for several GPUs when available.

    Raises:
        FailedPreconditionError: at construction, when CuPy or NCCL is missing.
    """

    name = "nccl"

    def __init__(self, **kwargs: Any) -> None:
        self._cupy, self._nccl = import_nccl()
        super().__init__(**kwargs)
        self._comms: dict[tuple[int, ...], list[Any]] = {}
        self._comms_lock = threading.Lock()

    def communicators(self, devices: list[int]) -> list[Any]:
        """The NCCL communicators of these GPUs, one per replica (created once).

        Raises:
            InvalidArgumentError: two replicas on one GPU.
        """
        key = tuple(devices)
        if len(set(key)) != len(key):
            raise errors.InvalidArgumentError(
                f"NcclAllReduce needs one GPU per replica, got devices {list(key)}"
            )
        with self._comms_lock:
            comms = self._comms.get(key)
            if comms is None:
                comms = self._comms[key] = list(self._nccl.NcclCommunicator.initAll(list(key)))
            return comms

    def _all_reduce_job(
        self,
        layout: Layout,
        rows: list[list[Any]],
        op: ReduceOp,
        out: list[list[Any]] | None,
        options: CommunicationOptions,
    ) -> Job:
        devices = replica_devices(rows)
        if any(d is None for d in devices):
            raise errors.InvalidArgumentError("NcclAllReduce reduces CuPy arrays, got NumPy arrays")
        for g in layout.groups:
            nccl_dtype(g.dtype)
        from psflow.collective.gpu import CupyKernels

        kernels = CupyKernels([int(d) for d in devices if d is not None])
        comms = self.communicators(kernels.devices)
        return NcclJob(layout, rows, op, out, kernels, comms, self._nccl)


class NcclJob(Job):
    """One NCCL all-reduce: a contiguous buffer per dtype and replica."""

    def __init__(
        self,
        layout: Layout,
        rows: list[list[Any]],
        op: ReduceOp,
        out: list[list[Any]] | None,
        kernels: Any,
        comms: list[Any],
        nccl: Any,
    ) -> None:
        self.num_ranks = len(rows)
        self.kernels = kernels
        self.layout = layout
        self.mean = op is ReduceOp.MEAN
        self.nbytes = layout.nbytes
        self.comms = comms
        self.nccl = nccl
        self.ins: list[list[Any]] = []
        self.outs: list[list[Any]] = []
        self.results: list[list[Any]] = []
        self._copy_back: list[list[tuple[Any, Any]]] = []
        for q, row in enumerate(rows):
            ins, outs, back = [], [], []
            for g in layout.groups:
                single = len(g.tensors) == 1
                t = g.tensors[0]
                if single and row[t].flags.c_contiguous:
                    ins.append(row[t].reshape(-1))
                else:
                    parts = [row[i] for i in g.tensors]
                    ins.append(kernels.concatenate(q, parts, g.size, g.dtype))
                if out is not None and single:
                    outs.append(out[q][t].reshape(-1))
                    continue
                buf = kernels.empty(q, g.size, g.dtype)
                outs.append(buf)
                if out is not None:
                    for i, off in zip(g.tensors, g.offsets, strict=True):
                        back.append((out[q][i].reshape(-1), buf[off : off + out[q][i].size]))
            self.ins.append(ins)
            self.outs.append(outs)
            self._copy_back.append(back)
            if out is not None:
                self.results.append(list(out[q]))
            else:
                self.results.append(tensor_views(layout, outs, kernels, q))
        kernels.prepared()

    def units(self, rank: int) -> int:
        """One unit: all of the rank's NCCL calls."""
        return 1

    def program(self, session: Session, rank: int) -> Iterator[None]:
        """Enqueues ``ncclAllReduce`` for each dtype on this rank's stream."""
        k, nccl = self.kernels, self.nccl
        with k.on_rank(rank):
            for g, src, dst in zip(
                self.layout.groups, self.ins[rank], self.outs[rank], strict=True
            ):
                name, per_element = nccl_dtype(g.dtype)
                self.comms[rank].allReduce(
                    src.data.ptr,
                    dst.data.ptr,
                    g.size * per_element,
                    getattr(nccl, name),
                    nccl.NCCL_SUM,
                    k.streams[rank].ptr,
                )
                if self.mean:
                    k.divide(rank, dst, self.num_ranks)
        yield

    def finish(self, session: Session, rank: int) -> None:
        """Waits for this rank's stream, then copies staged results into ``out``."""
        self.kernels.synchronize(rank)
        for dst, src in self._copy_back[rank]:
            self.kernels.copy(rank, dst, src)
        self.kernels.synchronize(rank)

    def result(self, rank: int) -> list[Any]:
        """Rank ``rank``'s reduced arrays."""
        return self.results[rank]

"""All-gather and broadcast: collectives that only copy.

Both are direct: each rank copies what it needs straight from the owner's
array (one read per receiver, which on shared memory costs the same as a ring
and needs no intermediate steps).  Each rank returns only when every rank has
finished, because the others read the arrays the caller passed in.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from psflow import backend, errors
from psflow.collective import arrays as arr
from psflow.collective.job import Job
from psflow.collective.session import Session


def device_kind(spec: Any) -> tuple[str, int]:
    """``("CPU"|"GPU", index)`` for a device spec, parsed by :func:`psflow.backend.parse_device`.

    Raises:
        InvalidArgumentError: ``spec`` names no CPU or GPU device.
    """
    device = backend.parse_device(spec)
    return device.device_type, device.index


class AllGatherJob(Job):
    """Every rank gets the concatenation of all ranks' arrays along ``axis``."""

    def __init__(self, arrays: list[Any], axis: int) -> None:
        self.num_ranks = len(arrays)
        self.arrays = arrays
        self.kernels = arr.kernels_for([[a] for a in arrays])
        first = arrays[0]
        self.axis = axis
        sizes = [a.shape[axis] for a in arrays]
        self.bounds = np.concatenate([[0], np.cumsum(sizes)]).tolist()
        shape = list(first.shape)
        shape[axis] = self.bounds[-1]
        self.shape = tuple(shape)
        self.nbytes = sum(a.nbytes for a in arrays)
        self.outputs = [
            self.kernels.empty(r, int(np.prod(shape)), first.dtype).reshape(shape)
            for r in range(self.num_ranks)
        ]

    @classmethod
    def create(cls, arrays: Any, axis: Any) -> AllGatherJob:
        """Validates one array per replica and an axis.

        Raises:
            InvalidArgumentError: an empty list, a non-array, a 0-d array, a bad
                axis, dtypes that differ, shapes that differ off ``axis``.
        """
        arr.check_sequence(arrays, "per_replica_arrays")
        if not arrays:
            raise errors.InvalidArgumentError("per_replica_arrays is empty")
        items = [arr.as_array(a, f"per_replica_arrays[{r}]") for r, a in enumerate(arrays)]
        first = items[0]
        if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
            raise errors.InvalidArgumentError(f"axis must be an int, got {axis!r}")
        if first.ndim == 0:
            raise errors.InvalidArgumentError("all_gather needs arrays of rank >= 1, got a scalar")
        if not -first.ndim <= axis < first.ndim:
            raise errors.InvalidArgumentError(
                f"axis {axis} is out of range for arrays of rank {first.ndim}"
            )
        axis = int(axis) % first.ndim
        for r, a in enumerate(items):
            if arr.is_cupy_array(a) != arr.is_cupy_array(first):
                raise errors.InvalidArgumentError(
                    f"per_replica_arrays[{r}] mixes NumPy and CuPy arrays"
                )
            if a.dtype != first.dtype:
                raise errors.InvalidArgumentError(
                    f"per_replica_arrays[{r}] has dtype {a.dtype} but "
                    f"per_replica_arrays[0] has {first.dtype}"
                )
            off = [d for i, d in enumerate(a.shape) if i != axis]
            ref = [d for i, d in enumerate(first.shape) if i != axis]
            if a.ndim != first.ndim or off != ref:
                raise errors.InvalidArgumentError(
                    f"per_replica_arrays[{r}] has shape {a.shape}, incompatible with "
                    f"per_replica_arrays[0]'s {first.shape} off axis {axis}"
                )
        return cls(items, axis)

    def units(self, rank: int) -> int:
        """One unit per source rank."""
        return self.num_ranks

    def program(self, session: Session, rank: int) -> Iterator[None]:
        """Copies each rank's array into this rank's output, in rank order."""
        out = self.outputs[rank]
        index: list[Any] = [slice(None)] * out.ndim
        for q, a in enumerate(self.arrays):
            index[self.axis] = slice(self.bounds[q], self.bounds[q + 1])
            self.kernels.copy(rank, out[tuple(index)], a)
            if q != rank:
                session.sent(rank, q, a.nbytes)
            yield

    def result(self, rank: int) -> Any:
        """Rank ``rank``'s gathered array."""
        return self.outputs[rank]


class BroadcastJob(Job):
    """Every destination gets new copies of the source's arrays."""

    def __init__(self, values: list[Any], kernels: Any, num_ranks: int, source: int | None) -> None:
        self.num_ranks = num_ranks
        self.values = values
        self.kernels = kernels
        self.source = source
        self.nbytes = sum(v.nbytes for v in values)
        self.outputs = [
            [kernels.empty(r, v.size, v.dtype).reshape(v.shape) for v in values]
            for r in range(num_ranks)
        ]

    @classmethod
    def create(cls, values: Any, destinations: Any, source: int | None = None) -> BroadcastJob:
        """Validates the arrays and the destinations (a count, or one device per replica).

        Raises:
            InvalidArgumentError: a non-array value, a bad count or device.
            UnimplementedError: a mix of CPU and GPU destinations.
        """
        arr.check_sequence(values, "values")
        vals = [arr.as_array(v, f"values[{i}]") for i, v in enumerate(values)]
        if isinstance(destinations, bool):
            raise errors.InvalidArgumentError(f"bad destinations {destinations!r}")
        if isinstance(destinations, (int, np.integer)):
            if destinations < 1:
                raise errors.InvalidArgumentError(
                    f"destinations must be >= 1 replicas, got {destinations}"
                )
            gpu = bool(vals) and arr.is_cupy_array(vals[0])
            kinds = [("GPU", int(vals[0].device.id)) if gpu else ("CPU", 0)] * int(destinations)
        else:
            arr.check_sequence(destinations, "destinations")
            if not destinations:
                raise errors.InvalidArgumentError("destinations is empty")
            kinds = [device_kind(d) for d in destinations]
        return cls.for_devices(vals, kinds, source)

    @classmethod
    def for_devices(
        cls, values: list[Any], devices: Sequence[tuple[str, int]], source: int | None
    ) -> BroadcastJob:
        """A broadcast of validated ``values`` to ``devices`` (``("CPU"|"GPU", index)``)."""
        types = {t for t, _ in devices}
        if types == {"CPU"}:
            kernels: Any = arr.NumpyKernels()
        elif types == {"GPU"}:
            from psflow.collective.gpu import CupyKernels

            kernels = CupyKernels([i for _, i in devices])
        else:
            raise errors.UnimplementedError(
                f"broadcast to a mix of CPU and GPU destinations {list(devices)}"
            )
        return cls(values, kernels, len(devices), source)

    def units(self, rank: int) -> int:
        """One unit per array."""
        return len(self.values)

    def program(self, session: Session, rank: int) -> Iterator[None]:
        """Copies each source array into this rank's new array."""
        for v, o in zip(self.values, self.outputs[rank], strict=True):
            self.kernels.copy(rank, o, v)
            if rank != self.source:
                session.sent(rank, 0 if self.source is None else self.source, v.nbytes)
            yield

    def result(self, rank: int) -> list[Any]:
        """Rank ``rank``'s copies."""
        return self.outputs[rank]

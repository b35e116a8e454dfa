"""Arrays as the collectives see them: validation, devices, and the elementwise kernels.

Collectives take raw arrays: NumPy arrays for logical CPU devices, CuPy arrays
for GPUs.  This module checks a call's arrays once (types, dtypes, shapes that
agree across replicas) and gives the algorithms a tiny set of kernels
(``add``, ``copy``, ``divide``, ``empty``) so the same algorithm code runs on
NumPy and on CuPy.  CuPy is only imported when a CuPy array is seen.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from psflow import errors

_NUMERIC_KINDS = "iufc"


def is_cupy_array(x: Any) -> bool:
    """Whether ``x`` is a CuPy array (checked without importing CuPy)."""
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(x, cupy.ndarray)


def as_array(x: Any, where: str) -> Any:
    """Returns ``x`` as a NumPy or CuPy array (NumPy scalars become 0-d arrays).

    Raises:
        InvalidArgumentError: ``x`` is not an array.
    """
    if isinstance(x, np.ndarray) or is_cupy_array(x):
        return x
    if isinstance(x, np.generic):
        return np.asarray(x)
    raise errors.InvalidArgumentError(
        f"{where} must be a NumPy or CuPy array, got {type(x).__name__}: {x!r:.80}"
    )


def check_sequence(value: Any, where: str) -> Sequence[Any]:
    """Checks that ``value`` is a list or tuple (not a string, not an array).

    Raises:
        InvalidArgumentError: it is not.
    """
    if not isinstance(value, (list, tuple)):
        raise errors.InvalidArgumentError(
            f"{where} must be a list or tuple, got {type(value).__name__}: {value!r:.80}"
        )
    return value


def check_rank(rank: Any, num_replicas: int) -> int:
    """Checks a replica index.

    Raises:
        InvalidArgumentError: ``rank`` is not an int in ``[0, num_replicas)``.
    """
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)):
        raise errors.InvalidArgumentError(f"rank must be an int, got {rank!r}")
    if not 0 <= int(rank) < num_replicas:
        raise errors.InvalidArgumentError(
            f"rank {rank} is out of range for {num_replicas} replicas"
        )
    return int(rank)


def check_numeric(dtype: np.dtype, where: str) -> None:
    """Rejects dtypes that cannot be summed (bool, strings, objects).

    Raises:
        InvalidArgumentError: naming ``dtype``.
    """
    if dtype.kind not in _NUMERIC_KINDS:
        raise errors.InvalidArgumentError(
            f"{where} has dtype {dtype}; collectives reduce numeric dtypes only"
        )


def check_per_replica(per_replica: Any, name: str = "per_replica") -> list[list[Any]]:
    """Validates ``per_replica[r][i]``: N replicas, each a list of T arrays.

    Every replica must hold the same number of arrays, and array ``i`` must have
    the same shape and dtype on every replica; all arrays must be NumPy, or all
    CuPy (each replica's arrays on one GPU).

    Returns:
        The arrays as a list of lists.

    Raises:
        InvalidArgumentError: naming the replica, the tensor index and the bad value.
    """
    check_sequence(per_replica, name)
    if not per_replica:
        raise errors.InvalidArgumentError(f"{name} is empty: need at least one replica")
    rows = []
    for r, row in enumerate(per_replica):
        check_sequence(row, f"{name}[{r}]")
        rows.append([as_array(x, f"{name}[{r}][{i}]") for i, x in enumerate(row)])
    first = rows[0]
    gpu = bool(first) and is_cupy_array(first[0])
    for r, row in enumerate(rows):
        if len(row) != len(first):
            raise errors.InvalidArgumentError(
                f"{name}[{r}] has {len(row)} arrays but {name}[0] has {len(first)}"
            )
        for i, (x, ref) in enumerate(zip(row, first, strict=True)):
            if is_cupy_array(x) != gpu:
                raise errors.InvalidArgumentError(
                    f"{name}[{r}][{i}] is a {type(x).__module__}.{type(x).__name__} but "
                    f"{name}[0][0] is a {type(first[0]).__module__}.{type(first[0]).__name__}: "
                    "mix of NumPy and CuPy arrays"
                )
            if x.dtype != ref.dtype:
                raise errors.InvalidArgumentError(
                    f"{name}[{r}][{i}] has dtype {x.dtype} but {name}[0][{i}] has {ref.dtype}"
                )
            if x.shape != ref.shape:
                raise errors.InvalidArgumentError(
                    f"{name}[{r}][{i}] has shape {x.shape} but {name}[0][{i}] has {ref.shape}"
                )
        if gpu and len({int(x.device.id) for x in row}) > 1:
            raise errors.InvalidArgumentError(
                f"{name}[{r}] holds arrays on several GPUs "
                f"{sorted({int(x.device.id) for x in row})}: one device per replica"
            )
    for i, x in enumerate(first):
        check_numeric(x.dtype, f"{name}[0][{i}]")
    return rows


def check_out(out: Any, inputs: list[list[Any]]) -> list[list[Any]]:
    """Validates ``out``: arrays to write the results into, shaped like ``inputs``.

    ``out[r][i]`` must match ``inputs[r][i]``'s shape, dtype and array type, be
    C-contiguous and writeable, and be either ``inputs[r][i]`` itself (in place) or
    an array of its own (no two outputs the same array).

    Raises:
        InvalidArgumentError: naming the offending output.
    """
    check_sequence(out, "out")
    if len(out) != len(inputs):
        raise errors.InvalidArgumentError(
            f"out has {len(out)} replicas but the inputs have {len(inputs)}"
        )
    rows = []
    seen: set[int] = set()
    for r, (row, ins) in enumerate(zip(out, inputs, strict=True)):
        check_sequence(row, f"out[{r}]")
        if len(row) != len(ins):
            raise errors.InvalidArgumentError(
                f"out[{r}] has {len(row)} arrays but the inputs have {len(ins)}"
            )
        checked = []
        for i, (o, x) in enumerate(zip(row, ins, strict=True)):
            where = f"out[{r}][{i}]"
            if not (isinstance(o, np.ndarray) or is_cupy_array(o)):
                raise errors.InvalidArgumentError(
                    f"{where} must be an array, got {type(o).__name__}"
                )
            if type(o) is not type(x):
                raise errors.InvalidArgumentError(
                    f"{where} is a {type(o).__name__} but its input is a {type(x).__name__}"
                )
            if o.shape != x.shape or o.dtype != x.dtype:
                raise errors.InvalidArgumentError(
                    f"{where} has shape {o.shape} and dtype {o.dtype}; "
                    f"expected {x.shape} and {x.dtype}"
                )
            if not o.flags.c_contiguous or not _writeable(o):
                raise errors.InvalidArgumentError(f"{where} must be C-contiguous and writeable")
            if is_cupy_array(o) and int(o.device.id) != int(x.device.id):
                raise errors.InvalidArgumentError(
                    f"{where} is on GPU {o.device.id} but its input is on GPU {x.device.id}"
                )
            if id(o) in seen:
                raise errors.InvalidArgumentError(f"{where} is the same array as another output")
            seen.add(id(o))
            checked.append(o)
        rows.append(checked)
    return rows


def _writeable(a: Any) -> bool:
    return bool(getattr(a.flags, "writeable", True))


def replica_devices(rows: list[list[Any]]) -> list[int | None]:
    """Each replica's GPU ordinal (CuPy), or None for NumPy replicas."""
    out: list[int | None] = []
    for row in rows:
        out.append(int(row[0].device.id) if row and is_cupy_array(row[0]) else None)
    return out


class NumpyKernels:
    """The elementwise work of the algorithms, on NumPy arrays, in place, no temporaries.

    NumPy ufuncs release the GIL on large arrays, so replica threads calling
    these overlap on several cores.  ``rank`` is the rank whose thread calls.
    """

    is_gpu = False

    def add(self, rank: int, out: Any, a: Any, b: Any) -> None:
        """``out = a + b``."""
        np.add(a, b, out=out)

    def copy(self, rank: int, dst: Any, src: Any) -> None:
        """``dst[...] = src``."""
        np.copyto(dst, src)

    def divide(self, rank: int, x: Any, n: int) -> None:
        """``x /= n`` in place (floating and complex dtypes)."""
        np.divide(x, n, out=x)

    def empty(self, rank: int, size: int, dtype: np.dtype) -> Any:
        """A new uninitialised 1-D array on ``rank``'s device."""
        return np.empty(size, dtype)

    def concatenate(self, rank: int, parts: list[Any], size: int, dtype: np.dtype) -> Any:
        """A new 1-D array holding ``parts`` (flattened) one after the other."""
        out = np.empty(size, dtype)
        pos = 0
        for p in parts:
            n = p.size
            np.copyto(out[pos : pos + n], p.reshape(-1))
            pos += n
        return out

    def synchronize(self, rank: int) -> None:
        """Waits for ``rank``'s queued device work (nothing to wait for on the CPU)."""

    def prepared(self) -> None:
        """Waits for the setup work of every rank (nothing to wait for on the CPU)."""


def kernels_for(rows: list[list[Any]]) -> Any:
    """The kernels for a call's arrays: NumPy's, or CuPy's for the replicas' GPUs."""
    devices = replica_devices(rows)
    if devices and devices[0] is not None:
        from psflow.collective.gpu import CupyKernels

        return CupyKernels(devices)
    return NumpyKernels()

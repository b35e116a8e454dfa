"""Tensors to and from the wire: dtype codes, shape checks, raw little-endian bytes.

Decoding never converts element by element: bytes become an array through
``np.frombuffer`` (a view of the received buffer, no copy).  Every check names
the offending value and raises :class:`~psflow.errors.InvalidArgumentError`.

Example:
    >>> import numpy as np
    >>> msg = encode_tensor(np.arange(3, dtype=np.int32))
    >>> decode_tensor(msg)
    array([0, 1, 2], dtype=int32)
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from psflow.errors import InvalidArgumentError
from psflow.proto import tensor_pb2

__all__ = [
    "MAX_RANK",
    "SUPPORTED_DTYPES",
    "c_contiguous",
    "check_spec",
    "decode_tensor",
    "default_max_tensor_bytes",
    "dtype_from_wire",
    "dtype_to_wire",
    "encode_tensor",
    "spec_to_proto",
    "tensor_from_buffer",
    "to_host",
]

MAX_RANK = 32
_DT = tensor_pb2.DataType
_TO_WIRE: dict[np.dtype, int] = {
    np.dtype(np.float16): _DT.DATA_TYPE_FLOAT16,
    np.dtype(np.float32): _DT.DATA_TYPE_FLOAT32,
    np.dtype(np.float64): _DT.DATA_TYPE_FLOAT64,
    np.dtype(np.int8): _DT.DATA_TYPE_INT8,
    np.dtype(np.int16): _DT.DATA_TYPE_INT16,
    np.dtype(np.int32): _DT.DATA_TYPE_INT32,
    np.dtype(np.int64): _DT.DATA_TYPE_INT64,
    np.dtype(np.uint8): _DT.DATA_TYPE_UINT8,
    np.dtype(np.bool_): _DT.DATA_TYPE_BOOL,
}
_FROM_WIRE: dict[int, np.dtype] = {code: dt for dt, code in _TO_WIRE.items()}
SUPPORTED_DTYPES: tuple[str, ...] = tuple(dt.name for dt in _TO_WIRE)
# Wire codes of the dtype objects met so far (any byte order), by the object.
_SEEN: dict[np.dtype, int] = {}


def default_max_tensor_bytes() -> int:
    """Half the machine's physical memory: the default cap on one tensor."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 1 << 34


def dtype_to_wire(dtype: Any) -> int:
    """The wire code of a NumPy dtype (any byte order).

    Raises:
        InvalidArgumentError: the dtype is not one psflow transports.
    """
    try:
        return _SEEN[dtype]  # every tensor on the wire asks: no new dtype object per call
    except (KeyError, TypeError):
        pass
    try:
        dt = np.dtype(dtype).newbyteorder("=")
    except TypeError as e:
        raise InvalidArgumentError(f"not a dtype: {dtype!r}") from e
    code = _TO_WIRE.get(dt)
    if code is None:
        raise InvalidArgumentError(
            f"unsupported dtype {dt.name!r}; supported: {list(SUPPORTED_DTYPES)}"
        )
    if isinstance(dtype, np.dtype) and len(_SEEN) < 64:
        _SEEN[dtype] = code
    return code


def dtype_from_wire(code: int) -> np.dtype:
    """The NumPy dtype of a wire code.

    Raises:
        InvalidArgumentError: unknown or unspecified code.
    """
    dt = _FROM_WIRE.get(int(code))
    if dt is None:
        raise InvalidArgumentError(f"unknown wire dtype code {int(code)}")
    return dt


def check_spec(
    dtype_code: int, shape: Sequence[int], *, max_bytes: int | None = None
) -> tuple[np.dtype, tuple[int, ...], int]:
    """Validates a wire dtype and shape; returns ``(dtype, shape, nbytes)``.

    Raises:
        InvalidArgumentError: unknown dtype, rank above :data:`MAX_RANK`, a
            negative dimension, or more than ``max_bytes`` bytes (default:
            :func:`default_max_tensor_bytes`).
    """
    dtype = dtype_from_wire(dtype_code)
    shape = tuple(int(d) for d in shape)
    if len(shape) > MAX_RANK:
        raise InvalidArgumentError(f"shape {shape} has rank {len(shape)} > {MAX_RANK}")
    if any(d < 0 for d in shape):
        raise InvalidArgumentError(f"shape {shape} has a negative dimension")
    nbytes = math.prod(shape) * dtype.itemsize
    limit = default_max_tensor_bytes() if max_bytes is None else max_bytes
    if nbytes > limit:
        raise InvalidArgumentError(
            f"shape {shape} of {dtype.name} is {nbytes} bytes, above the limit of {limit}"
        )
    return dtype, shape, nbytes


def spec_to_proto(dtype: Any, shape: Sequence[int]) -> tensor_pb2.TensorSpec:
    """A ``TensorSpec`` message for a dtype and shape."""
    return tensor_pb2.TensorSpec(dtype=dtype_to_wire(dtype), shape=[int(d) for d in shape])


def c_contiguous(array: Any) -> np.ndarray:
    """``array`` as a C-contiguous ndarray, keeping 0-d arrays 0-d (unlike
    ``np.ascontiguousarray``); no copy when it already is."""
    arr = np.asarray(array)
    return arr if arr.flags.c_contiguous else arr.copy(order="C")


def to_host(array: Any) -> np.ndarray:
    """``array`` as a C-contiguous, little-endian NumPy array (CuPy arrays copied to host).

    No copy is made when the array already qualifies.

    Raises:
        InvalidArgumentError: unsupported dtype.
    """
    if type(array).__module__.split(".", 1)[0] == "cupy":
        array = array.get()
    arr = np.asarray(array)
    dtype_to_wire(arr.dtype)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return c_contiguous(arr)


def tensor_from_buffer(
    dtype: np.dtype, shape: Sequence[int], buffer: Any, *, what: str = "tensor"
) -> np.ndarray:
    """A (read-only when the buffer is) array viewing ``buffer``; no copy.

    Raises:
        InvalidArgumentError: the byte count is not ``prod(shape) * itemsize``,
            or a bool tensor holds a byte other than 0 or 1.
    """
    shape = tuple(shape)
    expected = math.prod(shape) * dtype.itemsize
    got = memoryview(buffer).nbytes
    if got != expected:
        raise InvalidArgumentError(
            f"{what} of shape {shape} and dtype {dtype.name} needs {expected} bytes, got {got}"
        )
    arr = np.frombuffer(buffer, dtype=dtype).reshape(shape)
    if dtype == np.bool_ and arr.size and arr.view(np.uint8).max() > 1:
        raise InvalidArgumentError(f"{what} of dtype bool holds a byte other than 0 or 1")
    return arr


def encode_tensor(array: Any) -> tensor_pb2.Tensor:
    """A whole ``Tensor`` message (for small tensors; large ones are streamed)."""
    arr = to_host(array)
    return tensor_pb2.Tensor(
        dtype=dtype_to_wire(arr.dtype), shape=list(arr.shape), data=arr.tobytes()
    )


def decode_tensor(message: tensor_pb2.Tensor, *, max_bytes: int | None = None) -> np.ndarray:
    """The array a ``Tensor`` message holds (a read-only view of its bytes).

    Raises:
        InvalidArgumentError: bad dtype, shape or byte count.
    """
    dtype, shape, _ = check_spec(message.dtype, message.shape, max_bytes=max_bytes)
    return tensor_from_buffer(dtype, shape, message.data)

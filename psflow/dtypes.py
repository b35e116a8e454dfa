"""Data types with TensorFlow's names: ``psflow.float32``, ``psflow.int32``...

A :class:`DType` wraps a NumPy dtype; :func:`as_dtype` accepts a DType, a NumPy
dtype or type, or a name (``"float32"``).

Example:
    >>> import psflow as pf
    >>> pf.as_dtype("float32") is pf.float32
    True
"""

from __future__ import annotations

import builtins
from typing import Any

import numpy as np

from psflow import errors


class DType:
    """A tensor element type (TensorFlow's ``tf.DType``)."""

    __slots__ = ("_np", "name")

    def __init__(self, name: str, np_dtype: np.dtype) -> None:
        self.name = name
        self._np = np.dtype(np_dtype)

    @property
    def as_numpy_dtype(self) -> type:
        """The NumPy scalar type, e.g. ``numpy.float32``."""
        return self._np.type

    @property
    def np(self) -> np.dtype:
        """The NumPy dtype object."""
        return self._np

    @property
    def is_floating(self) -> bool:
        """Whether this is a floating-point type."""
        return self._np.kind == "f"

    @property
    def is_integer(self) -> bool:
        """Whether this is an integer type (not bool)."""
        return self._np.kind in "iu"

    @property
    def is_bool(self) -> bool:
        """Whether this is ``bool``."""
        return self._np.kind == "b"

    @property
    def is_unsigned(self) -> bool:
        """Whether this is an unsigned integer type."""
        return self._np.kind == "u"

    @property
    def size(self) -> int:
        """Bytes per element."""
        return self._np.itemsize

    @property
    def min(self) -> Any:
        """The smallest representable value."""
        return np.finfo(self._np).min if self.is_floating else np.iinfo(self._np).min

    @property
    def max(self) -> Any:
        """The largest representable value."""
        return np.finfo(self._np).max if self.is_floating else np.iinfo(self._np).max

    def __repr__(self) -> str:
        return f"psflow.{self.name}"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, DType):
            return self._np == other._np
        try:
            return self._np == as_dtype(other)._np
        except (TypeError, ValueError):
            return False

    def __hash__(self) -> int:
        return hash(self._np)

    def __reduce__(self):
        return (as_dtype, (self.name,))


float16 = DType("float16", np.float16)
float32 = DType("float32", np.float32)
float64 = DType("float64", np.float64)
bfloat16 = None  # not supported by NumPy; named so scripts get a clear error on use
int8 = DType("int8", np.int8)
int16 = DType("int16", np.int16)
int32 = DType("int32", np.int32)
int64 = DType("int64", np.int64)
uint8 = DType("uint8", np.uint8)
uint16 = DType("uint16", np.uint16)
uint32 = DType("uint32", np.uint32)
uint64 = DType("uint64", np.uint64)
bool = DType("bool", np.bool_)
# variable-length text: NumPy object arrays of Python ``str`` (TensorFlow's ``tf.string``, which
# holds bytes; psflow decodes bytes as UTF-8 when it makes the tensor). Host-only, never on a GPU.
string = DType("string", np.object_)
half = float16
double = float64

ALL: tuple[DType, ...] = (
    float16,
    float32,
    float64,
    int8,
    int16,
    int32,
    int64,
    uint8,
    uint16,
    uint32,
    uint64,
    bool,
    string,
)
_BY_NP: dict[np.dtype, DType] = {d.np: d for d in ALL}
_BY_NAME: dict[str, DType] = {d.name: d for d in ALL}
_BY_NAME.update({"half": float16, "double": float64, "bool_": bool})


def as_dtype(value: Any) -> DType:
    """Converts a DType, NumPy dtype, Python type or name into a :class:`DType`.

    Raises:
        TypeError: if ``value`` names no supported type (the message quotes it).
    """
    if isinstance(value, DType):
        return value
    if isinstance(value, str):
        found = _BY_NAME.get(value)
        if found is None:
            raise TypeError(f"Unknown dtype {value!r}; supported: {sorted(_BY_NAME)}")
        return found
    if value is float:
        return float32
    if value is int:
        return int32
    if value is builtins.bool:
        return bool
    if value is builtins.str or value is builtins.bytes:
        return string
    try:
        npd = np.dtype(value)
    except TypeError:
        raise TypeError(f"Cannot interpret {value!r} as a psflow dtype") from None
    if npd.kind in "US":  # fixed-width NumPy text becomes variable-length strings
        return string
    found = _BY_NP.get(npd)
    if found is None:
        raise TypeError(f"Unsupported dtype {value!r}; supported: {[d.name for d in ALL]}")
    return found


def from_numpy(npd: np.dtype) -> DType:
    """The DType of a NumPy dtype (fast path for arrays psflow created itself)."""
    found = _BY_NP.get(npd)
    if found is None:
        raise errors.InvalidArgumentError(
            f"Unsupported element type {npd}; supported: {[d.name for d in ALL]}"
        )
    return found

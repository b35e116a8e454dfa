"""Plumbing shared by every op: operand conversion, output wrapping, broadcasting.

An op converts its operands to *nodes* (tensors or variables, which the tape
tracks by identity), computes on their raw arrays and wraps the result; while
a tape records, it also hands the tape a backward function.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from psflow import backend, dtypes, errors
from psflow.framework import tape as tape_lib
from psflow.framework.tensor import Tensor, convert_to_tensor
from psflow.framework.variable import Variable

# hot-path aliases: every op goes through ``out`` and most through ``binary``
_ndarray = np.ndarray
_new_tensor = object.__new__
_tape_state = tape_lib._local  # per thread: its ``tapes`` stack
_Variable = Variable


def node(x: Any, dtype: Any = None) -> Any:
    """A tensor or variable for ``x`` (variables stay themselves so tapes see them)."""
    if dtype is None and (type(x) is Tensor or type(x) is _Variable):
        return x
    shards = getattr(x, "_shard_variables", None)
    if shards is not None:  # a sharded variable reads as its shards joined, differentiably
        from psflow.ops import array_ops

        x = array_ops.concat(list(shards), axis=0)
    if type(x) is Tensor or getattr(x, "_is_variable", False):
        if dtype is not None and x._array().dtype != dtypes.as_dtype(dtype).np:
            raise errors.InvalidArgumentError(
                f"Expected dtype {dtypes.as_dtype(dtype).name}, got {x._array().dtype.name}: {x!r}"
            )
        return x
    return convert_to_tensor(x, dtype=dtype)


def _is_weak(x: Any) -> bool:
    """Values that are not tensors or variables (Python numbers and lists, NumPy scalars
    and arrays) adopt the other operand's dtype, as TensorFlow converts them."""
    return not (
        isinstance(x, Tensor) or getattr(x, "_is_variable", False) or hasattr(x, "_shard_variables")
    )


def binary(x: Any, y: Any, op_name: str) -> tuple[Any, Any]:
    """Converts two operands to nodes of one dtype.

    A tensor or variable fixes the dtype; the other operand, when it is not a
    tensor, is converted to it (the first one decides when neither is).

    Raises:
        InvalidArgumentError: the dtypes differ (TensorFlow never promotes), or a
            value would lose data in the conversion (``1.5`` into int32).
    """
    tx, ty = type(x), type(y)
    if (tx is Tensor or tx is _Variable) and (ty is Tensor or ty is _Variable):
        pass  # the common case: plain tensors and variables need no conversion
    elif _is_weak(y):
        x = node(x)
        y = convert_to_tensor(y, dtype=_weak_dtype(y, x._array().dtype))
    elif _is_weak(x):
        y = node(y)
        x = convert_to_tensor(x, dtype=_weak_dtype(x, y._array().dtype))
    else:
        x, y = node(x), node(y)
    dx, dy = x._array().dtype, y._array().dtype
    if dx != dy:
        raise errors.InvalidArgumentError(
            f"{op_name}: cannot compute on a {dx.name} tensor and a {dy.name} tensor "
            f"(shapes {tuple(x._array().shape)} and {tuple(y._array().shape)}); cast one first"
        )
    return x, y


def operands(x: Any, y: Any, op_name: str) -> tuple[Any, Any, Any, Any]:
    """:func:`binary` plus the two raw arrays, with a fast path for plain nodes."""
    tx, ty = type(x), type(y)
    if (tx is Tensor or tx is _Variable) and (ty is Tensor or ty is _Variable):
        a, b = x._value, y._value
        if a.dtype is b.dtype or a.dtype == b.dtype:
            return x, y, a, b
    x, y = binary(x, y, op_name)
    return x, y, x._array(), y._array()


def _weak_dtype(value: Any, other: np.dtype) -> dtypes.DType:
    if other.kind in "iub":
        try:
            kind = np.asarray(value).dtype.kind
        except (TypeError, ValueError, OverflowError):
            kind = ""  # the conversion itself reports malformed data
        if kind == "f":
            raise errors.InvalidArgumentError(
                f"Cannot convert {value!r} to the integer dtype {other.name} without losing data"
            )
    return dtypes.from_numpy(other)


def out(array: Any, inputs: tuple[Any, ...], backward: Any = None) -> Tensor:
    """Wraps an op's result and records it on the active tapes."""
    t = _new_tensor(Tensor)
    t._value = array if type(array) is _ndarray else _as_array(array)
    if backward is not None:
        for tape in _tape_state.tapes:
            if tape._recording:
                tape._record(inputs, t, backward)
    return t


def _as_array(array: Any) -> Any:
    return np.asarray(array) if isinstance(array, np.generic) else array


def xp(a: Any) -> Any:
    """The array module of ``a``."""
    return np if type(a) is _ndarray else backend.xp_of(a)


def unbroadcast(g: Any, shape: tuple[int, ...]) -> Any:
    """Sums ``g`` down to ``shape`` (the VJP of NumPy broadcasting)."""
    if g.shape == shape:
        return g
    if g.shape[1:] == shape:  # a bias over a batch: the common case
        return g.sum(axis=0)
    lead = g.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(
        i + lead for i, d in enumerate(shape) if d == 1 and g.shape[i + lead] != 1
    )
    if axes:
        g = g.sum(axis=axes, keepdims=True)
    if lead:
        g = g.reshape(g.shape[lead:])
    return g.reshape(shape)


def check_broadcast(a: Any, b: Any, op_name: str) -> None:
    """Raises InvalidArgumentError naming the shapes when they cannot broadcast."""
    sa, sb = a.shape, b.shape
    if sa == sb:
        return
    for da, db in zip(reversed(sa), reversed(sb)):
        if da != db and da != 1 and db != 1:
            raise errors.InvalidArgumentError(
                f"{op_name}: incompatible shapes {list(sa)} and {list(sb)}"
            )


def normalize_axis(axis: Any, ndim: int, op_name: str) -> tuple[int, ...] | None:
    """Turns an axis argument (int, list, tensor, None) into a tuple of positive axes."""
    if axis is None:
        return None
    if isinstance(axis, Tensor) or getattr(axis, "_is_variable", False):
        axis = backend.to_numpy(axis._array()).tolist()
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    result = []
    for a in axes:
        a = int(a)
        if not -max(ndim, 1) <= a < max(ndim, 1):
            raise errors.InvalidArgumentError(
                f"{op_name}: axis {a} is out of range for a tensor of rank {ndim}"
            )
        result.append(a % max(ndim, 1))
    return tuple(result)

"""Shape manipulation, indexing, gathering and tensor creation, with their gradients."""

from __future__ import annotations

import builtins
import numbers
from typing import Any

import numpy as np

from psflow import backend, dtypes, errors
from psflow.framework.indexed_slices import IndexedSlices
from psflow.framework.tensor import Tensor, constant, convert_to_tensor
from psflow.ops._core import node, normalize_axis, out, xp


def _ints(value: Any, what: str) -> list[int]:
    if isinstance(value, Tensor) or getattr(value, "_is_variable", False):
        value = backend.to_numpy(value._array())
    arr = np.asarray(value)
    if arr.dtype.kind not in "iu" and arr.size:
        raise errors.InvalidArgumentError(f"{what} must be integers, got {value!r}")
    return [int(v) for v in arr.reshape(-1)]


# -- identity ----------------------------------------------------------------------------


def identity(input: Any, name: str | None = None) -> Tensor:
    """A tensor with the same value (a copy when reading a variable)."""
    x = node(input)
    a = x._array()
    z = a.copy() if getattr(x, "_is_variable", False) else a
    return out(z, (x,), lambda g, needs: (g,))


def stop_gradient(input: Any, name: str | None = None) -> Tensor:
    """The same value, invisible to gradient tapes."""
    return Tensor._wrap(node(input)._array())


# -- shapes ------------------------------------------------------------------------------


def shape(input: Any, out_type: Any = "int32", name: str | None = None) -> Tensor:
    """The shape as a 1-D integer tensor."""
    return constant(list(node(input)._array().shape), dtype=out_type)


def size(input: Any, out_type: Any = "int32", name: str | None = None) -> Tensor:
    """The number of elements, a scalar."""
    return constant(node(input)._array().size, dtype=out_type)


def rank(input: Any, name: str | None = None) -> Tensor:
    """The number of dimensions, a scalar int32."""
    return constant(node(input)._array().ndim, dtype="int32")


def reshape(tensor: Any, shape: Any, name: str | None = None) -> Tensor:
    """Same elements in a new shape; one dimension may be -1.

    Raises:
        InvalidArgumentError: the element counts differ (message names both shapes).
    """
    x = node(tensor)
    a = x._array()
    dims = _ints(shape, "reshape's shape")
    known = int(np.prod([d for d in dims if d != -1], dtype=np.int64))
    if dims.count(-1) > 1 or any(d < -1 for d in dims):
        raise errors.InvalidArgumentError(f"reshape: invalid target shape {dims}")
    if -1 in dims:
        if known == 0 or a.size % known:
            raise errors.InvalidArgumentError(
                f"reshape: cannot reshape a tensor of {a.size} elements (shape {list(a.shape)}) "
                f"to {dims}"
            )
    elif known != a.size:
        raise errors.InvalidArgumentError(
            f"reshape: cannot reshape a tensor of {a.size} elements (shape {list(a.shape)}) "
            f"to shape {dims}"
        )
    z = a.reshape(dims)
    return out(z, (x,), lambda g, needs: (g.reshape(a.shape),))


def transpose(a: Any, perm: Any = None, conjugate: bool = False, name: str | None = None) -> Tensor:
    """Permutes dimensions (reverses them when ``perm`` is None)."""
    x = node(a)
    arr = x._array()
    p = list(builtins.range(arr.ndim))[::-1] if perm is None else _ints(perm, "perm")
    if sorted(p) != list(builtins.range(arr.ndim)):
        raise errors.InvalidArgumentError(
            f"transpose: perm {p} is not a permutation of the {arr.ndim} axes of shape "
            f"{list(arr.shape)}"
        )
    inv = list(np.argsort(p))
    return out(arr.transpose(p), (x,), lambda g, needs: (g.transpose(inv),))


def expand_dims(input: Any, axis: int, name: str | None = None) -> Tensor:
    """Inserts a dimension of size 1 at ``axis``."""
    x = node(input)
    a = x._array()
    ax = int(axis)
    if not -a.ndim - 1 <= ax <= a.ndim:
        raise errors.InvalidArgumentError(f"expand_dims: axis {ax} out of range for rank {a.ndim}")
    z = xp(a).expand_dims(a, ax)
    return out(z, (x,), lambda g, needs: (g.reshape(a.shape),))


def squeeze(input: Any, axis: Any = None, name: str | None = None) -> Tensor:
    """Removes dimensions of size 1 (only ``axis`` when given)."""
    x = node(input)
    a = x._array()
    axes = normalize_axis(axis, a.ndim, "squeeze")
    if axes is not None:
        for ax in axes:
            if a.shape[ax] != 1:
                raise errors.InvalidArgumentError(
                    f"squeeze: cannot squeeze axis {ax} of size {a.shape[ax]} "
                    f"(shape {list(a.shape)})"
                )
    z = xp(a).squeeze(a, axis=axes)
    return out(z, (x,), lambda g, needs: (g.reshape(a.shape),))


def broadcast_to(input: Any, shape: Any, name: str | None = None) -> Tensor:
    """Broadcasts to ``shape``."""
    from psflow.ops._core import unbroadcast

    x = node(input)
    a = x._array()
    dims = tuple(_ints(shape, "shape"))
    try:
        z = xp(a).broadcast_to(a, dims)
    except ValueError:
        raise errors.InvalidArgumentError(
            f"broadcast_to: cannot broadcast shape {list(a.shape)} to {list(dims)}"
        ) from None
    return out(z, (x,), lambda g, needs: (unbroadcast(g, a.shape),))


def tile(input: Any, multiples: Any, name: str | None = None) -> Tensor:
    """Repeats the tensor ``multiples[i]`` times along axis ``i``."""
    x = node(input)
    a = x._array()
    reps = _ints(multiples, "multiples")
    if len(reps) != a.ndim:
        raise errors.InvalidArgumentError(
            f"tile: multiples {reps} must have one entry per dimension of shape {list(a.shape)}"
        )
    z = xp(a).tile(a, reps)

    def backward(g: Any, needs: tuple[bool, ...]) -> tuple[Any]:
        split = []
        for r, d in zip(reps, a.shape):
            split += [r, d]
        return (g.reshape(split).sum(axis=tuple(builtins.range(0, 2 * a.ndim, 2))),)

    return out(z, (x,), backward)


# -- joining and splitting ---------------------------------------------------------------


def _join_check(arrays: list[Any], axis: int, op_name: str, same_shape: bool) -> None:
    first = arrays[0]
    for a in arrays[1:]:
        if a.dtype != first.dtype:
            raise errors.InvalidArgumentError(
                f"{op_name}: all inputs need one dtype, got {first.dtype.name} and {a.dtype.name}"
            )
        if same_shape:
            bad = a.shape != first.shape
        else:
            bad = a.ndim != first.ndim or any(
                i != axis and d != e for i, (d, e) in enumerate(zip(a.shape, first.shape))
            )
        if bad:
            raise errors.InvalidArgumentError(
                f"{op_name}: incompatible shapes {list(first.shape)} and {list(a.shape)} "
                f"along axis {axis}"
            )


def concat(values: list[Any], axis: int, name: str | None = None) -> Tensor:
    """Joins tensors along an existing axis."""
    if not values:
        raise errors.InvalidArgumentError("concat needs at least one tensor")
    nodes = [node(v) for v in values]
    arrays = [n._array() for n in nodes]
    (ax,) = normalize_axis(axis, arrays[0].ndim, "concat")
    _join_check(arrays, ax, "concat", same_shape=False)
    z = xp(arrays[0]).concatenate(arrays, axis=ax)
    bounds = np.cumsum([a.shape[ax] for a in arrays])[:-1]

    def backward(g: Any, needs: tuple[bool, ...]) -> tuple[Any, ...]:
        parts = xp(g).split(g, bounds, axis=ax)
        return tuple(p if n else None for p, n in zip(parts, needs))

    return out(z, tuple(nodes), backward)


def stack(values: list[Any], axis: int = 0, name: str | None = None) -> Tensor:
    """Joins tensors of one shape along a new axis."""
    if not values:
        raise errors.InvalidArgumentError("stack needs at least one tensor")
    nodes = [node(v) for v in values]
    arrays = [n._array() for n in nodes]
    _join_check(arrays, axis, "stack", same_shape=True)
    nd = arrays[0].ndim + 1
    if not -nd <= axis < nd:
        raise errors.InvalidArgumentError(f"stack: axis {axis} out of range for rank {nd}")
    ax = axis % nd
    z = xp(arrays[0]).stack(arrays, axis=ax)

    def backward(g: Any, needs: tuple[bool, ...]) -> tuple[Any, ...]:
        return tuple(xp(g).take(g, i, axis=ax) if n else None for i, n in enumerate(needs))

    return out(z, tuple(nodes), backward)


def unstack(
    value: Any, num: int | None = None, axis: int = 0, name: str | None = None
) -> list[Tensor]:
    """Splits along ``axis`` into a list of tensors of one rank less."""
    x = node(value)
    a = x._array()
    (ax,) = normalize_axis(axis, a.ndim, "unstack")
    return [_take_slice(x, ax, i) for i in builtins.range(a.shape[ax])]


def _take_slice(x: Any, ax: int, i: int) -> Tensor:
    a = x._array()
    z = xp(a).take(a, i, axis=ax)

    def backward(g: Any, needs: tuple[bool, ...]) -> tuple[Any]:
        full = xp(g).zeros(a.shape, g.dtype)
        idx = [builtins.slice(None)] * a.ndim
        idx[ax] = i
        full[tuple(idx)] = g
        return (full,)

    return out(z, (x,), backward)


def split(
    value: Any, num_or_size_splits: Any, axis: int = 0, num: Any = None, name: str | None = None
) -> list[Tensor]:
    """Splits into equal parts (an int) or parts of the given sizes (a list)."""
    x = node(value)
    a = x._array()
    (ax,) = normalize_axis(axis, a.ndim, "split")
    n = a.shape[ax]
    if isinstance(num_or_size_splits, numbers.Integral):
        k = int(num_or_size_splits)
        if k <= 0 or n % k:
            raise errors.InvalidArgumentError(
                f"split: dimension {ax} of size {n} cannot be split into {k} equal parts"
            )
        sizes = [n // k] * k
    else:
        sizes = _ints(num_or_size_splits, "size_splits")
        if -1 in sizes:
            sizes[sizes.index(-1)] = n - (sum(sizes) + 1)
        if sum(sizes) != n:
            raise errors.InvalidArgumentError(
                f"split: sizes {sizes} do not add up to dimension {ax} of size {n}"
            )
    parts, start = [], 0
    for s in sizes:
        idx = [builtins.slice(None)] * a.ndim
        idx[ax] = builtins.slice(start, start + s)
        parts.append(_getitem(x, tuple(idx)))
        start += s
    return parts


# -- indexing ----------------------------------------------------------------------------


def _normalize_key(key: Any) -> Any:
    if isinstance(key, tuple):
        return tuple(_normalize_key(k) for k in key)
    if isinstance(key, Tensor) or getattr(key, "_is_variable", False):
        arr = backend.to_numpy(key._array())
        if arr.ndim == 0 and arr.dtype.kind in "iu":
            return int(arr)
        raise errors.InvalidArgumentError(
            f"Only scalar integer tensors can index a tensor (use gather / boolean_mask for "
            f"others), got shape {list(arr.shape)} dtype {arr.dtype.name}"
        )
    if isinstance(key, (list, np.ndarray)):
        raise errors.InvalidArgumentError(
            f"Index {key!r} is not supported: use ints, slices, ..., None, or pf.gather"
        )
    return key


def _getitem(tensor: Any, key: Any) -> Tensor:
    x = node(tensor)
    a = x._array()
    key = _normalize_key(key)
    try:
        z = a[key]
    except IndexError as e:
        raise errors.InvalidArgumentError(
            f"Index {key!r} is out of bounds for a tensor of shape {list(a.shape)}: {e}"
        ) from None
    if isinstance(z, np.generic):
        z = np.asarray(z)
    elif z.base is not None or z is a:
        z = z.copy()

    def backward(g: Any, needs: tuple[bool, ...]) -> tuple[Any]:
        full = xp(g).zeros(a.shape, g.dtype)
        full[key] = g
        return (full,)

    return out(z, (x,), backward)


def slice(input_: Any, begin: Any, size: Any, name: str | None = None) -> Tensor:
    """The block starting at ``begin`` of ``size`` (-1: to the end), as ``tf.slice``."""
    a = node(input_)._array()
    b, s = _ints(begin, "begin"), _ints(size, "size")
    if len(b) != a.ndim or len(s) != a.ndim:
        raise errors.InvalidArgumentError(
            f"slice: begin {b} and size {s} need one entry per dimension of shape {list(a.shape)}"
        )
    key = tuple(
        builtins.slice(bi, a.shape[i] if si == -1 else bi + si)
        for i, (bi, si) in enumerate(zip(b, s))
    )
    return _getitem(input_, key)


def gather(
    params: Any,
    indices: Any,
    validate_indices: Any = None,
    axis: Any = None,
    batch_dims: int = 0,
    name: str | None = None,
) -> Tensor:
    """Rows (or slices along ``axis``) of ``params`` at ``indices``.

    The gradient w.r.t. ``params`` is sparse (:class:`IndexedSlices`) for
    ``axis=0``, so only touched rows travel to a parameter server.

    Raises:
        InvalidArgumentError: an index outside ``[0, params.shape[axis])``, naming it.
    """
    x = node(params)
    a = x._array()
    idx_t = node(indices)
    idx = idx_t._array()
    if idx.dtype.kind not in "iu":
        raise errors.InvalidArgumentError(f"gather: indices must be integers, got {idx.dtype.name}")
    if batch_dims:
        raise errors.UnimplementedError(f"gather with batch_dims={batch_dims} is not supported")
    ax = 0 if axis is None else normalize_axis(axis, a.ndim, "gather")[0]
    n = a.shape[ax]
    if idx.size:
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= n:
            bad = lo if lo < 0 else hi
            raise errors.InvalidArgumentError(
                f"gather: index {bad} is out of range [0, {n}) for params of shape {list(a.shape)}"
            )
    z = xp(a).take(a, idx, axis=ax)
    if a.dtype.kind != "f":
        return out(z, (x,))

    def backward(g: Any, needs: tuple[bool, ...]) -> tuple[Any]:
        if ax == 0:
            flat = idx.reshape(-1)
            return (IndexedSlices._raw(g.reshape((flat.size, *a.shape[1:])), flat, tuple(a.shape)),)
        full = xp(g).zeros(a.shape, g.dtype)
        moved = xp(g).moveaxis(full, ax, 0)
        gm = xp(g).moveaxis(
            g, list(builtins.range(ax, ax + idx.ndim)), list(builtins.range(idx.ndim))
        )
        backend.scatter_add(moved, idx.reshape(-1), gm.reshape((idx.size, *moved.shape[1:])))
        return (full,)

    return out(z, (x, idx_t), backward)


def gather_nd(params: Any, indices: Any, batch_dims: int = 0, name: str | None = None) -> Tensor:
    """Slices of ``params`` addressed by the last axis of ``indices`` (``tf.gather_nd``)."""
    x = node(params)
    a = x._array()
    idx = node(indices)._array()
    k = idx.shape[-1]
    if k > a.ndim:
        raise errors.InvalidArgumentError(
            f"gather_nd: index depth {k} exceeds the rank {a.ndim} of params"
        )
    tup = tuple(idx[..., i] for i in builtins.range(k))
    for i, t in enumerate(tup):
        if t.size and (int(t.min()) < 0 or int(t.max()) >= a.shape[i]):
            raise errors.InvalidArgumentError(
                f"gather_nd: indices {backend.to_numpy(idx).tolist()} out of range "
                f"for shape {list(a.shape)}"
            )
    z = a[tup]

    def backward(g: Any, needs: tuple[bool, ...]) -> tuple[Any]:
        full = xp(g).zeros(a.shape, g.dtype)
        backend.scatter_add(full, tup, g)
        return (full,)

    return out(z, (x,), backward)


def boolean_mask(tensor: Any, mask: Any, axis: Any = None, name: str | None = None) -> Tensor:
    """The elements (or rows) where ``mask`` is true."""
    x = node(tensor)
    a = x._array()
    m = node(mask)._array()
    if m.dtype.kind != "b":
        raise errors.InvalidArgumentError(f"boolean_mask: mask must be bool, got {m.dtype.name}")
    if a.shape[: m.ndim] != m.shape:
        raise errors.InvalidArgumentError(
            f"boolean_mask: mask shape {list(m.shape)} does not match the leading dimensions of "
            f"{list(a.shape)}"
        )
    z = a[m]

    def backward(g: Any, needs: tuple[bool, ...]) -> tuple[Any]:
        full = xp(g).zeros(a.shape, g.dtype)
        full[m] = g
        return (full,)

    return out(z, (x,), backward)


def where(condition: Any, x: Any = None, y: Any = None, name: str | None = None) -> Tensor:
    """Elementwise choice ``x if condition else y``; with one argument, true coordinates."""
    c = node(condition)._array()
    if c.dtype.kind != "b":
        raise errors.InvalidArgumentError(f"where: condition must be bool, got {c.dtype.name}")
    if x is None and y is None:
        return Tensor._wrap(xp(c).argwhere(c).astype(np.int64))
    if x is None or y is None:
        raise errors.InvalidArgumentError("where: give both x and y, or neither")
    from psflow.ops._core import binary, unbroadcast

    xn, yn = binary(x, y, "where")
    a, b = xn._array(), yn._array()
    try:
        z = xp(a).where(c, a, b)
    except ValueError:
        raise errors.InvalidArgumentError(
            f"where: shapes {list(c.shape)}, {list(a.shape)}, {list(b.shape)} do not broadcast"
        ) from None
    if z.dtype.kind != "f":
        return out(z, (xn, yn))

    def backward(g: Any, needs: tuple[bool, ...]) -> tuple[Any, Any]:
        zero = xp(g).zeros((), g.dtype)
        ga = unbroadcast(xp(g).where(c, g, zero), a.shape) if needs[0] else None
        gb = unbroadcast(xp(g).where(c, zero, g), b.shape) if needs[1] else None
        return ga, gb

    return out(z, (xn, yn), backward)


def one_hot(
    indices: Any,
    depth: int,
    on_value: Any = None,
    off_value: Any = None,
    axis: int = -1,
    dtype: Any = None,
    name: str | None = None,
) -> Tensor:
    """One-hot vectors of length ``depth`` (indices outside ``[0, depth)`` give all-off rows)."""
    idx = node(indices)._array()
    if idx.dtype.kind not in "iu":
        raise errors.InvalidArgumentError(
            f"one_hot: indices must be integers, got {idx.dtype.name}"
        )
    depth = int(depth)
    if depth < 0:
        raise errors.InvalidArgumentError(f"one_hot: depth must be >= 0, got {depth}")
    dt = dtypes.as_dtype(dtype) if dtype is not None else dtypes.float32
    on = 1 if on_value is None else on_value
    off = 0 if off_value is None else off_value
    m = xp(idx)
    hot = idx[..., None] == m.arange(depth)
    z = m.where(hot, on, off).astype(dt.np)
    if axis != -1:
        z = m.moveaxis(z, -1, axis)
    return Tensor._wrap(z)


def argmax(
    input: Any, axis: Any = None, output_type: Any = "int64", name: str | None = None
) -> Tensor:
    """Index of the largest value along ``axis`` (0 by default, as TensorFlow)."""
    a = node(input)._array()
    (ax,) = normalize_axis(0 if axis is None else axis, a.ndim, "argmax")
    return Tensor._wrap(a.argmax(axis=ax).astype(dtypes.as_dtype(output_type).np))


def argmin(
    input: Any, axis: Any = None, output_type: Any = "int64", name: str | None = None
) -> Tensor:
    """Index of the smallest value along ``axis`` (0 by default)."""
    a = node(input)._array()
    (ax,) = normalize_axis(0 if axis is None else axis, a.ndim, "argmin")
    return Tensor._wrap(a.argmin(axis=ax).astype(dtypes.as_dtype(output_type).np))


def reverse(tensor: Any, axis: Any, name: str | None = None) -> Tensor:
    """Reverses the order along each of ``axis``."""
    x = node(tensor)
    a = x._array()
    axes = normalize_axis(axis, a.ndim, "reverse")
    z = xp(a).flip(a, axes).copy()
    return out(z, (x,), lambda g, needs: (xp(g).flip(g, axes),))


def pad(
    tensor: Any,
    paddings: Any,
    mode: str = "CONSTANT",
    constant_values: Any = 0,
    name: str | None = None,
) -> Tensor:
    """Pads with ``constant_values`` (``paddings[i] = [before, after]`` for axis i)."""
    x = node(tensor)
    a = x._array()
    p = np.asarray(_ints(paddings, "paddings")).reshape(-1, 2)
    if p.shape[0] != a.ndim or (p < 0).any():
        raise errors.InvalidArgumentError(
            f"pad: paddings {p.tolist()} need one [before, after] >= 0 per dimension "
            f"of {list(a.shape)}"
        )
    if str(mode).upper() != "CONSTANT":
        raise errors.UnimplementedError(f"pad mode {mode!r} is not supported (only CONSTANT)")
    z = xp(a).pad(a, [tuple(r) for r in p.tolist()], constant_values=constant_values)
    key = tuple(builtins.slice(int(b), int(b) + d) for (b, _), d in zip(p, a.shape))
    return out(z, (x,), lambda g, needs: (g[key],))


# -- creation ----------------------------------------------------------------------------


def _new(shape_: Any, dtype: Any, fill: Any) -> Tensor:
    dims = (
        tuple(_ints(shape_, "shape"))
        if not isinstance(shape_, numbers.Integral)
        else (int(shape_),)
    )
    if any(d < 0 for d in dims):
        raise errors.InvalidArgumentError(f"Dimensions must be >= 0, got shape {list(dims)}")
    dt = dtypes.as_dtype(dtype)
    m = backend.xp_for(backend.current_device())
    return Tensor._wrap(m.full(dims, fill, dtype=dt.np))


def zeros(shape: Any, dtype: Any = "float32", name: str | None = None) -> Tensor:
    """A tensor of zeros."""
    return _new(shape, dtype, 0)


def ones(shape: Any, dtype: Any = "float32", name: str | None = None) -> Tensor:
    """A tensor of ones."""
    return _new(shape, dtype, 1)


def fill(dims: Any, value: Any, name: str | None = None) -> Tensor:
    """A tensor of ``dims`` filled with ``value`` (its dtype inferred from the value)."""
    v = convert_to_tensor(value)
    return _new(dims, v.dtype, v._array().reshape(()))


def zeros_like(input: Any, dtype: Any = None, name: str | None = None) -> Tensor:
    """Zeros of the same shape (and dtype unless given)."""
    a = node(input)._array()
    return Tensor._wrap(xp(a).zeros(a.shape, dtypes.as_dtype(dtype).np if dtype else a.dtype))


def ones_like(input: Any, dtype: Any = None, name: str | None = None) -> Tensor:
    """Ones of the same shape (and dtype unless given)."""
    a = node(input)._array()
    return Tensor._wrap(xp(a).ones(a.shape, dtypes.as_dtype(dtype).np if dtype else a.dtype))


def range(
    start: Any, limit: Any = None, delta: Any = 1, dtype: Any = None, name: str | None = None
) -> Tensor:
    """``[start, limit)`` in steps of ``delta``; int32 for ints, float32 for floats."""
    if limit is None:
        start, limit = 0, start
    vals = [float(v) if isinstance(v, Tensor) else v for v in (start, limit, delta)]
    if vals[2] == 0:
        raise errors.InvalidArgumentError("range: delta must not be 0")
    if dtype is None:
        dtype = "float32" if any(isinstance(v, float) for v in vals) else "int32"
    m = backend.xp_for(backend.current_device())
    return Tensor._wrap(m.arange(*vals, dtype=dtypes.as_dtype(dtype).np))


def linspace(start: Any, stop: Any, num: int, name: str | None = None, axis: int = 0) -> Tensor:
    """``num`` evenly spaced values from ``start`` to ``stop`` inclusive (float32)."""
    m = backend.xp_for(backend.current_device())
    return Tensor._wrap(m.linspace(float(start), float(stop), int(num), dtype=np.float32))


def eye(
    num_rows: int, num_columns: int | None = None, dtype: Any = "float32", name: str | None = None
) -> Tensor:
    """An identity matrix."""
    m = backend.xp_for(backend.current_device())
    return Tensor._wrap(m.eye(int(num_rows), num_columns, dtype=dtypes.as_dtype(dtype).np))

"""Value and norm clipping (TensorFlow's ``tf.clip_by_*`` family)."""

from __future__ import annotations

from typing import Any

from psflow import errors
from psflow.framework.indexed_slices import IndexedSlices
from psflow.framework.tensor import Tensor
from psflow.ops import math_ops
from psflow.ops._core import node, out, unbroadcast, xp


def clip_by_value(
    t: Any, clip_value_min: Any, clip_value_max: Any, name: str | None = None
) -> Tensor:
    """Clamps every element into ``[clip_value_min, clip_value_max]``.

    The gradient passes where the value was inside the range (TensorFlow's rule).
    """
    x = node(t)
    a = x._array()
    lo = (
        node(clip_value_min, dtype=None)._array()
        if not isinstance(clip_value_min, (int, float))
        else clip_value_min
    )
    hi = (
        node(clip_value_max, dtype=None)._array()
        if not isinstance(clip_value_max, (int, float))
        else clip_value_max
    )
    m = xp(a)
    if m.any(m.asarray(lo) > m.asarray(hi)):
        raise errors.InvalidArgumentError(
            f"clip_by_value: clip_value_min {clip_value_min!r} > clip_value_max {clip_value_max!r}"
        )
    z = m.clip(a, lo, hi).astype(a.dtype, copy=False)
    if a.dtype.kind != "f":
        return out(z, (x,))
    inside = (a >= lo) & (a <= hi)
    return out(z, (x,), lambda g, needs: (unbroadcast(g * inside, a.shape),))


def global_norm(t_list: list[Any], name: str | None = None) -> Tensor:
    """``sqrt(sum of squared elements of every tensor)``; ``None`` entries are skipped."""
    squares = []
    for t in t_list:
        if t is None:
            continue
        if isinstance(t, IndexedSlices):
            t = t.values
        squares.append(math_ops.reduce_sum(math_ops.square(t)))
    if not squares:
        return Tensor._wrap(xp(0).zeros((), "float32"))
    return math_ops.sqrt(math_ops.add_n(squares))


def clip_by_norm(t: Any, clip_norm: Any, axes: Any = None, name: str | None = None) -> Tensor:
    """Rescales ``t`` so its L2 norm (over ``axes``) is at most ``clip_norm``."""
    sq = math_ops.reduce_sum(math_ops.square(t), axis=axes, keepdims=True)
    norm = math_ops.sqrt(sq)
    scale = math_ops.divide(clip_norm, math_ops.maximum(norm, clip_norm))
    return math_ops.multiply(t, scale)


def clip_by_global_norm(
    t_list: list[Any], clip_norm: Any, use_norm: Any = None, name: str | None = None
) -> tuple[list[Any], Tensor]:
    """Scales every tensor by ``clip_norm / max(global_norm, clip_norm)``.

    Returns the clipped list (``None`` entries kept, sparse gradients kept
    sparse) and the global norm before clipping.

    Raises:
        InvalidArgumentError: ``t_list`` is not a list or tuple.
    """
    if not isinstance(t_list, (list, tuple)):
        raise errors.InvalidArgumentError(
            f"clip_by_global_norm expects a list of tensors, got {t_list!r}"
        )
    norm = global_norm(t_list) if use_norm is None else node(use_norm)
    c = float(clip_norm)
    # An op, not a Python float: when clipping, the gradient flows through the norm too.
    scale = math_ops.divide(c, math_ops.maximum(norm, c))
    clipped: list[Any] = []
    for t in t_list:
        if t is None:
            clipped.append(None)
        elif isinstance(t, IndexedSlices):
            factor = t._values.dtype.type(float(scale.numpy()))
            clipped.append(IndexedSlices._raw(t._values * factor, t._indices, t._dense_shape))
        else:
            t = node(t)
            clipped.append(math_ops.multiply(t, math_ops.cast(scale, t.dtype)))
    return clipped, norm

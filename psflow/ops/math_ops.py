"""Elementwise math, reductions and ``matmul``, each with its vector-Jacobian product."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from psflow import dtypes, errors
from psflow.framework import tape as tape_lib
from psflow.framework.product_gradient import ProductGradient
from psflow.framework.tensor import Tensor
from psflow.ops import kernel_pool
from psflow.ops._core import (
    binary,
    check_broadcast,
    node,
    normalize_axis,
    operands,
    out,
    unbroadcast,
    xp,
)

# -- binary arithmetic -------------------------------------------------------------------


def _binary_op(
    name: str,
    forward: Callable[[Any, Any], Any],
    grads: Callable[[Any, Any, Any, Any], tuple[Any, Any]] | None,
) -> Callable[..., Tensor]:
    def op(x: Any, y: Any, name_: str | None = None) -> Tensor:
        x, y, a, b = operands(x, y, name)
        try:
            z = forward(a, b)
        except ValueError:
            check_broadcast(a, b, name)  # names the shapes when that is the cause
            raise
        if grads is None or z.dtype.kind != "f":
            return out(z, (x, y))

        def backward(g: Any, needs: tuple[bool, ...]) -> tuple[Any, Any]:
            ga, gb = grads(g, a, b, z)
            if not needs[0] or ga is None:
                ga = None
            elif ga.shape != a.shape:
                ga = unbroadcast(ga, a.shape)
            if not needs[1] or gb is None:
                gb = None
            elif gb.shape != b.shape:
                gb = unbroadcast(gb, b.shape)
            return ga, gb

        return out(z, (x, y), backward)

    op.__name__ = name
    op.__doc__ = f"Elementwise ``{name}`` with broadcasting (TensorFlow's ``tf.math.{name}``)."
    return op


def _add(a: Any, b: Any) -> Any:
    return a + b


add = _binary_op("add", _add, lambda g, a, b, z: (g, g))
subtract = _binary_op("subtract", lambda a, b: a - b, lambda g, a, b, z: (g, -g))
multiply = _binary_op("multiply", lambda a, b: a * b, lambda g, a, b, z: (g * b, g * a))
maximum = _binary_op(
    "maximum",
    lambda a, b: xp(a).maximum(a, b),
    lambda g, a, b, z: (g * (a >= b), g * (a < b)),
)
minimum = _binary_op(
    "minimum",
    lambda a, b: xp(a).minimum(a, b),
    lambda g, a, b, z: (g * (a <= b), g * (a > b)),
)
squared_difference = _binary_op(
    "squared_difference",
    lambda a, b: (a - b) * (a - b),
    lambda g, a, b, z: (2 * g * (a - b), -2 * g * (a - b)),
)


def _floordiv(a: Any, b: Any) -> Any:
    if a.dtype.kind in "iu" and b.size and not b.all():
        raise errors.InvalidArgumentError("floordiv: integer division by zero")
    return xp(a).floor_divide(a, b)


def _floormod(a: Any, b: Any) -> Any:
    if a.dtype.kind in "iu" and b.size and not b.all():
        raise errors.InvalidArgumentError("floormod: integer division by zero")
    return xp(a).mod(a, b)


floordiv = _binary_op("floordiv", _floordiv, lambda g, a, b, z: (None, None))
floormod = _binary_op("floormod", _floormod, lambda g, a, b, z: (g, -g * xp(a).floor(a / b)))
mod = floormod


def _pow_grads(g: Any, a: Any, b: Any, z: Any) -> tuple[Any, Any]:
    m = xp(a)
    ga = g * b * m.power(a, b - 1)
    safe = m.where(a > 0, a, 1)
    gb = g * z * m.where(a > 0, m.log(safe), 0)
    return ga, gb


pow = _binary_op("pow", lambda a, b: xp(a).power(a, b), _pow_grads)


def _true_div_dtype(d: np.dtype) -> np.dtype:
    if d.kind in "iu":
        return np.dtype(np.float32) if d.itemsize <= 2 else np.dtype(np.float64)
    return d


def divide(x: Any, y: Any, name: str | None = None) -> Tensor:
    """Elementwise ``x / y``; integer tensors divide into floats, as ``tf.math.truediv``."""
    x, y = binary(x, y, "divide")
    a, b = x._array(), y._array()
    check_broadcast(a, b, "divide")
    if a.dtype.kind in "iu":
        want = _true_div_dtype(a.dtype)
        return out(a.astype(want) / b.astype(want), (x, y))
    z = a / b

    def backward(g: Any, needs: tuple[bool, ...]) -> tuple[Any, Any]:
        ga = unbroadcast(g / b, a.shape) if needs[0] else None
        gb = unbroadcast(-g * z / b, b.shape) if needs[1] else None
        return ga, gb

    return out(z, (x, y), backward)


truediv = divide


def divide_no_nan(x: Any, y: Any, name: str | None = None) -> Tensor:
    """``x / y``, with 0 wherever ``y`` is 0."""
    x, y = binary(x, y, "divide_no_nan")
    a, b = x._array(), y._array()
    m = xp(a)
    zero = b == 0
    safe = m.where(zero, 1, b).astype(b.dtype)
    z = m.where(zero, 0, a / safe).astype(a.dtype)

    def backward(g: Any, needs: tuple[bool, ...]) -> tuple[Any, Any]:
        ga = unbroadcast(m.where(zero, 0, g / safe).astype(a.dtype), a.shape) if needs[0] else None
        gb = (
            unbroadcast(m.where(zero, 0, -g * z / safe).astype(b.dtype), b.shape)
            if needs[1]
            else None
        )
        return ga, gb

    return out(z, (x, y), backward)


def add_n(inputs: list[Any], name: str | None = None) -> Tensor:
    """Sum of a list of tensors of one shape and dtype."""
    if not inputs:
        raise errors.InvalidArgumentError("add_n needs at least one input")
    nodes = [node(t) for t in inputs]
    arrays = [n._array() for n in nodes]
    for a in arrays[1:]:
        if a.shape != arrays[0].shape or a.dtype != arrays[0].dtype:
            raise errors.InvalidArgumentError(
                f"add_n: all inputs need one shape and dtype, got {arrays[0].shape}/"
                f"{arrays[0].dtype.name} and {a.shape}/{a.dtype.name}"
            )
    total = arrays[0].copy()
    for a in arrays[1:]:
        total += a
    return out(total, tuple(nodes), lambda g, needs: tuple(g if n else None for n in needs))


# -- comparisons and logic (no gradients) ------------------------------------------------


def _compare(name: str, f: Callable[[Any, Any], Any]) -> Callable[..., Tensor]:
    def op(x: Any, y: Any, name_: str | None = None) -> Tensor:
        x, y = binary(x, y, name)
        a, b = x._array(), y._array()
        check_broadcast(a, b, name)
        return Tensor._wrap(f(a, b))

    op.__name__ = name
    op.__doc__ = f"Elementwise ``{name}``, a bool tensor (TensorFlow's ``tf.math.{name}``)."
    return op


equal = _compare("equal", lambda a, b: a == b)
not_equal = _compare("not_equal", lambda a, b: a != b)
less = _compare("less", lambda a, b: a < b)
less_equal = _compare("less_equal", lambda a, b: a <= b)
greater = _compare("greater", lambda a, b: a > b)
greater_equal = _compare("greater_equal", lambda a, b: a >= b)


def _logical(name: str, f: Callable[[Any, Any], Any]) -> Callable[..., Tensor]:
    def op(x: Any, y: Any, name_: str | None = None) -> Tensor:
        x, y = binary(x, y, name)
        if x._array().dtype.kind != "b":
            raise errors.InvalidArgumentError(f"{name} needs bool tensors, got {x.dtype.name}")
        return Tensor._wrap(f(x._array(), y._array()))

    op.__name__ = name
    op.__doc__ = f"Elementwise ``{name}`` of bool tensors."
    return op


logical_and = _logical("logical_and", lambda a, b: a & b)
logical_or = _logical("logical_or", lambda a, b: a | b)
logical_xor = _logical("logical_xor", lambda a, b: a ^ b)


def logical_not(x: Any, name: str | None = None) -> Tensor:
    """Elementwise not of a bool tensor."""
    x = node(x)
    if x._array().dtype.kind != "b":
        raise errors.InvalidArgumentError(f"logical_not needs a bool tensor, got {x.dtype.name}")
    return Tensor._wrap(~x._array())


# -- unary math --------------------------------------------------------------------------


def _unary_op(
    name: str,
    forward: Callable[[Any], Any],
    grad: Callable[[Any, Any, Any], Any] | None,
    float_only: bool = False,
) -> Callable[..., Tensor]:
    def op(x: Any, name_: str | None = None) -> Tensor:
        x = node(x)
        a = x._array()
        if float_only and a.dtype.kind != "f":
            raise errors.InvalidArgumentError(
                f"{name} needs a floating-point tensor, got {a.dtype.name}: {x!r}"
            )
        z = forward(a)
        if grad is None or z.dtype.kind != "f":
            return out(z, (x,))
        return out(z, (x,), lambda g, needs: (grad(g, a, z),))

    op.__name__ = name
    op.__doc__ = f"Elementwise ``{name}`` (TensorFlow's ``tf.math.{name}``)."
    return op


negative = _unary_op("negative", lambda a: -a, lambda g, a, z: -g)
abs = _unary_op("abs", lambda a: xp(a).abs(a), lambda g, a, z: g * xp(a).sign(a))
square = _unary_op("square", lambda a: a * a, lambda g, a, z: 2 * g * a)
exp = _unary_op("exp", lambda a: xp(a).exp(a), lambda g, a, z: g * z, float_only=True)
expm1 = _unary_op("expm1", lambda a: xp(a).expm1(a), lambda g, a, z: g * (z + 1), float_only=True)
log = _unary_op("log", lambda a: xp(a).log(a), lambda g, a, z: g / a, float_only=True)
log1p = _unary_op("log1p", lambda a: xp(a).log1p(a), lambda g, a, z: g / (1 + a), float_only=True)
sqrt = _unary_op("sqrt", lambda a: xp(a).sqrt(a), lambda g, a, z: g / (2 * z), float_only=True)
rsqrt = _unary_op(
    "rsqrt", lambda a: 1 / xp(a).sqrt(a), lambda g, a, z: -0.5 * g * z * z * z, float_only=True
)
reciprocal = _unary_op("reciprocal", lambda a: 1 / a, lambda g, a, z: -g * z * z, float_only=True)
sin = _unary_op("sin", lambda a: xp(a).sin(a), lambda g, a, z: g * xp(a).cos(a), float_only=True)
cos = _unary_op("cos", lambda a: xp(a).cos(a), lambda g, a, z: -g * xp(a).sin(a), float_only=True)
tanh = _unary_op("tanh", lambda a: xp(a).tanh(a), lambda g, a, z: g * (1 - z * z), float_only=True)
sign = _unary_op("sign", lambda a: xp(a).sign(a), lambda g, a, z: xp(a).zeros_like(g))
floor = _unary_op("floor", lambda a: xp(a).floor(a), None)
ceil = _unary_op("ceil", lambda a: xp(a).ceil(a), None)
round = _unary_op("round", lambda a: xp(a).round(a), None)


def _sigmoid(a: Any) -> Any:
    m = xp(a)
    # exp of a non-positive number only: no overflow for large |a|
    e = m.exp(-m.abs(a))
    return m.where(a >= 0, 1 / (1 + e), e / (1 + e)).astype(a.dtype, copy=False)


sigmoid = _unary_op("sigmoid", _sigmoid, lambda g, a, z: g * z * (1 - z), float_only=True)


def _softplus(a: Any) -> Any:
    m = xp(a)
    return (m.maximum(a, 0) + m.log1p(m.exp(-m.abs(a)))).astype(a.dtype, copy=False)


softplus = _unary_op("softplus", _softplus, lambda g, a, z: g * _sigmoid(a), float_only=True)


def cast(x: Any, dtype: Any, name: str | None = None) -> Tensor:
    """Converts to another dtype; gradients flow between floating types."""
    x = node(x)
    want = dtypes.as_dtype(dtype)
    a = x._array()
    if a.dtype == want.np:
        return out(a, (x,), lambda g, needs: (g,))
    if a.dtype.kind == "O" or want.np.kind == "O":  # text parses in preprocessing layers only
        raise TypeError(f"cast: cannot cast {dtypes.from_numpy(a.dtype).name} {x!r} to {want.name}")
    z = a.astype(want.np)
    if want.is_floating and a.dtype.kind == "f":
        return out(z, (x,), lambda g, needs: (g.astype(a.dtype),))
    return out(z, (x,))


# -- reductions --------------------------------------------------------------------------


def _keep_shape(a: Any, axes: tuple[int, ...] | None) -> tuple[int, ...]:
    if axes is None:
        return (1,) * a.ndim
    return tuple(1 if i in axes else d for i, d in enumerate(a.shape))


def _reduction(
    name: str,
    forward: Callable[..., Any],
    grad: Callable[[Any, Any, Any, tuple[int, ...] | None], Any] | None,
) -> Callable[..., Tensor]:
    def op(
        input_tensor: Any, axis: Any = None, keepdims: bool = False, name_: str | None = None
    ) -> Tensor:
        x = node(input_tensor)
        a = x._array()
        axes = normalize_axis(axis, a.ndim, name)
        if a.ndim == 0:
            axes = None
        z = forward(a, axis=axes, keepdims=keepdims)
        if grad is None or a.dtype.kind != "f":
            return out(z, (x,))

        def backward(g: Any, needs: tuple[bool, ...]) -> tuple[Any]:
            shape = _keep_shape(a, axes)
            zk = z.reshape(shape) if hasattr(z, "reshape") else z
            return (grad(g.reshape(shape), a, zk, axes),)

        return out(z, (x,), backward)

    op.__name__ = name
    op.__doc__ = (
        f"``{name}`` over ``axis`` (all axes when None), keeping reduced axes with "
        f"``keepdims`` (TensorFlow's ``tf.math.{name}``)."
    )
    return op


def _count(a: Any, axes: tuple[int, ...] | None) -> int:
    if axes is None:
        return a.size
    return int(np.prod([a.shape[i] for i in axes], dtype=np.int64))


def _mean(a: Any, axis: Any, keepdims: bool) -> Any:
    if a.dtype.kind in "iu":  # TensorFlow's integer mean truncates
        return (a.sum(axis=axis, keepdims=keepdims) // max(_count(a, axis), 1)).astype(a.dtype)
    count = _count(a, axis)
    if count and a.dtype.itemsize >= 4:
        # what ndarray.mean computes for float32/64, without its Python-level wrapper
        return a.sum(axis=axis, keepdims=keepdims) / count
    return a.mean(axis=axis, keepdims=keepdims)  # float16 accumulates in float32 there


def _extreme_grad(g: Any, a: Any, z: Any, axes: Any) -> Any:
    hit = (a == z).astype(a.dtype)
    return g * hit / hit.sum(axis=axes, keepdims=True)


def _spread(g: Any, a: Any) -> Any:
    """``g`` broadcast to ``a``'s shape: filled in for small arrays (cheaper than
    ``broadcast_to``'s Python wrapper), a read-only view for large ones."""
    if a.size <= 4096:
        return xp(a).full(a.shape, g, dtype=g.dtype)
    return xp(a).broadcast_to(g, a.shape)


reduce_sum = _reduction(
    "reduce_sum",
    lambda a, axis, keepdims: a.sum(axis=axis, keepdims=keepdims),
    lambda g, a, z, axes: _spread(g, a),
)
reduce_mean = _reduction(
    "reduce_mean",
    _mean,
    lambda g, a, z, axes: _spread(g / _count(a, axes), a),
)
reduce_max = _reduction(
    "reduce_max", lambda a, axis, keepdims: a.max(axis=axis, keepdims=keepdims), _extreme_grad
)
reduce_min = _reduction(
    "reduce_min", lambda a, axis, keepdims: a.min(axis=axis, keepdims=keepdims), _extreme_grad
)


def _prod_grad(g: Any, a: Any, z: Any, axes: tuple[int, ...] | None) -> Any:
    # d prod / d a_i is the product of the other elements; z / a is 0/0 where a_i == 0,
    # so multiply exclusive cumulative products from the left and from the right.
    m = xp(a)
    if a.size == 0:
        return m.zeros_like(a)
    axes = tuple(range(a.ndim)) if axes is None else axes
    perm = [i for i in range(a.ndim) if i not in axes] + list(axes)
    t = a.transpose(perm)
    flat = t.reshape((*t.shape[: a.ndim - len(axes)], -1))
    ones = m.ones((*flat.shape[:-1], 1), a.dtype)
    left = m.cumprod(m.concatenate([ones, flat[..., :-1]], axis=-1), axis=-1)
    rev = m.flip(flat, -1)
    right = m.flip(m.cumprod(m.concatenate([ones, rev[..., :-1]], axis=-1), axis=-1), -1)
    others = (left * right).reshape(t.shape).transpose(np.argsort(perm))
    return g * others


reduce_prod = _reduction(
    "reduce_prod", lambda a, axis, keepdims: a.prod(axis=axis, keepdims=keepdims), _prod_grad
)
reduce_any = _reduction(
    "reduce_any", lambda a, axis, keepdims: a.any(axis=axis, keepdims=keepdims), None
)
reduce_all = _reduction(
    "reduce_all", lambda a, axis, keepdims: a.all(axis=axis, keepdims=keepdims), None
)


def _logsumexp(a: Any, axis: Any, keepdims: bool) -> Any:
    m = xp(a)
    top = a.max(axis=axis, keepdims=True)
    top = m.where(m.isfinite(top), top, 0)
    s = m.log(m.exp(a - top).sum(axis=axis, keepdims=True)) + top
    return s if keepdims else s.reshape(m.sum(a, axis=axis).shape)


reduce_logsumexp = _reduction(
    "reduce_logsumexp", _logsumexp, lambda g, a, z, axes: g * xp(a).exp(a - z)
)


def reduce_variance(
    input_tensor: Any, axis: Any = None, keepdims: bool = False, name: str | None = None
) -> Tensor:
    """Population variance over ``axis``."""
    mean = reduce_mean(input_tensor, axis=axis, keepdims=True)
    return reduce_mean(squared_difference(input_tensor, mean), axis=axis, keepdims=keepdims)


def reduce_std(
    input_tensor: Any, axis: Any = None, keepdims: bool = False, name: str | None = None
) -> Tensor:
    """Population standard deviation over ``axis``."""
    return sqrt(reduce_variance(input_tensor, axis=axis, keepdims=keepdims))


def count_nonzero(
    input: Any, axis: Any = None, keepdims: bool = False, dtype: Any = "int64"
) -> Tensor:
    """Number of non-zero elements over ``axis``."""
    a = node(input)._array()
    axes = normalize_axis(axis, a.ndim, "count_nonzero")
    return Tensor._wrap(
        (a != 0).sum(axis=axes, keepdims=keepdims).astype(dtypes.as_dtype(dtype).np)
    )


def cumsum(
    x: Any, axis: int = 0, exclusive: bool = False, reverse: bool = False, name: str | None = None
) -> Tensor:
    """Cumulative sum along ``axis`` (TensorFlow's ``tf.math.cumsum``)."""
    x = node(x)
    a = x._array()
    (ax,) = normalize_axis(axis, a.ndim, "cumsum")
    m = xp(a)

    def scan(v: Any, excl: bool, rev: bool) -> Any:
        if rev:
            v = m.flip(v, ax)
        s = m.cumsum(v, axis=ax, dtype=v.dtype)
        if excl:
            s = s - v
        return m.flip(s, ax) if rev else s

    z = scan(a, exclusive, reverse)
    if a.dtype.kind != "f":
        return out(z, (x,))
    return out(z, (x,), lambda g, needs: (scan(g, exclusive, not reverse),))


# -- matrix products ---------------------------------------------------------------------


def matmul(
    a: Any,
    b: Any,
    transpose_a: bool = False,
    transpose_b: bool = False,
    adjoint_a: bool = False,
    adjoint_b: bool = False,
    name: str | None = None,
) -> Tensor:
    """Matrix product of the last two axes, batched over leading ones (``tf.linalg.matmul``).

    Raises:
        InvalidArgumentError: ranks below 2, or inner dimensions that differ.
    """
    x, y, A, B = operands(a, b, "matmul")
    if (
        A.ndim == 2
        and B.ndim == 2
        and not (transpose_a or transpose_b or adjoint_a or adjoint_b)
        and A.shape[1] == B.shape[0]
    ):
        return _matmul_2d(x, y, A, B)
    ta, tb = transpose_a or adjoint_a, transpose_b or adjoint_b
    if A.ndim < 2 or B.ndim < 2:
        raise errors.InvalidArgumentError(
            f"matmul needs tensors of rank >= 2, got shapes {list(A.shape)} and {list(B.shape)}"
        )
    Am = A.swapaxes(-1, -2) if ta else A
    Bm = B.swapaxes(-1, -2) if tb else B
    if Am.shape[-1] != Bm.shape[-2]:
        raise errors.InvalidArgumentError(
            f"matmul: inner dimensions differ: shapes {list(A.shape)} and {list(B.shape)} "
            f"(transpose_a={ta}, transpose_b={tb})"
        )
    m = xp(A)
    z = m.matmul(Am, Bm)
    if z.dtype.kind != "f":
        return out(z, (x, y))

    def backward(g: Any, needs: tuple[bool, ...]) -> tuple[Any, Any]:
        ga = gb = None
        if needs[0]:
            ga = m.matmul(Bm, g.swapaxes(-1, -2)) if ta else m.matmul(g, Bm.swapaxes(-1, -2))
            ga = unbroadcast(ga, A.shape) if ga.shape != A.shape else ga
        if needs[1]:
            gb = m.matmul(g.swapaxes(-1, -2), Am) if tb else m.matmul(Am.swapaxes(-1, -2), g)
            gb = unbroadcast(gb, B.shape) if gb.shape != B.shape else gb
        return ga, gb

    return out(z, (x, y), backward)


def _matmul_2d(x: Any, y: Any, A: Any, B: Any) -> Tensor:
    """The common case of :func:`matmul`: two matrices, no transposes (checked).

    Float NumPy products go through the kernel threads, cut by shape as the fused
    ``Dense`` op's are (:func:`psflow.ops.kernel_pool.matmul`): the two agree bitwise.
    """
    if A.dtype.kind != "f":
        return out(A @ B, (x, y))
    mm = multiplier(A)
    z = mm(A, B)

    def backward(g: Any, needs: tuple[bool, ...]) -> tuple[Any, Any]:
        return matmul_grads(g, A, B, needs, mm)

    return out(z, (x, y), backward)


def matmul_grads(g: Any, a: Any, w: Any, needs: tuple[bool, ...], mm: Any) -> tuple[Any, Any]:
    """The gradients of ``a @ w`` from the output's ``g``: ``(g @ w.T, a.T @ g)``, each only
    where ``needs`` asks (``mm`` multiplies: the kernel threads' for NumPy arrays).

    On NumPy arrays the two products run side by side on the kernel threads. While the
    tape defers products (:func:`psflow.framework.tape.products_deferred`: ``fit``'s step,
    for an optimizer that multiplies the weight's gradient out as it updates the weight),
    ``w``'s gradient is the :class:`ProductGradient` of ``a`` and ``g`` instead.
    """
    if needs[1] and mm is kernel_pool.matmul and tape_lib.products_deferred():
        return (mm(g, w.T) if needs[0] else None, ProductGradient(a, g))
    if needs[0] and needs[1] and mm is kernel_pool.matmul:
        gx, gw = kernel_pool.matmuls([(g, w.T), (a.T, g)])
        return gx, gw
    return (mm(g, w.T) if needs[0] else None, mm(a.T, g) if needs[1] else None)


def multiplier(a: Any) -> Any:
    """The product function for matrices like ``a``: the kernel threads' for NumPy arrays
    (cut by shape: the same bits on any thread count), ``@`` for others (CuPy's)."""
    return kernel_pool.matmul if xp(a) is np else _product


def _product(a: Any, b: Any) -> Any:
    return a @ b


def tensordot(a: Any, b: Any, axes: Any, name: str | None = None) -> Tensor:
    """Contraction over ``axes`` (an int, or two lists of axes), as ``tf.tensordot``."""
    x, y = binary(a, b, "tensordot")
    A, B = x._array(), y._array()
    if isinstance(axes, (int, np.integer)):
        ax_a, ax_b = list(range(A.ndim - int(axes), A.ndim)), list(range(int(axes)))
    else:
        ax_a, ax_b = [list(np.atleast_1d(v)) for v in axes]
    ax_a = [int(i) % A.ndim for i in ax_a]
    ax_b = [int(i) % B.ndim for i in ax_b]
    free_a = [i for i in range(A.ndim) if i not in ax_a]
    free_b = [i for i in range(B.ndim) if i not in ax_b]
    for i, j in zip(ax_a, ax_b):
        if A.shape[i] != B.shape[j]:
            raise errors.InvalidArgumentError(
                f"tensordot: axis {i} of shape {list(A.shape)} differs from axis {j} "
                f"of {list(B.shape)}"
            )
    from psflow.ops import array_ops

    at = array_ops.reshape(
        array_ops.transpose(x, free_a + ax_a),
        [int(np.prod([A.shape[i] for i in free_a], dtype=np.int64)), -1],
    )
    bt = array_ops.reshape(
        array_ops.transpose(y, ax_b + free_b),
        [-1, int(np.prod([B.shape[i] for i in free_b], dtype=np.int64))],
    )
    return array_ops.reshape(
        matmul(at, bt), [A.shape[i] for i in free_a] + [B.shape[i] for i in free_b]
    )

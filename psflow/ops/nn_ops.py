"""Neural-network ops: activations, softmax, cross-entropies, embeddings, dropout."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from psflow import backend, errors
from psflow.framework.tensor import Tensor, convert_to_tensor
from psflow.ops import array_ops, compiled, kernel_pool, math_ops
from psflow.ops._core import binary, node, normalize_axis, operands, out, xp


def _float_node(x: Any, op_name: str) -> Any:
    n = node(x)
    if n._array().dtype.kind != "f":
        raise errors.InvalidArgumentError(
            f"{op_name} needs a floating-point tensor, got {n._array().dtype.name}: {n!r}"
        )
    return n


def relu(features: Any, name: str | None = None) -> Tensor:
    """``max(features, 0)``."""
    x = node(features)
    a = x._array()
    z = xp(a).maximum(a, 0).astype(a.dtype, copy=False)
    if a.dtype.kind != "f":
        return out(z, (x,))
    return out(z, (x,), lambda g, needs: (_relu_grad(g, z),))


def _relu_grad(g: Any, z: Any) -> Any:
    """``g * (z > 0)``; on NumPy arrays one compiled pass where Numba is (the same bits)."""
    if isinstance(g, np.ndarray) and isinstance(z, np.ndarray):
        return compiled.relu_grad(g, z)
    return g * (z > 0)


def dense(x: Any, kernel: Any, bias: Any = None, relu: bool = False) -> Tensor | None:
    """``relu?(x @ kernel + bias)`` for a matrix ``x`` as one op, or None if it does not apply.

    The sum and the activation are computed in place in the product's fresh
    buffer, and the tape records one backward function: the same values,
    bitwise, as ``matmul``, ``add`` and ``relu`` one after the other, with two
    fewer temporaries per call.  Returns None (the caller composes the ops)
    unless ``x`` and ``kernel`` are floating-point matrices of one dtype that
    multiply and ``bias`` (if any) is a vector of the output width.
    """
    xn, kn, a, w = operands(x, kernel, "dense")
    if a.ndim != 2 or w.ndim != 2 or a.shape[1] != w.shape[0] or a.dtype.kind != "f":
        return None
    inputs: tuple[Any, ...] = (xn, kn)
    if bias is not None:
        bn = node(bias)
        b = bn._array()
        if b.dtype != a.dtype or b.shape != (w.shape[1],):
            return None
        inputs = (xn, kn, bn)
    mm = math_ops.multiplier(a)
    if mm is kernel_pool.matmul:  # the sum and ReLU on each chunk, by the thread that made it
        z = kernel_pool.dense(a, w, b if bias is not None else None, relu)
    else:
        z = mm(a, w)
        if bias is not None:
            z += b
        if relu:
            xp(z).maximum(z, 0, out=z)

    def backward(g: Any, needs: tuple[bool, ...]) -> tuple[Any, ...]:
        if relu:
            g = _relu_grad(g, z)
        grads = math_ops.matmul_grads(g, a, w, needs, mm)
        if len(needs) == 3:
            return (*grads, g.sum(axis=0) if needs[2] else None)
        return grads

    return out(z, inputs, backward)


def relu6(features: Any, name: str | None = None) -> Tensor:
    """``min(max(features, 0), 6)``."""
    x = _float_node(features, "relu6")
    a = x._array()
    z = xp(a).clip(a, 0, 6)
    return out(z, (x,), lambda g, needs: (g * ((a > 0) & (a < 6)),))


def leaky_relu(features: Any, alpha: float = 0.2, name: str | None = None) -> Tensor:
    """``features`` where positive, ``alpha * features`` elsewhere."""
    x = _float_node(features, "leaky_relu")
    a = x._array()
    m = xp(a)
    z = m.where(a > 0, a, a * alpha).astype(a.dtype, copy=False)
    return out(
        z, (x,), lambda g, needs: (m.where(a > 0, g, g * alpha).astype(g.dtype, copy=False),)
    )


def elu(features: Any, name: str | None = None) -> Tensor:
    """``features`` where positive, ``exp(features) - 1`` elsewhere."""
    x = _float_node(features, "elu")
    a = x._array()
    m = xp(a)
    z = m.where(a > 0, a, m.expm1(m.minimum(a, 0))).astype(a.dtype, copy=False)
    return out(
        z, (x,), lambda g, needs: (m.where(a > 0, g, g * (z + 1)).astype(g.dtype, copy=False),)
    )


def selu(features: Any, name: str | None = None) -> Tensor:
    """Scaled ELU with the self-normalizing constants."""
    alpha, scale = 1.6732632423543772, 1.0507009873554805
    return math_ops.multiply(
        scale,
        array_ops.where(
            math_ops.greater(features, 0),
            features,
            math_ops.multiply(alpha, math_ops.expm1(features)),
        ),
    )


# Python floats, not NumPy scalars: they take the input's dtype, so a float32 gelu
# stays float32 (a float64 scalar would promote it, slow on most GPUs)
_SQRT_2 = math.sqrt(2.0)
_SQRT_2PI = math.sqrt(2.0 * math.pi)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def gelu(features: Any, approximate: bool = False, name: str | None = None) -> Tensor:
    """Gaussian error linear unit (tanh approximation when ``approximate``)."""
    x = _float_node(features, "gelu")
    a = x._array()
    m = xp(a)
    if approximate:
        c = _SQRT_2_OVER_PI
        inner = c * (a + 0.044715 * a**3)
        t = m.tanh(inner)
        z = (0.5 * a * (1 + t)).astype(a.dtype)
        dinner = c * (1 + 3 * 0.044715 * a * a)
        return out(
            z,
            (x,),
            lambda g, needs: (
                (g * (0.5 * (1 + t) + 0.5 * a * (1 - t * t) * dinner)).astype(g.dtype),
            ),
        )
    cdf = 0.5 * (1 + backend.erf(a / _SQRT_2))
    z = (a * cdf).astype(a.dtype)
    pdf = m.exp(-0.5 * a * a) / _SQRT_2PI
    return out(z, (x,), lambda g, needs: ((g * (cdf + a * pdf)).astype(g.dtype),))


def sigmoid(x: Any, name: str | None = None) -> Tensor:
    """``1 / (1 + exp(-x))``, stable for large |x|."""
    return math_ops.sigmoid(x)


def tanh(x: Any, name: str | None = None) -> Tensor:
    """Hyperbolic tangent."""
    return math_ops.tanh(x)


def softplus(features: Any, name: str | None = None) -> Tensor:
    """``log(1 + exp(features))``, stable for large |x|."""
    return math_ops.softplus(features)


def swish(features: Any, beta: float = 1.0) -> Tensor:
    """``features * sigmoid(beta * features)`` (also called silu)."""
    return math_ops.multiply(features, math_ops.sigmoid(math_ops.multiply(beta, features)))


silu = swish


def _softmax_array(a: Any, ax: int) -> Any:
    m = xp(a)
    e = m.exp(a - a.max(axis=ax, keepdims=True))
    e /= e.sum(axis=ax, keepdims=True)
    return e


def softmax(logits: Any, axis: int = -1, name: str | None = None) -> Tensor:
    """``exp(logits) / sum(exp(logits))`` along ``axis``."""
    x = _float_node(logits, "softmax")
    a = x._array()
    (ax,) = normalize_axis(axis, a.ndim, "softmax")
    z = _softmax_array(a, ax)
    return out(z, (x,), lambda g, needs: (z * (g - (g * z).sum(axis=ax, keepdims=True)),))


def log_softmax(logits: Any, axis: int = -1, name: str | None = None) -> Tensor:
    """``logits - log(sum(exp(logits)))`` along ``axis``."""
    x = _float_node(logits, "log_softmax")
    a = x._array()
    (ax,) = normalize_axis(axis, a.ndim, "log_softmax")
    m = xp(a)
    shifted = a - a.max(axis=ax, keepdims=True)
    z = shifted - m.log(m.exp(shifted).sum(axis=ax, keepdims=True))
    return out(z, (x,), lambda g, needs: (g - m.exp(z) * g.sum(axis=ax, keepdims=True),))


def sigmoid_cross_entropy_with_logits(
    labels: Any = None, logits: Any = None, name: str | None = None
) -> Tensor:
    """Elementwise ``-labels*log(sigmoid(logits)) - (1-labels)*log(1-sigmoid(logits))``, stably.

    Raises:
        InvalidArgumentError: labels and logits differ in shape or dtype.
    """
    lab, lg = binary(labels, logits, "sigmoid_cross_entropy_with_logits")
    y, a = lab._array(), lg._array()
    if y.shape != a.shape:
        raise errors.InvalidArgumentError(
            f"sigmoid_cross_entropy_with_logits: labels shape {list(y.shape)} != logits shape "
            f"{list(a.shape)}"
        )
    m = xp(a)
    z = (m.maximum(a, 0) - a * y + m.log1p(m.exp(-m.abs(a)))).astype(a.dtype, copy=False)

    def backward(g: Any, needs: tuple[bool, ...]) -> tuple[Any, Any]:
        s = math_ops._sigmoid(a)
        return (-g * a if needs[0] else None, g * (s - y) if needs[1] else None)

    return out(z, (lab, lg), backward)


def softmax_cross_entropy_with_logits(
    labels: Any, logits: Any, axis: int = -1, name: str | None = None
) -> Tensor:
    """Cross-entropy between ``labels`` (distributions) and ``softmax(logits)`` per example."""
    lab, lg = binary(labels, logits, "softmax_cross_entropy_with_logits")
    y, a = lab._array(), lg._array()
    if y.shape != a.shape:
        raise errors.InvalidArgumentError(
            f"softmax_cross_entropy_with_logits: labels shape {list(y.shape)} != logits shape "
            f"{list(a.shape)}"
        )
    (ax,) = normalize_axis(axis, a.ndim, "softmax_cross_entropy_with_logits")
    m = xp(a)
    shifted = a - a.max(axis=ax, keepdims=True)
    lse = m.log(m.exp(shifted).sum(axis=ax, keepdims=True))
    logp = shifted - lse
    z = -(y * logp).sum(axis=ax)

    def backward(g: Any, needs: tuple[bool, ...]) -> tuple[Any, Any]:
        ge = m.expand_dims(g, ax)
        gl = ge * (m.exp(logp) * y.sum(axis=ax, keepdims=True) - y) if needs[1] else None
        gy = -ge * logp if needs[0] else None
        return gy, gl

    return out(z, (lab, lg), backward)


# labels of up to 32 bits read as unsigned when indexing: negatives become out of bounds
_UNSIGNED = {"b": np.uint8, "h": np.uint16, "i": np.uint32, "B": np.uint8, "H": np.uint16}


def _check_labels(y: Any, n: int) -> None:
    """Raises InvalidArgumentError naming a label outside ``[0, n)``."""
    unsigned = y.view(f"u{y.dtype.itemsize}") if y.dtype.kind == "i" else y
    if y.size and int(unsigned.max()) >= n:  # one reduction checks both ends
        lo, hi = int(y.min()), int(y.max())
        if lo < 0 or hi >= n:
            raise errors.InvalidArgumentError(
                "sparse_softmax_cross_entropy_with_logits: "
                f"label {lo if lo < 0 else hi} is outside [0, {n})"
            )


def sparse_softmax_cross_entropy_with_logits(
    labels: Any = None, logits: Any = None, name: str | None = None
) -> Tensor:
    """Cross-entropy of integer class ``labels`` against ``softmax(logits)``, per example.

    Raises:
        InvalidArgumentError: a label outside ``[0, num_classes)`` (named), or
            labels whose shape is not ``logits.shape[:-1]``.
    """
    lab = node(labels)
    lg = _float_node(logits, "sparse_softmax_cross_entropy_with_logits")
    y, a = lab._array(), lg._array()
    if y.dtype.kind not in "iu":
        raise errors.InvalidArgumentError(
            f"sparse_softmax_cross_entropy_with_logits: labels must be integers, got {y.dtype.name}"
        )
    if y.shape != a.shape[:-1]:
        raise errors.InvalidArgumentError(
            f"sparse_softmax_cross_entropy_with_logits: labels shape {list(y.shape)} must equal "
            f"logits shape without its last dimension {list(a.shape[:-1])}"
        )
    n = a.shape[-1]
    m = xp(a)
    rows = m.arange(y.size)
    flat_y = y.reshape(-1)
    if m is not np or y.dtype.char not in _UNSIGNED:
        # CuPy does not bounds-check fancy indices, and NumPy casts 64-bit indices to
        # its signed index type (a negative label would wrap): check these first
        _check_labels(y, n)
    shifted = a - a.max(axis=-1, keepdims=True)
    e = m.exp(shifted)
    total = e.sum(axis=-1, keepdims=True)
    # one row per example: pick each label's entry by (row, label) fancy indexing; read as
    # unsigned, a negative label is out of bounds too, so NumPy's check covers both ends
    try:
        picked = shifted.reshape(-1, n)[rows, flat_y.view(_UNSIGNED.get(y.dtype.char, y.dtype))]
    except IndexError:
        _check_labels(y, n)
        raise
    z = m.log(total).reshape(y.shape) - picked.reshape(y.shape)

    def backward(g: Any, needs: tuple[bool, ...]) -> tuple[None, Any]:
        grad = e / total  # the softmax, kept from the forward pass
        grad.reshape(-1, n)[rows, flat_y] -= 1
        grad *= g[..., None]
        return None, grad

    return out(z, (lab, lg), backward)


def embedding_lookup(
    params: Any, ids: Any, max_norm: Any = None, name: str | None = None
) -> Tensor:
    """Rows of ``params`` at ``ids``; a list of shards is split "div"-style as TensorFlow's.

    The gradient w.r.t. ``params`` is sparse (:class:`IndexedSlices`).
    """
    if hasattr(params, "_embedding_lookup"):
        return params._embedding_lookup(ids)
    if isinstance(params, (list, tuple)):
        if len(params) == 1:
            return array_ops.gather(params[0], ids)
        return _sharded_lookup(list(params), ids)
    return array_ops.gather(params, ids)


def _sharded_lookup(shards: list[Any], ids: Any) -> Tensor:
    """TensorFlow's "div" partition: shard i holds a contiguous block of rows."""
    sizes = [int(s.shape[0]) for s in shards]  # the shape only: a shard may live on a PS
    offsets = np.cumsum([0, *sizes])
    idx = node(ids)._array()
    flat = idx.reshape(-1)
    m = xp(flat)
    which = m.searchsorted(m.asarray(offsets[1:]), flat, side="right")
    parts, positions = [], []
    for i, shard in enumerate(shards):
        pos = m.nonzero(which == i)[0]
        if pos.size:
            local = Tensor._wrap(flat[pos] - int(offsets[i]))
            lookup = getattr(shard, "_embedding_lookup", None)
            parts.append(lookup(local) if lookup is not None else array_ops.gather(shard, local))
            positions.append(pos)
    if not parts:
        raise errors.InvalidArgumentError("embedding_lookup: empty ids")
    joined = array_ops.concat(parts, axis=0)
    order = m.argsort(m.concatenate(positions))
    res = array_ops.gather(joined, Tensor._wrap(order))
    return array_ops.reshape(res, list(idx.shape) + list(joined._array().shape[1:]))


def bias_add(value: Any, bias: Any, data_format: Any = None, name: str | None = None) -> Tensor:
    """Adds a 1-D ``bias`` along the last axis."""
    v, b = binary(value, bias, "bias_add")
    if b._array().ndim != 1 or b._array().shape[0] != v._array().shape[-1]:
        raise errors.InvalidArgumentError(
            f"bias_add: bias shape {list(b._array().shape)} must match the last dimension of "
            f"{list(v._array().shape)}"
        )
    return math_ops.add(v, b)


def l2_loss(t: Any, name: str | None = None) -> Tensor:
    """``sum(t ** 2) / 2``."""
    return math_ops.multiply(0.5, math_ops.reduce_sum(math_ops.square(t)))


def l2_normalize(
    x: Any, axis: Any = None, epsilon: float = 1e-12, name: str | None = None
) -> Tensor:
    """``x / sqrt(max(sum(x**2), epsilon))`` along ``axis``."""
    sq = math_ops.reduce_sum(math_ops.square(x), axis=axis, keepdims=True)
    return math_ops.multiply(x, math_ops.rsqrt(math_ops.maximum(sq, epsilon)))


def moments(
    x: Any, axes: Any, shift: Any = None, keepdims: bool = False, name: str | None = None
) -> tuple[Tensor, Tensor]:
    """Mean and variance over ``axes``."""
    mean = math_ops.reduce_mean(x, axis=axes, keepdims=True)
    var = math_ops.reduce_mean(math_ops.squared_difference(x, mean), axis=axes, keepdims=keepdims)
    if not keepdims:
        mean = array_ops.squeeze(mean, axis=axes)
    return mean, var


def dropout(
    x: Any, rate: float, noise_shape: Any = None, seed: int | None = None, name: str | None = None
) -> Tensor:
    """Zeros elements with probability ``rate`` and scales the rest by ``1/(1-rate)``."""
    from psflow import random as random_lib

    xn = _float_node(x, "dropout")
    if not 0 <= float(rate) < 1:
        raise errors.InvalidArgumentError(f"dropout: rate must be in [0, 1), got {rate!r}")
    a = xn._array()
    if rate == 0:
        return array_ops.identity(xn)
    shape = (
        tuple(a.shape)
        if noise_shape is None
        else tuple(array_ops._ints(noise_shape, "noise_shape"))
    )
    keep = random_lib._uniform_array(shape, np.dtype(a.dtype), seed) >= rate
    keep = xp(a).asarray(keep)
    scale = a.dtype.type(1.0 / (1.0 - rate))
    mask = keep * scale
    return out(a * mask, (xn,), lambda g, needs: (g * mask,))


def compute_average_loss(
    per_example_loss: Any, sample_weight: Any = None, global_batch_size: int | None = None
) -> Tensor:
    """Sum of per-example losses divided by the global batch size.

    Inside a strategy's replica function the default global batch size is the
    local batch times ``num_replicas_in_sync``, so summing replicas' results
    gives the mean over the global batch (TensorFlow's ``tf.nn.compute_average_loss``).

    Raises:
        InvalidArgumentError: a non-positive ``global_batch_size``.
    """
    loss = node(per_example_loss)
    if sample_weight is not None:
        loss = math_ops.multiply(loss, math_ops.cast(sample_weight, loss.dtype))
    if global_batch_size is None:
        from psflow.distribute import distribute_lib

        arr = loss._array()
        local = arr.shape[0] if arr.ndim else 1
        global_batch_size = local * distribute_lib.get_strategy().num_replicas_in_sync
    if int(global_batch_size) <= 0 and node(per_example_loss)._array().size:
        raise errors.InvalidArgumentError(
            f"compute_average_loss: global_batch_size must be > 0, got {global_batch_size!r}"
        )
    total = math_ops.reduce_sum(loss)
    divisor = convert_to_tensor(max(int(global_batch_size), 1), dtype=total.dtype)
    return math_ops.divide(total, divisor)


def scale_regularization_loss(regularization_loss: Any) -> Tensor:
    """Divides a regularization loss by the number of replicas in sync."""
    from psflow.distribute import distribute_lib

    if isinstance(regularization_loss, (list, tuple)):
        regularization_loss = math_ops.add_n(list(regularization_loss))
    return math_ops.divide(
        regularization_loss, float(distribute_lib.get_strategy().num_replicas_in_sync)
    )

"""``tf.nn.batch_normalization``: normalization by given statistics, composed of differentiable ops."""

from __future__ import annotations

from typing import Any

from psflow.framework.tensor import Tensor
from psflow.ops import math_ops


def batch_normalization(
    x: Any,
    mean: Any,
    variance: Any,
    offset: Any,
    scale: Any,
    variance_epsilon: float,
    name: str | None = None,
) -> Tensor:
    """``scale * (x - mean) / sqrt(variance + variance_epsilon) + offset`` (TensorFlow's
    ``tf.nn.batch_normalization``; ``offset`` and ``scale`` may be None).

    Computed as TensorFlow does, ``x * inv + (offset - mean * inv)`` with
    ``inv = scale * rsqrt(variance + variance_epsilon)``; gradients flow to every
    tensor argument.

    Example:
        >>> import psflow as pf
        >>> pf.nn.batch_normalization(pf.constant([3.0]), 1.0, 4.0, None, None, 0.0).numpy().tolist()
        [1.0]
    """
    inv = math_ops.rsqrt(math_ops.add(variance, variance_epsilon))
    if scale is not None:
        inv = math_ops.multiply(inv, scale)
    shift = math_ops.negative(math_ops.multiply(mean, inv))
    if offset is not None:
        shift = math_ops.add(offset, shift)
    return math_ops.add(math_ops.multiply(x, inv), shift)

"""``ReduceOp``: how values from several replicas combine, with TensorFlow's arithmetic."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from psflow import errors

# One enum for the collective layer and the strategies; re-exported here because
# ``tf.distribute.ReduceOp`` lives next to the strategies in TensorFlow.
from psflow.collective.reduce_op import ReduceOp

__all__ = ["ReduceOp", "check_same_shapes", "mean", "reduce_over_axis"]


def mean(total: Any, count: int) -> Any:
    """``total / count`` as TensorFlow's MEAN computes it: true division.

    Integers average into floats (int8/int16 into float32, int32/int64 into
    float64), never by floor division: TensorFlow divides the sum with
    ``tf.math.truediv``, so an int32 mean of ``[1, 2]`` is ``1.5`` (float64).
    """
    from psflow.ops import math_ops

    return math_ops.divide(total, count)


def reduce_over_axis(op: ReduceOp, value: Any, axis: int | Sequence[int]) -> Any:
    """SUM or MEAN of one tensor over ``axis``: a sum, divided by the count for MEAN.

    Not ``reduce_mean``, which keeps an integer dtype: TensorFlow's
    ``strategy.reduce(MEAN, x, axis)`` divides the sum by the count (a float).
    """
    from psflow.framework.tensor import to_array
    from psflow.ops import math_ops

    total = math_ops.reduce_sum(value, axis=axis)
    if op is not ReduceOp.MEAN:
        return total
    shape = to_array(value).shape
    axes = [axis] if isinstance(axis, int) else list(axis)
    return mean(total, max(math.prod(shape[a] for a in axes), 1))


def check_same_shapes(shapes: Sequence[tuple[int, ...]], what: str) -> None:
    """Raises unless every replica's part has one shape (TensorFlow refuses to broadcast them).

    Raises:
        InvalidArgumentError: the shapes differ; the message lists them by replica.
    """
    if any(tuple(s) != tuple(shapes[0]) for s in shapes[1:]):
        listed = ", ".join(f"replica {i}: {list(s)}" for i, s in enumerate(shapes))
        raise errors.InvalidArgumentError(
            f"{what}: the per-replica values must have the same shape, got {listed}"
        )

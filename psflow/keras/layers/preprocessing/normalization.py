"""``Normalization``: features shifted and scaled by a mean and variance, given or adapted."""

from __future__ import annotations

from typing import Any

import numpy as np

from psflow import errors
from psflow.framework.tensor import Tensor, TensorShape, constant
from psflow.keras.layers.base import Layer
from psflow.keras.layers.preprocessing import _common
from psflow.ops import math_ops
from psflow.ops._core import node

EPSILON = 1e-7  # Keras's backend epsilon: the smallest standard deviation divided by


class Normalization(Layer):
    """``(x - mean) / max(sqrt(variance), 1e-7)`` per feature (Keras's ``Normalization``).

    ``axis`` names the feature axes kept (statistics reduce over all others);
    ``adapt`` computes the mean and (biased) variance of data; ``invert=True``
    applies the inverse map. The result is differentiable in ``x``.

    Example:
        >>> import numpy as np, psflow as pf
        >>> layer = pf.keras.layers.Normalization()
        >>> layer.adapt(np.array([[1.0], [3.0]], np.float32))
        >>> layer(np.array([[5.0]], np.float32)).numpy().tolist()
        [[3.0]]
    """

    def __init__(
        self,
        axis: Any = -1,
        mean: Any = None,
        variance: Any = None,
        invert: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if (mean is None) != (variance is None):
            raise errors.InvalidArgumentError(
                "Normalization: pass both mean and variance, or neither (and adapt)"
            )
        self.axis = (
            ()
            if axis is None
            else (int(axis),)
            if isinstance(axis, (int, np.integer))
            else tuple(axis)
        )
        self.invert = bool(invert)
        self._mean: np.ndarray | None = None
        self._variance: np.ndarray | None = None
        if mean is not None:
            self._mean = np.asarray(mean, dtype=self.dtype)
            self._variance = np.asarray(variance, dtype=self.dtype)
            if self._mean.shape != self._variance.shape or (self._variance < 0).any():
                raise errors.InvalidArgumentError(
                    f"Normalization: mean {mean!r} and variance {variance!r} need one shape "
                    "and a variance >= 0"
                )

    def _kept(self, ndim: int) -> tuple[int, ...]:
        kept = []
        for a in self.axis:
            if not -ndim <= a < ndim or (a % ndim == 0 and ndim > 1):
                raise errors.InvalidArgumentError(
                    f"{self.name}: axis {a} does not name a feature axis of rank-{ndim} inputs"
                )
            kept.append(a % ndim)
        return tuple(sorted(kept))

    def adapt(self, data: Any, batch_size: int | None = None, steps: int | None = None) -> None:
        """Sets the mean and variance to those of ``data`` over all non-feature axes.

        Raises:
            InvalidArgumentError: no data, non-numeric data, or batches whose feature
                dimensions differ.
        """
        total = None
        count = 0
        for arr in _common.batches(data, steps, self.name):
            if arr.dtype.kind not in "fiu":
                raise errors.InvalidArgumentError(
                    f"{self.name}: adapt needs numbers, got elements of type {arr.dtype}"
                )
            x = arr.astype(np.float64)
            kept = self._kept(x.ndim)
            reduce = tuple(a for a in range(x.ndim) if a not in kept)
            n = int(np.prod([x.shape[a] for a in reduce]))
            sums = (x.sum(axis=reduce), (x * x).sum(axis=reduce))
            if total is not None and sums[0].shape != total[0].shape:
                raise errors.InvalidArgumentError(
                    f"{self.name}: adapt batches have features {sums[0].shape} and {total[0].shape}"
                )
            total = sums if total is None else (total[0] + sums[0], total[1] + sums[1])
            count += n
        if total is None or count == 0:
            raise errors.InvalidArgumentError(f"{self.name}: adapt got no data")
        mean = total[0] / count
        self._mean = mean.astype(self.dtype)
        self._variance = np.maximum(total[1] / count - mean * mean, 0).astype(self.dtype)

    def _broadcast(self, stats: np.ndarray, ndim: int) -> np.ndarray:
        kept = self._kept(ndim)
        shape = [1] * ndim
        for a, d in zip(kept, stats.shape if stats.ndim else ()):
            shape[a] = d
        return stats.reshape(shape) if stats.ndim else stats

    def call(self, inputs: Any) -> Tensor:
        if self._mean is None or self._variance is None:
            raise errors.FailedPreconditionError(
                f"{self.name}: no statistics; pass mean= and variance= or call adapt first"
            )
        x = node(inputs)
        if x._array().dtype != self.dtype:
            x = math_ops.cast(x, self.dtype)
        ndim = x._array().ndim
        mean = constant(self._broadcast(self._mean, ndim))
        std = constant(
            self._broadcast(np.maximum(np.sqrt(self._variance), EPSILON).astype(self.dtype), ndim)
        )
        if self.invert:
            return math_ops.add(math_ops.multiply(x, std), mean)
        return math_ops.divide(math_ops.subtract(x, mean), std)

    def compute_output_shape(self, input_shape: Any) -> TensorShape:
        return TensorShape(input_shape)

    def get_config(self) -> dict[str, Any]:
        stats = (
            {}
            if self._mean is None
            else {"mean": self._mean.tolist(), "variance": self._variance.tolist()}  # type: ignore[union-attr]
        )
        axis = self.axis[0] if len(self.axis) == 1 else list(self.axis) or None
        return {**super().get_config(), "axis": axis, "invert": self.invert, **stats}

"""Pooling layers: max and average over windows, and global pooling (channels last)."""

from __future__ import annotations

from typing import Any

from psflow import errors
from psflow.framework.tensor import TensorShape
from psflow.keras.layers.base import Layer
from psflow.keras.layers.convolutional import (
    check_channels_last,
    conv_output_length,
    normalize_padding,
    normalize_tuple,
)
from psflow.ops import math_ops, pool_ops
from psflow.ops._core import node


class _Pooling(Layer):
    """Window pooling over ``rank`` spatial dimensions; ``strides`` default to ``pool_size``."""

    rank = 2

    def __init__(
        self,
        pool_size: Any = 2,
        strides: Any = None,
        padding: str = "valid",
        data_format: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        cls = type(self).__name__
        check_channels_last(data_format, cls)
        self.pool_size = normalize_tuple(pool_size, self.rank, "pool_size", cls)
        self.strides = (
            self.pool_size
            if strides is None
            else normalize_tuple(strides, self.rank, "strides", cls)
        )
        self.padding = normalize_padding(padding, ("valid", "same"), cls)
        self.data_format = data_format

    def _pool(self, x: Any) -> Any:
        raise NotImplementedError

    def call(self, inputs: Any) -> Any:
        x = node(inputs)
        if x._array().ndim != self.rank + 2:
            raise errors.InvalidArgumentError(
                f"{self.name}: expected inputs of rank {self.rank + 2}, got shape "
                f"{list(x._array().shape)}"
            )
        return self._pool(x)

    def compute_output_shape(self, input_shape: Any) -> TensorShape:
        shape = tuple(input_shape)
        spatial = [
            conv_output_length(size, k, self.padding, s)
            for size, k, s in zip(shape[1:-1], self.pool_size, self.strides)
        ]
        return TensorShape((shape[0], *spatial, shape[-1]))

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "pool_size": self.pool_size,
            "strides": self.strides,
            "padding": self.padding,
            "data_format": self.data_format,
        }


class MaxPooling2D(_Pooling):
    """The maximum over each ``pool_size`` window of ``(batch, height, width, channels)``.

    Example:
        >>> import psflow as pf
        >>> pf.keras.layers.MaxPooling2D()(pf.ones([1, 4, 4, 3])).shape
        TensorShape([1, 2, 2, 3])
    """

    def _pool(self, x: Any) -> Any:
        return pool_ops.max_pool2d(x, self.pool_size, self.strides, self.padding.upper())


class AveragePooling2D(_Pooling):
    """The mean over each ``pool_size`` window of ``(batch, height, width, channels)``
    (with ``"same"`` padding, over the real elements of the window only)."""

    def _pool(self, x: Any) -> Any:
        return pool_ops.avg_pool2d(x, self.pool_size, self.strides, self.padding.upper())


class MaxPooling1D(_Pooling):
    """The maximum over each ``pool_size`` window of ``(batch, steps, channels)``."""

    rank = 1

    def _pool(self, x: Any) -> Any:
        return pool_ops.max_pool1d(x, self.pool_size, self.strides, self.padding.upper())


class AveragePooling1D(_Pooling):
    """The mean over each ``pool_size`` window of ``(batch, steps, channels)``."""

    rank = 1

    def _pool(self, x: Any) -> Any:
        return pool_ops.avg_pool1d(x, self.pool_size, self.strides, self.padding.upper())


class _GlobalPooling(Layer):
    """A reduction over every spatial dimension (all but the batch and channel axes)."""

    rank = 2

    def __init__(self, data_format: str | None = None, keepdims: bool = False, **kwargs: Any):
        super().__init__(**kwargs)
        check_channels_last(data_format, type(self).__name__)
        self.data_format = data_format
        self.keepdims = bool(keepdims)

    def _reduce(self, x: Any, axes: list[int]) -> Any:
        raise NotImplementedError

    def call(self, inputs: Any) -> Any:
        x = node(inputs)
        if x._array().ndim != self.rank + 2:
            raise errors.InvalidArgumentError(
                f"{self.name}: expected inputs of rank {self.rank + 2}, got shape "
                f"{list(x._array().shape)}"
            )
        return self._reduce(x, list(range(1, self.rank + 1)))

    def compute_output_shape(self, input_shape: Any) -> TensorShape:
        shape = tuple(input_shape)
        if self.keepdims:
            return TensorShape((shape[0], *([1] * self.rank), shape[-1]))
        return TensorShape((shape[0], shape[-1]))

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "data_format": self.data_format, "keepdims": self.keepdims}


class _GlobalAverage(_GlobalPooling):
    def _reduce(self, x: Any, axes: list[int]) -> Any:
        return math_ops.reduce_mean(x, axis=axes, keepdims=self.keepdims)


class _GlobalMax(_GlobalPooling):
    def _reduce(self, x: Any, axes: list[int]) -> Any:
        return math_ops.reduce_max(x, axis=axes, keepdims=self.keepdims)


class GlobalAveragePooling2D(_GlobalAverage):
    """The mean over height and width: ``(batch, h, w, c)`` -> ``(batch, c)``.

    Example:
        >>> import psflow as pf
        >>> pf.keras.layers.GlobalAveragePooling2D()(pf.ones([2, 4, 4, 3])).shape
        TensorShape([2, 3])
    """


class GlobalAveragePooling1D(_GlobalAverage):
    """The mean over the steps: ``(batch, steps, c)`` -> ``(batch, c)``."""

    rank = 1


class GlobalMaxPooling2D(_GlobalMax):
    """The maximum over height and width: ``(batch, h, w, c)`` -> ``(batch, c)``."""


class GlobalMaxPooling1D(_GlobalMax):
    """The maximum over the steps: ``(batch, steps, c)`` -> ``(batch, c)``."""

    rank = 1


MaxPool1D, MaxPool2D = MaxPooling1D, MaxPooling2D
AvgPool1D, AvgPool2D = AveragePooling1D, AveragePooling2D
GlobalAvgPool1D, GlobalAvgPool2D = GlobalAveragePooling1D, GlobalAveragePooling2D
GlobalMaxPool1D, GlobalMaxPool2D = GlobalMaxPooling1D, GlobalMaxPooling2D

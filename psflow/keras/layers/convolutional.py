"""Convolution layers: ``Conv1D`` and ``Conv2D`` (channels last), on :mod:`psflow.ops.conv_ops`."""

from __future__ import annotations

from typing import Any

import numpy as np

from psflow import errors
from psflow.framework.tensor import TensorShape
from psflow.keras import activations, initializers, regularizers
from psflow.keras.layers.base import Layer
from psflow.ops import conv_ops, math_ops
from psflow.ops._core import node


def normalize_tuple(value: Any, n: int, name: str, layer: str) -> tuple[int, ...]:
    """An int or ``n`` ints as a tuple of ``n`` positive ints (Keras's argument form).

    Raises:
        InvalidArgumentError: the wrong count, or a value that is not a positive int.
    """
    vals = (value,) * n if isinstance(value, (int, np.integer)) else tuple(value)
    if len(vals) != n or not all(isinstance(v, (int, np.integer)) and v > 0 for v in vals):
        raise errors.InvalidArgumentError(
            f"{layer}: {name} must be a positive int or {n} positive ints, got {value!r}"
        )
    return tuple(int(v) for v in vals)


def normalize_padding(value: Any, allowed: tuple[str, ...], layer: str) -> str:
    """``value`` lower-cased, if it is one of ``allowed``.

    Raises:
        InvalidArgumentError: any other value, quoting the allowed ones.
    """
    mode = str(value).lower()
    if mode not in allowed:
        raise errors.InvalidArgumentError(
            f"{layer}: padding must be one of {list(allowed)}, got {value!r}"
        )
    return mode


def check_channels_last(data_format: Any, layer: str) -> None:
    """Only ``channels_last`` (NHWC) is computed.

    Raises:
        InvalidArgumentError: ``channels_first``.
    """
    if data_format not in (None, "channels_last"):
        raise errors.InvalidArgumentError(
            f"{layer}: data_format {data_format!r} is not supported; use 'channels_last'"
        )


def conv_output_length(size: int | None, window: int, padding: str, stride: int) -> int | None:
    """Output length along one dimension for a (dilated) window extent ``window``."""
    if size is None:
        return None
    if padding in ("same", "causal"):
        return -(-size // stride) if padding == "same" else (size - 1) // stride + 1
    return max((size - window) // stride + 1, 0)


class _Conv(Layer):
    """The shared body of ``Conv1D``/``Conv2D`` for ``rank`` spatial dimensions."""

    rank = 2
    _paddings: tuple[str, ...] = ("valid", "same")

    def __init__(
        self,
        filters: int,
        kernel_size: Any,
        strides: Any = 1,
        padding: str = "valid",
        data_format: str | None = None,
        dilation_rate: Any = 1,
        groups: int = 1,
        activation: Any = None,
        use_bias: bool = True,
        kernel_initializer: Any = "glorot_uniform",
        bias_initializer: Any = "zeros",
        kernel_regularizer: Any = None,
        bias_regularizer: Any = None,
        activity_regularizer: Any = None,
        kernel_constraint: Any = None,
        bias_constraint: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        cls = type(self).__name__
        if not isinstance(filters, (int, np.integer)) or filters <= 0:
            raise errors.InvalidArgumentError(
                f"{cls}: filters must be a positive integer, got {filters!r}"
            )
        if groups != 1:
            raise errors.InvalidArgumentError(f"{cls}: only groups=1 is supported, got {groups!r}")
        check_channels_last(data_format, cls)
        self.filters = int(filters)
        self.kernel_size = normalize_tuple(kernel_size, self.rank, "kernel_size", cls)
        self.strides = normalize_tuple(strides, self.rank, "strides", cls)
        self.dilation_rate = normalize_tuple(dilation_rate, self.rank, "dilation_rate", cls)
        if max(self.strides) > 1 and max(self.dilation_rate) > 1:
            raise errors.InvalidArgumentError(
                f"{cls}: strides {self.strides} > 1 cannot be combined with dilation_rate "
                f"{self.dilation_rate} > 1"
            )
        self.padding = normalize_padding(padding, self._paddings, cls)
        self.data_format = data_format
        self.groups = groups
        self.activation = activations.get(activation)
        self.use_bias = bool(use_bias)
        # the identifiers as given, so get_config returns constructor arguments
        self._init_ids = (kernel_initializer, bias_initializer)
        self._reg_ids = (kernel_regularizer, bias_regularizer)
        self.kernel_initializer = initializers.get(kernel_initializer)
        self.bias_initializer = initializers.get(bias_initializer)
        self.kernel_regularizer = (
            regularizers.get(kernel_regularizer) if kernel_regularizer else None
        )
        self.bias_regularizer = regularizers.get(bias_regularizer) if bias_regularizer else None
        self.kernel_constraint, self.bias_constraint = kernel_constraint, bias_constraint
        if self._batch_input_shape is not None:
            self._maybe_build(self._batch_input_shape)

    def build(self, input_shape: Any) -> None:
        shape = tuple(input_shape)
        if len(shape) != self.rank + 2 or shape[-1] is None:
            raise errors.InvalidArgumentError(
                f"{self.name}: expected inputs of rank {self.rank + 2} with a known channel "
                f"dimension, got shape {list(shape)}"
            )
        self.input_channels = int(shape[-1])
        self.kernel = self.add_weight(
            "kernel",
            (*self.kernel_size, self.input_channels, self.filters),
            initializer=self.kernel_initializer,
            regularizer=self.kernel_regularizer,
            constraint=self.kernel_constraint,
        )
        self.bias = (
            self.add_weight(
                "bias",
                (self.filters,),
                initializer=self.bias_initializer,
                regularizer=self.bias_regularizer,
                constraint=self.bias_constraint,
            )
            if self.use_bias
            else None
        )
        self.built = True

    def _convolve(self, x: Any) -> Any:
        raise NotImplementedError

    def _input(self, inputs: Any) -> Any:
        """``inputs`` as a node of the layer's dtype, its rank and channels checked."""
        x = node(inputs)
        if x._array().dtype != self.dtype:  # Keras casts inputs to the layer's dtype
            x = math_ops.cast(x, self.dtype)
        a = x._array()
        if a.ndim != self.rank + 2 or a.shape[-1] != self.input_channels:
            raise errors.InvalidArgumentError(
                f"{self.name}: expected inputs of rank {self.rank + 2} with "
                f"{self.input_channels} channels, got shape {list(a.shape)}"
            )
        return x

    def call(self, inputs: Any) -> Any:
        x = self._input(inputs)
        relu = self.activation is activations.relu
        if relu or self.activation is activations.linear:  # bias and relu fused into the op
            return conv_ops.conv_layer(
                x,
                self.kernel,
                self.bias,
                self.rank,
                self.strides,
                self.padding,
                self.dilation_rate,
                relu,
            )
        y = self._convolve(x)
        if self.bias is not None:
            y = math_ops.add(y, self.bias)
        return self.activation(y)

    def compute_output_shape(self, input_shape: Any) -> TensorShape:
        shape = tuple(input_shape)
        spatial = [
            conv_output_length(size, (k - 1) * d + 1, self.padding, s)
            for size, k, s, d in zip(
                shape[1:-1], self.kernel_size, self.strides, self.dilation_rate
            )
        ]
        return TensorShape((shape[0], *spatial, self.filters))

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "filters": self.filters,
            "kernel_size": self.kernel_size,
            "strides": self.strides,
            "padding": self.padding,
            "data_format": self.data_format,
            "dilation_rate": self.dilation_rate,
            "groups": self.groups,
            "activation": activations.serialize(self.activation),
            "use_bias": self.use_bias,
            "kernel_initializer": self._init_ids[0],
            "bias_initializer": self._init_ids[1],
            "kernel_regularizer": self._reg_ids[0],
            "bias_regularizer": self._reg_ids[1],
            "kernel_constraint": self.kernel_constraint,
            "bias_constraint": self.bias_constraint,
        }


class Conv2D(_Conv):
    """2-D convolution over ``(batch, height, width, channels)`` inputs (Keras's ``Conv2D``).

    ``activation(conv2d(inputs, kernel) + bias)`` with a kernel of shape
    ``(*kernel_size, in_channels, filters)``; ``padding`` is ``"valid"`` or ``"same"``.

    Example:
        >>> import psflow as pf
        >>> layer = pf.keras.layers.Conv2D(4, 3, padding="same")
        >>> layer(pf.ones([2, 8, 8, 1])).shape
        TensorShape([2, 8, 8, 4])
    """

    rank = 2

    def _convolve(self, x: Any) -> Any:
        return conv_ops.conv2d(
            x, self.kernel, self.strides, self.padding.upper(), dilations=self.dilation_rate
        )


class Conv1D(_Conv):
    """1-D convolution over ``(batch, steps, channels)`` inputs (Keras's ``Conv1D``).

    ``padding`` is ``"valid"``, ``"same"`` or ``"causal"`` (output ``t`` sees inputs up to ``t``).

    Example:
        >>> import psflow as pf
        >>> pf.keras.layers.Conv1D(2, 3)(pf.ones([1, 10, 4])).shape
        TensorShape([1, 8, 2])
    """

    rank = 1
    _paddings = ("valid", "same", "causal")

    def _convolve(self, x: Any) -> Any:
        return conv_ops.conv1d(
            x, self.kernel, self.strides, self.padding.upper(), dilations=self.dilation_rate
        )


def pools_after(conv: Layer, pool: Layer) -> bool:
    """Whether ``conv`` is a ``Conv2D`` with a ReLU or no activation and ``pool`` a
    ``MaxPooling2D``, neither a subclass: a pair :func:`conv_then_max_pool` runs as one op."""
    if type(conv) is not Conv2D:  # first: Sequential asks of every pair of layers, every step
        return False
    from psflow.keras.layers.pooling import MaxPooling2D  # pooling imports this module

    if type(pool) is not MaxPooling2D:
        return False
    return conv.activation is activations.relu or conv.activation is activations.linear


def conv_then_max_pool(conv: Layer, pool: Layer, inputs: Any) -> Any:
    """``pool(conv(inputs))`` as one op (:func:`conv_ops.conv_layer_max_pool`: the same
    values and gradients, bit for bit) where ``conv`` is a ``Conv2D`` with a ReLU or no
    activation and ``pool`` a ``MaxPooling2D``, both built and neither a subclass, on
    tensors (not symbolic inputs); None for any other pair (the caller calls each layer)."""
    if not pools_after(conv, pool) or not (conv.built and pool.built):
        return None  # every other pair of a Sequential, every step: before any import
    from psflow.keras.engine import keras_tensor

    if keras_tensor.is_symbolic(inputs):
        return None
    return conv_ops.conv_layer_max_pool(
        conv._input(inputs),
        conv.kernel,
        conv.bias,
        conv.strides,
        conv.padding,
        conv.dilation_rate,
        conv.activation is activations.relu,
        pool.pool_size,
        pool.strides,
        pool.padding.upper(),
    )


Convolution1D = Conv1D
Convolution2D = Conv2D

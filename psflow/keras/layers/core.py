"""Core layers: ``Dense``, ``Activation``, ``Flatten``, ``Dropout``, ``Reshape``, ``InputLayer``."""

from __future__ import annotations

from typing import Any

import numpy as np

from psflow import errors
from psflow.framework.tensor import TensorShape, convert_to_tensor
from psflow.keras import activations, initializers, regularizers
from psflow.keras.layers.base import Layer
from psflow.ops import array_ops, math_ops, nn_ops
from psflow.ops._core import node


def _as_float_input(inputs: Any, dtype: str) -> Any:
    x = node(inputs)
    if x._array().dtype != dtype:  # Keras casts inputs to the layer's dtype
        x = math_ops.cast(x, dtype)
    return x


class Dense(Layer):
    """``activation(inputs @ kernel + bias)`` over the last axis.

    Example:
        >>> import psflow as pf
        >>> layer = pf.keras.layers.Dense(3)
        >>> layer(pf.ones([2, 4])).shape
        TensorShape([2, 3])
    """

    def __init__(
        self,
        units: int,
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
        if not isinstance(units, (int, np.integer)) or units <= 0:
            raise errors.InvalidArgumentError(
                f"Dense: units must be a positive integer, got {units!r}"
            )
        self.units = int(units)
        self.activation = activations.get(activation)
        self.use_bias = use_bias
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
        last = TensorShape(input_shape)[-1] if len(input_shape) else None
        if last is None:
            raise errors.InvalidArgumentError(
                f"{self.name}: the last dimension of the inputs must be known, got shape {list(input_shape)}"
            )
        self.kernel = self.add_weight(
            "kernel",
            (last, self.units),
            initializer=self.kernel_initializer,
            regularizer=self.kernel_regularizer,
            constraint=self.kernel_constraint,
        )
        self.bias = (
            self.add_weight(
                "bias",
                (self.units,),
                initializer=self.bias_initializer,
                regularizer=self.bias_regularizer,
                constraint=self.bias_constraint,
            )
            if self.use_bias
            else None
        )
        self.input_spec_last_dim = last
        self.built = True

    def call(self, inputs: Any) -> Any:
        x = _as_float_input(inputs, self.dtype)
        if x._array().ndim == 0 or x._array().shape[-1] != self.input_spec_last_dim:
            raise errors.InvalidArgumentError(
                f"{self.name}: expected inputs with last dimension {self.input_spec_last_dim}, got "
                f"shape {list(x._array().shape)}"
            )
        if self.activation is activations.relu or self.activation is activations.linear:
            fused = nn_ops.dense(
                x, self.kernel, self.bias, relu=self.activation is activations.relu
            )
            if fused is not None:
                return fused
        y = (
            math_ops.matmul(x, self.kernel)
            if x._array().ndim >= 2
            else array_ops.reshape(
                math_ops.matmul(array_ops.expand_dims(x, 0), self.kernel), [self.units]
            )
        )
        if self.bias is not None:
            y = math_ops.add(y, self.bias)
        return self.activation(y)

    def compute_output_shape(self, input_shape: Any) -> TensorShape:
        return TensorShape((*tuple(input_shape)[:-1], self.units))

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "units": self.units,
            "activation": activations.serialize(self.activation),
            "use_bias": self.use_bias,
        }


class Activation(Layer):
    """Applies an activation function."""

    def __init__(self, activation: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.activation = activations.get(activation)

    def call(self, inputs: Any) -> Any:
        return self.activation(node(inputs))

    def compute_output_shape(self, input_shape: Any) -> TensorShape:
        return TensorShape(input_shape)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "activation": activations.serialize(self.activation)}


class Flatten(Layer):
    """Flattens every example to one dimension."""

    def call(self, inputs: Any) -> Any:
        x = node(inputs)
        a = x._array()
        return array_ops.reshape(x, [a.shape[0], -1] if a.ndim > 1 else [a.shape[0], 1])

    def compute_output_shape(self, input_shape: Any) -> TensorShape:
        rest = tuple(input_shape)[1:]
        n = None if any(d is None for d in rest) else int(np.prod(rest)) if rest else 1
        return TensorShape((tuple(input_shape)[0], n))


class Reshape(Layer):
    """Reshapes every example to ``target_shape`` (one entry may be -1)."""

    def __init__(self, target_shape: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.target_shape = tuple(int(d) for d in target_shape)

    def call(self, inputs: Any) -> Any:
        x = node(inputs)
        return array_ops.reshape(x, [x._array().shape[0], *self.target_shape])

    def compute_output_shape(self, input_shape: Any) -> TensorShape:
        rest = tuple(input_shape)[1:]
        target = list(self.target_shape)
        if -1 in target and all(d is not None for d in rest):
            known = int(np.prod([d for d in target if d != -1]))
            target[target.index(-1)] = int(np.prod(rest)) // max(known, 1)
        return TensorShape((tuple(input_shape)[0], *target))

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "target_shape": self.target_shape}


class Dropout(Layer):
    """Randomly zeros inputs with probability ``rate`` while training; identity otherwise."""

    def __init__(
        self, rate: float, noise_shape: Any = None, seed: int | None = None, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        if not 0 <= float(rate) < 1:
            raise errors.InvalidArgumentError(f"Dropout: rate must be in [0, 1), got {rate!r}")
        self.rate, self.noise_shape, self.seed = float(rate), noise_shape, seed

    def call(self, inputs: Any, training: Any = None) -> Any:
        if not training or self.rate == 0:
            return node(inputs)
        return nn_ops.dropout(inputs, self.rate, noise_shape=self.noise_shape, seed=self.seed)

    def compute_output_shape(self, input_shape: Any) -> TensorShape:
        return TensorShape(input_shape)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "rate": self.rate, "seed": self.seed}


class InputLayer(Layer):
    """Declares the input shape of a ``Sequential`` model."""

    def __init__(
        self,
        input_shape: Any = None,
        batch_size: int | None = None,
        dtype: Any = None,
        name: str | None = None,
        shape: Any = None,
        **kwargs: Any,
    ) -> None:
        shape = shape if shape is not None else input_shape
        if shape is None:
            raise errors.InvalidArgumentError("InputLayer needs a shape")
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        super().__init__(name=name, dtype=dtype, batch_input_shape=(batch_size, *shape), **kwargs)
        self.built = True

    def call(self, inputs: Any) -> Any:
        return convert_to_tensor(inputs) if not hasattr(inputs, "_array") else inputs

    def compute_output_shape(self, input_shape: Any) -> TensorShape:
        return TensorShape(input_shape)


class KerasInput:
    """What ``keras.Input(shape=...)`` returns: a placeholder naming the model's input shape."""

    def __init__(self, shape: tuple, batch_size: int | None, dtype: str, name: str | None) -> None:
        self.shape = TensorShape((batch_size, *shape))
        self.dtype = dtype
        self.name = name
        self._layer = InputLayer(shape=shape, batch_size=batch_size, dtype=dtype, name=name)

    def __repr__(self) -> str:
        return (
            f"<KerasInput shape={tuple(self.shape)}, dtype={self.dtype}, name={self._layer.name}>"
        )


def Input(
    shape: Any = None,
    batch_size: int | None = None,
    dtype: Any = None,
    name: str | None = None,
    batch_shape: Any = None,
    **kwargs: Any,
) -> KerasInput:
    """A symbolic input for ``Sequential([keras.Input(shape=(4,)), ...])``.

    Raises:
        InvalidArgumentError: neither ``shape`` nor ``batch_shape`` given.
    """
    if batch_shape is not None:
        batch_size, shape = batch_shape[0], tuple(batch_shape[1:])
    if shape is None:
        raise errors.InvalidArgumentError("Input needs shape= (the shape of one example)")
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    return KerasInput(shape, batch_size, dtype or "float32", name)

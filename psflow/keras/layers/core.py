"""Core layers: ``Dense``, ``Activation``, ``Flatten``, ``Dropout``, ``Reshape``, ``Lambda``,
``InputLayer`` and ``Input``."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import numpy as np

from psflow import errors
from psflow.framework.tensor import TensorShape, convert_to_tensor
from psflow.keras import activations, initializers, regularizers
from psflow.keras.engine.keras_tensor import KerasTensor, Node, is_shape, map_shapes, shapes_of
from psflow.keras.layers.base import Layer
from psflow.ops import array_ops, math_ops, nn_ops
from psflow.ops._core import node
from psflow.util import nest


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
        self.kernel_initializer = initializers.get(_from_dict(kernel_initializer, initializers))
        self.bias_initializer = initializers.get(_from_dict(bias_initializer, initializers))
        self.kernel_regularizer = (
            regularizers.get(_from_dict(kernel_regularizer, regularizers))
            if kernel_regularizer
            else None
        )
        self.bias_regularizer = (
            regularizers.get(_from_dict(bias_regularizer, regularizers))
            if bias_regularizer
            else None
        )
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
            "kernel_initializer": _initializer_config(self.kernel_initializer),
            "bias_initializer": _initializer_config(self.bias_initializer),
            "kernel_regularizer": _regularizer_config(self, self.kernel_regularizer),
            "bias_regularizer": _regularizer_config(self, self.bias_regularizer),
        }


def _from_dict(value: Any, module: Any) -> Any:
    """An initializer or regularizer written by get_config (``{"class_name", "config"}``)."""
    if not isinstance(value, dict):
        return value
    cls = getattr(module, str(value.get("class_name")), None)
    if not isinstance(cls, type):
        raise errors.InvalidArgumentError(
            f"Unknown {module.__name__.rsplit('.', 1)[-1]} class {value.get('class_name')!r}"
        )
    return cls(**value.get("config", {}))


def _initializer_config(init: Any) -> Any:
    # A function given as initializer has no config; the saved weights make it moot.
    if (
        isinstance(init, initializers.Initializer)
        and type(init).__module__ == initializers.__name__
    ):
        if type(init).__name__.startswith("_"):
            return None
        return {"class_name": type(init).__name__, "config": init.get_config()}
    return None


def _regularizer_config(layer: Layer, reg: Any) -> Any:
    if reg is None:
        return None
    if isinstance(reg, regularizers.L1L2):  # L1 and L2 are L1L2s with one term
        return {"class_name": "L1L2", "config": reg.get_config()}
    raise errors.InvalidArgumentError(
        f"{layer.name}: regularizer {reg!r} has no config; use keras.regularizers.L1L2/L1/L2 "
        "to save the model"
    )


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
        return {
            **super().get_config(),
            "rate": self.rate,
            "noise_shape": self.noise_shape,
            "seed": self.seed,
        }


class Lambda(Layer):
    """Wraps a function of tensors as a layer: ``Lambda(lambda x: x * 2)``.

    Its output shape comes from ``output_shape`` (a shape without the batch
    dimension, or a function of the input shape) or, when not given, from one
    call of the function on zeros. For saving, the function is stored by name:
    register it with ``keras.utils.register_keras_serializable`` (or pass it in
    ``custom_objects`` when loading); anonymous lambdas cannot be loaded back.

    Example:
        >>> import psflow as pf
        >>> x = pf.keras.Input(shape=(3,))
        >>> pf.keras.layers.Lambda(lambda t: t * 2.0)(x).shape
        TensorShape([None, 3])
    """

    def __init__(
        self,
        function: Callable[..., Any],
        output_shape: Any = None,
        mask: Any = None,
        arguments: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if not callable(function):
            raise TypeError(f"Lambda needs a callable, got {type(function).__name__}: {function!r}")
        self.function = function
        self.output_shape = output_shape
        self.arguments = dict(arguments or {})

    def call(self, inputs: Any, training: Any = None) -> Any:
        kwargs = dict(self.arguments)
        if "training" in inspect.signature(self.function).parameters:
            kwargs["training"] = training
        return self.function(inputs, **kwargs)

    def compute_output_shape(self, input_shape: Any) -> Any:
        if callable(self.output_shape):
            return self.output_shape(input_shape)
        if self.output_shape is not None:
            batch = _batch_dim(input_shape)
            return TensorShape((batch, *tuple(self.output_shape)))
        spec = self.compute_output_spec(_placeholders(input_shape))
        return nest.map_structure(lambda t: t.shape, spec)

    def compute_output_spec(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        """Keras tensors for the outputs: the declared shape, else one call on zeros."""
        shapes = shapes_of(inputs)
        if self.output_shape is not None:
            return map_shapes(
                lambda s: KerasTensor(s, self.dtype), self.compute_output_shape(shapes)
            )
        zeros = nest.map_structure(
            lambda t: convert_to_tensor(
                np.zeros([1 if d is None else d for d in t.shape], dtype=t.dtype)
            ),
            inputs,
        )
        out = self.call(zeros, **{k: v for k, v in kwargs.items() if k == "training"})
        batch = _batch_dim(shapes)
        return nest.map_structure(
            lambda t: KerasTensor((batch, *tuple(t.shape)[1:]) if len(t.shape) else (), t.dtype),
            out,
        )

    def get_config(self) -> dict[str, Any]:
        from psflow.keras.saving import serialization

        return {
            **super().get_config(),
            "function": serialization.function_name(self.function),
            "output_shape": None if callable(self.output_shape) else self.output_shape,
            "arguments": self.arguments,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Lambda:
        """Rebuilds the layer, finding its function among the registered/custom objects.

        Raises:
            InvalidArgumentError: the function's name is neither registered nor in
                ``custom_objects``.
        """
        from psflow.keras.saving import serialization

        config = dict(config)
        config["function"] = serialization.resolve_function(config["function"])
        return cls(**config)


def _batch_dim(shapes: Any) -> Any:
    if is_shape(shapes):
        return tuple(shapes)[0] if len(shapes) else None
    first = nest.flatten(map_shapes(lambda s: [s[0] if len(s) else None], shapes))
    return first[0] if first else None


def _placeholders(shapes: Any) -> Any:
    return map_shapes(lambda s: KerasTensor(s), shapes)


class InputLayer(Layer):
    """The source of a model's input: ``output`` is the symbolic tensor ``keras.Input`` returns."""

    def __init__(
        self,
        input_shape: Any = None,
        batch_size: int | None = None,
        dtype: Any = None,
        name: str | None = None,
        shape: Any = None,
        batch_input_shape: Any = None,
        **kwargs: Any,
    ) -> None:
        if batch_input_shape is not None:  # what get_config writes
            batch_size, shape = batch_input_shape[0], tuple(batch_input_shape[1:])
        shape = shape if shape is not None else input_shape
        if shape is None:
            raise errors.InvalidArgumentError("InputLayer needs a shape")
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if any(d is not None and (not isinstance(d, (int, np.integer)) or d < 0) for d in shape):
            raise errors.InvalidArgumentError(
                f"InputLayer: shape must hold non-negative ints or None, got {shape!r}"
            )
        super().__init__(name=name, dtype=dtype, batch_input_shape=(batch_size, *shape), **kwargs)
        self.built = True
        self.output = KerasTensor((batch_size, *shape), self.dtype, self.name)
        Node(self, (), {}, self.output)

    def call(self, inputs: Any) -> Any:
        return convert_to_tensor(inputs) if not hasattr(inputs, "_array") else inputs

    def compute_output_shape(self, input_shape: Any) -> TensorShape:
        return TensorShape(input_shape)


KerasInput = KerasTensor  # the name this module used before the functional API


def Input(
    shape: Any = None,
    batch_size: int | None = None,
    dtype: Any = None,
    name: str | None = None,
    batch_shape: Any = None,
    **kwargs: Any,
) -> KerasTensor:
    """A symbolic input: the start of a functional model, or the first entry of a Sequential.

    Example:
        >>> import psflow as pf
        >>> x = pf.keras.Input(shape=(4,), name="features")
        >>> y = pf.keras.layers.Dense(1)(x)
        >>> model = pf.keras.Model(x, y)

    Raises:
        InvalidArgumentError: neither ``shape`` nor ``batch_shape`` given, or a bad dimension.
    """
    if batch_shape is not None:
        batch_size, shape = batch_shape[0], tuple(batch_shape[1:])
    if shape is None:
        raise errors.InvalidArgumentError("Input needs shape= (the shape of one example)")
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    return InputLayer(shape=shape, batch_size=batch_size, dtype=dtype, name=name).output

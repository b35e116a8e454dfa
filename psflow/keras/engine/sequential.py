"""``keras.Sequential``: a stack of layers, each feeding the next."""

from __future__ import annotations

from typing import Any

from psflow import errors
from psflow.framework.tensor import TensorShape
from psflow.keras.engine import input_spec
from psflow.keras.engine.keras_tensor import KerasTensor
from psflow.keras.engine.training import Model
from psflow.keras.layers.base import Layer
from psflow.keras.layers.convolutional import conv_then_max_pool
from psflow.keras.layers.core import InputLayer


class Sequential(Model):
    """A linear stack of layers (Keras's ``keras.Sequential``).

    The model builds when its input shape becomes known: at construction if
    the first layer has ``input_shape`` (or an ``Input`` comes first), else on
    the first call or ``fit``.

    Example:
        >>> import psflow as pf
        >>> model = pf.keras.Sequential([pf.keras.layers.Dense(4, activation="relu"),
        ...                              pf.keras.layers.Dense(1)])
        >>> model(pf.ones([2, 3])).shape
        TensorShape([2, 1])
    """

    def __init__(
        self, layers: list[Any] | None = None, name: str | None = None, **kwargs: Any
    ) -> None:
        super().__init__(name=name, **kwargs)
        self._layers: list[Layer] = []
        # (shape, dtype) of the input declared by an Input or input_shape, conformed to
        # on every call (dtype None: an input_shape only, which fixes no dtype)
        self._declared_input: tuple[Any, str | None] | None = None
        for layer in layers or []:
            self.add(layer)

    def _tracked_layers(self) -> list[Layer]:
        return self.layers

    @property
    def layers(self) -> list[Layer]:
        """The layers in order (an ``Input`` is not listed)."""
        return [layer for layer in self._layers if not isinstance(layer, InputLayer)]

    def add(self, layer: Any) -> None:
        """Appends a layer (or an ``Input``, only first).

        Raises:
            TypeError: ``layer`` is not a layer.
            InvalidArgumentError: an ``Input`` after other layers.
        """
        if isinstance(layer, KerasTensor):
            if layer.node is None or not isinstance(layer.node.layer, InputLayer):
                raise errors.InvalidArgumentError(
                    f"Sequential.add takes layers or a keras.Input, got the Keras tensor {layer!r}"
                )
            layer = layer.node.layer
        if not isinstance(layer, Layer):
            raise TypeError(
                f"Sequential.add expects a Layer, got {type(layer).__name__}: {layer!r}"
            )
        if isinstance(layer, InputLayer) and self._layers:
            raise errors.InvalidArgumentError(
                "An Input can only be the first element of a Sequential model"
            )
        self._layers.append(layer)
        self._sublayers.append(layer)
        self.built = False
        first = self._layers[0]
        if first._batch_input_shape is not None:
            self._batch_input_shape = first._batch_input_shape
            dtype = first.output.dtype if isinstance(first, InputLayer) else None
            self._declared_input = (first._batch_input_shape, dtype)
            self.build(self._batch_input_shape)

    def pop(self) -> Layer:
        """Removes and returns the last layer."""
        if not self._layers:
            raise errors.InvalidArgumentError("There are no layers to pop")
        layer = self._layers.pop()
        self._sublayers.remove(layer)
        if not self._layers:
            self._declared_input = None
        return layer

    def _maybe_build(self, input_shape: Any) -> None:
        # Built from a first batch (call, fit, predict): as in Keras, the batch
        # dimension stays unknown, so the size of that batch is not baked in.
        if not self.built and self._batch_input_shape is None and len(input_shape):
            input_shape = (None, *tuple(input_shape)[1:])
        super()._maybe_build(input_shape)

    def build(self, input_shape: Any = None) -> None:
        """Builds every layer in turn from the input shape."""
        if input_shape is None:
            input_shape = self._batch_input_shape
        if input_shape is None:
            raise errors.InvalidArgumentError(f"{self.name}: build needs an input shape")
        shape = TensorShape(input_shape)
        self._batch_input_shape = tuple(shape)
        with self._strategy_scope():
            for layer in self._layers:
                layer._maybe_build(shape)
                shape = TensorShape(layer.compute_output_shape(shape))
        self.built = True

    def call(self, inputs: Any, training: Any = None, mask: Any = None) -> Any:
        x = inputs
        if self._declared_input is not None and not isinstance(inputs, (dict, list, tuple)):
            shape, dtype = self._declared_input
            # an input_shape on a layer (no Input): that layer checks the dimensions itself
            first = self._layers[0]
            x = input_spec.conform(
                inputs, shape, dtype, first.name, self.name, isinstance(first, InputLayer)
            )
        layers, i = self._layers, 0
        while i < len(layers):
            # a convolution and the max pool after it run as one op (the same bits, a pass
            # through memory fewer each way: psflow.ops.conv_ops.conv_layer_max_pool)
            pooled = (
                conv_then_max_pool(layers[i], layers[i + 1], x) if i + 1 < len(layers) else None
            )
            if pooled is not None:
                x, i = pooled, i + 2
            else:
                x, i = layers[i](x, training=training), i + 1
        return x

    def compute_output_shape(self, input_shape: Any) -> TensorShape:
        shape = TensorShape(input_shape)
        for layer in self._layers:
            shape = TensorShape(layer.compute_output_shape(shape))
        return shape

    def get_config(self) -> dict[str, Any]:
        from psflow.keras.saving import serialization

        return {
            "name": self.name,
            "trainable": self.trainable,
            "layers": [serialization.serialize_keras_object(layer) for layer in self._layers],
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Sequential:
        """Rebuilds the stack from :meth:`get_config` (layers resolved by class name).

        Raises:
            InvalidArgumentError: an unknown layer class (named) or a malformed entry.
        """
        from psflow.keras.saving import serialization

        entries = config.get("layers")
        if not isinstance(entries, list):
            raise errors.InvalidArgumentError(
                f"A Sequential config needs a list of layers, got {entries!r:.200}"
            )
        layers = [serialization.deserialize_keras_object(e) for e in entries]
        model = cls(layers, name=config.get("name"))
        model.trainable = config.get("trainable", True)
        return model

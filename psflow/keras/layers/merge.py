"""Merge layers: combine a list of tensors into one (``Concatenate``, ``Add``, ``Multiply``...).

Elementwise merges follow NumPy broadcasting, as Keras does; the shapes are
checked when the layer is called on Keras tensors, so a mismatch is reported
where the graph is built, naming the shapes.
"""

from __future__ import annotations

from functools import reduce
from typing import Any

from psflow import errors
from psflow.framework.tensor import TensorShape
from psflow.keras.engine.keras_tensor import is_shape
from psflow.keras.layers.base import Layer
from psflow.ops import array_ops, math_ops
from psflow.ops._core import node


class _Merge(Layer):
    """Base of the merge layers: takes a list of at least two tensors."""

    def _check_shapes(self, input_shape: Any) -> list[tuple]:
        if is_shape(input_shape) or not isinstance(input_shape, (list, tuple)):
            raise errors.InvalidArgumentError(
                f"{self.name}: a merge layer takes a list of tensors, got one of shape "
                f"{input_shape!r}"
            )
        shapes = [tuple(s) for s in input_shape]
        if len(shapes) < 2:
            raise errors.InvalidArgumentError(
                f"{self.name}: a merge layer needs at least 2 inputs, got {len(shapes)}"
            )
        return shapes

    def build(self, input_shape: Any) -> None:
        shapes = self._check_shapes(input_shape)
        self.compute_output_shape(shapes)  # raises on incompatible shapes, before any call
        self.built = True

    def _merge(self, a: Any, b: Any) -> Any:
        raise NotImplementedError

    def call(self, inputs: Any) -> Any:
        if not isinstance(inputs, (list, tuple)) or len(inputs) < 2:
            raise errors.InvalidArgumentError(
                f"{self.name}: a merge layer takes a list of at least 2 tensors"
            )
        return reduce(self._merge, [node(x) for x in inputs])

    def compute_output_shape(self, input_shape: Any) -> TensorShape:
        shapes = self._check_shapes(input_shape)
        return reduce(lambda a, b: _broadcast(self.name, a, b), shapes)


def _broadcast(name: str, a: tuple, b: tuple) -> TensorShape:
    """NumPy's broadcast of two shapes, with ``None`` for unknown dimensions."""
    a, b = tuple(a), tuple(b)
    if len(a) < len(b):
        a = (1,) * (len(b) - len(a)) + a
    b = (1,) * (len(a) - len(b)) + b
    out = []
    for da, db in zip(a, b):
        if da is None or db is None:  # unknown: assume it matches the known side
            known = db if da is None else da
            out.append(None if known in (None, 1) else known)
        elif da == db or db == 1:
            out.append(da)
        elif da == 1:
            out.append(db)
        else:
            raise errors.InvalidArgumentError(
                f"{name}: inputs of shapes {list(a)} and {list(b)} cannot be merged elementwise"
            )
    return TensorShape(out)


class Add(_Merge):
    """The elementwise sum of its inputs.

    Example:
        >>> import psflow as pf
        >>> a, b = pf.keras.Input(shape=(3,)), pf.keras.Input(shape=(3,))
        >>> pf.keras.layers.Add()([a, b]).shape
        TensorShape([None, 3])
    """

    def _merge(self, a: Any, b: Any) -> Any:
        return math_ops.add(a, b)


class Subtract(_Merge):
    """The first input minus the second (exactly two inputs)."""

    def _check_shapes(self, input_shape: Any) -> list[tuple]:
        shapes = super()._check_shapes(input_shape)
        if len(shapes) != 2:
            raise errors.InvalidArgumentError(
                f"{self.name}: Subtract takes exactly 2 inputs, got {len(shapes)}"
            )
        return shapes

    def _merge(self, a: Any, b: Any) -> Any:
        return math_ops.subtract(a, b)


class Multiply(_Merge):
    """The elementwise product of its inputs."""

    def _merge(self, a: Any, b: Any) -> Any:
        return math_ops.multiply(a, b)


class Maximum(_Merge):
    """The elementwise maximum of its inputs."""

    def _merge(self, a: Any, b: Any) -> Any:
        return math_ops.maximum(a, b)


class Minimum(_Merge):
    """The elementwise minimum of its inputs."""

    def _merge(self, a: Any, b: Any) -> Any:
        return math_ops.minimum(a, b)


class Average(_Merge):
    """The elementwise mean of its inputs."""

    def call(self, inputs: Any) -> Any:
        total = super().call(inputs)
        return math_ops.multiply(total, 1.0 / len(inputs))

    def _merge(self, a: Any, b: Any) -> Any:
        return math_ops.add(a, b)


class Concatenate(_Merge):
    """Joins its inputs along ``axis`` (the last by default); other dimensions must agree.

    Example:
        >>> import psflow as pf
        >>> a, b = pf.keras.Input(shape=(3,)), pf.keras.Input(shape=(2,))
        >>> pf.keras.layers.Concatenate()([a, b]).shape
        TensorShape([None, 5])
    """

    def __init__(self, axis: int = -1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.axis = int(axis)

    def call(self, inputs: Any) -> Any:
        if not isinstance(inputs, (list, tuple)) or len(inputs) < 2:
            raise errors.InvalidArgumentError(
                f"{self.name}: Concatenate takes a list of at least 2 tensors"
            )
        return array_ops.concat([node(x) for x in inputs], axis=self.axis)

    def compute_output_shape(self, input_shape: Any) -> TensorShape:
        shapes = self._check_shapes(input_shape)
        rank = len(shapes[0])
        if any(len(s) != rank for s in shapes) or not -rank <= self.axis < rank:
            raise errors.InvalidArgumentError(
                f"{self.name}: cannot concatenate shapes {[list(s) for s in shapes]} on axis "
                f"{self.axis}"
            )
        axis = self.axis % rank
        out = list(shapes[0])
        for s in shapes[1:]:
            for i, d in enumerate(s):
                if i == axis:
                    out[i] = None if out[i] is None or d is None else out[i] + d
                elif out[i] is None:
                    out[i] = d
                elif d is not None and d != out[i]:
                    raise errors.InvalidArgumentError(
                        f"{self.name}: cannot concatenate shapes {[list(s) for s in shapes]} "
                        f"on axis {self.axis}: dimension {i} differs"
                    )
        return TensorShape(out)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "axis": self.axis}


def add(inputs: list[Any], **kwargs: Any) -> Any:
    """Functional form of :class:`Add`."""
    return Add(**kwargs)(inputs)


def subtract(inputs: list[Any], **kwargs: Any) -> Any:
    """Functional form of :class:`Subtract`."""
    return Subtract(**kwargs)(inputs)


def multiply(inputs: list[Any], **kwargs: Any) -> Any:
    """Functional form of :class:`Multiply`."""
    return Multiply(**kwargs)(inputs)


def average(inputs: list[Any], **kwargs: Any) -> Any:
    """Functional form of :class:`Average`."""
    return Average(**kwargs)(inputs)


def maximum(inputs: list[Any], **kwargs: Any) -> Any:
    """Functional form of :class:`Maximum`."""
    return Maximum(**kwargs)(inputs)


def minimum(inputs: list[Any], **kwargs: Any) -> Any:
    """Functional form of :class:`Minimum`."""
    return Minimum(**kwargs)(inputs)


def concatenate(inputs: list[Any], axis: int = -1, **kwargs: Any) -> Any:
    """Functional form of :class:`Concatenate`."""
    return Concatenate(axis=axis, **kwargs)(inputs)

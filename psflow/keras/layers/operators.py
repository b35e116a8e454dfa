"""Python operators on Keras tensors: ``x / 255.0``, ``a + b``, ``-x``, ``x[:, :2]``.

Writing arithmetic on ``keras.Input``s is common in Keras programs; each
operator becomes a small layer in the functional graph, so the model runs,
differentiates and saves it like any other layer. Constants must be Python
numbers (they are saved in the model's JSON); anything else belongs in a
``keras.layers.Lambda``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from psflow import errors
from psflow.framework.tensor import TensorShape
from psflow.keras.layers.base import Layer
from psflow.keras.layers.merge import _broadcast
from psflow.ops import math_ops
from psflow.ops._core import node

_BINARY = {
    "add": math_ops.add,
    "subtract": math_ops.subtract,
    "multiply": math_ops.multiply,
    "divide": math_ops.divide,
    "pow": math_ops.pow,
}


class TensorOperator(Layer):
    """``x <op> constant``, ``constant <op> x`` (``reverse``), ``a <op> b`` or ``-x``.

    Args:
        op: one of add, subtract, multiply, divide, pow, negative.
        constant: a Python number, or None when both operands are tensors.
        reverse: the constant is the left operand.

    Raises:
        InvalidArgumentError: an unknown ``op``, or a constant that is not a number.
    """

    def __init__(self, op: str, constant: Any = None, reverse: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if op not in _BINARY and op != "negative":
            raise errors.InvalidArgumentError(
                f"TensorOperator: unknown op {op!r}; known: {sorted([*_BINARY, 'negative'])}"
            )
        if constant is not None and (
            isinstance(constant, bool) or not isinstance(constant, (int, float))
        ):
            raise errors.InvalidArgumentError(
                f"Keras tensors combine with Python numbers or Keras tensors, got "
                f"{type(constant).__name__}: {constant!r:.80}; use keras.layers.Lambda for others"
            )
        self.op, self.constant, self.reverse = op, constant, bool(reverse)

    def call(self, inputs: Any) -> Any:
        if self.op == "negative":
            return math_ops.negative(node(inputs))
        fn = _BINARY[self.op]
        if self.constant is None:
            a, b = inputs
            return fn(node(a), node(b))
        x = node(inputs)
        c = np.asarray(self.constant, dtype=x._array().dtype)
        return fn(c, x) if self.reverse else fn(x, c)

    def compute_output_shape(self, input_shape: Any) -> TensorShape:
        if self.op != "negative" and self.constant is None:
            a, b = input_shape
            return _broadcast(self.name, tuple(a), tuple(b))
        return TensorShape(input_shape)

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "op": self.op,
            "constant": self.constant,
            "reverse": self.reverse,
        }


def _encode_key(key: Any) -> list[Any]:
    items = key if isinstance(key, tuple) else (key,)
    out: list[Any] = []
    for item in items:
        if isinstance(item, slice):
            out.append({"slice": [item.start, item.stop, item.step]})
        elif item is Ellipsis:
            out.append("...")
        elif item is None:
            out.append(None)
        elif isinstance(item, (int, np.integer)) and not isinstance(item, bool):
            out.append(int(item))
        else:
            raise errors.InvalidArgumentError(
                f"Keras tensors take ints, slices, None and ... as indices, got {item!r:.80}; "
                "use keras.layers.Lambda for others"
            )
    return out


def _decode_key(items: list[Any]) -> tuple:
    out: list[Any] = []
    for item in items:
        if isinstance(item, dict):
            out.append(slice(*item["slice"]))
        elif item == "...":
            out.append(Ellipsis)
        else:
            out.append(item)
    return tuple(out)


class TensorSlice(Layer):
    """``x[key]`` for a key of ints, slices, ``None`` and ``...`` (what ``kt[:, :2]`` builds)."""

    def __init__(self, key: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.key = key if isinstance(key, list) else _encode_key(key)
        self._key = _decode_key(self.key)

    def call(self, inputs: Any) -> Any:
        return node(inputs)[self._key]

    def compute_output_shape(self, input_shape: Any) -> TensorShape:
        shape = tuple(input_shape)
        # The shape from indexing a stand-in array; an unknown dimension stands in as a prime
        # size no index here produces by chance, and maps back to None.
        unknown = 9973
        probe = np.empty([unknown if d is None else d for d in shape], dtype=np.bool_)
        try:
            out = probe[self._key].shape
        except IndexError as e:
            raise errors.InvalidArgumentError(
                f"{self.name}: index {self._key!r} does not fit shape {list(shape)}: {e}"
            ) from e
        return TensorShape([None if d == unknown else d for d in out])

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "key": self.key}

"""Activation functions by name (Keras's ``keras.activations``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from psflow import errors
from psflow.ops import math_ops, nn_ops
from psflow.ops._core import node


def linear(x: Any) -> Any:
    """The identity."""
    return x


def relu(x: Any) -> Any:
    """``max(x, 0)``."""
    return nn_ops.relu(x)


def sigmoid(x: Any) -> Any:
    """``1 / (1 + exp(-x))``.

    The result remembers ``x``: a binary cross-entropy of it (``from_logits=False``)
    then works from the logits, as Keras does, so a saturated sigmoid (exactly 0
    or 1 in float32) still gets a gradient instead of a clipped, flat loss.
    """
    y = math_ops.sigmoid(x)
    y._sigmoid_logits = node(x)
    return y


def sigmoid_logits(y: Any) -> Any:
    """The logits ``y`` is the sigmoid activation of, or None (any other tensor)."""
    try:
        return y._sigmoid_logits
    except AttributeError:
        return None


def tanh(x: Any) -> Any:
    """Hyperbolic tangent."""
    return math_ops.tanh(x)


def softmax(x: Any, axis: int = -1) -> Any:
    """Softmax along ``axis``."""
    return nn_ops.softmax(x, axis=axis)


def log_softmax(x: Any, axis: int = -1) -> Any:
    """Log-softmax along ``axis``."""
    return nn_ops.log_softmax(x, axis=axis)


def softplus(x: Any) -> Any:
    """``log(1 + exp(x))``."""
    return math_ops.softplus(x)


def elu(x: Any) -> Any:
    """Exponential linear unit."""
    return nn_ops.elu(x)


def selu(x: Any) -> Any:
    """Scaled exponential linear unit."""
    return nn_ops.selu(x)


def gelu(x: Any, approximate: bool = False) -> Any:
    """Gaussian error linear unit."""
    return nn_ops.gelu(x, approximate=approximate)


def swish(x: Any) -> Any:
    """``x * sigmoid(x)``."""
    return nn_ops.swish(x)


def leaky_relu(x: Any, negative_slope: float = 0.2) -> Any:
    """Leaky ReLU."""
    return nn_ops.leaky_relu(x, alpha=negative_slope)


def exponential(x: Any) -> Any:
    """``exp(x)``."""
    return math_ops.exp(x)


silu = swish

_BY_NAME: dict[str, Callable[[Any], Any]] = {
    "linear": linear,
    "relu": relu,
    "sigmoid": sigmoid,
    "tanh": tanh,
    "softmax": softmax,
    "log_softmax": log_softmax,
    "softplus": softplus,
    "elu": elu,
    "selu": selu,
    "gelu": gelu,
    "swish": swish,
    "silu": silu,
    "leaky_relu": leaky_relu,
    "exponential": exponential,
}


def get(identifier: Any) -> Callable[[Any], Any]:
    """An activation from a name, a callable, or ``None`` (linear).

    Raises:
        ValueError: an unknown name, quoted with the known ones.
    """
    if identifier is None:
        return linear
    if callable(identifier):
        return identifier
    if isinstance(identifier, str):
        fn = _BY_NAME.get(identifier.lower())
        if fn is None:
            raise errors.InvalidArgumentError(
                f"Unknown activation {identifier!r}; known: {sorted(_BY_NAME)}"
            )
        return fn
    raise TypeError(f"Could not interpret activation {identifier!r}")


def serialize(fn: Callable[[Any], Any]) -> str:
    """The name of a built-in activation (or the function's name)."""
    for name, f in _BY_NAME.items():
        if f is fn:
            return name
    return getattr(fn, "__name__", repr(fn))

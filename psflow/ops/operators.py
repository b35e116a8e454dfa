"""Python operators (``+``, ``@``, ``<``...) for tensors and variables.

Installed on both classes once, when ``psflow`` is imported, so ``v * 2``
on a variable is recorded by tapes like ``pf.multiply(v, 2)``.
"""

from __future__ import annotations

from typing import Any

from psflow.ops import math_ops


def _flip(op: Any) -> Any:
    return lambda self, other: op(other, self)


_BINARY = {
    "add": math_ops.add,
    "sub": math_ops.subtract,
    "mul": math_ops.multiply,
    "truediv": math_ops.divide,
    "floordiv": math_ops.floordiv,
    "mod": math_ops.floormod,
    "pow": math_ops.pow,
    "matmul": math_ops.matmul,
    "and": math_ops.logical_and,
    "or": math_ops.logical_or,
    "xor": math_ops.logical_xor,
}
_COMPARE = {
    "lt": math_ops.less,
    "le": math_ops.less_equal,
    "gt": math_ops.greater,
    "ge": math_ops.greater_equal,
    "eq": math_ops.equal,
    "ne": math_ops.not_equal,
}


def _eq(self: Any, other: Any) -> Any:
    if other is None:
        return False
    try:
        return math_ops.equal(self, other)
    except (TypeError, ValueError):
        return False


def _ne(self: Any, other: Any) -> Any:
    if other is None:
        return True
    try:
        return math_ops.not_equal(self, other)
    except (TypeError, ValueError):
        return True


def install(cls: type) -> None:
    """Adds the arithmetic, comparison and unary operators to ``cls``."""
    for name, op in _BINARY.items():
        setattr(cls, f"__{name}__", op)  # op(self, other): no wrapper frame on the hot path
        setattr(cls, f"__r{name}__", _flip(op))
    for name, op in _COMPARE.items():
        if name not in ("eq", "ne"):
            setattr(cls, f"__{name}__", op)
    cls.__eq__ = _eq
    cls.__ne__ = _ne
    cls.__neg__ = lambda self: math_ops.negative(self)
    cls.__pos__ = lambda self: self
    cls.__abs__ = lambda self: math_ops.abs(self)
    cls.__invert__ = lambda self: math_ops.logical_not(self)

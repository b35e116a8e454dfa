"""Weight regularizers: ``regularizer(weight) -> scalar penalty``."""

from __future__ import annotations

from typing import Any

from psflow import errors
from psflow.ops import math_ops


class Regularizer:
    """Base class."""

    def __call__(self, x: Any) -> Any:
        return 0.0

    def get_config(self) -> dict[str, Any]:
        """Constructor arguments."""
        return {}


class L1L2(Regularizer):
    """``l1 * sum(|x|) + l2 * sum(x**2)``."""

    def __init__(self, l1: float = 0.0, l2: float = 0.0) -> None:
        self.l1, self.l2 = float(l1), float(l2)

    def __call__(self, x: Any) -> Any:
        total = math_ops.multiply(0.0, math_ops.reduce_sum(x))
        if self.l1:
            total = math_ops.add(
                total, math_ops.multiply(self.l1, math_ops.reduce_sum(math_ops.abs(x)))
            )
        if self.l2:
            total = math_ops.add(
                total, math_ops.multiply(self.l2, math_ops.reduce_sum(math_ops.square(x)))
            )
        return total

    def get_config(self) -> dict[str, Any]:
        return {"l1": self.l1, "l2": self.l2}


class L1(L1L2):
    """``l1 * sum(|x|)``."""

    def __init__(self, l1: float = 0.01) -> None:
        super().__init__(l1=l1)


class L2(L1L2):
    """``l2 * sum(x**2)``."""

    def __init__(self, l2: float = 0.01) -> None:
        super().__init__(l2=l2)


l1, l2, l1_l2 = L1, L2, L1L2


def get(identifier: Any) -> Regularizer:
    """A regularizer from a name (``"l1"``, ``"l2"``, ``"l1_l2"``), an instance or a callable."""
    if isinstance(identifier, Regularizer) or (
        callable(identifier) and not isinstance(identifier, str)
    ):
        return identifier
    table = {"l1": L1, "l2": L2, "l1_l2": L1L2}
    if isinstance(identifier, str) and identifier.lower() in table:
        return table[identifier.lower()]()
    raise errors.InvalidArgumentError(f"Unknown regularizer {identifier!r}; known: {sorted(table)}")

"""``ReduceOp``: how values from several replicas combine."""

from __future__ import annotations

import enum
from typing import Any

from psflow import errors


class ReduceOp(enum.Enum):
    """SUM or MEAN across replicas (TensorFlow's ``tf.distribute.ReduceOp``)."""

    SUM = "SUM"
    MEAN = "MEAN"

    @classmethod
    def from_value(cls, value: Any) -> ReduceOp:
        """Accepts a ReduceOp or its name in any case.

        Raises:
            InvalidArgumentError: an unknown name, quoted.
        """
        if isinstance(value, cls):
            return value
        if isinstance(value, enum.Enum):
            value = value.name
        try:
            return cls(str(value).upper())
        except ValueError:
            raise errors.InvalidArgumentError(
                f"Unknown reduce op {value!r}; expected one of {[m.value for m in cls]}"
            ) from None

"""The reduction a cross-device op applies: TensorFlow's ``tf.distribute.ReduceOp``."""

from __future__ import annotations

import enum
from typing import Any

from psflow import errors


class ReduceOp(enum.Enum):
    """How the replicas' values are combined.

    ``SUM`` adds them; ``MEAN`` adds them and divides the sum once by the number
    of replicas (floating and complex dtypes only: an integer mean is not exact,
    so psflow refuses it rather than silently changing the dtype).

    Strings are accepted case-insensitively, as is any enum member named
    ``SUM`` or ``MEAN`` (e.g. another library's ``ReduceOp``).

    Example:
        >>> ReduceOp.parse("mean")
        <ReduceOp.MEAN: 'MEAN'>
    """

    SUM = "SUM"
    MEAN = "MEAN"

    @classmethod
    def _missing_(cls, value: object) -> ReduceOp | None:
        if isinstance(value, str):
            return cls.__members__.get(value.strip().upper())
        return None

    @classmethod
    def parse(cls, value: Any) -> ReduceOp:
        """Returns the member for ``value`` (a member, a name, or a same-named enum).

        Raises:
            InvalidArgumentError: ``value`` names no reduction.
        """
        if isinstance(value, cls):
            return value
        if isinstance(value, enum.Enum):
            value = value.name
        if isinstance(value, str):
            member = cls.__members__.get(value.strip().upper())
            if member is not None:
                return member
        raise errors.InvalidArgumentError(
            f"Unknown reduce op {value!r}: expected one of {[m.name for m in cls]}"
        )

    @classmethod
    def from_value(cls, value: Any) -> ReduceOp:
        """The same parser as :meth:`parse`, under the name the strategies call.

        Raises:
            InvalidArgumentError: ``value`` names no reduction.
        """
        return cls.parse(value)

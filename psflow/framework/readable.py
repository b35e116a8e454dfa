"""The one question every array-backed value answers: "which array holds you?".

Tensors and every kind of variable (plain, mirrored, sync-on-read, on a PS,
sharded) hold their value in one backend array.  Code that turns any of them
into host data (predictions, metrics) checks :class:`Readable` with
``isinstance`` instead of probing for the method.  It is a nominal base (as in
:mod:`psflow.distribute.protocols`): a runtime ``typing.Protocol`` would probe
the members on every check, and this check runs once per output of a step.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Readable"]


class Readable:
    """A value held in one backend array (NumPy or CuPy), read without a copy."""

    # no instance dict: Tensor keeps its slots
    __slots__ = ()

    def _array(self) -> Any:
        """The backend array behind the value (never a copy; do not modify it)."""
        raise NotImplementedError(f"{type(self).__name__} does not define _array")

"""Iterators over datasets (TensorFlow's ``tf.data.Iterator``) and ``Optional``.

An iterator is one pass over a dataset. Its elements are psflow tensors on the
current device (host arrays on CPU:0, copied to the GPU when one is current).

Example:
    >>> import psflow as pf
    >>> it = iter(pf.data.Dataset.range(2))
    >>> int(it.get_next()), int(next(it))
    (0, 1)
    >>> bool(it.get_next_as_optional().has_value())
    False
"""

from __future__ import annotations

from typing import Any

import numpy as np

from psflow import errors
from psflow.framework.tensor import Tensor, _place


class Iterator:
    """One pass over a dataset: ``next(it)``, ``it.get_next()``, ``for x in it``."""

    def __init__(self, dataset: Any) -> None:
        self._dataset = dataset
        self._flat = dataset._iter_flat()
        self._position = 0  # elements handed out: what a checkpoint saves

    # -- checkpointing (``psflow.train.Checkpoint(iterator=it)``) ------------------------
    def _checkpoint_position(self, path: str) -> int:
        """The position to save.

        Raises:
            FailedPreconditionError: the dataset's passes may differ (a Python
                generator, an unseeded shuffle), naming it and ``path``.
        """
        reason = self._dataset._replay_obstacle()
        if reason is not None:
            raise errors.FailedPreconditionError(
                f"Checkpoint cannot save the iterator {path!r}: its dataset reads {reason}, "
                "whose elements a restored iterator could not find again"
            )
        return self._position

    def _restore_position(self, position: int) -> None:
        """Continues after the first ``position`` elements of a pass (replayed from the start)."""
        if position < self._position:  # read past it already: a fresh pass
            self._flat = self._dataset._iter_flat()
            self._position = 0
        for _ in range(position - self._position):
            try:
                next(self._flat)
            except StopIteration:
                break
        self._position = position

    @property
    def element_spec(self) -> Any:
        """The dataset's element spec."""
        return self._dataset.element_spec

    def __iter__(self) -> Iterator:
        return self

    def __next__(self) -> Any:
        flat = next(self._flat)
        self._position += 1
        return self._dataset._pack(tuple(Tensor._wrap(_place(a)) for a in flat))

    def next(self) -> Any:
        """The next element (raises ``StopIteration`` at the end)."""
        return self.__next__()

    def get_next(self) -> Any:
        """The next element.

        Raises:
            OutOfRangeError: the pass is over (TensorFlow's end-of-sequence error).
        """
        try:
            return self.__next__()
        except StopIteration:
            raise errors.OutOfRangeError("End of sequence") from None

    def get_next_as_optional(self) -> Optional:
        """The next element wrapped in an :class:`Optional`, empty at the end."""
        try:
            return Optional.from_value(self.__next__())
        except StopIteration:
            return Optional.empty(self._dataset.element_spec)

    def __repr__(self) -> str:
        return f"<psflow.data.Iterator element_spec={self.element_spec!r}>"


class Optional:
    """A value that may be missing (TensorFlow's ``tf.experimental.Optional``).

    Example:
        >>> import psflow as pf
        >>> opt = Optional.from_value(pf.constant(3))
        >>> bool(opt.has_value()), int(opt.get_value())
        (True, 3)
    """

    def __init__(self, value: Any, has_value: bool, element_spec: Any) -> None:
        self._value = value
        self._has_value = has_value
        self._spec = element_spec

    @staticmethod
    def from_value(value: Any) -> Optional:
        """An optional holding ``value``."""
        from psflow.data import structure

        spec = structure.map_structure(structure.TensorSpec.from_tensor, value)
        return Optional(value, True, spec)

    @staticmethod
    def empty(element_spec: Any) -> Optional:
        """An optional with no value, for elements described by ``element_spec``."""
        return Optional(None, False, element_spec)

    @property
    def element_spec(self) -> Any:
        """The spec of the (possible) value."""
        return self._spec

    def has_value(self) -> Tensor:
        """A scalar bool tensor: whether there is a value."""
        return Tensor._wrap(np.asarray(self._has_value))

    def get_value(self) -> Any:
        """The value.

        Raises:
            InvalidArgumentError: the optional is empty.
        """
        if not self._has_value:
            raise errors.InvalidArgumentError("The optional has no value")
        return self._value

    def __repr__(self) -> str:
        return f"<psflow.data.Optional has_value={self._has_value} element_spec={self._spec!r}>"

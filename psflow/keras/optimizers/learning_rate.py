"""The learning rate an optimizer reports: a float with TensorFlow's variable API on top.

Keras hands out ``optimizer.learning_rate`` as a variable, and tutorials call
``optimizer.learning_rate.numpy()`` or ``.assign(...)`` on it.  psflow keeps
the learning rate a plain number inside the optimizer (it is a hyperparameter
of the update rule, sent as such to parameter servers) and reports it as a
:class:`LearningRate`: a ``float`` (so arithmetic, comparisons, formatting,
JSON and schedules behave as a float's) that also has ``numpy()``, ``dtype``
and ``assign()``.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from psflow import errors
from psflow.dtypes import DType, float32


class LearningRate(float):
    """The learning rate at one moment, as a float, with ``numpy()`` and ``assign()``.

    It is a snapshot: later changes to the optimizer do not change it, and
    ``assign`` changes the optimizer, not this value (read
    ``optimizer.learning_rate`` again).  Pickled or copied it becomes a plain
    float.

    Example:
        >>> import psflow as pf
        >>> opt = pf.keras.optimizers.SGD(0.5)
        >>> lr = opt.learning_rate
        >>> float(lr * 2), lr.numpy().dtype.name
        (1.0, 'float32')
        >>> _ = lr.assign(0.25)
        >>> float(opt.learning_rate)
        0.25
    """

    __slots__ = ("_optimizer",)

    def __new__(cls, value: float, optimizer: Any = None) -> LearningRate:
        """``value`` as reported by ``optimizer`` (which ``assign`` writes to)."""
        self = super().__new__(cls, value)
        self._optimizer = None if optimizer is None else weakref.ref(optimizer)
        return self

    @property
    def dtype(self) -> DType:
        """float32, as TensorFlow's learning-rate variable."""
        return float32

    def numpy(self) -> np.float32:
        """The value as a NumPy float32 scalar (what TensorFlow's variable returns)."""
        return np.float32(self)

    def assign(self, value: Any) -> LearningRate:
        """Sets the optimizer's learning rate (a number or a schedule); returns the new one.

        Raises:
            FailedPreconditionError: this value belongs to no live optimizer (it was
                pickled, copied, or the optimizer is gone).
            InvalidArgumentError: ``value`` is neither a non-negative number nor a schedule.
        """
        optimizer = self._optimizer() if self._optimizer is not None else None
        if optimizer is None:
            raise errors.FailedPreconditionError(
                f"This learning rate ({float(self)}) belongs to no optimizer; "
                "set optimizer.learning_rate instead"
            )
        optimizer.learning_rate = value
        return optimizer.learning_rate

    def __reduce__(self) -> tuple:
        return (float, (float(self),))

    def __repr__(self) -> str:
        return float.__repr__(self)

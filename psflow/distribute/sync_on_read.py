"""``SyncOnReadVariable``: one unsynchronized copy per replica, aggregated when read.

Created by a MirroredStrategy for ``Variable(..., synchronization=ON_READ,
aggregation=...)`` (TensorFlow's ``SyncOnReadVariable``; what Keras 3 keeps a
metric's totals in). Each replica reads and writes its own copy inside
``strategy.run``, with no communication; in cross-replica context a read
aggregates the copies and a write sets every copy so that the next read gives
the written value. TensorFlow 2.21's observed rules (see
``tests/test_sync_on_read_tf_reference.py``):

=================== ================ ======================= =======================
aggregation         read (cross)     ``assign(x)`` (cross)   ``assign_add(d)`` (cross)
=================== ================ ======================= =======================
SUM                 sum of copies    each copy ``x / N``     refused
MEAN                mean of copies   each copy ``x``         each copy ``+ d``
ONLY_FIRST_REPLICA  copy 0           each copy ``x``         each copy ``+ d``
NONE                refused          each copy ``x``         each copy ``+ d``
=================== ================ ======================= =======================

An integer SUM variable assigned ``x`` gets ``x / N`` truncated, as
TensorFlow's cast does; MEAN of a non-floating variable is refused at creation.

Example:
    >>> import psflow as pf
    >>> s = pf.distribute.MirroredStrategy()
    >>> with s.scope():
    ...     v = pf.Variable(0.0, synchronization=pf.VariableSynchronization.ON_READ,
    ...                     aggregation=pf.VariableAggregation.SUM)
    >>> _ = s.run(lambda: v.assign_add(2.0))
    >>> float(v)
    2.0
"""

from __future__ import annotations

from typing import Any

import numpy as np

from psflow import backend, errors
from psflow.distribute import distribute_lib
from psflow.distribute.protocols import ReplicatedVariable
from psflow.framework import variable as variable_lib
from psflow.framework.tensor import TensorShape

Aggregation = variable_lib.VariableAggregation


def check_aggregation(aggregation: Aggregation, dtype: Any, name: str) -> None:
    """Refuses what TensorFlow refuses at creation: MEAN of a non-floating variable.

    Raises:
        InvalidArgumentError: naming the variable and its dtype.
    """
    if aggregation is Aggregation.MEAN and np.dtype(dtype).kind not in "fc":
        raise errors.InvalidArgumentError(
            f"Variable {name!r}: aggregation=MEAN needs a floating dtype, got {np.dtype(dtype)}; "
            "use SUM or ONLY_FIRST_REPLICA"
        )


class SyncOnReadVariable(variable_lib.Variable, ReplicatedVariable):
    """A variable with one copy per replica, combined by its aggregation when read.

    Args:
        strategy: the MirroredStrategy that owns it.
        copies: one plain variable per device, equal in value at creation.
        aggregation: SUM, MEAN, ONLY_FIRST_REPLICA (or NONE: readable only per replica).
    """

    def __init__(
        self, strategy: Any, copies: list[variable_lib.Variable], *, aggregation: Aggregation
    ) -> None:
        self._strategy_ref = strategy
        self._copies = tuple(copies)
        first = copies[0]
        self._name = first.name
        self._trainable = first.trainable
        self._constraint = first.constraint
        self._synchronization = variable_lib.VariableSynchronization.ON_READ
        self._aggregation = Aggregation(aggregation)

    # -- which copy ------------------------------------------------------------------
    @property
    def values(self) -> tuple[variable_lib.Variable, ...]:
        """The per-replica copies."""
        return self._copies

    def _replica(self) -> int | None:
        """This thread's replica of the owning strategy, or None in cross-replica context."""
        current = distribute_lib._current()
        ctx = current.replica_context if current is not None else None
        if ctx is not None and ctx._strategy is self._strategy_ref:
            return ctx._replica_id
        return None

    def _array(self) -> Any:
        replica = self._replica()
        if replica is not None:
            return self._copies[replica]._value
        return self._aggregate()

    @property
    def _value(self) -> Any:  # type: ignore[override]
        return self._array()

    @property
    def update_group(self) -> Any:
        """The strategy's extended object: a trainable one is updated copy by copy."""
        return self._strategy_ref.extended

    def _aggregate(self) -> Any:
        """The cross-replica value: a new array on the first copy's device."""
        agg = self._aggregation
        first = self._copies[0]._value
        if agg is Aggregation.NONE:
            raise errors.InvalidArgumentError(
                f"Reading {self.name} (synchronization=ON_READ, aggregation=NONE) in "
                "cross-replica context needs an aggregation: create it with SUM, MEAN or "
                "ONLY_FIRST_REPLICA, or read it inside strategy.run"
            )
        if agg is Aggregation.ONLY_FIRST_REPLICA:
            return first.copy()
        where = backend.device_of(first)
        with backend.on_device_of(first):
            total = first.copy()
            for c in self._copies[1:]:
                total += backend.place(c._value, where)
            if agg is Aggregation.MEAN:
                total /= len(self._copies)  # floating only (checked at creation)
        return total

    # -- writes ----------------------------------------------------------------------
    def _refuse_cross(self, method: str) -> None:
        agg = self._aggregation
        if method != "assign" and agg is Aggregation.SUM:
            raise errors.InvalidArgumentError(
                f"{method} on {self.name} (synchronization=ON_READ, aggregation={agg.name}) is "
                "not supported in cross-replica context, as in TensorFlow; call it inside "
                "strategy.run (each replica updates its own copy)"
            )

    def _update(self, method: str, value: Any) -> None:
        replica = self._replica()
        if replica is not None:  # this replica's copy only: no communication
            getattr(self._copies[replica], method)(value)
            return
        self._refuse_cross(method)
        new = self._copies[0]._checked_update(value, method)  # validated before any write
        if method == "assign" and self._aggregation is Aggregation.SUM:
            # every copy gets x / N, so that the sum read back is x (truncated for ints)
            with backend.on_device_of(new):
                new = (new / len(self._copies)).astype(new.dtype)
        for c in self._copies:
            getattr(c, method)(backend.place(new, backend.device_of(c._value)))

    def _write(self, array: Any) -> None:
        self._update("assign", array)

    def assign(
        self, value: Any, use_locking: Any = None, name: Any = None, read_value: bool = True
    ) -> Any:
        """In ``run``: sets this replica's copy. Outside: see the module's table.

        Raises:
            InvalidArgumentError: a value of another shape or dtype (nothing is written).
        """
        self._update("assign", value)
        return self if read_value else None

    def assign_add(
        self, delta: Any, use_locking: Any = None, name: Any = None, read_value: bool = True
    ) -> Any:
        """In ``run``: adds to this replica's copy. Outside: to every copy (refused for SUM)."""
        self._update("assign_add", delta)
        return self if read_value else None

    def assign_sub(
        self, delta: Any, use_locking: Any = None, name: Any = None, read_value: bool = True
    ) -> Any:
        """In ``run``: subtracts from this replica's copy. Outside: every copy (refused for SUM)."""
        self._update("assign_sub", delta)
        return self if read_value else None

    # -- attributes ------------------------------------------------------------------
    @property
    def shape(self) -> TensorShape:
        return TensorShape(self._copies[0]._value.shape)

    @property
    def dtype(self) -> Any:
        return self._copies[0].dtype

    @property
    def device(self) -> str:
        replica = self._replica()
        return self._copies[replica or 0].device

    def __repr__(self) -> str:
        body = ",\n".join(f"  {i}: {c!r}" for i, c in enumerate(self._copies))
        return f"SyncOnReadVariable:{{\n{body}\n}}"

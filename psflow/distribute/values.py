"""Distributed values: ``PerReplica`` results and ``MirroredVariable`` copies.

A :class:`PerReplica` holds one value per replica (what ``strategy.run``
returns with several replicas). A :class:`MirroredVariable` keeps one copy of
a variable per device; inside ``run`` each replica reads and updates its own
copy, and in cross-replica context reads see the first copy and writes go to
all of them.
"""

from __future__ import annotations

from typing import Any

from psflow import errors
from psflow.distribute import distribute_lib
from psflow.distribute.protocols import DistributedValues, ReplicatedVariable
from psflow.distribute.sync_on_read import SyncOnReadVariable
from psflow.framework import variable as variable_lib
from psflow.framework.tensor import TensorShape
from psflow.util import nest


class PerReplica(DistributedValues):
    """One value per replica (TensorFlow's ``PerReplica``).

    Example:
        >>> from psflow.distribute.values import PerReplica
        >>> PerReplica((1, 2)).values
        (1, 2)
    """

    def __init__(self, values: Any) -> None:
        self._values = tuple(values)

    @property
    def values(self) -> tuple[Any, ...]:
        """The per-replica components, in replica order."""
        return self._values

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        body = ",\n".join(f"  {i}: {v!r}" for i, v in enumerate(self._values))
        return f"PerReplica:{{\n{body}\n}}"

    def __str__(self) -> str:
        body = ",\n".join(f"  {i}: {v!s}" for i, v in enumerate(self._values))
        return f"PerReplica:{{\n{body}\n}}"


def regroup(per_replica_results: list[Any]) -> Any:
    """Turns a list (one nest per replica) into one nest of :class:`PerReplica` leaves."""
    first = per_replica_results[0]
    if len(per_replica_results) == 1:
        return first

    def group(*vals: Any) -> Any:
        # the same object from every replica (a variable, a constant) stays itself
        if all(v is vals[0] for v in vals[1:]):
            return vals[0]
        return PerReplica(vals)

    if not nest.is_nested(first):
        return group(*per_replica_results)
    return nest.map_structure(group, *per_replica_results)


def select_replica(replica: int, structure: Any) -> Any:
    """The component of ``replica`` in every :class:`PerReplica` leaf of ``structure``."""

    def pick(x: Any) -> Any:
        if isinstance(x, PerReplica):
            return x.values[replica]
        return x

    if isinstance(structure, PerReplica):
        return structure.values[replica]
    if nest.is_nested(structure):
        return nest.map_structure(pick, structure)
    return structure


def local_results(value: Any, num_replicas: int) -> tuple[Any, ...]:
    """TensorFlow's ``experimental_local_results``: one entry per local replica.

    A :class:`PerReplica` or :class:`MirroredVariable` gives its components; a
    nested structure (a dict of ``PerReplica``, as ``all_reduce`` of a dict
    returns) gives a tuple of ``num_replicas`` structures, replica ``i``'s holding
    the ``i``-th component of every distributed leaf and the other leaves as
    they are; any other value gives ``(value,)``.

    Example:
        >>> local_results({"a": PerReplica((1, 2)), "b": 3}, 2)
        ({'a': 1, 'b': 3}, {'a': 2, 'b': 3})
    """
    kinds = (PerReplica, MirroredVariable, SyncOnReadVariable)
    if isinstance(value, kinds):
        return tuple(value.values)
    if not nest.is_nested(value):
        return (value,)

    def pick(replica: int) -> Any:
        return nest.map_structure(lambda x: x.values[replica] if isinstance(x, kinds) else x, value)

    return tuple(pick(i) for i in range(num_replicas))


class MirroredVariable(variable_lib.Variable, ReplicatedVariable):
    """A variable with one synchronized copy per replica device.

    Args:
        strategy: the MirroredStrategy that owns it.
        copies: one plain variable per device, equal in value.
    """

    def __init__(
        self,
        strategy: Any,
        copies: list[variable_lib.Variable],
        *,
        aggregation: variable_lib.VariableAggregation,
    ) -> None:
        self._strategy_ref = strategy
        self._copies = tuple(copies)
        first = copies[0]
        self._name = first.name
        self._trainable = first.trainable
        self._constraint = first.constraint
        self._synchronization = first.synchronization
        self._aggregation = aggregation

    # -- which copy ------------------------------------------------------------------
    @property
    def values(self) -> tuple[variable_lib.Variable, ...]:
        """The per-device copies."""
        return self._copies

    def _replica_index(self) -> int:
        # every read of the variable asks: the innermost context, without the public
        # lookup's default-strategy fallback (whose replica context is never ours)
        current = distribute_lib._current()
        ctx = current.replica_context if current is not None else None
        if ctx is not None and ctx._strategy is self._strategy_ref:
            return ctx._replica_id
        return 0

    def _array(self) -> Any:
        return self._copies[self._replica_index()]._value

    @property
    def _value(self) -> Any:  # type: ignore[override]
        return self._array()

    @property
    def update_group(self) -> Any:
        """The strategy's extended object: it updates every copy."""
        return self._strategy_ref.extended

    # -- writes ----------------------------------------------------------------------
    def _in_replica_context(self) -> bool:
        from psflow.distribute import distribute_lib

        ctx = distribute_lib.get_replica_context()
        return (
            ctx is not None
            and ctx.strategy is self._strategy_ref
            and self._strategy_ref.num_replicas_in_sync > 1
        )

    def _write(self, array: Any) -> None:
        if self._in_replica_context():
            raise errors.FailedPreconditionError(
                "Writing a MirroredVariable inside strategy.run needs merge_call or an "
                "aggregation; use assign/assign_add, which reduce across replicas"
            )
        from psflow import backend

        for copy in self._copies:
            copy._write(
                backend.place(array, backend.device_of(copy._value))
                if not isinstance(copy._value, type(array))
                else array
            )

    def _replica_update(self, method: str, value: Any) -> Any:
        """An assign* inside ``run``: reduce by the aggregation in a merge_call, then write all copies."""
        from psflow.distribute import distribute_lib
        from psflow.distribute.reduce_util import ReduceOp

        agg = self._aggregation
        if agg is variable_lib.VariableAggregation.NONE:
            raise errors.FailedPreconditionError(
                f"You must specify an aggregation method to update {self.name} (a MirroredVariable) "
                "in replica context; create it with aggregation=VariableAggregation.SUM, MEAN or "
                "ONLY_FIRST_REPLICA"
            )
        ctx = distribute_lib.get_replica_context()

        def merge(strategy: Any, per_replica: Any) -> None:
            if agg is variable_lib.VariableAggregation.ONLY_FIRST_REPLICA:
                reduced = (
                    per_replica.values[0] if isinstance(per_replica, PerReplica) else per_replica
                )
            else:
                op = ReduceOp.SUM if agg is variable_lib.VariableAggregation.SUM else ReduceOp.MEAN
                reduced = strategy.reduce(op, per_replica, axis=None)
            getattr(variable_lib.Variable, method)(self, reduced)

        ctx.merge_call(merge, args=(value,))
        return self

    def assign(
        self, value: Any, use_locking: Any = None, name: Any = None, read_value: bool = True
    ) -> Any:
        if self._in_replica_context():
            self._replica_update("assign", value)
            return self if read_value else None
        return super().assign(value, read_value=read_value)

    def assign_add(
        self, delta: Any, use_locking: Any = None, name: Any = None, read_value: bool = True
    ) -> Any:
        if self._in_replica_context():
            self._replica_update("assign_add", delta)
            return self if read_value else None
        return super().assign_add(delta, read_value=read_value)

    def assign_sub(
        self, delta: Any, use_locking: Any = None, name: Any = None, read_value: bool = True
    ) -> Any:
        if self._in_replica_context():
            self._replica_update("assign_sub", delta)
            return self if read_value else None
        return super().assign_sub(delta, read_value=read_value)

    @property
    def shape(self) -> TensorShape:
        return TensorShape(self._copies[0]._value.shape)

    def __repr__(self) -> str:
        body = ",\n".join(f"  {i}: {c!r}" for i, c in enumerate(self._copies))
        return f"MirroredVariable:{{\n{body}\n}}"

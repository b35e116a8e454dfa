"""The kinds of distributed values, as types the optimizer and strategies check with ``isinstance``.

Each is a small nominal base class rather than a ``typing.Protocol``: a
runtime protocol's ``isinstance`` would probe (and evaluate) every member on
every check, and some members (a dynamic table's update group) need a live
session to answer. Plain classes also mix with
:class:`psflow.framework.variable.Variable`, whose metaclass an ``ABCMeta``
base would clash with. A subclass must override what it declares; the bases
raise :class:`NotImplementedError` naming the class that forgot.

* :class:`UpdateGroup` — applies an optimizer's update to the variables it
  holds, where they live: a PS session, a mirrored strategy's copies, a
  dynamic-table backend.
* :class:`GroupUpdated` — a variable updated by its group, never in place
  by the optimizer (a PS variable, a dynamic table, every replicated one).
* :class:`ReplicatedVariable` — one copy per replica (mirrored, sync-on-read).
* :class:`DistributedValues` — one value per replica (``PerReplica``).
* :class:`Readable` — held in one backend array: a tensor or any kind of
  variable (defined with the tensor, :mod:`psflow.framework.readable`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from psflow.framework.readable import Readable

__all__ = ["DistributedValues", "GroupUpdated", "Readable", "ReplicatedVariable", "UpdateGroup"]


def _done() -> None:
    """An update that already finished."""


class UpdateGroup:
    """Applies an optimizer's update rule to variables that live elsewhere."""

    def apply_optimizer(self, optimizer: Any, pairs: Sequence[tuple[Any, Any]], step: int) -> None:
        """Applies ``(gradient, variable)`` pairs with ``optimizer``'s rule at ``step``."""
        raise NotImplementedError(f"{type(self).__name__} does not define apply_optimizer")

    def start_optimizer(
        self, optimizer: Any, pairs: Sequence[tuple[Any, Any]], step: int
    ) -> Callable[[], None]:
        """:meth:`apply_optimizer` in two halves: sends the update and returns a
        callable that waits for it (and raises its error), so a step's groups
        update concurrently.  By default the whole update happens here."""
        self.apply_optimizer(optimizer, pairs, step)
        return _done


class GroupUpdated:
    """A variable whose updates its :class:`UpdateGroup` applies."""

    @property
    def update_group(self) -> UpdateGroup:
        """The group that applies this variable's updates."""
        raise NotImplementedError(f"{type(self).__name__} does not define update_group")


class ReplicatedVariable(GroupUpdated):
    """A variable with one copy per replica, every copy of the same shape."""

    @property
    def values(self) -> tuple[Any, ...]:
        """The per-replica copies (plain variables), in replica order."""
        raise NotImplementedError(f"{type(self).__name__} does not define values")


class DistributedValues:
    """One value per replica (what ``strategy.run`` returns with several)."""

    @property
    def values(self) -> tuple[Any, ...]:
        """The per-replica components, in replica order."""
        raise NotImplementedError(f"{type(self).__name__} does not define values")

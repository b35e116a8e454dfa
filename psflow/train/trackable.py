"""What a checkpoint asks of an object: the small protocol it saves everything through.

As TensorFlow's trackables do, an object tells the checkpoint what it is and
what it holds; the checkpoint knows no layer, model or optimizer class.  A
:class:`Trackable` says its :class:`Kind` (a container, or one of the kinds
of state a restore consumes) and names its children: the edges of the object
graph (:mod:`psflow.train.object_graph`) whose paths name the saved values.
Keras layers and models, optimizers, :class:`~psflow.train.Checkpoint` and
:class:`~psflow.train.checkpoint.ExternalState` are trackables; variables,
iterators and plain numbers are values the graph knows by their own types.

Example:
    >>> import psflow as pf
    >>> class Pair(Trackable):
    ...     def __init__(self):
    ...         self.a, self.b = pf.Variable(1.0), pf.Variable(2.0)
    ...     def checkpoint_children(self):
    ...         return {"a": self.a, "b": self.b}
    >>> sorted(Pair().checkpoint_children())
    ['a', 'b']
"""

from __future__ import annotations

import enum
from typing import Any, ClassVar

__all__ = ["VALUE_KINDS", "Kind", "Trackable"]


class Kind(enum.Enum):
    """What a node of the graph holds."""

    OBJECT = "object"  # a container: its children are its state
    VARIABLE = "variable"  # a value in this process (plain, mirrored, sync-on-read)
    PS_VARIABLE = "ps"  # a value (or its shards) on parameter servers
    EXTERNAL = "external"  # state that writes its own files (a dynamic embedding table)
    OPTIMIZER = "optimizer"  # a step count, a learning rate and slots of variables
    ITERATOR = "iterator"  # a position in a dataset
    SCALAR = "scalar"  # a plain number given to the Checkpoint


VALUE_KINDS = frozenset(
    {Kind.VARIABLE, Kind.PS_VARIABLE, Kind.EXTERNAL, Kind.OPTIMIZER, Kind.ITERATOR}
)
"""Kinds whose nodes carry state that a restore must consume."""


class Trackable:
    """An object a checkpoint can save: its kind and its named children.

    Attributes:
        checkpoint_kind: what the object holds (a container by default).
        checkpoint_grows: the object may create saved children later (a layer
            builds its weights on first use): a restore keeps their values
            waiting for them rather than reporting them unmatched.
    """

    checkpoint_kind: ClassVar[Kind] = Kind.OBJECT
    checkpoint_grows: ClassVar[bool] = False

    def checkpoint_children(self) -> dict[str, Any]:
        """The named edges out of this object, in a stable order (none by default)."""
        return {}

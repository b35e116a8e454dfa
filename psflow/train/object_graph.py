"""The object graph of a checkpoint: tracked objects and the names that lead to them.

TensorFlow's rule, kept here: a checkpoint names every value by the path of
attribute names from the :class:`~psflow.train.Checkpoint` to it, not by the
variable's own name.  A second model built in the same process (whose layers
are ``dense_2``, ``dense_3``...) therefore restores the first one's checkpoint.

The edges out of an object are what it names as a
:class:`~psflow.train.trackable.Trackable` (this module imports no Keras):

* a :class:`~psflow.train.Checkpoint`: the objects it was given, by keyword;
* a ``Sequential`` or functional model: ``layer-<i>`` for every layer and
  ``layer_with_weights-<j>`` for the layers that have weights (one object,
  two names: an unbuilt model is matched through ``layer-<i>``);
* any layer: its weights by the name they were made with (``kernel``,
  ``bias``), and its public attributes that hold layers, variables,
  optimizers or iterators (a list gives ``<attr>/<index>``);
* optimizers, variables, iterators: none (their state is their value).

The graph is a graph: an object reached twice is one node, found under its
first path (breadth first).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from psflow.train.trackable import VALUE_KINDS, Kind, Trackable

__all__ = ["VALUE_KINDS", "Kind", "Node", "build", "children", "kind_of", "trackable_attr"]


_MODEL_EDGE = re.compile(r"^layer(_with_weights)?-\d+$")


def is_model_edge(name: str) -> bool:
    """Whether ``name`` is a model's edge to one of its layers (``layer-<i>``...): never
    created later by the layer itself, matched through its other name instead."""
    return _MODEL_EDGE.match(name) is not None


def kind_of(obj: Any) -> Kind | None:
    """The kind of ``obj``, or None when a checkpoint cannot track it."""
    from psflow.data.iterator import Iterator
    from psflow.distribute.ps.values import PSVariable, ShardedVariable
    from psflow.framework.variable import Variable

    if isinstance(obj, Trackable):
        return obj.checkpoint_kind
    if isinstance(obj, (PSVariable, ShardedVariable)):
        return Kind.PS_VARIABLE
    if isinstance(obj, Variable):
        return Kind.VARIABLE
    if isinstance(obj, Iterator):
        return Kind.ITERATOR
    if isinstance(obj, (list, tuple)) and any(trackable_attr(x) for x in obj):
        return Kind.OBJECT
    if isinstance(obj, (int, float, str, bool)):
        return Kind.SCALAR
    return None


def trackable_attr(value: Any) -> bool:
    """Whether an object's attribute is an edge (plain numbers of a layer are config,
    not state)."""
    kind = kind_of(value)
    return kind is not None and kind is not Kind.SCALAR


def children(obj: Any) -> dict[str, Any]:
    """The named edges out of ``obj``, in a stable order."""
    if isinstance(obj, Trackable):
        return obj.checkpoint_children()
    if isinstance(obj, (list, tuple)):
        return {str(i): x for i, x in enumerate(obj) if trackable_attr(x)}
    return {}


@dataclass
class Node:
    """One object of the graph: where it was first found and its edges (child node ids)."""

    obj: Any
    path: str
    kind: Kind
    children: dict[str, int] = field(default_factory=dict)


def build(root: Any) -> list[Node]:
    """The graph reachable from ``root`` (node 0), breadth first."""
    nodes = [Node(root, "", Kind.OBJECT)]
    ids = {id(root): 0}
    for node in nodes:  # grows while iterating: breadth first
        for name, child in children(node.obj).items():
            node_id = ids.get(id(child))
            if node_id is None:
                kind = kind_of(child)
                if kind is None:
                    continue
                node_id = ids[id(child)] = len(nodes)
                nodes.append(Node(child, join(node.path, name), kind))
            node.children[name] = node_id
    return nodes


def join(path: str, name: str) -> str:
    """``path/name`` (the root's path is empty)."""
    return f"{path}/{name}" if path else name


def value_key(path: str) -> str:
    """The tensor name of a variable's value (TensorFlow's spelling)."""
    return f"{path}/.ATTRIBUTES/VARIABLE_VALUE"


def slot_key(variable_path: str, optimizer_path: str, slot: str) -> str:
    """The tensor name of an optimizer slot, keyed by its variable's path (TensorFlow's)."""
    return f"{variable_path}/.OPTIMIZER_SLOT/{optimizer_path}/{slot}/.ATTRIBUTES/VARIABLE_VALUE"

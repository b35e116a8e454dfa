"""The object graph of a checkpoint: tracked objects and the names that lead to them.

TensorFlow's rule, kept here: a checkpoint names every value by the path of
attribute names from the :class:`~psflow.train.Checkpoint` to it, not by the
variable's own name.  A second model built in the same process (whose layers
are ``dense_2``, ``dense_3``...) therefore restores the first one's checkpoint.

The edges out of an object:

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

import enum
import re
from dataclasses import dataclass, field
from typing import Any


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
    from psflow.keras.layers.base import Layer
    from psflow.keras.optimizers.optimizer import Optimizer
    from psflow.train.checkpoint import Checkpoint, ExternalState

    if isinstance(obj, ExternalState):
        return Kind.EXTERNAL
    if isinstance(obj, (PSVariable, ShardedVariable)):
        return Kind.PS_VARIABLE
    if isinstance(obj, Variable):
        return Kind.VARIABLE
    if isinstance(obj, Optimizer):
        return Kind.OPTIMIZER
    if isinstance(obj, Iterator):
        return Kind.ITERATOR
    if isinstance(obj, (Layer, Checkpoint)):
        return Kind.OBJECT
    if isinstance(obj, (list, tuple)) and any(_trackable_attr(x) for x in obj):
        return Kind.OBJECT
    if isinstance(obj, (int, float, str, bool)):
        return Kind.SCALAR
    return None


def _trackable_attr(value: Any) -> bool:
    """Whether a layer's attribute is an edge (plain numbers of a layer are config, not state)."""
    kind = kind_of(value)
    return kind is not None and kind is not Kind.SCALAR


def children(obj: Any) -> dict[str, Any]:
    """The named edges out of ``obj``, in a stable order."""
    from psflow.keras.engine.functional import Functional
    from psflow.keras.engine.sequential import Sequential
    from psflow.keras.layers.base import Layer
    from psflow.train.checkpoint import Checkpoint

    if isinstance(obj, Checkpoint):
        return obj._tracked()
    if isinstance(obj, (list, tuple)):
        return {str(i): x for i, x in enumerate(obj) if _trackable_attr(x)}
    if not isinstance(obj, Layer):
        return {}
    out: dict[str, Any] = {}
    if isinstance(obj, (Sequential, Functional)):
        with_weights = 0
        for i, layer in enumerate(obj.layers):  # TensorFlow's order: its paths are these
            if layer.weights:
                out[f"layer_with_weights-{with_weights}"] = layer
                with_weights += 1
            out[f"layer-{i}"] = layer
    for name, weight in obj._named_weights():
        out.setdefault(name, weight)
    for name, value in vars(obj).items():
        if not name.startswith("_") and _trackable_attr(value):
            out.setdefault(name, value)
    return out


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

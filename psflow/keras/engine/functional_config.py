"""A functional model's graph as a JSON-able config, and back.

The config lists the layers (class and config, by unique name), then every
layer call in topological order with its arguments, where a Keras tensor is
``{"node_ref": [layer name, call index of that layer, output index]}``.
Rebuilding creates the layers and replays the calls on fresh ``Input``s, so
shared layers stay shared and nested models are rebuilt from their own configs.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from psflow import errors
from psflow.keras.engine.keras_tensor import KerasTensor, Node
from psflow.keras.layers.core import InputLayer
from psflow.util import nest

_REF = "node_ref"


def graph_config(model: Any) -> dict[str, Any]:
    """``model``'s layers, calls, inputs and outputs.

    Raises:
        InvalidArgumentError: two layers of the graph share a name.
    """
    from psflow.keras.saving import serialization

    layers = model.layers
    names = [layer.name for layer in layers]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise errors.InvalidArgumentError(
            f"{model.name}: layer names must be unique to save the model, repeated: {duplicates}"
        )
    calls: dict[int, list[Node]] = defaultdict(list)  # id(layer) -> its nodes in this model
    for t in model.inputs:
        calls[id(t.node.layer)].append(t.node)
    for node in model._nodes:
        calls[id(node.layer)].append(node)

    def ref(x: Any) -> Any:
        if isinstance(x, KerasTensor):
            node = x.node
            index = next(i for i, n in enumerate(calls[id(node.layer)]) if n is node)
            position = next(i for i, t in enumerate(node.flat_outputs) if t is x)
            return {_REF: [node.layer.name, index, position]}
        if isinstance(x, dict):
            return {k: ref(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [ref(v) for v in x]
        return x

    return {
        "name": model.name,
        "trainable": model.trainable,
        "layers": [serialization.serialize_keras_object(layer) for layer in layers],
        "nodes": [
            {"layer": n.layer.name, "args": ref(list(n.args)), "kwargs": ref(dict(n.kwargs))}
            for n in model._nodes
        ],
        "inputs": ref(model._input_struct),
        "outputs": ref(model._output_struct),
    }


def graph_from_config(cls: type, config: dict[str, Any]) -> Any:
    """A new ``cls`` (a functional model class) with the graph of ``config``.

    Raises:
        InvalidArgumentError: a malformed config (naming the entry), or an unknown class.
    """
    from psflow.keras.saving import serialization

    try:
        entries, node_entries = list(config["layers"]), list(config["nodes"])
        input_refs, output_refs = config["inputs"], config["outputs"]
    except (KeyError, TypeError) as e:
        raise errors.InvalidArgumentError(
            f"A functional model config needs layers, nodes, inputs and outputs; missing {e}"
        ) from e
    layers: dict[str, Any] = {}
    outputs_of: dict[str, list[Any]] = defaultdict(list)
    for entry in entries:
        layer = serialization.deserialize_keras_object(entry)
        layers[layer.name] = layer
        if isinstance(layer, InputLayer):
            outputs_of[layer.name].append(layer.output)

    def unref(x: Any) -> Any:
        if isinstance(x, dict) and set(x) == {_REF}:
            try:
                name, index, position = x[_REF]
                return nest.flatten(outputs_of[name][index])[position]
            except (ValueError, IndexError, TypeError, KeyError) as e:
                raise errors.InvalidArgumentError(
                    f"Functional config: bad tensor reference {x!r} ({e})"
                ) from e
        if isinstance(x, dict):
            return {k: unref(v) for k, v in x.items()}
        if isinstance(x, list):
            return [unref(v) for v in x]
        return x

    for entry in node_entries:
        name = entry.get("layer") if isinstance(entry, dict) else None
        if name not in layers:
            raise errors.InvalidArgumentError(
                f"Functional config: a call of unknown layer {name!r}; layers: {sorted(layers)}"
            )
        args, kwargs = unref(entry.get("args", [])), unref(entry.get("kwargs", {}))
        outputs_of[name].append(layers[name](*args, **kwargs))
    model = cls(unref(input_refs), unref(output_refs), name=config.get("name"))
    model.trainable = config.get("trainable", True)
    return model

"""Functional models: ``keras.Model(inputs, outputs)`` over a graph of layer calls.

The graph is the :class:`~psflow.keras.engine.keras_tensor.Node` records left
by calling layers on ``keras.Input``s. Building the model walks them back from
the outputs, checks that every path ends at one of the declared inputs and
orders the calls topologically; calling the model replays those calls on
real tensors with the eager engine, so ``GradientTape`` sees ordinary ops.
Layers were built (their variables created) when they were first called on
Keras tensors, in the strategy scope active then, exactly as Sequential
builds them.
"""

from __future__ import annotations

from typing import Any

from psflow import errors
from psflow.framework.tensor import TensorShape
from psflow.keras.engine import input_spec
from psflow.keras.engine.keras_tensor import KerasTensor, Node, is_shape, map_shapes
from psflow.keras.engine.training import Model
from psflow.keras.layers.base import Layer
from psflow.keras.layers.convolutional import conv_then_max_pool, pools_after
from psflow.keras.layers.core import InputLayer
from psflow.util import nest


def _normalize(structure: Any) -> Any:
    # Keras treats a tuple of outputs as a list; a one-element list stays a list.
    if isinstance(structure, tuple):
        return list(structure)
    return structure


def _check_keras_tensors(structure: Any, what: str) -> list[KerasTensor]:
    flat = nest.flatten(structure)
    if not flat:
        raise errors.InvalidArgumentError(f"Model {what} must not be empty")
    for t in flat:
        if not isinstance(t, KerasTensor) or t.node is None:
            raise errors.InvalidArgumentError(
                f"Model {what} must be Keras tensors (from keras.Input and layer calls), got "
                f"{type(t).__name__}: {t!r}"
            )
    return flat


def topological_nodes(inputs: list[KerasTensor], outputs: list[KerasTensor]) -> list[Node]:
    """The layer calls between ``inputs`` and ``outputs``, each after those it depends on.

    Raises:
        InvalidArgumentError: an output depends on an ``Input`` that is not among
            ``inputs`` ("graph disconnected"), naming it.
    """
    given = {id(t) for t in inputs}
    order: list[Node] = []
    done: set[int] = set()
    # Iterative depth-first search: deep graphs must not hit Python's recursion limit.
    for out in outputs:
        if id(out) in given:
            continue
        stack: list[tuple[Node, bool]] = [(out.node, False)]
        while stack:
            node, expanded = stack.pop()
            if id(node) in done:
                continue
            if expanded:
                done.add(id(node))
                order.append(node)
                continue
            if isinstance(node.layer, InputLayer):
                raise errors.InvalidArgumentError(
                    f"Graph disconnected: the outputs need input {node.layer.name!r} "
                    f"{node.outputs!r}, which is not among the model's inputs "
                    f"{[t.name for t in inputs]}"
                )
            stack.append((node, True))
            for parent in reversed(node.parents):  # popped in argument order, as Keras lists them
                if id(parent) not in given and id(parent.node) not in done:
                    stack.append((parent.node, False))
    return order


class Functional(Model):
    """A model defined by its inputs and outputs (what ``keras.Model(inputs, outputs)`` builds).

    Inputs and outputs may be one Keras tensor, a list or a dict of them. Layers
    may be shared (called several times) and models may be used as layers.

    Example:
        >>> import psflow as pf
        >>> a = pf.keras.Input(shape=(3,), name="a")
        >>> b = pf.keras.Input(shape=(2,), name="b")
        >>> h = pf.keras.layers.Concatenate()([a, b])
        >>> out = pf.keras.layers.Dense(1, name="out")(h)
        >>> model = pf.keras.Model([a, b], out)
        >>> model([pf.ones([4, 3]), pf.ones([4, 2])]).shape
        TensorShape([4, 1])

    Raises:
        InvalidArgumentError: inputs that are not ``keras.Input`` tensors, or
            outputs that do not depend only on the inputs.
    """

    def __init__(self, inputs: Any, outputs: Any, name: str | None = None, **kwargs: Any) -> None:
        super().__init__(name=name, **kwargs)
        inputs, outputs = _normalize(inputs), _normalize(outputs)
        flat_in = _check_keras_tensors(inputs, "inputs")
        flat_out = _check_keras_tensors(outputs, "outputs")
        for t in flat_in:
            if not isinstance(t.node.layer, InputLayer):
                raise errors.InvalidArgumentError(
                    f"Model inputs must come from keras.Input, got {t!r} (the output of layer "
                    f"{t.node.layer.name!r})"
                )
        self._input_struct = inputs
        self._output_struct = outputs
        self.inputs = flat_in
        self.outputs = flat_out
        self._nodes = topological_nodes(flat_in, flat_out)
        ordered: list[Layer] = [t.node.layer for t in flat_in]
        for node in self._nodes:
            if node.layer not in ordered:
                ordered.append(node.layer)
        self._graph_layers = ordered
        self._pooled_convs = _conv_pool_pairs(self._nodes, flat_out)
        for layer in ordered:
            if layer not in self._sublayers:
                self._sublayers.append(layer)
        if isinstance(inputs, KerasTensor):
            self._batch_input_shape = tuple(inputs.shape)
        self.built = True

    # -- structure -----------------------------------------------------------------------
    def _tracked_layers(self) -> list[Layer]:
        return self.layers

    @property
    def layers(self) -> list[Layer]:
        """Every layer of the graph, inputs first, then in call order (as Keras lists them)."""
        return list(self._graph_layers)

    @property
    def output_names(self) -> list[str]:
        """One name per output, in ``outputs`` order: dict keys, else the producing layers'."""
        if isinstance(self._output_struct, dict):
            return [str(k) for k in sorted(self._output_struct)]
        return [t.node.layer.name for t in self.outputs]

    @property
    def input_names(self) -> list[str]:
        """One name per input: dict keys, else the ``Input`` layers' names."""
        if isinstance(self._input_struct, dict):
            return [str(k) for k in sorted(self._input_struct)]
        return [t.node.layer.name for t in self.inputs]

    @property
    def input(self) -> Any:
        """The inputs, in the structure the model was built with."""
        return self._input_struct

    @property
    def output(self) -> Any:
        """The outputs, in the structure the model was built with."""
        return self._output_struct

    def get_layer(self, name: str | None = None, index: int | None = None) -> Layer:
        """A layer by name or by index in :attr:`layers`.

        Raises:
            InvalidArgumentError: no layer has that name or index.
        """
        if index is not None:
            if not -len(self._graph_layers) <= index < len(self._graph_layers):
                raise errors.InvalidArgumentError(
                    f"{self.name}: no layer at index {index} (the model has "
                    f"{len(self._graph_layers)})"
                )
            return self._graph_layers[index]
        for layer in self._graph_layers:
            if layer.name == name:
                return layer
        raise errors.InvalidArgumentError(
            f"{self.name}: no layer named {name!r}; layers: {[x.name for x in self._graph_layers]}"
        )

    # -- running -------------------------------------------------------------------------
    def _flat_inputs(self, inputs: Any) -> list[Any]:
        names = self.input_names
        if isinstance(inputs, dict):
            missing = [n for n in names if n not in inputs]
            if missing:
                raise errors.InvalidArgumentError(
                    f"{self.name}: missing inputs {missing}; the model's inputs are {names}, got "
                    f"keys {sorted(inputs)}"
                )
            return [inputs[n] for n in names]
        flat = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
        if len(flat) != len(names):
            raise errors.InvalidArgumentError(
                f"{self.name}: expects {len(names)} input(s) {names}, got {len(flat)}"
            )
        return flat

    def call(self, inputs: Any, training: Any = None, mask: Any = None) -> Any:
        values: dict[int, Any] = {}
        for t, name, value in zip(self.inputs, self.input_names, self._flat_inputs(inputs)):
            values[id(t)] = input_spec.conform(value, t.shape, t.dtype, name, self.name)

        def fill(x: Any) -> Any:
            return values[id(x)] if isinstance(x, KerasTensor) else x

        done: set[int] = set()  # max pools already run with the convolution before them
        for node in self._nodes:
            if id(node) in done:
                continue
            pool = self._pooled_convs.get(id(node))
            if pool is not None:  # one op, the same bits (see _conv_pool_pairs)
                pooled = conv_then_max_pool(node.layer, pool.layer, fill(node.args[0]))
                if pooled is not None:
                    values[id(pool.flat_outputs[0])] = pooled
                    done.add(id(pool))
                    continue
            args = nest.map_structure(fill, list(node.args))
            kwargs = nest.map_structure(fill, dict(node.kwargs))
            kwargs.setdefault("training", training)  # a call's own training= wins, as in Keras
            out = node.layer(*args, **kwargs)
            flat_out = nest.flatten(out)
            symbolic = node.flat_outputs
            if len(flat_out) != len(symbolic):
                raise errors.InternalError(
                    f"{node.layer.name} returned {len(flat_out)} tensors, its symbolic call "
                    f"{len(symbolic)}"
                )
            for t, value in zip(symbolic, flat_out):
                values[id(t)] = value
        return nest.pack_sequence_as(self._output_struct, [values[id(t)] for t in self.outputs])

    def compute_output_shape(self, input_shape: Any) -> Any:
        if isinstance(input_shape, dict):
            flat = [input_shape[n] for n in self.input_names]
        elif is_shape(input_shape):
            flat = [input_shape]
        else:
            flat = list(input_shape)
        shapes: dict[int, Any] = {id(t): TensorShape(s) for t, s in zip(self.inputs, flat)}
        for node in self._nodes:
            first = node.args[0]
            in_shapes = _shape_structure(first, shapes)
            out = node.layer.compute_output_shape(in_shapes)
            flat_out: list[Any] = []
            map_shapes(flat_out.append, out)
            for t, s in zip(node.flat_outputs, flat_out):
                shapes[id(t)] = s
        result = [shapes[id(t)] for t in self.outputs]
        if isinstance(self._output_struct, KerasTensor):
            return result[0]
        if isinstance(self._output_struct, dict):
            return dict(zip(self.output_names, result))
        return result

    # -- config --------------------------------------------------------------------------
    def get_config(self) -> dict[str, Any]:
        from psflow.keras.engine import functional_config

        return functional_config.graph_config(self)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Functional:
        """Rebuilds the graph from :meth:`get_config` (layers resolved by class name).

        Raises:
            InvalidArgumentError: a layer class that is neither built in, registered,
                nor in ``custom_objects``; or a malformed config.
        """
        from psflow.keras.engine import functional_config

        return functional_config.graph_from_config(cls, config)

    def _summary_rows(self) -> list[tuple[Layer, str, str]]:
        """(layer, output shape, inbound layers) per layer, for :meth:`summary`."""
        rows = []
        for layer in self._graph_layers:
            nodes = [n for n in self._nodes if n.layer is layer] or [
                t.node for t in self.inputs if t.node.layer is layer
            ]
            outs = [tuple(t.shape) for n in nodes for t in n.flat_outputs]
            shown = str(outs[0]) if len(outs) == 1 else str(outs) if outs else "?"
            parents = [p.node.layer.name for n in nodes for p in n.parents]
            rows.append((layer, shown, ", ".join(parents) or "-"))
        return rows


def _shape_structure(x: Any, shapes: dict[int, Any]) -> Any:
    if isinstance(x, KerasTensor):
        return tuple(shapes[id(x)])
    if isinstance(x, dict):
        return {k: _shape_structure(v, shapes) for k, v in x.items()}
    return [_shape_structure(v, shapes) for v in x]


def _conv_pool_pairs(nodes: list[Node], outputs: list[KerasTensor]) -> dict[int, Node]:
    """``{id(conv node): pool node}`` for each layer call on one tensor whose one output
    only the call after it reads, itself a call on that tensor alone, and is no output of
    the model: the pairs :func:`conv_then_max_pool` may run as one op (it checks the
    layers' kinds at each call; the convolution's output is then never made)."""
    readers: dict[int, list[Node]] = {}
    for node in nodes:
        for t in node.parents:
            readers.setdefault(id(t), []).append(node)
    kept = {id(t) for t in outputs}
    pairs = {}
    for node in nodes:
        outs = node.flat_outputs
        if len(outs) != 1 or len(node.args) != 1 or node.kwargs or id(outs[0]) in kept:
            continue
        after = readers.get(id(outs[0]), [])
        if len(after) != 1 or not pools_after(node.layer, after[0].layer):
            continue
        pool = after[0]
        if len(pool.args) == 1 and pool.args[0] is outs[0] and not pool.kwargs:
            pairs[id(node)] = pool
    return pairs

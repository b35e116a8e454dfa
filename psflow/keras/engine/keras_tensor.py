"""Symbolic tensors: what ``keras.Input`` returns and what layers return when called on it.

A :class:`KerasTensor` carries a shape (batch dimension first, ``None`` when
unknown) and a dtype, and remembers the :class:`Node` (one call of one layer)
that produced it. A functional model walks those nodes back from its outputs
to its inputs and, at call time, replays them in topological order on real
tensors; nothing is computed when the graph is built, so no weight is read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from psflow import errors
from psflow.framework.tensor import TensorShape
from psflow.util import nest


class KerasTensor:
    """A placeholder for a tensor of ``shape`` and ``dtype`` in a functional graph.

    Example:
        >>> import psflow as pf
        >>> x = pf.keras.Input(shape=(4,))
        >>> pf.keras.layers.Dense(2)(x).shape
        TensorShape([None, 2])
    """

    def __init__(
        self, shape: Any, dtype: Any = "float32", name: str | None = None, node: Node | None = None
    ) -> None:
        self.shape = TensorShape(shape)
        self.dtype = str(getattr(dtype, "name", dtype))
        self.name = name
        self.node = node

    @property
    def ndim(self) -> int:
        """Rank, batch dimension included."""
        return len(self.shape)

    def __repr__(self) -> str:
        return f"<KerasTensor shape={tuple(self.shape)}, dtype={self.dtype}, name={self.name}>"

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        # NumPy (and every op converting its inputs) would otherwise fail obscurely.
        raise TypeError(
            f"{self!r} is symbolic: it has no value until the model is called on data; "
            "compute on it with layers, Python operators (+ - * / ** [...]) or "
            "keras.layers.Lambda"
        )

    # -- Python operators: each becomes a layer of the graph --------------------------------
    def _binary(self, op: str, other: Any, reverse: bool = False) -> Any:
        from psflow.keras.layers.operators import TensorOperator

        if isinstance(other, KerasTensor):
            pair = [other, self] if reverse else [self, other]
            return TensorOperator(op, dtype=self.dtype)(pair)
        return TensorOperator(op, constant=other, reverse=reverse, dtype=self.dtype)(self)

    def __add__(self, other: Any) -> Any:
        return self._binary("add", other)

    def __radd__(self, other: Any) -> Any:
        return self._binary("add", other, reverse=True)

    def __sub__(self, other: Any) -> Any:
        return self._binary("subtract", other)

    def __rsub__(self, other: Any) -> Any:
        return self._binary("subtract", other, reverse=True)

    def __mul__(self, other: Any) -> Any:
        return self._binary("multiply", other)

    def __rmul__(self, other: Any) -> Any:
        return self._binary("multiply", other, reverse=True)

    def __truediv__(self, other: Any) -> Any:
        return self._binary("divide", other)

    def __rtruediv__(self, other: Any) -> Any:
        return self._binary("divide", other, reverse=True)

    def __pow__(self, other: Any) -> Any:
        return self._binary("pow", other)

    def __neg__(self) -> Any:
        from psflow.keras.layers.operators import TensorOperator

        return TensorOperator("negative", dtype=self.dtype)(self)

    def __getitem__(self, key: Any) -> Any:
        from psflow.keras.layers.operators import TensorSlice

        return TensorSlice(key, dtype=self.dtype)(self)


class Node:
    """One call of ``layer`` on symbolic arguments, and the symbolic outputs it gave."""

    def __init__(self, layer: Any, args: tuple, kwargs: dict[str, Any], outputs: Any) -> None:
        self.layer = layer
        self.args = args
        self.kwargs = kwargs
        self.outputs = outputs
        self.parents = [t for t in nest.flatten((list(args), kwargs)) if isinstance(t, KerasTensor)]
        for t in nest.flatten(outputs):
            t.node = self

    @property
    def flat_outputs(self) -> list[KerasTensor]:
        """The outputs in ``nest.flatten`` order."""
        return nest.flatten(self.outputs)


def is_symbolic(structure: Any) -> bool:
    """Whether any leaf of ``structure`` is a :class:`KerasTensor`."""
    if isinstance(structure, KerasTensor):
        return True
    if not isinstance(structure, (list, tuple, dict)):  # every eager layer call asks: be quick
        return False
    return any(isinstance(t, KerasTensor) for t in nest.flatten(structure))


def is_shape(value: Any) -> bool:
    """A single shape (a tuple of ints and ``None``s), as opposed to a structure of shapes."""
    return isinstance(value, (tuple, list)) and all(
        d is None or (isinstance(d, int) and not isinstance(d, bool)) or hasattr(d, "__index__")
        for d in value
    )


def map_shapes(fn: Callable[[TensorShape], Any], shapes: Any) -> Any:
    """Applies ``fn`` to every shape in a (nested) structure of shapes."""
    if isinstance(shapes, dict):
        return {k: map_shapes(fn, v) for k, v in shapes.items()}
    if is_shape(shapes):
        return fn(TensorShape(shapes))
    if isinstance(shapes, (list, tuple)):
        return type(shapes)(map_shapes(fn, s) for s in shapes)
    raise errors.InvalidArgumentError(f"Not a shape or a structure of shapes: {shapes!r}")


def shapes_of(structure: Any) -> Any:
    """The shapes of a structure of symbolic tensors (lists of shapes stay lists)."""
    if isinstance(structure, KerasTensor):
        return tuple(structure.shape)
    if isinstance(structure, dict):
        return {k: shapes_of(v) for k, v in structure.items()}
    if isinstance(structure, (list, tuple)):
        return [shapes_of(v) for v in structure]
    raise errors.InvalidArgumentError(
        f"Layers called on keras.Input take Keras tensors (or lists/dicts of them), got "
        f"{type(structure).__name__}: {structure!r}"
    )


def symbolic_call(layer: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    """Calls ``layer`` on Keras tensors: builds it, records a node, returns symbolic outputs.

    The output shapes come from ``layer.compute_output_spec`` when the layer
    has one (it returns Keras tensors), else from ``compute_output_shape``;
    the output dtype is the layer's.

    Raises:
        InvalidArgumentError: an argument mixes Keras tensors with other values.
    """
    first = args[0]
    shapes = shapes_of(first)
    if not layer.built:
        layer._maybe_build(shapes)
    spec = getattr(layer, "compute_output_spec", None)
    if spec is not None:
        outputs = nest.map_structure(
            lambda t: KerasTensor(t.shape, t.dtype, layer.name), spec(*args, **kwargs)
        )
    else:
        out_shapes = layer.compute_output_shape(shapes)
        outputs = map_shapes(lambda s: KerasTensor(s, layer.dtype, layer.name), out_shapes)
    Node(layer, tuple(args), dict(kwargs), outputs)
    return outputs

"""``keras.utils.plot_model`` and ``model_to_dot``: a model's layers as a Graphviz graph.

``pydot`` (and Graphviz's ``dot`` program, which renders) are optional and
imported only when a graph is drawn; without them the call raises
``ImportError`` saying how to install both, as Keras does.
"""

from __future__ import annotations

import os
from typing import Any

_INSTALL = (
    "plot_model and model_to_dot need pydot (pip install pydot) and Graphviz's `dot` "
    "program (apt-get install graphviz, brew install graphviz, or see "
    "https://graphviz.org/download/)"
)


def _pydot() -> Any:
    """The ``pydot`` module, once it is known to render through Graphviz.

    Raises:
        ImportError: pydot is missing, or cannot run Graphviz's ``dot``.
    """
    try:
        import pydot
    except ImportError as e:
        raise ImportError(f"{_INSTALL}: pydot is not installed") from e
    try:
        pydot.Dot().create()  # an empty graph: fails when `dot` is missing
    except Exception as e:  # pydot reports a missing `dot` with its own exception types
        raise ImportError(f"{_INSTALL}: pydot could not run Graphviz ({e})") from e
    return pydot


def _edges(model: Any) -> list[tuple[Any, Any]]:
    """(from layer, to layer) for every connection; a Sequential is a chain."""
    nodes = getattr(model, "_nodes", None)
    if nodes is not None:  # functional: the recorded layer calls
        pairs = []
        for node in nodes:
            for parent in node.parents:
                pair = (parent.node.layer, node.layer)
                if pair not in pairs:
                    pairs.append(pair)
        return pairs
    layers = list(getattr(model, "_layers", model.layers))
    return list(zip(layers, layers[1:]))


def model_to_dot(
    model: Any,
    show_shapes: bool = False,
    show_dtype: bool = False,
    show_layer_names: bool = True,
    rankdir: str = "TB",
    expand_nested: bool = False,
    dpi: int = 96,
    **kwargs: Any,
) -> Any:
    """A ``pydot.Dot`` graph of the model: one node per layer, one edge per connection.

    A nested model is one node (``expand_nested`` is accepted and not applied).

    Raises:
        ImportError: pydot or Graphviz is missing (the message says how to install them).
    """
    pydot = _pydot()
    dot = pydot.Dot()
    dot.set("rankdir", rankdir)
    dot.set("concentrate", True)
    dot.set("dpi", dpi)
    dot.set_node_defaults(shape="record")
    shapes = {id(layer): shape for layer, shape, _ in model._summary_rows()}
    layers: list[Any] = []
    for a, b in _edges(model):
        layers.extend(x for x in (a, b) if x not in layers)
    layers.extend(x for x in model.layers if x not in layers)
    for layer in layers:
        label = type(layer).__name__
        if show_layer_names:
            label = f"{layer.name}: {label}"
        if show_dtype:
            label = f"{label}|{layer.dtype}"
        if show_shapes:
            label = f"{label}|output: {shapes.get(id(layer), '?')}"
        dot.add_node(pydot.Node(str(id(layer)), label=label))
    for a, b in _edges(model):
        dot.add_edge(pydot.Edge(str(id(a)), str(id(b))))
    return dot


def plot_model(
    model: Any,
    to_file: str = "model.png",
    show_shapes: bool = False,
    show_dtype: bool = False,
    show_layer_names: bool = True,
    rankdir: str = "TB",
    expand_nested: bool = False,
    dpi: int = 96,
    **kwargs: Any,
) -> Any:
    """Draws the model's graph into ``to_file`` (format from its extension, PNG by default).

    Returns an ``IPython.display.Image`` of the file where IPython is installed
    (and the file is no PDF), as Keras does; else None.

    Example:
        >>> import psflow as pf
        >>> model = pf.keras.Sequential([pf.keras.Input((3,)), pf.keras.layers.Dense(1)])
        >>> pf.keras.utils.plot_model(model, "model.png", show_shapes=True)  # doctest: +SKIP

    Raises:
        ImportError: pydot or Graphviz is missing (the message says how to install them).
    """
    dot = model_to_dot(
        model, show_shapes, show_dtype, show_layer_names, rankdir, expand_nested, dpi
    )
    to_file = os.fspath(to_file)
    extension = os.path.splitext(to_file)[1][1:] or "png"
    dot.write(to_file, format=extension)
    if extension != "pdf":
        try:
            from IPython import display
        except ImportError:
            return None
        return display.Image(filename=to_file)
    return None

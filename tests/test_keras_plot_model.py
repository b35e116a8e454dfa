"""``keras.utils.plot_model``: ImportError with install guidance without pydot/Graphviz, and
with them, a file with one node per layer and one edge per connection.

pydot is not a dependency; the second test puts a small stand-in for it in
``sys.modules`` that records the graph and writes it as DOT text.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import types
from typing import Any

import pytest

import psflow as pf

keras = pf.keras


def _functional() -> Any:
    a = keras.Input(shape=(3,), name="a")
    b = keras.Input(shape=(2,), name="b")
    h = keras.layers.Concatenate(name="cat")([a, b])
    return keras.Model([a, b], keras.layers.Dense(1, name="out")(h))


@pytest.mark.skipif(importlib.util.find_spec("pydot") is not None, reason="pydot is installed")
def test_without_pydot_plot_model_raises_import_error_saying_how_to_install(
    tmp_path: pathlib.Path,
) -> None:
    target = tmp_path / "model.png"
    with pytest.raises(ImportError, match=r"pip install pydot.*[Gg]raphviz"):
        keras.utils.plot_model(_functional(), str(target))
    assert not target.exists()
    with pytest.raises(ImportError, match="pydot"):
        keras.utils.model_to_dot(_functional())


class _Graph:
    """What the test reads back: pydot's Dot as far as plot_model uses it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.nodes: list[tuple[str, str]] = []
        self.edges: list[tuple[str, str]] = []
        self.attrs: dict[str, Any] = {}

    def create(self, *args: Any, **kwargs: Any) -> bytes:
        return b""

    def set(self, key: str, value: Any) -> None:
        self.attrs[key] = value

    def set_node_defaults(self, **kwargs: Any) -> None:
        self.attrs.update(kwargs)

    def add_node(self, node: Any) -> None:
        self.nodes.append((node.name, node.label))

    def add_edge(self, edge: Any) -> None:
        self.edges.append((edge.src, edge.dst))

    def write(self, path: str, format: str = "raw") -> None:
        labels = dict(self.nodes)
        lines = [f"format={format}", *(labels[a] + " -> " + labels[b] for a, b in self.edges)]
        pathlib.Path(path).write_text("\n".join(lines))


def _fake_pydot() -> types.ModuleType:
    module = types.ModuleType("pydot")
    module.Dot = _Graph  # type: ignore[attr-defined]
    module.Node = lambda name, label: types.SimpleNamespace(name=name, label=label)  # type: ignore[attr-defined]
    module.Edge = lambda src, dst: types.SimpleNamespace(src=src, dst=dst)  # type: ignore[attr-defined]
    return module


def test_with_pydot_plot_model_writes_every_layer_and_connection(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pydot", _fake_pydot())
    target = tmp_path / "model.svg"
    keras.utils.plot_model(_functional(), str(target), show_shapes=True)
    lines = target.read_text().splitlines()
    assert lines[0] == "format=svg"
    assert sorted(lines[1:]) == [
        "a: InputLayer|output: (None, 3) -> cat: Concatenate|output: (None, 5)",
        "b: InputLayer|output: (None, 2) -> cat: Concatenate|output: (None, 5)",
        "cat: Concatenate|output: (None, 5) -> out: Dense|output: (None, 1)",
    ]
    seq = keras.Sequential([keras.Input((3,), name="x"), keras.layers.Dense(2, name="d")])
    keras.utils.plot_model(seq, str(tmp_path / "seq"), show_layer_names=True)
    assert (tmp_path / "seq").read_text().splitlines() == [
        "format=png",
        "x: InputLayer -> d: Dense",
    ]

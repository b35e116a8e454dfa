"""Nested structures of lists, tuples, namedtuples and dicts (TensorFlow's ``tf.nest``).

Dicts flatten in sorted key order, as TensorFlow's do; ``None`` and any other
object is a leaf.

Example:
    >>> from psflow.util import nest
    >>> nest.flatten({"b": [1, 2], "a": 3})
    [3, 1, 2]
    >>> nest.map_structure(lambda x: x * 10, {"a": 1, "b": (2, 3)})
    {'a': 10, 'b': (20, 30)}
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from psflow import errors


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


# type -> nested or not: ``isinstance(x, Mapping)`` is an ABC check, slow on the hot paths
# (every strategy.run and every distributed batch walks its structures)
_NESTED_BY_TYPE: dict[type, bool] = {list: True, tuple: True, dict: True}


def is_nested(x: Any) -> bool:
    """Whether ``x`` is a list, tuple or mapping (not a leaf)."""
    t = type(x)
    nested = _NESTED_BY_TYPE.get(t)
    if nested is None:
        nested = _NESTED_BY_TYPE[t] = isinstance(x, (list, tuple, Mapping))
    return nested


def _children(x: Any) -> list[Any]:
    t = type(x)
    if t is list or t is tuple:
        return list(x)
    if isinstance(x, Mapping):
        return [x[k] for k in _sorted_keys(x)]
    return list(x)


def _sorted_keys(mapping: Mapping) -> list[Any]:
    try:
        return sorted(mapping)
    except TypeError:
        return list(mapping)


def _flatten_into(x: Any, out: list[Any]) -> None:
    if is_nested(x):
        for c in _children(x):
            _flatten_into(c, out)
    else:
        out.append(x)


def flatten(structure: Any) -> list[Any]:
    """The leaves of ``structure`` in order (a leaf alone gives ``[leaf]``)."""
    out: list[Any] = []
    _flatten_into(structure, out)
    return out


def _rebuild(template: Any, children: list[Any]) -> Any:
    if isinstance(template, Mapping):
        keys = _sorted_keys(template)
        values = dict(zip(keys, children))
        rebuilt = {k: values[k] for k in template}
        return type(template)(rebuilt) if type(template) is not dict else rebuilt
    if _is_namedtuple(template):
        return type(template)(*children)
    if isinstance(template, tuple):
        return tuple(children)
    return list(children)


def pack_sequence_as(structure: Any, flat: list[Any]) -> Any:
    """Builds ``structure``'s shape from a flat list of leaves.

    Raises:
        InvalidArgumentError: the number of leaves differs from the structure's.
    """
    flat = list(flat)
    if not is_nested(structure):
        if len(flat) != 1:
            raise errors.InvalidArgumentError(
                f"Expected 1 leaf for a non-nested value, got {len(flat)}"
            )
        return flat[0]
    it = iter(flat)
    out = _pack(structure, it, structure, len(flat))
    if next(it, _SENTINEL) is not _SENTINEL:
        raise errors.InvalidArgumentError(
            f"Too many leaves ({len(flat)}) for structure {structure!r}"
        )
    return out


# Module-level recursion, not a nested function: a closure that calls itself is a
# reference cycle, which would keep every leaf (gradient arrays) alive until the
# garbage collector runs.
def _pack(s: Any, it: Iterator[Any], structure: Any, n: int) -> Any:
    if not is_nested(s):
        try:
            return next(it)
        except StopIteration:
            raise errors.InvalidArgumentError(
                f"Too few leaves ({n}) for structure {structure!r}"
            ) from None
    return _rebuild(s, [_pack(c, it, structure, n) for c in _children(s)])


_SENTINEL = object()


def assert_same_structure(a: Any, b: Any) -> None:
    """Raises ``ValueError`` naming both when ``a`` and ``b`` differ in structure."""
    _walk(a, b, a, b)


def _walk(x: Any, y: Any, a: Any, b: Any) -> None:
    if is_nested(x) != is_nested(y):
        raise errors.InvalidArgumentError(
            f"The two structures don't have the same nested structure: {a!r} vs {b!r}"
        )
    if not is_nested(x):
        return
    if isinstance(x, Mapping) != isinstance(y, Mapping) or len(x) != len(y):
        raise errors.InvalidArgumentError(
            f"The two structures don't have the same nested structure: {a!r} vs {b!r}"
        )
    if isinstance(x, Mapping) and set(x) != set(y):
        raise errors.InvalidArgumentError(
            f"The two structures have different keys: {sorted(map(str, x))} vs "
            f"{sorted(map(str, y))}"
        )
    for cx, cy in zip(_children(x), _children(y)):
        _walk(cx, cy, a, b)


def map_structure(func: Callable[..., Any], *structures: Any) -> Any:
    """Applies ``func`` leaf-wise over structures of the same shape."""
    if not structures:
        raise errors.InvalidArgumentError("map_structure needs at least one structure")
    for s in structures[1:]:
        assert_same_structure(structures[0], s)
    flats = [flatten(s) for s in structures]
    return pack_sequence_as(structures[0], [func(*leaves) for leaves in zip(*flats)])

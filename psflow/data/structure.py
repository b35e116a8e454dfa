"""Element structures of a dataset: :class:`TensorSpec` and nests of host arrays.

tf.data treats tuples (named or not) and dicts as structure, and everything
else, Python lists included, as a leaf: ``from_tensor_slices([[1, 2], [3, 4]])``
slices one int32 tensor, not two. This module flattens and packs values that
way. Inside a pipeline an element is a flat tuple of NumPy arrays; it becomes
a nest of :class:`psflow.Tensor` only at the iterator's output.

Example:
    >>> from psflow.data.structure import TensorSpec
    >>> TensorSpec([None, 3], "float32")
    TensorSpec(shape=(None, 3), dtype=psflow.float32, name=None)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from psflow import backend, dtypes, errors
from psflow.framework.tensor import Tensor, TensorShape, is_tensor, string_array, to_array


class TensorSpec:
    """The type of one tensor component of an element (TensorFlow's ``tf.TensorSpec``).

    Args:
        shape: dimensions (``None`` for an unknown dimension); ``None`` alone
            means an unknown rank.
        dtype: element type (a psflow dtype, NumPy dtype or name).
        name: optional name, kept for display.

    Example:
        >>> import psflow as pf
        >>> spec = TensorSpec([2], pf.int32)
        >>> spec.is_compatible_with(pf.constant([1, 2]))
        True
    """

    __slots__ = ("_dims", "dtype", "name")

    def __init__(self, shape: Any, dtype: Any = "float32", name: str | None = None) -> None:
        self._dims = None if shape is None else tuple(TensorShape(shape))
        self.dtype = dtypes.as_dtype(dtype)
        self.name = name

    @property
    def shape(self) -> TensorShape | None:
        """The shape, or ``None`` when even the rank is unknown."""
        return None if self._dims is None else TensorShape(self._dims)

    @classmethod
    def from_tensor(cls, tensor: Any, name: str | None = None) -> TensorSpec:
        """The spec of a tensor or array (its exact shape and dtype)."""
        arr = tensor._array() if is_tensor(tensor) else np.asarray(tensor)
        return cls(arr.shape, dtypes.from_numpy(arr.dtype), name)

    def is_compatible_with(self, other: Any) -> bool:
        """Whether ``other`` (a spec, tensor or array) could be described by this spec."""
        if not isinstance(other, TensorSpec):
            try:
                other = TensorSpec.from_tensor(other)
            except (TypeError, ValueError):
                return False
        return self.dtype == other.dtype and _dims_compatible(self._dims, other._dims)

    def most_specific_common(self, other: TensorSpec) -> TensorSpec:
        """The spec both describe, unknown where the shapes differ (for ``concatenate``)."""
        a, b = self._dims, other._dims
        if a is None or b is None or len(a) != len(b):
            dims = None
        else:
            dims = tuple(x if x == y else None for x, y in zip(a, b))
        return TensorSpec(dims, self.dtype)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, TensorSpec)
            and self._dims == other._dims
            and self.dtype == other.dtype
            and self.name == other.name
        )

    def __hash__(self) -> int:
        return hash((self._dims, self.dtype, self.name))

    def __repr__(self) -> str:
        if self._dims is None:
            shape = "<unknown>"
        else:
            shape = (
                "("
                + ", ".join(str(d) for d in self._dims)
                + ("," if len(self._dims) == 1 else "")
                + ")"
            )
        return f"TensorSpec(shape={shape}, dtype={self.dtype!r}, name={self.name!r})"

    def __reduce__(self):
        return (TensorSpec, (self._dims, self.dtype.name, self.name))


def _dims_compatible(a: tuple | None, b: tuple | None) -> bool:
    if a is None or b is None:
        return True
    return len(a) == len(b) and all(x is None or y is None or x == y for x, y in zip(a, b))


def shape_matches(spec: TensorSpec, shape: tuple[int, ...]) -> bool:
    """Whether a concrete array shape fits ``spec``'s (partial) shape."""
    return _dims_compatible(spec._dims, shape)


# -- nests: tuples and dicts are structure, everything else a leaf ------------------------


def is_structure(x: Any) -> bool:
    """Whether tf.data treats ``x`` as structure (a tuple or a mapping)."""
    return isinstance(x, (tuple, Mapping))


def _keys(m: Mapping) -> list[Any]:
    try:
        return sorted(m)
    except TypeError:
        return list(m)


def flatten(x: Any) -> list[Any]:
    """The leaves of ``x``, dicts in sorted key order, lists as leaves."""
    if isinstance(x, tuple):
        out: list[Any] = []
        for c in x:
            out.extend(flatten(c) if is_structure(c) else (c,))
        return out
    if isinstance(x, Mapping):
        out = []
        for k in _keys(x):
            c = x[k]
            out.extend(flatten(c) if is_structure(c) else (c,))
        return out
    return [x]


def map_structure(fn: Callable[[Any], Any], x: Any) -> Any:
    """``x`` with every leaf replaced by ``fn(leaf)``."""
    return pack(x, [fn(leaf) for leaf in flatten(x)])


def flatten_up_to(template: Any, value: Any, what: str = "value") -> list[Any]:
    """The parts of ``value`` at ``template``'s leaves (value's own lists may be leaves).

    Raises:
        TypeError: ``value`` lacks a tuple or dict where ``template`` has one;
            the message quotes both.
    """
    out: list[Any] = []

    def walk(t: Any, v: Any) -> None:
        if isinstance(t, Mapping):
            if not isinstance(v, Mapping) or set(v) != set(t):
                raise TypeError(
                    f"The {what} {v!r} does not match the expected structure {template!r}"
                )
            for k in _keys(t):
                walk(t[k], v[k])
        elif isinstance(t, tuple):
            if not isinstance(v, (tuple, list)) or len(v) != len(t):
                raise TypeError(
                    f"The {what} {v!r} does not match the expected structure {template!r}"
                )
            for tc, vc in zip(t, v):
                walk(tc, vc)
        elif is_structure(v):
            raise TypeError(
                f"The {what} {v!r} is a structure where the expected structure "
                f"{template!r} has a single tensor"
            )
        else:
            out.append(v)

    walk(template, value)
    return out


def pack(template: Any, flat: Sequence[Any]) -> Any:
    """Builds ``template``'s structure from ``flat`` leaves (dict key order kept)."""
    return make_packer(template)(flat)


def make_packer(template: Any) -> Callable[[Sequence[Any]], Any]:
    """A function packing flat leaves into ``template``'s structure, built once."""
    if not is_structure(template):
        return lambda flat: flat[0]
    if type(template) is tuple and not any(is_structure(c) for c in template):
        return tuple
    counter = [0]

    def build(t: Any) -> Callable[[Sequence[Any], int], Any]:
        if isinstance(t, Mapping):
            keys = _keys(t)
            subs: dict[Any, Any] = {}
            for k in keys:
                subs[k] = build(t[k])
            order = list(t)
            cls = type(t)

            def make_dict(flat: Sequence[Any]) -> Any:
                d = {k: subs[k](flat) for k in order}
                return d if cls is dict else cls(d)

            return make_dict
        if isinstance(t, tuple):
            parts = [build(c) for c in t]
            if hasattr(t, "_fields"):
                cls = type(t)
                return lambda flat: cls(*(p(flat) for p in parts))
            return lambda flat: tuple(p(flat) for p in parts)
        i = counter[0]
        counter[0] += 1
        return lambda flat: flat[i]

    return build(template)


def count_leaves(template: Any) -> int:
    """Number of leaves of ``template``."""
    return len(flatten(template))


# -- values to host arrays ------------------------------------------------------------------


def _host(arr: Any) -> np.ndarray:
    if isinstance(arr, np.ndarray):
        return arr
    if isinstance(arr, np.generic):
        return np.asarray(arr)
    return backend.to_numpy(arr)


def to_host_array(value: Any, what: str = "value") -> np.ndarray:
    """A NumPy array for a tensor, variable, array or Python value (TF's dtype inference).

    Raises:
        TypeError: non-numeric data (strings, objects, ``None``), quoting it.
    """
    if type(value) is Tensor:
        arr = value._array()
    else:
        if value is None:
            raise TypeError(f"The {what} None cannot be converted to a tensor")
        try:
            arr = to_array(value)
        except errors.InvalidArgumentError as e:
            raise errors.InvalidArgumentError(f"The {what} {value!r} is malformed: {e}") from None
    arr = _host(arr)
    if arr.dtype.kind not in "fiubO":  # "O": string tensors' text (to_array made it str)
        raise TypeError(f"The {what} {value!r} has non-numeric element type {arr.dtype}")
    dtypes.from_numpy(arr.dtype)
    return arr


def convert_to_dtype(value: Any, spec: TensorSpec, what: str = "value") -> np.ndarray:
    """``value`` as an array of ``spec``'s dtype and shape, refusing lossy or bad conversions.

    Raises:
        TypeError: non-numeric data, or a float that would lose its fraction.
        InvalidArgumentError: the shape does not fit ``spec``.
    """
    want = spec.dtype.np
    if is_tensor(value):
        arr = _host(value._array())
    elif type(value).__module__.startswith("cupy"):
        arr = backend.to_numpy(value)
    else:
        try:
            arr = np.asarray(value)
        except (TypeError, ValueError) as e:
            raise TypeError(f"The {what} {value!r} cannot be converted to a tensor: {e}") from None
    text = arr.dtype.kind in "USO"
    if text and want.kind == "O":
        arr = string_array(arr, value)  # validates the elements: text only
    elif text or arr.dtype.kind not in "fiub" or want.kind == "O":
        raise TypeError(
            f"The {what} {value!r} has element type {arr.dtype}, expected {spec.dtype.name}"
        )
    if arr.dtype != want:
        converted = arr.astype(want)
        if arr.dtype.kind == "f" and want.kind in "iub" and not np.array_equal(converted, arr):
            raise TypeError(
                f"The {what} {value!r} cannot be converted to {spec.dtype.name} without loss"
            )
        arr = converted
    if not shape_matches(spec, arr.shape):
        raise errors.InvalidArgumentError(
            f"The {what} has shape {arr.shape} where an element of shape "
            f"{'<unknown>' if spec.shape is None else tuple(spec.shape)} was expected: {value!r}"
        )
    return arr


def spec_of(arr: np.ndarray) -> TensorSpec:
    """The exact spec of a host array."""
    return TensorSpec(arr.shape, dtypes.from_numpy(arr.dtype))


def normalize_output(value: Any, what: str = "function output") -> tuple[Any, list[np.ndarray]]:
    """Splits a user function's return value into (template of specs, flat host arrays).

    A top-level list becomes a tuple, as in tf.data; inner lists are converted
    to tensors.
    """
    if isinstance(value, list):
        value = tuple(value)
    leaves = flatten(value)
    arrays = [to_host_array(v, what) for v in leaves]
    template = (
        pack(value, [spec_of(a) for a in arrays]) if is_structure(value) else spec_of(arrays[0])
    )
    return template, arrays


def same_structure(a: Any, b: Any) -> bool:
    """Whether two templates have the same tuples and dict keys."""
    if isinstance(a, Mapping):
        return (
            isinstance(b, Mapping)
            and set(a) == set(b)
            and all(same_structure(a[k], b[k]) for k in a)
        )
    if isinstance(a, tuple):
        return (
            isinstance(b, tuple)
            and len(a) == len(b)
            and all(same_structure(x, y) for x, y in zip(a, b))
        )
    return not is_structure(b)


def format_spec(template: Any) -> str:
    """The spec nest as text (``repr`` of the template)."""
    return repr(template)

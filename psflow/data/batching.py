"""Batching transformations: ``batch``, ``padded_batch``, ``unbatch``, ``rebatch``.

``batch`` over an input with an index plan cuts the row positions into
batches and gathers each batch with one indexing call per component; over
any other input it stacks the elements it collects.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np

from psflow import errors
from psflow.data import structure
from psflow.data.dataset import INFINITE_CARDINALITY, UNKNOWN_CARDINALITY, Dataset, int_arg
from psflow.data.structure import TensorSpec
from psflow.framework.tensor import is_tensor


def _positive(value: Any, name: str) -> int:
    n = int_arg(value, name)
    if n <= 0:
        raise errors.InvalidArgumentError(f"{name} must be greater than zero, got {n}")
    return n


def _batched_cardinality(n: int, batch_size: int, drop_remainder: bool) -> int:
    if n in (INFINITE_CARDINALITY, UNKNOWN_CARDINALITY):
        return n
    return n // batch_size if drop_remainder else -(-n // batch_size)


def _batched_spec(spec: Any, batch_size: int, drop_remainder: bool) -> Any:
    lead = batch_size if drop_remainder else None

    def one(s: TensorSpec) -> TensorSpec:
        return TensorSpec(None if s._dims is None else (lead, *s._dims), s.dtype)

    return structure.map_structure(one, spec)


def _batch_positions(chunks: Iterator[np.ndarray], size: int, drop: bool) -> Iterator[np.ndarray]:
    """Cuts a stream of position chunks into arrays of ``size`` positions."""
    pending: np.ndarray | None = None
    for c in chunks:
        if pending is not None:
            c = np.concatenate((pending, c))
            pending = None
        full = len(c) - len(c) % size
        for i in range(0, full, size):
            yield c[i : i + size]
        if full < len(c):
            pending = c[full:]
    if pending is not None and not drop:
        yield pending


def stack_elements(items: list[tuple[Any, ...]]) -> tuple[np.ndarray, ...]:
    """Stacks flat elements component-wise along a new first axis.

    Raises:
        InvalidArgumentError: two elements differ in a component's shape.
    """
    out = []
    for k, column in enumerate(zip(*items)):
        try:
            out.append(np.stack(column))
        except ValueError:
            shapes = [np.shape(c) for c in column]
            bad = next(i for i, s in enumerate(shapes) if s != shapes[0])
            raise errors.InvalidArgumentError(
                f"Cannot batch tensors with different shapes in component {k}. First element "
                f"had shape {list(shapes[0])} and element {bad} had shape {list(shapes[bad])}."
            ) from None
    return tuple(out)


class BatchDataset(Dataset):
    """``Dataset.batch``: ``batch_size`` consecutive elements stacked."""

    def __init__(self, input_dataset: Dataset, batch_size: Any, drop_remainder: bool) -> None:
        super().__init__(input_dataset)
        self._size = _positive(batch_size, "batch_size")
        self._drop = bool(drop_remainder)

    def _derive_spec(self, spec: Any) -> Any:
        return _batched_spec(spec, self._size, self._drop)

    def _cardinality(self) -> int:
        return _batched_cardinality(self._inputs[0]._cardinality(), self._size, self._drop)

    def _iter_elements(self) -> Iterator[tuple[Any, ...]]:
        inp, size, drop = self._inputs[0], self._size, self._drop
        if inp._has_plan():
            plan = inp._plan()
            return (plan.gather(idx) for idx in _batch_positions(plan.chunks, size, drop))
        src = inp._iter_flat()

        def gen() -> Iterator[tuple[Any, ...]]:
            while True:
                items = list(itertools.islice(src, size))
                if not items or (drop and len(items) < size):
                    return
                yield stack_elements(items)

        return gen()


def _shape_arg(value: Any) -> tuple[int | None, ...] | None:
    if value is None:
        return None
    if is_tensor(value):
        value = value.numpy().tolist()
    if isinstance(value, (int, np.integer)):
        value = [value]
    dims = []
    for d in value:
        if d is None or (isinstance(d, (int, np.integer)) and int(d) == -1):
            dims.append(None)
        elif isinstance(d, (int, np.integer)) and int(d) >= 0:
            dims.append(int(d))
        else:
            raise errors.InvalidArgumentError(f"padded_batch: bad padded shape {value!r}")
    return tuple(dims)


class PaddedBatchDataset(Dataset):
    """``Dataset.padded_batch``: batches of elements padded to a common shape."""

    def __init__(
        self,
        input_dataset: Dataset,
        batch_size: Any,
        padded_shapes: Any,
        padding_values: Any,
        drop_remainder: bool,
    ) -> None:
        super().__init__(input_dataset)
        self._size = _positive(batch_size, "batch_size")
        self._drop = bool(drop_remainder)
        spec = input_dataset.element_spec
        leaves = structure.flatten(spec)
        if padded_shapes is None:
            shapes = [s._dims for s in leaves]
            for s, dims in zip(leaves, shapes):
                if dims is None:
                    raise errors.InvalidArgumentError(
                        "padded_batch: padded_shapes is needed for a component of unknown "
                        f"rank: {s!r}"
                    )
        else:
            shapes = [
                _shape_arg(v) for v in structure.flatten_up_to(spec, padded_shapes, "padded_shapes")
            ]
            for s, dims in zip(leaves, shapes):
                if s._dims is not None and (
                    dims is None
                    or len(dims) != len(s._dims)
                    or any(p is not None and d is not None and p < d for p, d in zip(dims, s._dims))
                ):
                    raise errors.InvalidArgumentError(
                        f"padded_batch: padded shape {dims} does not fit the component {s!r}"
                    )
        self._shapes = shapes
        if padding_values is None:
            pads = [np.zeros((), s.dtype.np) for s in leaves]
        else:
            given = structure.flatten_up_to(spec, padding_values, "padding_values")
            pads = [self._pad_value(v, s) for v, s in zip(given, leaves)]
        self._pads = pads

    @staticmethod
    def _pad_value(value: Any, spec: TensorSpec) -> np.ndarray:
        if is_tensor(value) or isinstance(value, (np.ndarray, np.generic)):
            arr = structure.to_host_array(value, "padding value")
            if arr.dtype != spec.dtype.np:
                raise TypeError(
                    f"padded_batch: padding value {value!r} has dtype {arr.dtype}, "
                    f"the component has {spec.dtype.name}"
                )
        else:
            arr = structure.convert_to_dtype(value, TensorSpec((), spec.dtype), "padding value")
        if arr.ndim != 0:
            raise errors.InvalidArgumentError(
                f"padded_batch: padding value {value!r} must be a scalar"
            )
        return arr

    def _derive_spec(self, spec: Any) -> Any:
        lead = self._size if self._drop else None
        leaves = structure.flatten(spec)
        out = [TensorSpec((lead, *dims), s.dtype) for s, dims in zip(leaves, self._shapes)]
        return structure.pack(spec, out)

    def _cardinality(self) -> int:
        return _batched_cardinality(self._inputs[0]._cardinality(), self._size, self._drop)

    def _pad(self, k: int, column: tuple[Any, ...]) -> np.ndarray:
        want = self._shapes[k]
        shapes = [np.shape(c) for c in column]
        for s in shapes:
            if len(s) != len(want):
                raise errors.InvalidArgumentError(
                    f"padded_batch: component {k} has shape {list(s)}, expected rank {len(want)}"
                )
        target = tuple(max(s[i] for s in shapes) if w is None else w for i, w in enumerate(want))
        out = np.full((len(column), *target), self._pads[k], dtype=self._pads[k].dtype)
        for i, (c, s) in enumerate(zip(column, shapes)):
            if any(a > b for a, b in zip(s, target)):
                raise errors.InvalidArgumentError(
                    f"padded_batch: cannot pad component {k} of shape {list(s)} to the "
                    f"smaller shape {list(target)}"
                )
            out[(i, *(slice(0, d) for d in s))] = c
        return out

    def _iter_elements(self) -> Iterator[tuple[Any, ...]]:
        src, size, drop = self._inputs[0]._iter_flat(), self._size, self._drop

        def gen() -> Iterator[tuple[Any, ...]]:
            while True:
                items = list(itertools.islice(src, size))
                if not items or (drop and len(items) < size):
                    return
                yield tuple(self._pad(k, col) for k, col in enumerate(zip(*items)))

        return gen()


def _leading_dim(flat: tuple[Any, ...], what: str) -> int:
    n = None
    for a in flat:
        if np.ndim(a) == 0:
            raise errors.InvalidArgumentError(f"{what}: cannot split a scalar component {a!r}")
        d = np.shape(a)[0]
        if n is None:
            n = d
        elif d != n:
            raise errors.InvalidArgumentError(
                f"{what}: components differ in their first dimension: "
                f"{[list(np.shape(x)) for x in flat]}"
            )
    return int(n or 0)


class UnbatchDataset(Dataset):
    """``Dataset.unbatch``: every row of every element, in order."""

    def __init__(self, input_dataset: Dataset) -> None:
        super().__init__(input_dataset)
        self.element_spec  # noqa: B018  -- validates ranks now, as TensorFlow does

    def _derive_spec(self, spec: Any) -> Any:
        def one(s: TensorSpec) -> TensorSpec:
            if s._dims is None:
                return s
            if not s._dims:
                raise errors.InvalidArgumentError(
                    f"Cannot unbatch an input with scalar components: {spec!r}"
                )
            return TensorSpec(s._dims[1:], s.dtype)

        return structure.map_structure(one, spec)

    def _cardinality(self) -> int:
        n = self._inputs[0]._cardinality()
        if n in (INFINITE_CARDINALITY, UNKNOWN_CARDINALITY):
            return n
        leads = {
            s._dims[0] if s._dims else None for s in structure.flatten(self._inputs[0].element_spec)
        }
        if len(leads) == 1 and None not in leads:
            return n * leads.pop()
        return UNKNOWN_CARDINALITY

    def _iter_elements(self) -> Iterator[tuple[Any, ...]]:
        src = self._inputs[0]._iter_flat()

        def gen() -> Iterator[tuple[Any, ...]]:
            for flat in src:
                _leading_dim(flat, "unbatch")
                if len(flat) == 1:
                    for v in flat[0]:
                        yield (v,)
                else:
                    yield from zip(*flat)

        return gen()


class RebatchDataset(Dataset):
    """``Dataset.rebatch``: batched elements re-cut into batches of the given size(s)."""

    def __init__(self, input_dataset: Dataset, batch_size: Any, drop_remainder: bool) -> None:
        super().__init__(input_dataset)
        if is_tensor(batch_size):
            batch_size = batch_size.numpy().tolist()
        if isinstance(batch_size, (list, tuple)):
            sizes = [int_arg(b, "batch_size") for b in batch_size]
            if not sizes or any(b < 0 for b in sizes) or sum(sizes) <= 0:
                raise errors.InvalidArgumentError(
                    f"rebatch: batch sizes must be >= 0 with a positive sum, got {sizes}"
                )
            self._scalar = False
        else:
            sizes = [_positive(batch_size, "batch_size")]
            self._scalar = True
        self._sizes = sizes
        self._drop = bool(drop_remainder)
        self.element_spec  # noqa: B018  -- validates ranks now, as TensorFlow does

    def _derive_spec(self, spec: Any) -> Any:
        lead = self._sizes[0] if self._scalar and self._drop else None

        def one(s: TensorSpec) -> TensorSpec:
            if s._dims is None:
                return s
            if not s._dims:
                raise errors.InvalidArgumentError(
                    f"rebatch needs batched elements (rank >= 1), got {spec!r}; "
                    "add a batch transformation first"
                )
            return TensorSpec((lead, *s._dims[1:]), s.dtype)

        return structure.map_structure(one, spec)

    def _cardinality(self) -> int:
        n = self._inputs[0]._cardinality()
        return INFINITE_CARDINALITY if n == INFINITE_CARDINALITY else UNKNOWN_CARDINALITY

    def _iter_elements(self) -> Iterator[tuple[Any, ...]]:
        src = self._inputs[0]._iter_flat()
        sizes, drop = self._sizes, self._drop

        def join(parts: list[tuple[Any, ...]]) -> tuple[Any, ...]:
            if len(parts) == 1:
                return parts[0]
            return tuple(np.concatenate(col) for col in zip(*parts))

        def gen() -> Iterator[tuple[Any, ...]]:
            cycle = itertools.cycle(sizes)
            want = next(cycle)
            parts: list[tuple[Any, ...]] = []
            have = 0
            for flat in src:
                n = _leading_dim(flat, "rebatch")
                pos = 0
                while pos < n:
                    if want == 0:  # an empty batch, as a strategy with idle replicas needs
                        yield tuple(a[0:0] for a in flat)
                        want = next(cycle)
                        continue
                    take = min(want - have, n - pos)
                    parts.append(tuple(a[pos : pos + take] for a in flat))
                    have += take
                    pos += take
                    if have == want:
                        yield join(parts)
                        parts, have, want = [], 0, next(cycle)
            if parts and not drop:
                yield join(parts)

        return gen()

"""Dataset sources: in-memory arrays, ranges and Python generators.

``from_tensor_slices``, ``from_tensors`` and ``range`` are random-access: they
offer an index plan (see :mod:`psflow.data.dataset`), so batching and shuffling
above them work on row positions and gather whole batches at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from psflow import dtypes, errors
from psflow.data import structure
from psflow.data.dataset import UNKNOWN_CARDINALITY, Dataset, _Plan, int_arg
from psflow.data.structure import TensorSpec
from psflow.framework.tensor import Tensor

_MAX_CHUNK = 4096
_CHUNK_BYTES = 1 << 20


def index_chunks(n: int, chunk: int) -> Iterator[np.ndarray]:
    """Positions ``0..n-1`` as int64 arrays of at most ``chunk`` entries."""
    for start in range(0, n, chunk):
        yield np.arange(start, min(n, start + chunk), dtype=np.int64)


def _owned_array(value: Any) -> np.ndarray:
    """A host array of ``value`` that nobody else can change (copies user arrays)."""
    arr = structure.to_host_array(value, "component")
    if type(value) is not Tensor and not isinstance(value, (list, tuple, int, float, bool)):
        arr = np.array(arr, copy=True)  # a NumPy array or a variable the caller may mutate
    return arr


class _ArraySource(Dataset):
    """Rows of in-memory arrays that share their first dimension."""

    def __init__(self, arrays: tuple[np.ndarray, ...], spec: Any) -> None:
        super().__init__()
        self._arrays = arrays
        self._n = int(arrays[0].shape[0])
        self._spec = spec
        row_bytes = sum(a.itemsize * int(np.prod(a.shape[1:], dtype=np.int64)) for a in arrays)
        self._chunk = max(1, min(_MAX_CHUNK, _CHUNK_BYTES // max(1, row_bytes)))

    def _derive_spec(self) -> Any:
        return self._spec

    def _cardinality(self) -> int:
        return self._n

    def _has_plan(self) -> bool:
        return True

    def _plan(self) -> _Plan:
        arrays = self._arrays
        return _Plan(
            lambda idx: tuple(a[idx] for a in arrays),
            index_chunks(self._n, self._chunk),
            self._chunk,
        )


class TensorSliceDataset(_ArraySource):
    """``Dataset.from_tensor_slices``: one element per row of the given components."""

    def __init__(self, tensors: Any) -> None:
        if isinstance(tensors, Dataset):
            raise TypeError(f"from_tensor_slices needs tensors, got the dataset {tensors!r}")
        leaves = structure.flatten(tensors)
        if not leaves:
            raise errors.InvalidArgumentError(
                f"from_tensor_slices needs at least one component, got {tensors!r}"
            )
        arrays = []
        for leaf in leaves:
            arr = _owned_array(leaf)
            if arr.ndim == 0:
                raise errors.InvalidArgumentError(
                    f"from_tensor_slices cannot slice the scalar {leaf!r}: "
                    "components need rank >= 1"
                )
            arrays.append(arr)
        lengths = [int(a.shape[0]) for a in arrays]
        if len(set(lengths)) > 1:
            raise errors.InvalidArgumentError(
                f"from_tensor_slices: all components must have the same first dimension, "
                f"got lengths {lengths}"
            )
        specs = [TensorSpec(a.shape[1:], dtypes.from_numpy(a.dtype)) for a in arrays]
        spec = structure.pack(tensors, specs) if structure.is_structure(tensors) else specs[0]
        super().__init__(tuple(arrays), spec)


class TensorDataset(_ArraySource):
    """``Dataset.from_tensors``: a single element."""

    def __init__(self, tensors: Any) -> None:
        if isinstance(tensors, Dataset):
            raise TypeError(f"from_tensors needs tensors, got the dataset {tensors!r}")
        leaves = structure.flatten(tensors)
        if not leaves:
            raise errors.InvalidArgumentError(
                f"from_tensors needs at least one component, got {tensors!r}"
            )
        arrays = [_owned_array(leaf) for leaf in leaves]
        specs = [TensorSpec(a.shape, dtypes.from_numpy(a.dtype)) for a in arrays]
        spec = structure.pack(tensors, specs) if structure.is_structure(tensors) else specs[0]
        super().__init__(tuple(a[np.newaxis] for a in arrays), spec)


class RangeDataset(Dataset):
    """``Dataset.range``: an arithmetic progression, like Python's ``range``."""

    def __init__(self, *args: Any, output_type: Any = "int64") -> None:
        super().__init__()
        if not 1 <= len(args) <= 3:
            raise TypeError(f"range takes 1 to 3 integer arguments, got {args!r}")
        ints = [int_arg(a, "range argument") for a in args]
        start, stop, step = (0, ints[0], 1) if len(ints) == 1 else (*ints, 1)[:3]
        if step == 0:
            raise errors.InvalidArgumentError(f"range: step must not be 0, got args {args!r}")
        self._start, self._stop, self._step = start, stop, step
        self._n = len(range(start, stop, step))
        self._dtype = dtypes.as_dtype(output_type)
        if not (self._dtype.is_integer or self._dtype.is_floating):
            raise TypeError(f"range: output_type must be numeric, got {output_type!r}")

    def _derive_spec(self) -> Any:
        return TensorSpec((), self._dtype)

    def _cardinality(self) -> int:
        return self._n

    def _has_plan(self) -> bool:
        return True

    def _plan(self) -> _Plan:
        start, step, np_dtype = self._start, self._step, self._dtype.np

        def gather(idx: np.ndarray) -> tuple[np.ndarray, ...]:
            return ((start + idx * step).astype(np_dtype, copy=False),)

        return _Plan(gather, index_chunks(self._n, _MAX_CHUNK), _MAX_CHUNK)

    def __repr__(self) -> str:
        return (
            f"<RangeDataset start={self._start} stop={self._stop} step={self._step} "
            f"element_spec={self.element_spec!r}>"
        )


def _tuples_for_lists(x: Any) -> Any:
    """A signature nest with lists turned into tuples (signatures have no tensor lists)."""
    if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
        return tuple(_tuples_for_lists(c) for c in x)
    if isinstance(x, dict):
        return {k: _tuples_for_lists(v) for k, v in x.items()}
    return x


class GeneratorDataset(Dataset):
    """``Dataset.from_generator``: elements from a Python generator, checked against a signature."""

    def __init__(
        self,
        generator: Callable[..., Any],
        output_types: Any,
        output_shapes: Any,
        args: Any,
        output_signature: Any,
    ) -> None:
        super().__init__()
        if not callable(generator):
            raise TypeError(f"from_generator: generator must be callable, got {generator!r}")
        self._generator = generator
        self._spec = self._signature(output_types, output_shapes, output_signature)
        self._leaf_specs = structure.flatten(self._spec)
        if args is None:
            args = ()
        elif not isinstance(args, (tuple, list)):
            raise TypeError(f"from_generator: args must be a tuple, got {args!r}")
        host = [structure.to_host_array(a, "generator argument") for a in args]
        self._args = tuple(a[()] if a.ndim == 0 else a for a in host)

    def _replay_obstacle(self) -> str | None:
        return f"Dataset.from_generator({getattr(self._generator, '__name__', self._generator)!r})"

    @staticmethod
    def _signature(output_types: Any, output_shapes: Any, output_signature: Any) -> Any:
        if output_signature is not None:
            if output_types is not None or output_shapes is not None:
                raise TypeError(
                    "from_generator: give either output_signature or output_types/"
                    "output_shapes, not both"
                )
            sig = _tuples_for_lists(output_signature)
            for leaf in structure.flatten(sig):
                if not isinstance(leaf, TensorSpec):
                    raise TypeError(
                        f"from_generator: output_signature must be a nest of TensorSpec, "
                        f"found {leaf!r}"
                    )
            return sig
        if output_types is None:
            raise TypeError(
                "To specify the output signature you need to provide either the "
                "`output_signature` argument or the `output_types` argument."
            )
        types = _tuples_for_lists(output_types)
        type_leaves = [dtypes.as_dtype(t) for t in structure.flatten(types)]
        if output_shapes is None:
            shapes: list[Any] = [None] * len(type_leaves)
        else:
            shapes = structure.flatten_up_to(types, output_shapes, "output_shapes")
        specs = [TensorSpec(s, t) for s, t in zip(shapes, type_leaves)]
        return structure.pack(types, specs) if structure.is_structure(types) else specs[0]

    def _derive_spec(self) -> Any:
        return self._spec

    def _cardinality(self) -> int:
        return UNKNOWN_CARDINALITY

    def _iter_elements(self) -> Iterator[tuple[Any, ...]]:
        source = iter(self._generator(*self._args))
        spec, leaf_specs = self._spec, self._leaf_specs
        what = "element yielded by `generator`"

        def gen() -> Iterator[tuple[Any, ...]]:
            for value in source:
                parts = structure.flatten_up_to(spec, value, what)
                yield tuple(
                    structure.convert_to_dtype(v, s, what) for v, s in zip(parts, leaf_specs)
                )

        return gen()

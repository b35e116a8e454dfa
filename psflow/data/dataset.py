"""``psflow.data.Dataset``: tf.data's input pipelines on NumPy arrays.

A dataset is an immutable description of a sequence of *elements*; each
element is a nest (tuples and dicts) of tensors. Transformations return new
datasets; iterating one (``for x in ds``) yields psflow tensors. The element
order, cardinality rules and errors are TensorFlow's.

Inside a pipeline an element is a flat tuple of NumPy arrays, and datasets
that read from in-memory arrays (``from_tensor_slices``, ``range``) and the
order-only transformations above them (``shuffle``, ``repeat``, ``take``,
``skip``, ``shard``, ``cache``) also offer an *index plan*: the positions of
the source rows in output order. ``batch`` over a plan gathers whole batches
with one fancy-indexing call per component instead of stacking elements one
by one; both paths give the same elements in the same order.

Example:
    >>> import psflow as pf
    >>> ds = pf.data.Dataset.range(8).batch(3)
    >>> [b.numpy().tolist() for b in ds]
    [[0, 1, 2], [3, 4, 5], [6, 7]]
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np

from psflow import errors
from psflow.data import structure
from psflow.data.options import Options
from psflow.framework.tensor import Tensor, is_tensor

INFINITE_CARDINALITY = -1
UNKNOWN_CARDINALITY = -2
AUTOTUNE = -1


class _Plan(NamedTuple):
    """One pass over a random-access dataset: where to read, in output order.

    ``chunks`` yields non-empty int64 arrays of row positions; ``gather(idx)``
    returns the flat tuple of component arrays for those rows (leading axis
    ``len(idx)``, fresh arrays that alias nothing). ``rows`` is the chunk
    length the source prefers (small for large rows), kept by re-chunking.
    """

    gather: Callable[[np.ndarray], tuple[np.ndarray, ...]]
    chunks: Iterator[np.ndarray]
    rows: int


def rows_of(plan: _Plan) -> Iterator[tuple[Any, ...]]:
    """The elements (flat tuples) of a plan, one chunk gathered at a time."""
    for chunk in plan.chunks:
        cols = tuple(
            _object_rows(c) if c.dtype.kind == "O" and c.ndim == 1 else c
            for c in plan.gather(chunk)
        )
        if len(cols) == 1:
            for v in cols[0]:
                yield (v,)
        else:
            yield from zip(*cols)


def _object_rows(column: np.ndarray) -> list[np.ndarray]:
    """A string column's rows as 0-d object arrays (iterating it would give bare ``str``)."""
    rows = []
    for v in column.tolist():
        row = np.empty((), dtype=object)
        row[()] = v
        rows.append(row)
    return rows


def int_arg(value: Any, name: str) -> int:
    """An integer argument from an int, NumPy integer or scalar integer tensor.

    Raises:
        TypeError: ``value`` is not an integer (the message quotes it).
    """
    if is_tensor(value):
        arr = np.asarray(value.numpy())
        if arr.ndim != 0 or arr.dtype.kind not in "iu":
            raise TypeError(f"{name} must be a scalar integer, got {value!r}")
        return int(arr)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    return int(value)


class Dataset:
    """A sequence of elements, each a nest of tensors (TensorFlow's ``tf.data.Dataset``).

    Build one with :meth:`from_tensor_slices`, :meth:`from_tensors`,
    :meth:`from_generator` or :meth:`range`, chain transformations, and iterate.

    Example:
        >>> import psflow as pf
        >>> ds = pf.data.Dataset.from_tensor_slices(([1, 2, 3], [4.0, 5.0, 6.0]))
        >>> ds = ds.map(lambda x, y: x * 2).filter(lambda x: x > 2)
        >>> list(ds.as_numpy_iterator())
        [np.int32(4), np.int32(6)]
    """

    _inputs: tuple[Dataset, ...] = ()

    def __init__(self, *inputs: Dataset) -> None:
        for d in inputs:
            if not isinstance(d, Dataset):
                raise TypeError(f"Expected a psflow.data.Dataset, got {d!r}")
        self._inputs = tuple(inputs)
        opts = Options()
        for d in inputs:
            opts = opts.merge(d._options)
        self._options = opts
        self._spec_cache: Any = None
        self._template_cache: Any = None
        self._packer: Any = None

    # -- hooks for subclasses -----------------------------------------------------------------
    def _derive_spec(self, *input_specs: Any) -> Any:
        """This dataset's element spec from its inputs' (default: the first's)."""
        return input_specs[0]

    def _cardinality(self) -> int:
        """Number of elements, or INFINITE_CARDINALITY / UNKNOWN_CARDINALITY."""
        return self._inputs[0]._cardinality()

    def _has_plan(self) -> bool:
        """Whether :meth:`_plan` is available (a structural property: no side effects)."""
        return False

    def _plan(self) -> _Plan:
        """Starts one pass as an index plan (only when :meth:`_has_plan`)."""
        raise errors.InternalError(f"{type(self).__name__} has no index plan")

    def _iter_elements(self) -> Iterator[tuple[Any, ...]]:
        """Starts one pass element by element (datasets without a plan implement this).

        Implementations draw seeds and create input iterators here, eagerly,
        and return a generator for the rest, so that the order in which
        iterators are created (and so every shuffle seed) is deterministic.
        """
        raise errors.InternalError(f"{type(self).__name__} cannot be iterated")

    def _replay_obstacle(self) -> str | None:
        """Why a fresh pass might not repeat this one's elements (None: it does).

        A checkpointed iterator is restored by starting a fresh pass and
        skipping the elements already read, which is right only for a
        pipeline whose passes repeat (no Python generator, no unseeded shuffle).
        """
        for d in self._inputs:
            reason = d._replay_obstacle()
            if reason is not None:
                return reason
        return None

    def _iter_flat(self) -> Iterator[tuple[Any, ...]]:
        """Starts one pass; yields elements as flat tuples of NumPy arrays."""
        if self._has_plan():
            return rows_of(self._plan())
        return self._iter_elements()

    # -- structure ----------------------------------------------------------------------------
    @property
    def element_spec(self) -> Any:
        """The nest of :class:`TensorSpec` describing one element."""
        if self._spec_cache is None:
            self._spec_cache = self._derive_spec(*(d.element_spec for d in self._inputs))
        return self._spec_cache

    def _template(self) -> Any:
        """The element's nest of specs as far as packing needs it.

        Equal to ``element_spec`` except after a ``map``, whose structure is
        taken from the function's first real output instead of a trace.
        """
        if self._template_cache is None:
            self._template_cache = self._derive_spec(*(d._template() for d in self._inputs))
        return self._template_cache

    def _pack(self, flat: tuple[Any, ...]) -> Any:
        """Packs a flat element into the element's structure."""
        packer = self._packer
        if packer is None:
            packer = self._packer = structure.make_packer(self._template())
        return packer(flat)

    def _pack_tensors(self, flat: tuple[Any, ...]) -> Any:
        """Packs a flat element as tensors (no copy, host arrays)."""
        return self._pack(tuple(Tensor._wrap(a) for a in flat))

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_packer"] = None
        return state

    # -- sources --------------------------------------------------------------------------------
    @staticmethod
    def from_tensor_slices(tensors: Any, name: str | None = None) -> Dataset:
        """Slices ``tensors`` along their first dimension, one element per row.

        ``tensors`` is an array, tensor, Python list, or a tuple/dict nest of
        them; all components must have the same length.

        Raises:
            InvalidArgumentError: a scalar component, or lengths that differ.
            TypeError: non-numeric data.

        Example:
            >>> import psflow as pf
            >>> ds = pf.data.Dataset.from_tensor_slices({"a": [1, 2], "b": [3.0, 4.0]})
            >>> [e["a"].numpy().item() for e in ds]
            [1, 2]
        """
        from psflow.data.sources import TensorSliceDataset

        return TensorSliceDataset(tensors)

    @staticmethod
    def list_files(
        file_pattern: Any, shuffle: bool | None = None, seed: Any = None, name: str | None = None
    ) -> Dataset:
        """The names of the files matching ``file_pattern`` (a glob, or a list of them).

        Sorted, then shuffled unless ``shuffle`` is False; ``seed`` makes the
        shuffle repeatable.

        Raises:
            InvalidArgumentError: no file matches (the message names the pattern).
        """
        from psflow.data.files import list_files

        return list_files(file_pattern, shuffle, seed)

    @staticmethod
    def from_tensors(tensors: Any, name: str | None = None) -> Dataset:
        """A dataset of one element, ``tensors``.

        Example:
            >>> import psflow as pf
            >>> [x.numpy().tolist() for x in pf.data.Dataset.from_tensors([1, 2])]
            [[1, 2]]
        """
        from psflow.data.sources import TensorDataset

        return TensorDataset(tensors)

    @staticmethod
    def from_generator(
        generator: Callable[..., Any],
        output_types: Any = None,
        output_shapes: Any = None,
        args: Any = None,
        output_signature: Any = None,
        name: str | None = None,
    ) -> Dataset:
        """Elements produced by ``generator(*args)``, which is called anew for each pass.

        Give the element type as ``output_signature`` (a nest of
        :class:`TensorSpec`) or as ``output_types`` (and optionally
        ``output_shapes``). Yielded values are converted to those dtypes;
        a value of the wrong structure, a lossy conversion or a shape that does
        not fit raises when it is produced.

        Raises:
            TypeError: neither ``output_signature`` nor ``output_types`` given, or
                ``generator`` is not callable.

        Example:
            >>> import psflow as pf
            >>> ds = pf.data.Dataset.from_generator(
            ...     lambda: iter([[1, 2], [3]]),
            ...     output_signature=pf.data.TensorSpec([None], pf.int32))
            >>> [x.numpy().tolist() for x in ds]
            [[1, 2], [3]]
        """
        from psflow.data.sources import GeneratorDataset

        return GeneratorDataset(generator, output_types, output_shapes, args, output_signature)

    @staticmethod
    def range(*args: Any, output_type: Any = "int64", name: str | None = None) -> Dataset:
        """``range(stop)``, ``range(start, stop)`` or ``range(start, stop, step)`` as int64.

        Example:
            >>> import psflow as pf
            >>> list(pf.data.Dataset.range(1, 6, 2).as_numpy_iterator())
            [np.int64(1), np.int64(3), np.int64(5)]
        """
        from psflow.data.sources import RangeDataset

        return RangeDataset(*args, output_type=output_type)

    @staticmethod
    def zip(*datasets: Any, name: str | None = None) -> Dataset:
        """Combines datasets element-wise; stops with the shortest.

        Accepts ``zip(a, b)``, ``zip((a, b))`` or a dict/nest of datasets; the
        elements have that structure.

        Example:
            >>> import psflow as pf
            >>> a, b = pf.data.Dataset.range(3), pf.data.Dataset.range(10, 12)
            >>> [(int(x), int(y)) for x, y in pf.data.Dataset.zip(a, b)]
            [(0, 10), (1, 11)]
        """
        from psflow.data.ordering import ZipDataset

        if len(datasets) == 1:
            return ZipDataset(datasets[0])
        return ZipDataset(tuple(datasets))

    def concatenate(self, dataset: Dataset, name: str | None = None) -> Dataset:
        """This dataset's elements followed by ``dataset``'s (same structure and dtypes).

        Raises:
            TypeError: the element structures or dtypes differ.
        """
        from psflow.data.ordering import ConcatenateDataset

        return ConcatenateDataset(self, dataset)

    # -- transformations ----------------------------------------------------------------------
    def batch(
        self,
        batch_size: Any,
        drop_remainder: bool = False,
        num_parallel_calls: Any = None,
        deterministic: Any = None,
        name: str | None = None,
    ) -> Dataset:
        """Stacks consecutive elements into batches along a new first axis.

        The last batch may be smaller unless ``drop_remainder``.

        Raises:
            InvalidArgumentError: ``batch_size`` <= 0.

        Example:
            >>> import psflow as pf
            >>> [b.numpy().tolist() for b in pf.data.Dataset.range(8).batch(3, True)]
            [[0, 1, 2], [3, 4, 5]]
        """
        from psflow.data.batching import BatchDataset

        return BatchDataset(self, batch_size, drop_remainder)

    def padded_batch(
        self,
        batch_size: Any,
        padded_shapes: Any = None,
        padding_values: Any = None,
        drop_remainder: bool = False,
        name: str | None = None,
    ) -> Dataset:
        """Batches elements of different shapes, padding each component to a common shape.

        ``padded_shapes`` (default: the longest in each batch) and
        ``padding_values`` (default 0) follow the element structure.

        Example:
            >>> import psflow as pf
            >>> ds = pf.data.Dataset.range(1, 3).map(lambda x: pf.fill([x], x))
            >>> [b.numpy().tolist() for b in ds.padded_batch(2)]
            [[[1, 0], [2, 2]]]
        """
        from psflow.data.batching import PaddedBatchDataset

        return PaddedBatchDataset(self, batch_size, padded_shapes, padding_values, drop_remainder)

    def unbatch(self, name: str | None = None) -> Dataset:
        """Splits each element along its first axis into several elements.

        Raises:
            InvalidArgumentError: a component is a scalar.
        """
        from psflow.data.batching import UnbatchDataset

        return UnbatchDataset(self)

    def rebatch(
        self, batch_size: Any, drop_remainder: bool = False, name: str | None = None
    ) -> Dataset:
        """Re-cuts batched elements into batches of ``batch_size`` rows.

        The same as ``unbatch().batch(batch_size, drop_remainder)``, but by
        slicing; ``batch_size`` may also be a list of sizes used in turn
        (how a distribution strategy splits a global batch among replicas).

        Example:
            >>> import psflow as pf
            >>> ds = pf.data.Dataset.range(10).batch(4).rebatch(3)
            >>> [b.numpy().tolist() for b in ds]
            [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
        """
        from psflow.data.batching import RebatchDataset

        return RebatchDataset(self, batch_size, drop_remainder)

    def shuffle(
        self,
        buffer_size: Any,
        seed: Any = None,
        reshuffle_each_iteration: bool = True,
        name: str | None = None,
    ) -> Dataset:
        """Shuffles with TensorFlow's buffer algorithm.

        A buffer holds ``buffer_size`` elements; each output is drawn uniformly
        from it and its place taken by the next input element. A buffer of 1
        keeps the order; one at least as large as the dataset gives a uniform
        permutation. With ``psflow.random.set_seed`` or ``seed`` the order is
        reproducible; ``reshuffle_each_iteration`` draws a new order, still
        reproducibly, for each pass.

        Raises:
            InvalidArgumentError: ``buffer_size`` <= 0 (other than
                UNKNOWN_CARDINALITY, which buffers the whole input).

        Example:
            >>> import psflow as pf
            >>> sorted(pf.data.Dataset.range(5).shuffle(5, seed=1).as_numpy_iterator())
            [np.int64(0), np.int64(1), np.int64(2), np.int64(3), np.int64(4)]
        """
        from psflow.data.shuffle import ShuffleDataset

        return ShuffleDataset(self, buffer_size, seed, reshuffle_each_iteration)

    def repeat(self, count: Any = None, name: str | None = None) -> Dataset:
        """Repeats the dataset ``count`` times (forever if ``None`` or -1).

        Example:
            >>> import psflow as pf
            >>> list(pf.data.Dataset.range(2).repeat(2).as_numpy_iterator())
            [np.int64(0), np.int64(1), np.int64(0), np.int64(1)]
        """
        from psflow.data.ordering import RepeatDataset

        return RepeatDataset(self, count)

    def map(
        self,
        map_func: Callable[..., Any],
        num_parallel_calls: Any = None,
        deterministic: Any = None,
        name: str | None = None,
    ) -> Dataset:
        """Applies ``map_func`` to each element.

        A tuple element is passed as positional arguments (``map_func(*element)``),
        anything else (a tensor, a dict) as one argument. The function runs on
        the host (CPU:0). ``num_parallel_calls`` > 1 (or AUTOTUNE) calls it
        from a thread pool; the output order stays the input order.

        Example:
            >>> import psflow as pf
            >>> ds = pf.data.Dataset.from_tensor_slices(([1, 2], [10, 20]))
            >>> [int(v) for v in ds.map(lambda x, y: x + y)]
            [11, 22]
        """
        from psflow.data.mapping import MapDataset

        return MapDataset(self, map_func, num_parallel_calls)

    def flat_map(self, map_func: Callable[..., Any], name: str | None = None) -> Dataset:
        """Maps each element to a dataset and yields those datasets' elements in turn."""
        from psflow.data.mapping import FlatMapDataset

        return FlatMapDataset(self, map_func)

    def interleave(
        self,
        map_func: Callable[..., Any],
        cycle_length: Any = None,
        block_length: Any = None,
        num_parallel_calls: Any = None,
        deterministic: Any = None,
        name: str | None = None,
    ) -> Dataset:
        """Maps each element to a dataset and interleaves them: ``cycle_length`` at a
        time, ``block_length`` consecutive elements from each in turn.

        ``cycle_length`` None or AUTOTUNE is the number of CPU cores (as in
        TensorFlow, so the order then depends on the machine); ``block_length``
        defaults to 1. The order is TensorFlow's; ``num_parallel_calls`` and
        ``deterministic`` are accepted and the datasets are read in turn.

        Raises:
            InvalidArgumentError: a length that is not a positive integer.

        Example:
            >>> import psflow as pf
            >>> ds = pf.data.Dataset.range(1, 4).interleave(
            ...     lambda x: pf.data.Dataset.from_tensors(x).repeat(3), cycle_length=2,
            ...     block_length=2)
            >>> [int(x) for x in ds]
            [1, 1, 2, 2, 1, 2, 3, 3, 3]
        """
        import os

        from psflow.data.mapping import InterleaveDataset

        cycle = int_arg(cycle_length, "cycle_length") if cycle_length is not None else AUTOTUNE
        if cycle == AUTOTUNE:
            cycle = os.cpu_count() or 1
        block = 1 if block_length is None else int_arg(block_length, "block_length")
        return InterleaveDataset(self, map_func, cycle, block)

    def filter(self, predicate: Callable[..., Any], name: str | None = None) -> Dataset:
        """Keeps the elements for which ``predicate`` returns a true scalar bool.

        Raises:
            InvalidArgumentError: the predicate returns something other than a
                scalar bool (when it is called).

        Example:
            >>> import psflow as pf
            >>> list(pf.data.Dataset.range(6).filter(lambda x: x % 2 == 0).as_numpy_iterator())
            [np.int64(0), np.int64(2), np.int64(4)]
        """
        from psflow.data.mapping import FilterDataset

        return FilterDataset(self, predicate)

    def take(self, count: Any, name: str | None = None) -> Dataset:
        """The first ``count`` elements (all of them if ``count`` is -1)."""
        from psflow.data.ordering import TakeDataset

        return TakeDataset(self, count)

    def skip(self, count: Any, name: str | None = None) -> Dataset:
        """All but the first ``count`` elements (none if ``count`` is -1)."""
        from psflow.data.ordering import SkipDataset

        return SkipDataset(self, count)

    def shard(self, num_shards: Any, index: Any, name: str | None = None) -> Dataset:
        """Every ``num_shards``-th element, starting at ``index``.

        Raises:
            InvalidArgumentError: ``num_shards`` <= 0 or ``index`` outside
                ``[0, num_shards)``.

        Example:
            >>> import psflow as pf
            >>> list(pf.data.Dataset.range(10).shard(num_shards=3, index=0).as_numpy_iterator())
            [np.int64(0), np.int64(3), np.int64(6), np.int64(9)]
        """
        from psflow.data.ordering import ShardDataset

        return ShardDataset(self, num_shards, index)

    def prefetch(self, buffer_size: Any, name: str | None = None) -> Dataset:
        """Produces elements ahead in a background thread (at most ``buffer_size`` waiting).

        The order never changes. ``buffer_size`` 0 prefetches nothing;
        AUTOTUNE picks a small buffer.
        """
        from psflow.data.prefetch import PrefetchDataset

        return PrefetchDataset(self, buffer_size)

    def cache(self, filename: str = "", name: str | None = None) -> Dataset:
        """Remembers the elements of the first complete pass and replays them afterwards.

        The cache lives in memory; a ``filename`` is accepted for TensorFlow
        compatibility but nothing is written to it.
        """
        from psflow.data.ordering import CacheDataset

        return CacheDataset(self, filename)

    def enumerate(self, start: Any = 0, name: str | None = None) -> Dataset:
        """Pairs each element with its int64 position: ``(i, element)``."""
        from psflow.data.ordering import EnumerateDataset

        return EnumerateDataset(self, start)

    def apply(self, transformation_func: Callable[[Dataset], Dataset]) -> Dataset:
        """Returns ``transformation_func(self)``, which must be a dataset.

        Raises:
            TypeError: the function does not return a dataset.
        """
        out = transformation_func(self)
        if not isinstance(out, Dataset):
            raise TypeError(
                f"The transformation function {transformation_func!r} must return a Dataset, "
                f"got {out!r}"
            )
        return out

    def with_options(self, options: Options, name: str | None = None) -> Dataset:
        """This dataset with ``options`` merged in (later settings win)."""
        from psflow.data.ordering import OptionsDataset

        return OptionsDataset(self, options)

    def options(self) -> Options:
        """The options of this pipeline (read-only; change them with :meth:`with_options`)."""
        return Options().merge(self._options)._freeze()  # type: ignore[return-value]

    # -- size ---------------------------------------------------------------------------------
    def cardinality(self) -> Tensor:
        """The number of elements as a scalar int64 tensor.

        INFINITE_CARDINALITY (-1) for an infinite dataset, UNKNOWN_CARDINALITY (-2)
        when it cannot be known without iterating (after ``filter``, for a generator).
        """
        return Tensor._wrap(np.asarray(self._cardinality(), dtype=np.int64))

    def __len__(self) -> int:
        n = self._cardinality()
        if n == INFINITE_CARDINALITY:
            raise TypeError("The dataset is infinite.")
        if n == UNKNOWN_CARDINALITY:
            raise TypeError("The dataset length is unknown.")
        return n

    def __bool__(self) -> bool:
        return True

    # -- iteration ----------------------------------------------------------------------------
    def __iter__(self) -> Any:
        from psflow.data.iterator import Iterator as _Iterator

        return _Iterator(self)

    def as_numpy_iterator(self) -> Iterator[Any]:
        """Iterates the elements as NumPy values (scalars for 0-d components).

        Example:
            >>> import psflow as pf
            >>> list(pf.data.Dataset.range(3).as_numpy_iterator())
            [np.int64(0), np.int64(1), np.int64(2)]
        """
        flat_iter = self._iter_flat()

        def gen() -> Iterator[Any]:
            for flat in flat_iter:
                yield self._pack(
                    tuple(a[()] if isinstance(a, np.ndarray) and a.ndim == 0 else a for a in flat)
                )

        return gen()

    def reduce(self, initial_state: Any, reduce_func: Callable[[Any, Any], Any]) -> Any:
        """Folds the elements: ``state = reduce_func(state, element)`` from ``initial_state``.

        Raises:
            TypeError: the new state's structure or dtypes differ from the initial state's.

        Example:
            >>> import psflow as pf
            >>> int(pf.data.Dataset.range(5).reduce(pf.constant(0, pf.int64), lambda s, x: s + x))
            10
        """
        from psflow.data.mapping import run_reduce

        return run_reduce(self, initial_state, reduce_func)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} element_spec={self.element_spec!r}>"

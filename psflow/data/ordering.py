"""Transformations that choose or combine elements without computing on them.

``repeat``, ``take``, ``skip``, ``shard`` and ``cache`` work on an index plan
when their input has one (so ``batch`` above them can gather whole batches),
and element by element otherwise; both give the same order. ``zip``,
``concatenate`` and ``enumerate`` combine element streams.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np

from psflow import dtypes, errors
from psflow.data import structure
from psflow.data.dataset import (
    INFINITE_CARDINALITY,
    UNKNOWN_CARDINALITY,
    Dataset,
    _Plan,
    int_arg,
)
from psflow.data.options import Options
from psflow.data.structure import TensorSpec

logger = logging.getLogger(__name__)

# -- repeat / take / skip / shard -------------------------------------------------------------


class RepeatDataset(Dataset):
    """``Dataset.repeat``: the input ``count`` times, forever if ``count`` < 0 or ``None``."""

    def __init__(self, input_dataset: Dataset, count: Any) -> None:
        super().__init__(input_dataset)
        self._count = -1 if count is None else int_arg(count, "count")

    def _cardinality(self) -> int:
        n, c = self._inputs[0]._cardinality(), self._count
        if c == 0 or n == 0:
            return 0
        if n == INFINITE_CARDINALITY or c < 0:
            return INFINITE_CARDINALITY
        if n == UNKNOWN_CARDINALITY:
            return UNKNOWN_CARDINALITY
        return n * c

    def _passes(self, start: Any, make: Any) -> Iterator[Any]:
        """Items of successive passes; stops after ``count`` or after an empty pass."""
        count, current, done = self._count, start, 0
        while True:
            produced = False
            for item in current:
                produced = True
                yield item
            done += 1
            if not produced or (count >= 0 and done >= count):
                return
            current = make()

    def _has_plan(self) -> bool:
        return self._inputs[0]._has_plan()

    def _plan(self) -> _Plan:
        inp = self._inputs[0]
        if self._count == 0:  # never starts the input (no shuffle seed is used up)
            return _Plan(_gather_nothing, iter(()), 1)
        first = inp._plan()
        return _Plan(
            first.gather, self._passes(first.chunks, lambda: inp._plan().chunks), first.rows
        )

    def _iter_elements(self) -> Iterator[tuple[Any, ...]]:
        if self._count == 0:
            return iter(())
        inp = self._inputs[0]
        return self._passes(inp._iter_flat(), inp._iter_flat)


def _gather_nothing(idx: np.ndarray) -> tuple[np.ndarray, ...]:
    raise errors.InternalError(f"An empty plan was asked to gather rows {idx!r}")


def _take_chunks(chunks: Iterator[np.ndarray], count: int) -> Iterator[np.ndarray]:
    remaining = count
    while remaining > 0:
        c = next(chunks, None)
        if c is None:
            return
        if len(c) >= remaining:
            yield c[:remaining]
            return
        remaining -= len(c)
        yield c


def _skip_chunks(chunks: Iterator[np.ndarray], count: int) -> Iterator[np.ndarray]:
    remaining = count
    for c in chunks:
        if remaining >= len(c):
            remaining -= len(c)
            continue
        yield c[remaining:] if remaining else c
        remaining = 0


def _shard_chunks(chunks: Iterator[np.ndarray], num: int, index: int) -> Iterator[np.ndarray]:
    offset = 0  # global position of the chunk's first row
    for c in chunks:
        part = c[(index - offset) % num :: num]
        offset += len(c)
        if len(part):
            yield part


class TakeDataset(Dataset):
    """``Dataset.take``: at most ``count`` elements (all if ``count`` < 0)."""

    def __init__(self, input_dataset: Dataset, count: Any) -> None:
        super().__init__(input_dataset)
        self._count = int_arg(count, "count")

    def _cardinality(self) -> int:
        n, c = self._inputs[0]._cardinality(), self._count
        if c < 0:
            return n
        if c == 0:
            return 0
        if n == INFINITE_CARDINALITY:
            return c
        if n == UNKNOWN_CARDINALITY:
            return UNKNOWN_CARDINALITY
        return min(n, c)

    def _has_plan(self) -> bool:
        return self._inputs[0]._has_plan()

    def _plan(self) -> _Plan:
        inner = self._inputs[0]._plan()
        if self._count < 0:
            return inner
        return _Plan(inner.gather, _take_chunks(inner.chunks, self._count), inner.rows)

    def _iter_elements(self) -> Iterator[tuple[Any, ...]]:
        if self._count == 0:
            return iter(())
        src = self._inputs[0]._iter_flat()
        return src if self._count < 0 else itertools.islice(src, self._count)


class SkipDataset(Dataset):
    """``Dataset.skip``: all but the first ``count`` elements (nothing if ``count`` < 0)."""

    def __init__(self, input_dataset: Dataset, count: Any) -> None:
        super().__init__(input_dataset)
        self._count = int_arg(count, "count")

    def _cardinality(self) -> int:
        n, c = self._inputs[0]._cardinality(), self._count
        if n in (INFINITE_CARDINALITY, UNKNOWN_CARDINALITY):
            return n
        return 0 if c < 0 else max(0, n - c)

    def _has_plan(self) -> bool:
        return self._inputs[0]._has_plan()

    def _plan(self) -> _Plan:
        inner = self._inputs[0]._plan()
        if self._count < 0:
            return _Plan(inner.gather, iter(()), inner.rows)
        return _Plan(inner.gather, _skip_chunks(inner.chunks, self._count), inner.rows)

    def _iter_elements(self) -> Iterator[tuple[Any, ...]]:
        if self._count < 0:
            return iter(())
        return itertools.islice(self._inputs[0]._iter_flat(), self._count, None)


SHARD_HINT = -1
"""``shard(SHARD_HINT, SHARD_HINT)``: a placeholder a multi-worker strategy with
``AutoShardPolicy.HINT`` replaces by ``shard(num_workers, worker_index)``."""


class ShardDataset(Dataset):
    """``Dataset.shard``: elements ``index``, ``index + num_shards``, ...

    ``shard(SHARD_HINT, SHARD_HINT)`` is a placeholder (see :data:`SHARD_HINT`,
    :func:`replace_shard_hints`); iterating it unreplaced is an error.
    """

    def __init__(self, input_dataset: Dataset, num_shards: Any, index: Any) -> None:
        super().__init__(input_dataset)
        num = int_arg(num_shards, "num_shards")
        idx = int_arg(index, "index")
        self._num: int | None
        self._index: int | None
        if num == SHARD_HINT and idx == SHARD_HINT:
            self._num = self._index = None
            return
        if num <= 0:
            raise errors.InvalidArgumentError(
                f"shard: num_shards must be greater than zero, got num_shards={num}"
            )
        if not 0 <= idx < num:
            raise errors.InvalidArgumentError(
                f"shard: index must be in [0, {num}) for num_shards={num}, got index={idx}"
            )
        self._num, self._index = num, idx

    @property
    def is_hint(self) -> bool:
        """Whether this is a ``shard(SHARD_HINT, SHARD_HINT)`` placeholder."""
        return self._num is None

    def _shards(self) -> tuple[int, int]:
        if self._num is None or self._index is None:
            raise errors.InvalidArgumentError(
                "shard(SHARD_HINT, SHARD_HINT) is a placeholder: MultiWorkerMirroredStrategy "
                "replaces it with auto_shard_policy=HINT; elsewhere give num_shards and index"
            )
        return self._num, self._index

    def _cardinality(self) -> int:
        n = self._inputs[0]._cardinality()
        if n in (INFINITE_CARDINALITY, UNKNOWN_CARDINALITY):
            return n
        if self._num is None:
            return UNKNOWN_CARDINALITY
        return n // self._num + (1 if self._index < n % self._num else 0)

    def _has_plan(self) -> bool:
        return self._num is not None and self._inputs[0]._has_plan()

    def _plan(self) -> _Plan:
        num, index = self._shards()
        inner = self._inputs[0]._plan()
        return _Plan(inner.gather, _shard_chunks(inner.chunks, num, index), inner.rows)

    def _iter_elements(self) -> Iterator[tuple[Any, ...]]:
        num, index = self._shards()
        return itertools.islice(self._inputs[0]._iter_flat(), index, None, num)


def replace_shard_hints(dataset: Dataset, num_shards: int, index: int) -> tuple[Dataset, int]:
    """``dataset`` with every ``shard(SHARD_HINT, SHARD_HINT)`` made ``shard(num_shards, index)``.

    The nodes on the way to a placeholder are copied (the others shared);
    ``dataset`` itself is not changed.  Returns the new dataset and how many
    placeholders were replaced.

    Example:
        >>> import psflow as pf
        >>> ds = pf.data.Dataset.range(6).shard(SHARD_HINT, SHARD_HINT)
        >>> shard, count = replace_shard_hints(ds, 2, 1)
        >>> [int(x) for x in shard], count
        ([1, 3, 5], 1)
    """
    import copy

    inputs = [replace_shard_hints(d, num_shards, index) for d in dataset._inputs]
    count = sum(c for _, c in inputs)
    hint = isinstance(dataset, ShardDataset) and dataset.is_hint
    if not count and not hint:
        return dataset, 0
    node = copy.copy(dataset)
    node._inputs = tuple(d for d, _ in inputs)
    if hint:
        node._num, node._index = num_shards, index
        count += 1
    return node, count


# -- cache ------------------------------------------------------------------------------------


class CacheDataset(Dataset):
    """``Dataset.cache``: the first complete pass is kept in memory and replayed.

    Over an index plan only the row positions are kept (the source arrays
    never change). A pass abandoned half-way caches nothing, as in TF.
    The cache is per process: a pickled copy starts empty.
    """

    def __init__(self, input_dataset: Dataset, filename: str) -> None:
        super().__init__(input_dataset)
        if not isinstance(filename, str):
            raise TypeError(f"cache: filename must be a string, got {filename!r}")
        if filename:
            logger.warning(
                "Dataset.cache(%r): psflow caches in memory; nothing is written to the file",
                filename,
            )
        self._elements: list[tuple[Any, ...]] | None = None
        self._chunks: tuple[Any, list[np.ndarray], int] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_elements"] = None
        state["_chunks"] = None
        return state

    def _has_plan(self) -> bool:
        return self._inputs[0]._has_plan()

    def _plan(self) -> _Plan:
        cached = self._chunks
        if cached is not None:
            gather, chunks, rows = cached
            return _Plan(gather, iter(chunks), rows)
        inner = self._inputs[0]._plan()

        def record() -> Iterator[np.ndarray]:
            seen = []
            for c in inner.chunks:
                seen.append(c)
                yield c
            if self._chunks is None:
                self._chunks = (inner.gather, seen, inner.rows)

        return _Plan(inner.gather, record(), inner.rows)

    def _iter_elements(self) -> Iterator[tuple[Any, ...]]:
        if self._elements is not None:
            return iter(self._elements)
        src = self._inputs[0]._iter_flat()

        def record() -> Iterator[tuple[Any, ...]]:
            seen = []
            for e in src:
                seen.append(e)
                yield e
            if self._elements is None:
                self._elements = seen

        return record()


# -- combining --------------------------------------------------------------------------------


class ZipDataset(Dataset):
    """``Dataset.zip``: one element from each input, in the inputs' nest structure."""

    def __init__(self, datasets: Any) -> None:
        if isinstance(datasets, list):
            raise TypeError(f"zip needs a tuple or dict of datasets, not a list: {datasets!r}")
        leaves = structure.flatten(datasets)
        for d in leaves:
            if not isinstance(d, Dataset):
                raise TypeError(f"zip needs datasets, got {d!r}")
        super().__init__(*leaves)
        self._structure = datasets

    def _derive_spec(self, *specs: Any) -> Any:
        return structure.pack(self._structure, list(specs))

    def _cardinality(self) -> int:
        ns = [d._cardinality() for d in self._inputs]
        if UNKNOWN_CARDINALITY in ns:
            return UNKNOWN_CARDINALITY
        finite = [n for n in ns if n != INFINITE_CARDINALITY]
        return min(finite) if finite else INFINITE_CARDINALITY

    def _iter_elements(self) -> Iterator[tuple[Any, ...]]:
        iters = [d._iter_flat() for d in self._inputs]
        if len(iters) == 1:
            return iters[0]
        chain = itertools.chain.from_iterable
        return (tuple(chain(parts)) for parts in zip(*iters))


class ConcatenateDataset(Dataset):
    """``Dataset.concatenate``: one input after the other."""

    def __init__(self, first: Dataset, second: Dataset) -> None:
        if not isinstance(second, Dataset):
            raise TypeError(f"concatenate needs a dataset, got {second!r}")
        super().__init__(first, second)
        a, b = first.element_spec, second.element_spec
        ok = structure.same_structure(a, b) and all(
            x.dtype == y.dtype for x, y in zip(structure.flatten(a), structure.flatten(b))
        )
        if not ok:
            raise TypeError(f"Incompatible dataset elements: {a!r} vs. {b!r}")

    def _derive_spec(self, a: Any, b: Any) -> Any:
        common = [
            x.most_specific_common(y) for x, y in zip(structure.flatten(a), structure.flatten(b))
        ]
        return structure.pack(a, common)

    def _cardinality(self) -> int:
        ns = [d._cardinality() for d in self._inputs]
        if INFINITE_CARDINALITY in ns:
            return INFINITE_CARDINALITY
        if UNKNOWN_CARDINALITY in ns:
            return UNKNOWN_CARDINALITY
        return sum(ns)

    def _iter_elements(self) -> Iterator[tuple[Any, ...]]:
        first = self._inputs[0]._iter_flat()
        second = self._inputs[1]

        def gen() -> Iterator[tuple[Any, ...]]:
            yield from first
            yield from second._iter_flat()

        return gen()


class EnumerateDataset(Dataset):
    """``Dataset.enumerate``: ``(position, element)`` with an int64 position."""

    def __init__(self, input_dataset: Dataset, start: Any) -> None:
        super().__init__(input_dataset)
        self._start = int_arg(start, "start")

    def _derive_spec(self, spec: Any) -> Any:
        return (TensorSpec((), dtypes.int64), spec)

    def _iter_elements(self) -> Iterator[tuple[Any, ...]]:
        src = self._inputs[0]._iter_flat()
        return ((np.asarray(i, dtype=np.int64), *e) for i, e in enumerate(src, self._start))


class OptionsDataset(Dataset):
    """``Dataset.with_options``: the input unchanged, with options merged in."""

    def __init__(self, input_dataset: Dataset, options: Options) -> None:
        if not isinstance(options, Options):
            raise TypeError(f"with_options needs psflow.data.Options, got {options!r}")
        super().__init__(input_dataset)
        self._options = self._options.merge(options)

    def _has_plan(self) -> bool:
        return self._inputs[0]._has_plan()

    def _plan(self) -> _Plan:
        return self._inputs[0]._plan()

    def _iter_elements(self) -> Iterator[tuple[Any, ...]]:
        return self._inputs[0]._iter_flat()


class AssertCardinalityDataset(Dataset):
    """``experimental.assert_cardinality``: declares the size and checks it while iterating."""

    def __init__(self, input_dataset: Dataset, expected: Any) -> None:
        super().__init__(input_dataset)
        self._expected = int_arg(expected, "expected_cardinality")

    def _cardinality(self) -> int:
        return self._expected

    def _check(self, count: int, ended: bool) -> None:
        n = self._expected
        if n == INFINITE_CARDINALITY and ended:
            raise errors.FailedPreconditionError(
                f"Input dataset was expected to be infinite but ended after {count} elements"
            )
        if n >= 0 and (count > n or (ended and count < n)):
            got = f"at least {count}" if not ended else str(count)
            raise errors.FailedPreconditionError(
                f"Input dataset was expected to contain {n} elements but contained {got}"
            )

    def _iter_elements(self) -> Iterator[tuple[Any, ...]]:
        src = self._inputs[0]._iter_flat()

        def gen() -> Iterator[tuple[Any, ...]]:
            count = 0
            for e in src:
                count += 1
                self._check(count, ended=False)
                yield e
            self._check(count, ended=True)

        return gen()

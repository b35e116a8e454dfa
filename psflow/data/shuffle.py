"""``Dataset.shuffle``: TensorFlow's shuffle buffer with TensorFlow's seeding rules.

The buffer algorithm is TF's: a queue of up to ``buffer_size`` elements in
arrival order; each output is a uniformly drawn slot, whose place the oldest
element takes. Over an input with an index plan the same algorithm shuffles
row positions instead of elements, with the same draws, so both paths give
the same order.

Example:
    >>> import psflow as pf
    >>> ds = pf.data.Dataset.range(6).shuffle(6, seed=3)
    >>> sorted(int(x) for x in ds)
    [0, 1, 2, 3, 4, 5]
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from psflow import errors
from psflow import random as pf_random
from psflow.data.dataset import (
    INFINITE_CARDINALITY,
    UNKNOWN_CARDINALITY,
    Dataset,
    _Plan,
    int_arg,
)

_MASK63 = (1 << 63) - 1
_DEFAULT_GLOBAL_SEED = 87654321  # TensorFlow's graph seed when only an op seed is given
_DRAW_BLOCK = 1024
_COUNTER_LOCK = threading.Lock()


def buffer_shuffle(
    source: Iterator[Any], buffer_size: int | None, rng: np.random.Generator
) -> Iterator[Any]:
    """TensorFlow's shuffle buffer over any stream (``buffer_size=None``: unbounded).

    The buffer is a queue in arrival order. Before each output it is topped up
    to ``buffer_size`` from ``source``; then a slot is drawn uniformly, its
    element is produced, and the oldest element moves into that slot (TF's
    swap with the front). The draws depend only on the buffer's fill, never on
    the data, so shuffling row positions and shuffling elements agree.
    """
    buf: list[Any] = []
    head = 0
    draws: list[int] = []
    exhausted = False
    while True:
        # Phase 1: top up the buffer from the input.
        while not exhausted and (buffer_size is None or len(buf) - head < buffer_size):
            try:
                buf.append(next(source))
            except StopIteration:
                exhausted = True
        size = len(buf) - head
        if size == 0:
            return
        # Phase 2: produce a uniformly chosen element; the front fills its slot.
        if not draws:
            draws = rng.integers(0, _MASK63, _DRAW_BLOCK, dtype=np.int64).tolist()
        pos = head + draws.pop() % size
        out = buf[pos]
        buf[pos] = buf[head]
        buf[head] = None
        head += 1
        if head >= 4096 and 2 * head >= len(buf):  # drop the consumed front now and then
            del buf[:head]
            head = 0
        yield out


def _positions(chunks: Iterator[np.ndarray]) -> Iterator[int]:
    for c in chunks:
        yield from c.tolist()


def _rechunk(positions: Iterator[int], rows: int) -> Iterator[np.ndarray]:
    while True:
        block = list(itertools.islice(positions, rows))
        if not block:
            return
        yield np.array(block, dtype=np.int64)


def _seed_key(seed: Any) -> tuple[int, int, int]:
    """The entropy a shuffle derives its per-pass generators from (TF's seeding rules).

    Op seed given: (global seed or TF's default, op seed), the same for every
    dataset built with it. Only a global seed: a draw from the global stream,
    so successive shuffles differ but a rerun repeats them. Neither: fresh entropy.
    """
    glob = pf_random.get_global_seed()
    if seed is not None:
        s = int_arg(seed, "seed")
        g = glob if glob is not None else _DEFAULT_GLOBAL_SEED
        return (g & _MASK63, s & _MASK63, 1)
    if glob is not None:
        return (int(pf_random.new_generator().integers(0, _MASK63)), 0, 2)
    return (int(np.random.SeedSequence().entropy) & _MASK63, 0, 3)


class ShuffleDataset(Dataset):
    """``Dataset.shuffle``: TF's buffer shuffle, reseeded per pass if asked."""

    def __init__(
        self, input_dataset: Dataset, buffer_size: Any, seed: Any, reshuffle: bool
    ) -> None:
        super().__init__(input_dataset)
        b = int_arg(buffer_size, "buffer_size")
        if b == UNKNOWN_CARDINALITY:
            n = input_dataset._cardinality()
            if n == INFINITE_CARDINALITY:
                raise errors.InvalidArgumentError(
                    "shuffle: buffer_size UNKNOWN_CARDINALITY (-2) buffers the whole input, "
                    "which is infinite here"
                )
            self._buffer: int | None = None if n == UNKNOWN_CARDINALITY else max(n, 1)
        elif b <= 0:
            raise errors.InvalidArgumentError(
                f"shuffle: buffer_size must be greater than zero or UNKNOWN_CARDINALITY (-2), "
                f"got {b}"
            )
        else:
            self._buffer = b
        self._reshuffle = bool(reshuffle)
        self._seed = _seed_key(seed)
        self._passes = 0

    def _replay_obstacle(self) -> str | None:
        if self._seed[2] == 3:  # fresh entropy: another process shuffles otherwise
            return f"Dataset.shuffle({self._buffer}) without a seed"
        return super()._replay_obstacle()

    def _next_rng(self) -> np.random.Generator:
        with _COUNTER_LOCK:
            n = self._passes
            if self._reshuffle:
                self._passes += 1
        return np.random.default_rng(np.random.SeedSequence([*self._seed, n]))

    def _has_plan(self) -> bool:
        return self._inputs[0]._has_plan()

    def _plan(self) -> _Plan:
        rng = self._next_rng()
        inner = self._inputs[0]._plan()
        order = buffer_shuffle(_positions(inner.chunks), self._buffer, rng)
        return _Plan(inner.gather, _rechunk(order, inner.rows), inner.rows)

    def _iter_elements(self) -> Iterator[tuple[Any, ...]]:
        rng = self._next_rng()
        return buffer_shuffle(self._inputs[0]._iter_flat(), self._buffer, rng)

"""Reduce-scatter fused with the update it feeds: each rank updates one shard of all copies.

Synchronous data-parallel training all-reduces the gradients and then has every
replica apply the same elementwise update to its own copy of the weights.  On
one host, where every replica's memory is addressable from every thread, the
same result needs less memory traffic when the work is split by *elements*
instead of by replica:

* the flattened tensors (all of them, end to end) are split into N contiguous
  ranges, one per rank (split at multiples of 16 elements);
* rank r sums its range over every replica's arrays, in rank order, into a
  small scratch buffer, one sub-chunk at a time (so the sum stays in cache),
* and hands each summed sub-chunk to its ``update(index, lo, hi, summed)``
  callback, which applies it to every replica's copy of tensor ``index``,
  elements ``lo:hi``.

Each element's sum is computed once, by one rank, so every copy receives the
same values (bitwise), as after a ring all-reduce.  No reduced gradient is ever
written out whole, and each copy's weights are read and written once.  Rank r
reads its range from the N-1 other replicas and writes that range into their
N-1 copies: ``2(N-1)/N`` of the buffer, as the ring sends.

A rank returns once every rank has finished, since the other ranks read its
arrays and write its copies until then.  NumPy arrays only (the callers fall
back to all-reduce then update for GPU replicas).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from psflow import errors
from psflow.collective.arrays import NumpyKernels
from psflow.collective.job import Job
from psflow.collective.session import Session

Update = Callable[[int, int, int, Any], None]

ALIGN = 16  # elements: rank ranges split the concatenation at multiples of 16
SUB_CHUNK_BYTES = 2 << 20  # bytes summed per unit: few Python calls, about one L2 of data


class ReduceUpdateJob(Job):
    """One fused reduce-scatter and update; see the module docstring.

    Args:
        rows: ``rows[q]`` is replica ``q``'s list of NumPy arrays (same shapes and
            dtypes on every replica).
        updates: ``updates[q]`` is replica ``q``'s callback; rank ``r`` calls its own.
        sub_chunk_bytes: bytes summed per unit (default: ``SUB_CHUNK_BYTES``).

    Raises:
        InvalidArgumentError: the replicas' arrays differ in count, shape or dtype,
            or are not NumPy arrays.
    """

    def __init__(
        self,
        rows: list[list[Any]],
        updates: list[Update],
        sub_chunk_bytes: int | None = None,
    ) -> None:
        self.num_ranks = n = len(rows)
        self.kernels = NumpyKernels()
        sub_chunk_bytes = sub_chunk_bytes or SUB_CHUNK_BYTES
        _check_rows(rows)
        self._flat = [[a.reshape(-1) for a in row] for row in rows]  # read only: a copy is fine
        self._updates = updates
        first = self._flat[0]
        self.nbytes = sum(a.nbytes for a in first)
        self._pieces, self._bytes, largest = _plan(
            tuple(a.size for a in first), tuple(a.itemsize for a in first), n, sub_chunk_bytes
        )
        dtypes = {a.dtype for a in first}
        self._scratch = [{dt: np.empty(largest, dt) for dt in dtypes} for _ in range(n)]

    def units(self, rank: int) -> int:
        """One unit per summed sub-chunk of ``rank``'s range."""
        return len(self._pieces[rank])

    def program(self, session: Session, rank: int) -> Iterator[None]:
        """Sums and updates ``rank``'s range, one sub-chunk per ``yield``."""
        flat, update, n = self._flat, self._updates[rank], self.num_ranks
        scratch = self._scratch[rank]
        for k, lo, hi in self._pieces[rank]:
            first = flat[0][k]
            summed = scratch[first.dtype][: hi - lo]
            if n == 1:
                np.copyto(summed, first[lo:hi])
            else:
                np.add(first[lo:hi], flat[1][k][lo:hi], out=summed)
                for q in range(2, n):
                    summed += flat[q][k][lo:hi]
            update(k, lo, hi, summed)
            yield
        mine = self._bytes[rank]
        for q in range(n):
            if q != rank:
                session.sent(rank, q, mine)  # replica q's part of this range, read here
        session.sent(rank, rank, mine * (n - 1))  # the updated range, written into N-1 copies

    def result(self, rank: int) -> None:
        """Nothing: the updates are the result."""
        return None


@functools.lru_cache(maxsize=64)
def _plan(
    sizes: tuple[int, ...], itemsizes: tuple[int, ...], n: int, sub_chunk_bytes: int
) -> tuple[list[list[tuple[int, int, int]]], list[int], int]:
    """Each rank's pieces ``(tensor, lo, hi)``, its bytes, and the largest piece; the
    same every step of a training loop, so computed once per signature."""
    total = sum(sizes)
    bounds = [min(total, (total * r // n + ALIGN - 1) // ALIGN * ALIGN) for r in range(n)]
    bounds.append(total)
    starts = [0, *itertools.accumulate(sizes)]
    all_pieces: list[list[tuple[int, int, int]]] = []
    all_bytes: list[int] = []
    for r in range(n):
        pieces, nbytes = [], 0
        lo_r, hi_r = bounds[r], bounds[r + 1]
        for k, (size, itemsize) in enumerate(zip(sizes, itemsizes)):
            lo, hi = max(lo_r, starts[k]) - starts[k], min(hi_r, starts[k] + size) - starts[k]
            if lo >= hi:
                continue
            step = max(ALIGN, sub_chunk_bytes // itemsize // ALIGN * ALIGN)
            pieces.extend((k, a, min(a + step, hi)) for a in range(lo, hi, step))
            nbytes += (hi - lo) * itemsize
        all_pieces.append(pieces)
        all_bytes.append(nbytes)
    largest = max((hi - lo for ps in all_pieces for _, lo, hi in ps), default=0)
    return all_pieces, all_bytes, largest


def _check_rows(rows: list[list[Any]]) -> None:
    first = rows[0]
    for q, row in enumerate(rows):
        if len(row) != len(first):
            raise errors.InvalidArgumentError(
                f"replica {q} passed {len(row)} arrays, replica 0 passed {len(first)}"
            )
        for i, (a, b) in enumerate(zip(row, first)):
            if not isinstance(a, np.ndarray):
                raise errors.InvalidArgumentError(
                    f"reduce_and_update takes NumPy arrays; replica {q} passed "
                    f"{type(a).__name__} at position {i}"
                )
            if a.shape != b.shape or a.dtype != b.dtype:
                raise errors.InvalidArgumentError(
                    f"replica {q}'s array {i} is {a.dtype}{list(a.shape)}, replica 0's is "
                    f"{b.dtype}{list(b.shape)}"
                )

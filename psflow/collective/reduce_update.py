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

A replica's gradient may also be a matrix weight's
:class:`~psflow.framework.product_gradient.ProductGradient` (its two factors):
its ranges are then whole rows, and rank r multiplies out its rows of every
replica's product into scratch, one sub-chunk at a time, and sums them there in
rank order, so the replicas' products are never written out whole. Each row of a
product is what the replica's whole product gives it (one BLAS call over a block
of its rows; OpenBLAS's rows do not depend on how many a call makes), so the sum
is the one the replicas' written-out products would give.
(Stacking the replicas' factors into one product over the whole batch was as
fast, 2 and 4 replicas at batch 64 and 256, and rounds otherwise.)
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
from psflow.framework.product_gradient import ProductGradient, multiplied_out

Update = Callable[[int, int, int, Any], None]

ALIGN = 16  # elements: rank ranges split the concatenation at multiples of 16
SUB_CHUNK_BYTES = 2 << 20  # bytes summed per unit: few Python calls, about one L2 of data


class ReduceUpdateJob(Job):
    """One fused reduce-scatter and update; see the module docstring.

    Args:
        rows: ``rows[q]`` is replica ``q``'s list of NumPy arrays or
            :class:`ProductGradient` of NumPy factors (the same shapes, dtypes and
            kinds on every replica).
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
        rows = _same_kinds(rows)
        _check_rows(rows)
        # read only: a copy is fine; a product stays as its factors
        self._flat = [
            [a if type(a) is ProductGradient else a.reshape(-1) for a in row] for row in rows
        ]
        self._updates = updates
        first = rows[0]
        sizes = tuple(int(np.prod(a.shape)) for a in first)
        itemsizes = tuple(np.dtype(a.dtype).itemsize for a in first)
        self.nbytes = sum(size * item for size, item in zip(sizes, itemsizes))
        # a product's pieces are whole rows of its weight (0: an array's, any 16 elements)
        widths = tuple(a.shape[1] if type(a) is ProductGradient else 0 for a in first)
        self._pieces, self._bytes, largest = _plan(sizes, itemsizes, widths, n, sub_chunk_bytes)
        dtypes = {np.dtype(a.dtype) for a in first}
        # a second buffer per dtype for products (the next replica's rows, added to the first)
        spare = any(type(a) is ProductGradient for a in first) and n > 1
        self._scratch = [
            {dt: (np.empty(largest, dt), np.empty(largest if spare else 0, dt)) for dt in dtypes}
            for _ in range(n)
        ]

    def units(self, rank: int) -> int:
        """One unit per summed sub-chunk of ``rank``'s range."""
        return len(self._pieces[rank])

    def program(self, session: Session, rank: int) -> Iterator[None]:
        """Sums and updates ``rank``'s range, one sub-chunk per ``yield``."""
        flat, update, n = self._flat, self._updates[rank], self.num_ranks
        scratch = self._scratch[rank]
        for k, lo, hi in self._pieces[rank]:
            first = flat[0][k]
            buffers = scratch[np.dtype(first.dtype)]
            summed = buffers[0][: hi - lo]
            if type(first) is ProductGradient:
                _sum_product_rows([row[k] for row in flat], lo, hi, summed, buffers[1])
            elif n == 1:
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


def _sum_product_rows(
    products: list[ProductGradient], lo: int, hi: int, summed: Any, spare: Any
) -> None:
    """Elements ``lo:hi`` (whole rows) of the replicas' products, summed in rank order into
    ``summed``: each replica's rows multiplied out by one single-threaded BLAS call, the
    next one's into ``spare`` and added."""
    from psflow.ops import kernel_pool

    width = products[0].shape[1]
    r0, r1 = lo // width, hi // width
    out = summed.reshape(r1 - r0, width)
    with kernel_pool.blas_held_to_one():
        products[0].rows(r0, r1, out=out)
        if len(products) > 1:
            other = spare[: hi - lo].reshape(r1 - r0, width)
            for p in products[1:]:
                out += p.rows(r0, r1, out=other)


@functools.lru_cache(maxsize=64)
def _plan(
    sizes: tuple[int, ...],
    itemsizes: tuple[int, ...],
    widths: tuple[int, ...],
    n: int,
    sub_chunk_bytes: int,
) -> tuple[list[list[tuple[int, int, int]]], list[int], int]:
    """Each rank's pieces ``(tensor, lo, hi)``, its bytes, and the largest piece; the
    same every step of a training loop, so computed once per signature. A tensor with
    a ``widths`` entry (a product's row width; 0 for an array) has pieces of whole rows:
    the rank ranges' bounds inside it rounded down to a row, alike on both sides."""
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
            width = widths[k]
            if width:  # whole rows (a product's size is a multiple of its row width)
                lo, hi = lo // width * width, hi // width * width
            if lo >= hi:
                continue
            unit = width or ALIGN
            step = max(unit, sub_chunk_bytes // itemsize // unit * unit)
            pieces.extend((k, a, min(a + step, hi)) for a in range(lo, hi, step))
            nbytes += (hi - lo) * itemsize
        all_pieces.append(pieces)
        all_bytes.append(nbytes)
    largest = max((hi - lo for ps in all_pieces for _, lo, hi in ps), default=0)
    return all_pieces, all_bytes, largest


def _same_kinds(rows: list[list[Any]]) -> list[list[Any]]:
    """``rows`` with a gradient multiplied out where another replica's at its position is an
    array (a replica with no gradient there passes zeros)."""
    if not any(type(a) is ProductGradient for row in rows for a in row):
        return rows
    width = min(len(row) for row in rows)
    mixed = {i for i in range(width) if len({type(row[i]) is ProductGradient for row in rows}) > 1}
    if not mixed:
        return rows
    return [[multiplied_out(a) if i in mixed else a for i, a in enumerate(row)] for row in rows]


def _check_rows(rows: list[list[Any]]) -> None:
    first = rows[0]
    for q, row in enumerate(rows):
        if len(row) != len(first):
            raise errors.InvalidArgumentError(
                f"replica {q} passed {len(row)} arrays, replica 0 passed {len(first)}"
            )
        for i, (a, b) in enumerate(zip(row, first)):
            factors = type(a) is ProductGradient
            if not (
                isinstance(a, np.ndarray)
                or (
                    factors
                    and isinstance(a.left, np.ndarray)
                    and isinstance(a.right, np.ndarray)
                    and a.left.dtype == a.right.dtype
                )
            ):
                raise errors.InvalidArgumentError(
                    f"reduce_and_update takes NumPy arrays; replica {q} passed "
                    f"{type(a).__name__} at position {i}"
                )
            if a.shape != b.shape or a.dtype != b.dtype:
                raise errors.InvalidArgumentError(
                    f"replica {q}'s array {i} is {a.dtype}{list(a.shape)}, replica 0's is "
                    f"{b.dtype}{list(b.shape)}"
                )

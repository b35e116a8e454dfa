"""Splitting a CPU kernel's batch into cache-sized chunks, run on every core this thread may use.

The window kernels (convolution, pooling) are memory-bound when written as
whole-batch NumPy passes: each pass streams an ``(N, OH, OW, C)`` array through
memory, and NumPy's element-wise loops use one core. Run chunk by chunk, every
pass of a chunk finds its operands in cache, and the chunks run side by side on
a small thread pool (NumPy and BLAS release the GIL inside their loops).

Determinism: the chunks depend on the shapes only (:func:`chunk_bounds`), never
on the thread count, and every partial result (a weight or bias gradient summed
over the batch) is added up in chunk order by the caller. The same shapes give
the same bits whichever thread ran which chunk, and on a machine with another
number of cores.

Width: a thread's kernels use :func:`width` threads: the process's BLAS budget
(:func:`psflow.thread_budget.process_threads`) unless the thread narrowed its own
share (:func:`set_thread_width`; MirroredStrategy's replica threads do, as they
narrow their BLAS threads). Chunks make no BLAS calls: the GEMMs run whole, on
BLAS's own threads (OpenBLAS's count is process-wide in NumPy's wheels, so GEMMs
called from several threads at once would each start a pool as wide as the
machine).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

CHUNK_BYTES = 256 * 1024
"""Bytes of working set a chunk aims for: a fraction of a core's L2 cache, so that a
chunk's input, output and temporaries stay in cache across the kernel's passes."""

_local = threading.local()  # per thread: ``width``, set by set_thread_width
_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_width = 0


def chunk_bounds(
    items: int, bytes_per_item: int, target: int = CHUNK_BYTES
) -> list[tuple[int, int]]:
    """``[lo, hi)`` ranges covering ``range(items)``, each about ``target`` bytes of work.

    A function of its arguments only (never of the thread count), so a split, and
    the order partial sums are added in, is the same on every run and machine.

    Example:
        >>> chunk_bounds(10, 100, target=400)
        [(0, 4), (4, 8), (8, 10)]
    """
    per = max(1, target // max(1, bytes_per_item))
    return [(lo, min(lo + per, items)) for lo in range(0, items, per)]


def set_thread_width(threads: int | None) -> None:
    """Limits the kernels called from this thread to ``threads`` threads (None: the default)."""
    _local.width = None if threads is None else max(1, int(threads))


def width() -> int:
    """The threads a kernel called from this thread may use."""
    own = getattr(_local, "width", None)
    if own is not None:
        return own
    from psflow.thread_budget import process_threads

    return max(1, process_threads())


def _executor(threads: int) -> ThreadPoolExecutor:
    """The shared pool, with at least ``threads`` workers (the caller is one more)."""
    global _pool, _pool_width
    with _pool_lock:
        if _pool is None or _pool_width < threads:
            old = _pool
            _pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="psflow-kernel")
            _pool_width = threads
            if old is not None:
                old.shutdown(wait=False)
        return _pool


def run_chunks(fn: Callable[[int, int], T], bounds: Sequence[tuple[int, int]]) -> list[T]:
    """``[fn(lo, hi) for lo, hi in bounds]``, spread over :func:`width` threads.

    ``fn`` must write disjoint outputs per chunk and make no BLAS call; its
    return values come back in chunk order (for the caller to sum in that order).

    Raises:
        The exception of a failed chunk (the calling thread's first), after every
        thread's chunks ended.
    """
    threads = min(width(), len(bounds))
    if threads <= 1:
        return [fn(lo, hi) for lo, hi in bounds]
    return _spread(_executor(threads - 1), fn, bounds, threads)


def _forget_pool_in_child() -> None:
    # a forked child has the pool object but not its threads: it starts its own when needed
    global _pool, _pool_width
    _pool, _pool_width = None, 0


if hasattr(os, "register_at_fork"):  # not on Windows
    os.register_at_fork(after_in_child=_forget_pool_in_child)


def _spread(
    pool: ThreadPoolExecutor,
    fn: Callable[[int, int], T],
    bounds: Sequence[tuple[int, int]],
    threads: int,
) -> list[T]:
    # ``threads`` interleaved strands of chunks; the caller runs the first itself
    results: list[Any] = [None] * len(bounds)

    def strand(first: int) -> None:
        for i in range(first, len(bounds), threads):
            results[i] = fn(*bounds[i])

    futures = [pool.submit(strand, s) for s in range(1, threads)]
    error: BaseException | None = None
    try:
        strand(0)
    except BaseException as e:  # reported after the other strands ended
        error = e
    for f in futures:
        e = f.exception()
        if e is not None and error is None:
            error = e
    if error is not None:
        raise error
    return results

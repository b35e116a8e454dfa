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
narrow their BLAS threads). Threads claim chunks one at a time, so a thread
descheduled on a busy machine holds up one chunk, not a fixed share.

Products (:func:`matmul`) are cut the same way into single-threaded BLAS calls,
with the BLAS held to one thread meanwhile: OpenBLAS's count is process-wide in
NumPy's wheels, and its own threads wait for their slowest member spinning.
:func:`run_chunks` is for chunks that make no BLAS call.
"""

from __future__ import annotations

import functools
import itertools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from psflow.ops import kernel_team

T = TypeVar("T")

CHUNK_BYTES = 256 * 1024
"""Bytes of working set a chunk aims for: a fraction of a core's L2 cache, so that a
chunk's input, output and temporaries stay in cache across the kernel's passes."""


class _Width(threading.local):
    """Per thread: ``width``, set by :func:`set_thread_width` (None: the process's)."""

    def __init__(self) -> None:
        self.width: int | None = None


_local = _Width()
_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_width = 0
_process_width: int | None = None  # the process's budget, read on first use
_team_now: kernel_team.Team | None = None  # the kernels' threads (the executor is the fallback)


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
    own = _local.width
    if own is not None:
        return own
    global _process_width
    if _process_width is None:  # read once: the budget is set when the process starts
        from psflow.thread_budget import process_threads

        _process_width = max(1, process_threads())
    return _process_width


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
        The exception of a failed chunk, after every thread stopped claiming chunks.
    """
    threads = min(width(), len(bounds))
    if threads <= 1:
        return [fn(lo, hi) for lo, hi in bounds]
    return _spread(fn, bounds, threads)


def _forget_pool_in_child() -> None:
    # a forked child has the pool object but not its threads: it starts its own when needed
    global _pool, _pool_width, _process_width, _team_now
    _pool, _pool_width, _process_width, _team_now = None, 0, None, None


if hasattr(os, "register_at_fork"):  # not on Windows
    os.register_at_fork(after_in_child=_forget_pool_in_child)


def _team(helpers: int) -> kernel_team.Team:
    """The shared team, with at least ``helpers`` threads."""
    global _team_now
    team = _team_now
    if team is not None and team.helpers >= helpers:  # every call after the first
        return team
    with _pool_lock:
        if _team_now is None or _team_now.helpers < helpers:
            old = _team_now
            _team_now = kernel_team.Team(helpers)
            if old is not None:
                old.close()
        return _team_now


def _spread(
    fn: Callable[[int, int], T], bounds: Sequence[tuple[int, int]], threads: int
) -> list[T]:
    # Each thread claims the next chunk until none is left (the caller is one of them): on a
    # shared machine a descheduled thread then holds up one chunk, not a fixed share of them.
    # Which thread ran a chunk changes nothing: results are kept by chunk index.
    results: list[Any] = [None] * len(bounds)
    claims = itertools.count()  # next() on it is atomic under the GIL
    failed: list[BaseException] = []

    def work() -> None:
        while not failed:
            i = next(claims)
            if i >= len(bounds):
                return
            try:
                results[i] = fn(*bounds[i])
            except BaseException as e:  # the others stop claiming; raised by the caller
                failed.append(e)
                return

    # the team (cheap to wake); the executor while another thread has the team
    if not _team(threads - 1).try_run(work, threads - 1):
        futures = [_executor(threads - 1).submit(work) for _ in range(threads - 1)]
        work()
        for f in futures:
            f.result()
    if failed:
        raise failed[0]
    return results


# -- matrix products ---------------------------------------------------------------------

GEMM_CHUNK_FLOPS = 16_000_000
"""Floating-point operations a GEMM chunk aims for: enough that a chunk's call costs far
more than its dispatch, small enough that a thread descheduled on a busy machine holds
up little of the product."""

GEMM_MAX_CHUNKS = 8
"""The most chunks a GEMM is cut into: each chunk packs its operands again, and the
MLP's b256 product ran 15% slower in 16 chunks than in 4 or 8 on 2 cores."""

GEMM_MIN_SPAN = 256
"""The fewest rows (row cut) or columns (column cut) a chunk of a product gets: each
chunk packs the whole other operand again, which costs about 11 / span of the chunk's
own work on a Haswell core (the MLP's 784-512 product at batch 256 took 20% more CPU
in 8 column chunks than in 2; in 4, 10%). At 128 the 784-512-512-10 MLP's batch-256
step cut its products in 4 and took 3-7% more CPU per step than at 256 (2 chunks per
product, or one per product of a side-by-side pair: still one chunk per core)."""

_blas_state = threading.Lock()
_blas_narrowed = 0  # parallel GEMM sections running now
_blas_before: int | None = None  # the BLAS thread count they narrowed from


def gemm_cut(m: int, k: int, n: int, share: int = 1) -> tuple[str, list[tuple[int, int]]]:
    """How an ``(m, k) @ (k, n)`` product is cut: ``("rows" | "columns" | "sum", bounds)``.

    A function of the shapes (and ``share``, the products run side by side with it)
    only, never of the thread count: a BLAS gives other bits for another cut, so the
    cut fixes them. The sum over ``K`` is cut when it dominates (``K`` at least 8
    times ``M`` and ``N``); otherwise the longer of ``M`` and ``N``, in a power of two
    of chunks (even on 2 or 4 threads) of at least :data:`GEMM_MIN_SPAN` rows or
    columns, divided among the ``share`` products.

    Example:
        >>> gemm_cut(256, 784, 512)
        ('columns', [(0, 256), (256, 512)])
        >>> gemm_cut(784, 256, 512)
        ('rows', [(0, 392), (392, 784)])
        >>> gemm_cut(64, 784, 512)
        ('columns', [(0, 256), (256, 512)])
    """
    kind, bounds = _cut(m, k, n, share)
    return kind, list(bounds)


_cuts: dict[tuple[int, ...], tuple[str, tuple[tuple[int, int], ...]]] = {}


def _cut(m: int, k: int, n: int, share: int = 1) -> tuple[str, tuple[tuple[int, int], ...]]:
    """:func:`gemm_cut` with the bounds as a tuple, worked out once per shape (a step asks
    for the same few shapes every time; the constants are part of the key)."""
    key = (m, k, n, share, GEMM_CHUNK_FLOPS, GEMM_MAX_CHUNKS, GEMM_MIN_SPAN)
    cut = _cuts.get(key)
    if cut is None:
        if len(_cuts) >= 4096:  # bounded where shapes keep changing (one entry each)
            _cuts.clear()
        cut = _cuts[key] = _compute_cut(m, k, n, share)
    return cut


def _compute_cut(m: int, k: int, n: int, share: int) -> tuple[str, tuple[tuple[int, int], ...]]:
    flops = 2 * m * n * k
    if k >= 8 * max(m, n):
        # the summation order: kept as it was (partial sums added in chunk order)
        return "sum", _even(k, min(GEMM_MAX_CHUNKS, flops // GEMM_CHUNK_FLOPS, k // 8))
    kind, along = ("rows", m) if m >= n else ("columns", n)
    return kind, _spans(along, flops, share)


def _spans(along: int, flops: int, share: int = 1) -> tuple[tuple[int, int], ...]:
    """``range(along)`` (rows or columns of a product of ``flops``) in a power of two of
    even chunks, each of at least :data:`GEMM_MIN_SPAN` and :data:`GEMM_CHUNK_FLOPS`,
    divided among ``share`` products run side by side."""
    parts = min(GEMM_MAX_CHUNKS, flops // GEMM_CHUNK_FLOPS, along // GEMM_MIN_SPAN)
    parts //= max(1, share)
    parts = 1 << (parts.bit_length() - 1) if parts > 1 else 1
    return _even(along, parts)


def _even(along: int, parts: int) -> tuple[tuple[int, int], ...]:
    """``range(along)`` in ``parts`` chunks (one where ``parts`` is below 2), the last shorter."""
    if parts < 2:
        return ((0, along),)
    step = -(-along // parts)
    return tuple((lo, min(lo + step, along)) for lo in range(0, along, step))


def row_chunks(m: int, k: int, n: int) -> tuple[tuple[int, int], ...]:
    """The rows of an ``(m, k) @ (k, n)`` product in chunks, for a caller that uses each
    chunk of rows as soon as it is made (an optimizer updating a weight with its gradient's
    rows while they are in cache): as many chunks as :func:`gemm_cut` would make alone,
    always along the rows. A function of the shapes only.

    Example:
        >>> row_chunks(784, 64, 512)
        ((0, 392), (392, 784))
        >>> row_chunks(300, 64, 512)
        ((0, 300),)
    """
    return _spans(m, 2 * m * k * n)


def matmul(a: Any, b: Any) -> Any:
    """``a @ b`` for 2-D NumPy matrices, cut by shape into chunks run on the kernel threads.

    Each chunk is one single-threaded BLAS call (:func:`gemm_cut`): rows of ``a``,
    columns of ``b``, or slices of ``K`` whose partial products are added in chunk
    order. Threads claim chunks one by one, so on a shared machine a descheduled
    thread delays one chunk, where a BLAS's own threads wait for their slowest
    member spinning (a product too small to cut is one call, also on one BLAS
    thread). The cut depends on the shapes only: the same bits with any number of
    threads. Without a BLAS whose thread count can be set (or with one kernel
    thread) it is ``a @ b`` cut the same way, run in this thread.
    """
    if len(_cut(a.shape[0], a.shape[1], b.shape[1])[1]) == 1:
        with blas_held_to_one():  # one chunk: the call matmuls would make, without its setup
            return np.matmul(a, b)
    return matmuls([(a, b)])[0]


def dense(a: Any, w: Any, bias: Any = None, relu: bool = False) -> Any:
    """``relu?(a @ w + bias)`` for NumPy matrices: :func:`matmul`, then the sum and the ReLU.

    Where the product is cut into row or column chunks, the thread that computed a
    chunk adds the bias and applies the ReLU to it at once, while it is in cache, in
    parallel with the other chunks; otherwise they follow the product here. Either
    way the bits are those of :func:`matmul`'s product, then ``+=`` and ``maximum``
    on the whole array (elementwise operations, whoever runs them).
    """
    m, k = a.shape
    n = w.shape[1]
    kind, bounds = _cut(m, k, n)
    if len(bounds) == 1:
        with blas_held_to_one():
            c = np.matmul(a, w)
        _bias_relu(c, bias, relu)
        return c
    if kind == "sum":
        c = matmuls([(a, w)])[0]
        _bias_relu(c, bias, relu)
        return c
    c = np.empty((m, n), dtype=np.result_type(a, w))

    def chunk(lo: int, hi: int) -> None:
        if kind == "rows":
            np.matmul(a[lo:hi], w, out=c[lo:hi])
            _bias_relu(c[lo:hi], bias, relu)
        else:
            np.matmul(a, w[:, lo:hi], out=c[:, lo:hi])
            _bias_relu(c[:, lo:hi], None if bias is None else bias[lo:hi], relu)

    run_gemm_chunks(chunk, bounds)
    return c


def _bias_relu(c: Any, bias: Any, relu: bool) -> None:
    if bias is not None:
        c += bias
    if relu:
        np.maximum(c, 0, out=c)


def matmuls(products: Sequence[tuple[Any, Any]]) -> list[Any]:
    """``[a @ b for a, b in products]``, their chunks run side by side on the kernel threads.

    A layer's backward pass needs two independent products (the input's and the
    weight's gradient): run together, each is cut in half as many chunks as alone
    (:func:`gemm_cut` with ``share``), so fewer chunks pack their operands again,
    and the threads never wait between the two. Each product's bits are those of
    its cut: a function of the shapes and of ``len(products)`` only.
    """
    share = len(products)
    cuts = [_cut(a.shape[0], a.shape[1], b.shape[1], share) for a, b in products]
    if all(len(bounds) == 1 for _, bounds in cuts) and (
        sum(2 * a.shape[0] * a.shape[1] * b.shape[1] for a, b in products) < GEMM_CHUNK_FLOPS
    ):
        # too small to be worth waking a thread (a last layer's pair): one after the other,
        # the calls the general path below makes, without building its tasks
        with blas_held_to_one():
            return [np.matmul(a, b) for a, b in products]
    tasks: list[Callable[[], Any]] = []
    finish: list[Callable[[list[Any]], Any]] = []
    for (a, b), (kind, bounds) in zip(products, cuts):
        m, n = a.shape[0], b.shape[1]
        first = len(tasks)
        if len(bounds) == 1:
            tasks.append(functools.partial(np.matmul, a, b))
            finish.append(lambda done, i=first: done[i])
        elif kind == "sum":
            tasks += [functools.partial(np.matmul, a[:, lo:hi], b[lo:hi]) for lo, hi in bounds]
            finish.append(functools.partial(_add_in_order, first=first, count=len(bounds)))
        else:
            c = np.empty((m, n), dtype=np.result_type(a, b))
            if kind == "rows":
                tasks += [
                    functools.partial(np.matmul, a[lo:hi], b, out=c[lo:hi]) for lo, hi in bounds
                ]
            else:
                tasks += [
                    functools.partial(np.matmul, a, b[:, lo:hi], out=c[:, lo:hi])
                    for lo, hi in bounds
                ]
            finish.append(lambda done, c=c: c)
    # (a product cut in several chunks has at least twice GEMM_CHUNK_FLOPS: never that small)
    done = run_gemm_chunks(lambda i, _: tasks[i](), [(i, i + 1) for i in range(len(tasks))])
    return [f(done) for f in finish]


def _add_in_order(done: list[Any], first: int, count: int) -> Any:
    """The partial products ``done[first:first + count]`` summed in chunk order."""
    total = done[first]
    for p in done[first + 1 : first + count]:
        total += p
    return total


class _Held(threading.local):
    """Per thread: how deep this thread is in :func:`blas_held_to_one` sections."""

    def __init__(self) -> None:
        self.depth = 0


_held = _Held()
_replica_pool: Any = None  # psflow.distribute.replica_pool, once a hold first needs it


def _blas_control() -> Any:
    # psflow.distribute.replica_pool, imported on first use, not with this module
    # (psflow.distribute imports the ops), and kept: an import statement costs ~1.7 us,
    # twice per hold, each product a hold in a replica thread (its functions are looked up
    # on the module, so a test can patch them)
    global _replica_pool
    if _replica_pool is None:
        from psflow.distribute import replica_pool

        _replica_pool = replica_pool
    return _replica_pool


def blas_held_to_one() -> _HeldToOne:
    """Holds the BLAS to one thread inside the block; yields whether it could.

    The products (:func:`matmul`) each hold it while they run. A caller that runs
    many of them in a row (a ``fit`` step runs six for a three-layer MLP) can hold
    it once around them all: a product inside the block then skips the library
    calls that narrow and restore the count (~15 us per product with OpenBLAS).
    Any BLAS call of this thread inside the block runs on one BLAS thread.
    Nested blocks of one thread cost a counter; the count is restored when the
    last block of any thread ends.
    """
    return _HeldToOne()


class _HeldToOne:
    """The block of :func:`blas_held_to_one` (a class, not a generator: a step enters a
    dozen of them, nearly all nested, where a generator's machinery cost more than the
    counter they change)."""

    __slots__ = ("_outer",)

    def __enter__(self) -> bool:
        if _held.depth:  # this thread holds it already: nothing to set or restore
            _held.depth += 1
            self._outer = False
            return True
        pool = _blas_control()
        global _blas_narrowed, _blas_before
        with _blas_state:
            if _blas_narrowed == 0:
                _blas_before = pool.blas_thread_count()
            if _blas_before is None:  # no control over the BLAS's threads: do not fight them
                self._outer = None
                return False
            _blas_narrowed += 1
            if _blas_before != 1:  # a budget of one thread (a PS worker's) has nothing to narrow
                pool.set_blas_thread_count(1)
        _held.depth = 1
        self._outer = True
        return True

    def __exit__(self, *exc: object) -> None:
        outer = self._outer
        if outer is None:
            return
        if not outer:
            _held.depth -= 1
            return
        global _blas_narrowed
        _held.depth = 0
        with _blas_state:
            _blas_narrowed -= 1
            if _blas_narrowed == 0 and _blas_before not in (None, 1):
                _blas_control().set_blas_thread_count(_blas_before)


def run_gemm_chunks(fn: Callable[[int, int], T], bounds: Sequence[tuple[int, int]]) -> list[T]:
    """:func:`run_chunks` for chunks that call BLAS, its own threads held to one meanwhile
    (also with one kernel thread: a BLAS may pick another kernel, another summation order,
    for another thread count, and the bits must not depend on it)."""
    with blas_held_to_one() as held:
        threads = min(width(), len(bounds)) if held else 1
        if threads <= 1:
            return [fn(lo, hi) for lo, hi in bounds]
        return _spread(fn, bounds, threads)

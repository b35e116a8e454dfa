"""One long-lived thread per replica, so ``strategy.run`` does not start threads each step.

Each replica thread runs the step function for its replica; the caller waits
for all of them and gets every result or the first error (by replica order).

Replicas on logical CPU devices share the machine's cores, and each replica's
matrix products go to BLAS. OpenBLAS by default runs every call on all cores
(busy-waiting threads), so N replicas would ask for N x cores threads and
serialize on OpenBLAS's shared thread pool: tens of times slower on a small
machine. A pool given ``blas_threads`` sets the BLAS thread count from each
replica thread with the library's per-thread setter (OpenBLAS's
``openblas_set_num_threads_local``, MKL's ``mkl_set_num_threads_local``). With
OpenMP builds that affects the replica threads only; OpenBLAS built with
pthreads (NumPy's wheels) has a single, process-wide count, so there it also
applies to the other threads of the process.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

# the BLAS libraries that may be loaded: (file name part, per-thread setters, getters)
_BLAS_LIBRARIES = (
    (
        "openblas",
        ("openblas_set_num_threads_local", "scipy_openblas_set_num_threads_local64_"),
        ("openblas_get_num_threads", "scipy_openblas_get_num_threads64_"),
    ),
    ("mkl_rt", ("mkl_set_num_threads_local",), ("mkl_get_max_threads",)),
)
_blas_lock = threading.Lock()
_blas_found: list[tuple[Callable[[int], int], Callable[[], int] | None] | None] = []


def _loaded_libraries() -> list[str]:
    """Paths of the shared libraries mapped into this process (Linux; empty elsewhere)."""
    try:
        with open("/proc/self/maps") as maps:
            return sorted({line.split()[-1] for line in maps if ".so" in line})
    except OSError:
        return []


def _first_symbol(lib: Any, names: tuple[str, ...]) -> Any:
    for name in names:
        fn = getattr(lib, name, None)
        if fn is not None:
            return fn
    return None


def _blas_local_setter() -> tuple[Callable[[int], int], Callable[[], int] | None] | None:
    """The loaded BLAS's per-thread "set threads" function and its "get threads", or None."""
    with _blas_lock:
        if _blas_found:
            return _blas_found[0]
        found = None
        libs = _loaded_libraries()
        for marker, setters, getters in _BLAS_LIBRARIES:
            for path in (p for p in libs if marker in os.path.basename(p).lower()):
                try:
                    lib = ctypes.CDLL(path)
                except OSError:
                    continue
                setter = _first_symbol(lib, setters)
                if setter is None:
                    continue
                setter.argtypes, setter.restype = [ctypes.c_int], ctypes.c_int
                getter = _first_symbol(lib, getters)
                if getter is not None:
                    getter.argtypes, getter.restype = [], ctypes.c_int
                found = (setter, getter)
                logger.debug("per-thread BLAS threads through %s", path)
                break
            if found is not None:
                break
        _blas_found.append(found)
        return found


def available_cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def limit_blas_threads_in_this_thread(threads: int) -> bool:
    """Makes this thread's BLAS calls use at most ``threads`` threads; False if not possible.

    Never raises: without a BLAS that supports per-thread settings it does nothing.
    """
    found = _blas_local_setter()
    if found is None:
        return False
    setter, getter = found
    try:
        current = getter() if getter is not None else threads
        setter(max(1, min(int(threads), int(current))))
    except Exception:  # a foreign library: never let tuning break a replica
        logger.debug("could not set per-thread BLAS threads", exc_info=True)
        return False
    return True


def blas_thread_count() -> int | None:
    """The loaded BLAS's thread count now, or None without a per-thread setter for it."""
    found = _blas_local_setter()
    if found is None or found[1] is None:
        return None
    try:
        return int(found[1]())
    except Exception:  # a foreign library: never let tuning break a kernel
        return None


def set_blas_thread_count(threads: int) -> None:
    """Sets the BLAS's thread count with its per-thread setter (process-wide in OpenBLAS's
    pthreads builds, NumPy's wheels); does nothing without one."""
    found = _blas_local_setter()
    if found is not None:
        try:
            found[0](max(1, int(threads)))
        except Exception:  # a foreign library: never let tuning break a kernel
            logger.debug("could not set BLAS threads", exc_info=True)


class _Result:
    __slots__ = ("error", "value")

    def __init__(self) -> None:
        self.value: Any = None
        self.error: BaseException | None = None


class ReplicaPool:
    """N daemon threads, one per replica; :meth:`run` calls one function on each.

    Args:
        num_replicas: how many threads.
        name: a prefix for the thread names (shows in stack dumps).
        blas_threads: BLAS threads each replica thread may use (None: BLAS's default).
    """

    def __init__(
        self, num_replicas: int, name: str = "replica", blas_threads: int | None = None
    ) -> None:
        self._queues: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(num_replicas)]
        self._threads = [
            threading.Thread(
                target=self._loop, args=(q, blas_threads), name=f"{name}-{i}", daemon=True
            )
            for i, q in enumerate(self._queues)
        ]
        for t in self._threads:
            t.start()
        self._closed = False

    @staticmethod
    def _loop(q: queue.SimpleQueue, blas_threads: int | None) -> None:
        if blas_threads is not None:
            limit_blas_threads_in_this_thread(blas_threads)
            # the window kernels split their batch over as many threads as this replica's share
            from psflow.ops.kernel_pool import set_thread_width

            set_thread_width(blas_threads)
        while True:
            item = q.get()
            if item is None:
                return
            fn, result, done = item
            try:
                result.value = fn()
            except BaseException as e:  # carried back to the caller
                result.error = e
            finally:
                done.put(None)

    @property
    def thread_idents(self) -> list[int]:
        """The ident of each replica's thread, in replica order."""
        return [t.ident or 0 for t in self._threads]

    def run(self, fns: list[Callable[[], Any]]) -> list[Any]:
        """Runs ``fns[i]`` on replica thread ``i``; returns the results in order.

        Raises:
            The first replica's exception (by replica index), after every replica finished.
        """
        outcomes = self.run_collecting(fns)
        for _, error in outcomes:
            if error is not None:
                raise error
        return [value for value, _ in outcomes]

    def run_collecting(
        self, fns: list[Callable[[], Any]]
    ) -> list[tuple[Any, BaseException | None]]:
        """Like :meth:`run`, but returns ``(value, error)`` per replica instead of raising."""
        if self._closed:
            raise RuntimeError("ReplicaPool is closed")
        done: queue.SimpleQueue = queue.SimpleQueue()  # C-level: lighter than a Semaphore
        results = [_Result() for _ in fns]
        for q, fn, res in zip(self._queues, fns, results):
            q.put((fn, res, done))
        for _ in fns:
            done.get()
        return [(res.value, res.error) for res in results]

    def close(self) -> None:
        """Stops the threads (they finish their current item first)."""
        if self._closed:
            return
        self._closed = True
        for q in self._queues:
            q.put(None)

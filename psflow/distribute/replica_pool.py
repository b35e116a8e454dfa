"""One long-lived thread per replica, so ``strategy.run`` does not start threads each step.

Each replica thread runs the step function for its replica; the caller waits
for all of them and gets every result or the first error (by replica order).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any


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
    """

    def __init__(self, num_replicas: int, name: str = "replica") -> None:
        self._queues: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(num_replicas)]
        self._threads = [
            threading.Thread(target=self._loop, args=(q,), name=f"{name}-{i}", daemon=True)
            for i, q in enumerate(self._queues)
        ]
        for t in self._threads:
            t.start()
        self._closed = False

    @staticmethod
    def _loop(q: queue.SimpleQueue) -> None:
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
                done.release()

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
        done = threading.Semaphore(0)
        results = [_Result() for _ in fns]
        for q, fn, res in zip(self._queues, fns, results):
            q.put((fn, res, done))
        for _ in fns:
            done.acquire()
        return [(res.value, res.error) for res in results]

    def close(self) -> None:
        """Stops the threads (they finish their current item first)."""
        if self._closed:
            return
        self._closed = True
        for q in self._queues:
            q.put(None)

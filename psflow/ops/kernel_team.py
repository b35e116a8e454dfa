"""A team of daemon threads that run one function together with their caller.

The CPU kernels hand chunks tens to hundreds of microseconds long to other
threads several times per training step, so the hand-off itself counts. A
``ThreadPoolExecutor`` pays for a future, a queue and a condition per task: about
30 us of CPU per two-thread call on a 2-core machine (the caller's, not hidden),
a tenth of a 784-512-512-10 MLP step's non-GEMM time at batch 64. A team wakes
each of its threads with a lock of its own and waits for each on another: about
12 us per call.

One caller at a time: :meth:`Team.try_run` returns False, having run nothing,
while another thread is using the team (MirroredStrategy's replica threads can
call kernels at once); the caller then uses its fallback (the shared executor).

Example:
    >>> import threading
    >>> team = Team(helpers=1)
    >>> names = set()
    >>> team.try_run(lambda: names.add(threading.current_thread().name), 1)
    True
    >>> len(names)
    2
    >>> team.close()
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class Team:
    """``helpers`` daemon threads, each waiting on its own lock for the next job.

    Args:
        helpers: how many threads (besides each caller).
        name: a prefix for the thread names (shows in stack dumps).
    """

    def __init__(self, helpers: int, name: str = "psflow-kernel") -> None:
        self.helpers = max(0, int(helpers))
        self._busy = threading.Lock()
        self._job: Callable[[], object] | None = None
        self._closed = False
        # a held lock is a closed gate: the caller opens ``_starts[i]`` to wake thread i,
        # which opens ``_dones[i]`` when the job returned there
        self._starts = [threading.Lock() for _ in range(self.helpers)]
        self._dones = [threading.Lock() for _ in range(self.helpers)]
        for gate in (*self._starts, *self._dones):
            gate.acquire()
        for i in range(self.helpers):
            threading.Thread(target=self._serve, args=(i,), name=f"{name}-{i}", daemon=True).start()

    def _serve(self, i: int) -> None:
        start, done = self._starts[i], self._dones[i]
        while True:
            start.acquire()
            if self._closed:
                return
            job = self._job
            try:
                if job is not None:
                    job()
            except BaseException:  # a job reports its own errors (kernel_pool's do)
                pass
            finally:
                done.release()

    def try_run(self, work: Callable[[], object], helpers: int) -> bool:
        """Runs ``work()`` on ``helpers`` team threads and in this thread; returns when all did.

        ``work`` must catch its own exceptions (what it raises on a team thread is
        dropped). Returns False, running nothing, when the team is closed, in use by
        another thread, or has fewer than ``helpers`` threads.
        """
        if helpers > self.helpers or self._closed or not self._busy.acquire(blocking=False):
            return False
        try:
            self._job = work
            for gate in self._starts[:helpers]:
                gate.release()
            try:
                work()
            finally:
                for gate in self._dones[:helpers]:
                    gate.acquire()
                self._job = None
        finally:
            self._busy.release()
        return True

    def close(self) -> None:
        """Ends the team's threads (after the job in flight, if any)."""
        with self._busy:
            if self._closed:
                return
            self._closed = True
            for gate in self._starts:
                gate.release()

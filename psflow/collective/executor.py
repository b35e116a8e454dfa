"""Running a job's rank programs on threads.

:func:`drive` runs some ranks' programs on the calling thread, interleaved unit
by unit (round robin), marking each completed unit in the session.  A replica
thread of a :class:`~.communicator.Communicator` drives its own rank; a batch
call drives all N ranks on ``W <= N`` threads, W chosen by the caller (on a
2-core machine, two threads beat eight).

Why fewer threads than ranks cannot deadlock: every dependency points to a unit
with a smaller number, and a thread runs the units of its ranks in round-robin
order, i.e. in increasing unit number.  The blocked thread whose unit number is
smallest waits for a smaller number, which every thread has already passed.
(GPU jobs always run one thread per rank: their ranks may differ in unit counts.)
"""

from __future__ import annotations

import concurrent.futures
import threading

from psflow.collective.job import Job
from psflow.collective.session import Session


def drive(job: Job, session: Session, ranks: list[int], finish: bool = True) -> None:
    """Runs ``ranks``' programs to completion on this thread, then (``finish``) their
    ``finish``.

    Raises:
        The first error of these ranks (after failing the session so other
        ranks stop waiting), or the error another rank failed the session with.
    """
    current = ranks[0]
    try:
        progs = [(r, job.program(session, r)) for r in ranks]
        while progs:
            alive = []
            for r, prog in progs:
                current = r
                try:
                    next(prog)
                except StopIteration:
                    continue
                session.mark(r)
                alive.append((r, prog))
            progs = alive
        if finish:
            for r in ranks:
                current = r
                job.finish(session, r)
    except BaseException as exc:
        session.fail(current, exc)
        raise


class Executor:
    """A small thread pool for batch calls; one batch call at a time.

    Args:
        name: prefix of the pool threads' names.
    """

    def __init__(self, name: str = "psflow-collective") -> None:
        self._name = name
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._size = 0

    def run(self, job: Job, session: Session, workers: int) -> None:
        """Runs every rank of ``job`` on ``workers`` threads (the caller is one of them).

        Raises:
            The error that failed the collective (the first one, on any thread).
        """
        n = job.num_ranks
        w = max(1, min(workers, n))
        if job.kernels.is_gpu:
            w = n
        groups = [list(range(i, n, w)) for i in range(w)]
        if w == 1:
            drive(job, session, groups[0])
            return
        with self._lock:
            pool = self._pool_with(w - 1)
            futures = [pool.submit(drive, job, session, g) for g in groups[1:]]
            mine: BaseException | None = None
            try:
                drive(job, session, groups[0])
            except BaseException as exc:
                mine = exc
            # Every wait inside drive is bounded by the session timeout, so these end.
            concurrent.futures.wait(futures)
        failure = session.failure
        if failure is not None:
            if mine is failure:
                raise mine
            raise failure
        if mine is not None:
            raise mine
        for f in futures:
            f.result()

    def _pool_with(self, size: int) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None or self._size < size:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=size, thread_name_prefix=self._name
            )
            self._size = size
        return self._pool

    def close(self) -> None:
        """Stops the pool threads (a later call starts new ones)."""
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            self._pool = None
            self._size = 0

"""Progress of one collective across its ranks: waits, failure, bytes moved.

A collective is run as one *program* per rank (a generator, see
:mod:`psflow.collective.job`); every ``yield`` completes one *unit* of that
rank's work.  A rank that needs another rank's data waits until that rank has
completed the unit that produced it.  Units are numbered per rank from 0, so
"rank q finished unit u" is simply ``done[q] > u``: one counter and one
condition variable per rank, no per-unit objects.

Every wait is bounded: a rank that makes no progress for ``timeout`` seconds
fails the whole collective with :class:`~psflow.errors.DeadlineExceededError`
naming it, and any failure wakes every waiter, which then raises too.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from psflow import errors


class TrafficCounter:
    """Bytes each rank sent to other ranks, accumulated over calls; resettable.

    Rank ``q`` "sends" a chunk when another rank reads it out of ``q``'s
    buffers (or ``q`` writes it into theirs): the bytes one replica would put on
    a wire if the replicas were on different devices.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sent: list[int] = []

    def add(self, per_rank: list[int]) -> None:
        """Adds a call's per-rank byte counts."""
        with self._lock:
            if len(per_rank) > len(self._sent):
                self._sent.extend([0] * (len(per_rank) - len(self._sent)))
            for rank, n in enumerate(per_rank):
                self._sent[rank] += n

    @property
    def bytes_sent(self) -> list[int]:
        """Bytes sent by each rank since the last reset (index = rank)."""
        with self._lock:
            return list(self._sent)

    def reset(self) -> None:
        """Sets every count back to zero."""
        with self._lock:
            self._sent = [0] * len(self._sent)


class Session:
    """The shared state of one running collective.

    Args:
        num_ranks: how many rank programs take part.
        timeout: seconds a rank may wait for another rank's progress.
        device_sync: optional hooks ``record(rank)``, ``wait(rank, other, unit)``
            that order device streams behind the host-side counters (CuPy).
    """

    def __init__(self, num_ranks: int, timeout: float, device_sync: Any = None) -> None:
        self.num_ranks = num_ranks
        self.timeout = timeout
        self._done = [0] * num_ranks
        self._waiting = [0] * num_ranks  # threads blocked on each rank's condition
        self._conds = [threading.Condition(threading.Lock()) for _ in range(num_ranks)]
        self._failure: BaseException | None = None
        self._failed_rank: int | None = None
        self._device_sync = device_sync
        # _sent[executing rank][sender] so each row has one writer (the rank's thread).
        self._sent = [[0] * num_ranks for _ in range(num_ranks)]

    # -- progress --------------------------------------------------------------------------
    def mark(self, rank: int) -> None:
        """Records that ``rank`` completed its next unit and wakes its waiters."""
        if self._device_sync is not None:
            self._device_sync.record(rank)
        # Only rank's own thread writes _done[rank].  A waiter registers in _waiting
        # under the lock and re-checks _done before sleeping, so skipping the lock
        # when nobody waits loses no wake-up.
        self._done[rank] += 1
        if self._waiting[rank]:
            cond = self._conds[rank]
            with cond:
                cond.notify_all()

    def done(self, rank: int) -> int:
        """How many units ``rank`` has completed."""
        return self._done[rank]

    def wait(self, rank: int, other: int, unit: int) -> None:
        """Blocks ``rank`` until ``other`` has completed unit ``unit``.

        Raises:
            DeadlineExceededError: ``other`` made no progress for ``timeout`` seconds.
            AbortedError: (or the failing rank's own error type) another rank failed.
        """
        if self._done[other] <= unit:
            self._wait_host(other, unit)
        if self._failure is not None:
            raise self._error_for_waiter()
        if self._device_sync is not None:
            self._device_sync.wait(rank, other, unit)

    def _wait_host(self, other: int, unit: int) -> None:
        cond = self._conds[other]
        deadline = time.monotonic() + self.timeout
        timed_out = False
        with cond:
            self._waiting[other] += 1
            try:
                while self._done[other] <= unit and self._failure is None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        timed_out = True
                        break
                    cond.wait(remaining)
            finally:
                self._waiting[other] -= 1
        if timed_out:
            self.fail(
                other,
                errors.DeadlineExceededError(
                    f"rank {other} made no progress for {self.timeout:g} s "
                    f"(stuck after {self._done[other]} of its work units)"
                ),
            )

    def wait_finished(self, rank: int, others: list[int], totals: list[int]) -> None:
        """Blocks ``rank`` until each rank in ``others`` completed ``totals[i]`` units."""
        for other, total in zip(others, totals, strict=True):
            if total > 0:
                self.wait(rank, other, total - 1)

    # -- failure ---------------------------------------------------------------------------
    def fail(self, rank: int, error: BaseException) -> None:
        """Fails the collective because of ``rank``; wakes every waiter.

        The first failure wins; later ones (the waiters' own errors) are ignored.
        """
        if self._failure is None:
            self._failure = error
            self._failed_rank = rank
        for cond in self._conds:
            with cond:
                cond.notify_all()

    @property
    def failure(self) -> BaseException | None:
        """The error that failed the collective, or None."""
        return self._failure

    def _error_for_waiter(self) -> errors.OpError:
        err = self._failure
        if isinstance(err, errors.OpError):
            # A fresh instance per waiting thread: one exception object must not
            # collect tracebacks from several threads.
            return type(err)(err.message, err.task)
        return errors.AbortedError(
            f"collective aborted: rank {self._failed_rank} failed with {type(err).__name__}: {err}"
        )

    def raise_if_failed(self) -> None:
        """Raises the collective's failure (as a waiter sees it), if any."""
        if self._failure is not None:
            raise self._error_for_waiter()

    # -- bytes -----------------------------------------------------------------------------
    def sent(self, rank: int, sender: int, nbytes: int) -> None:
        """Records, from ``rank``'s thread, that ``sender`` sent ``nbytes``."""
        self._sent[rank][sender] += nbytes

    def bytes_sent(self) -> list[int]:
        """Bytes each rank sent during this collective."""
        return [sum(row[q] for row in self._sent) for q in range(self.num_ranks)]

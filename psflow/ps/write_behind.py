"""Write-behind for the disk tier: demoted rows reach the store off the request path.

A :class:`WriteBehind` holds a bounded queue of batches (records to put, or ids
to delete) and one thread that drains it into a :class:`~psflow.ps.disk_store.RowStore`,
coalescing the queued batches into one transaction (the newest operation on
an id wins).  Guarantees:

* **Reads see what is in flight.** :meth:`WriteBehind.resolve` answers ids from
  the queue (newest first) before the store is read; a batch leaves the queue
  only after its transaction committed, so every id is in the queue, in the
  store, or in neither — never lost in between.
* **Bounded.** :meth:`WriteBehind.put` waits while more than ``max_rows``
  records are queued (deletes are ids only and never wait).
* **A failing disk stops it, losing nothing.** The failed batches stay queued
  (readable); :meth:`WriteBehind.check` retries them in the caller's thread and
  raises the store's typed error while they still fail.

Example:
    >>> import tempfile, numpy as np
    >>> from psflow.ps.disk_store import open_store
    >>> wb = WriteBehind(open_store("lmdb", tempfile.mkdtemp()), max_rows=100)
    >>> wb.put(np.array([4], np.int64), np.array([[7, 7]], np.uint8))
    >>> wb.flush(5.0)
    >>> wb.store.read(np.array([4], np.int64), 2)[1].tolist()
    [[7, 7]]
    >>> wb.close()
"""

from __future__ import annotations

import collections
import threading
import time

import numpy as np

from psflow.errors import DeadlineExceededError, OpError

from .disk_store import RowStore

__all__ = ["TXN_ROWS", "DirectWriter", "WriteBehind"]

# ids one write transaction takes (more queued batches wait for the next one)
TXN_ROWS = 4096


class _Batch:
    """Sorted unique ``ids`` and their ``records`` (None: the ids are deleted)."""

    __slots__ = ("ids", "records")

    def __init__(self, ids: np.ndarray, records: np.ndarray | None) -> None:
        order = np.argsort(ids, kind="stable")
        self.ids = ids[order]
        self.records = None if records is None else records[order]


class WriteBehind:
    """Background writer of one store (see the module doc).

    Args:
        store: where the batches go.
        max_rows: records queued before :meth:`put` waits.
        wait_s: how long :meth:`put` and :meth:`flush` wait for the writer.
    """

    def __init__(self, store: RowStore, max_rows: int = 65536, wait_s: float = 60.0) -> None:
        self.store = store
        self.max_rows = max(1, int(max_rows))
        self.wait_s = wait_s
        self._cond = threading.Condition()
        self._queue: collections.deque[_Batch] = collections.deque()
        self._queued_rows = 0
        self._writing = 0  # batches the thread took from the head and is writing
        self.error: OpError | None = None
        self.bytes_written = 0
        self._closed = False
        self._drain = True
        self._thread = threading.Thread(target=self._run, name="psflow-disk-writer", daemon=True)
        self._thread.start()

    # -- producers (the table, its lock held) ----------------------------------------
    def put(self, ids: np.ndarray, records: np.ndarray) -> None:
        """Queues ``records`` for ``ids`` (unique), waiting while the queue is full.

        Raises:
            OpError: the writer failed (the store's typed error); nothing queued.
            DeadlineExceededError: the queue stayed full for ``wait_s``.
        """
        deadline = time.monotonic() + self.wait_s
        with self._cond:
            while self._queued_rows + ids.shape[0] > self.max_rows and self._queued_rows:
                if self.error is not None:
                    raise self.error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DeadlineExceededError(
                        f"disk tier at {self.store.path!r}: the writer took over "
                        f"{self.wait_s}s to make room"
                    )
                self._cond.wait(left)
            if self.error is not None:
                raise self.error
            self._queue.append(_Batch(ids, records))
            self._queued_rows += ids.shape[0]
            self._cond.notify_all()

    def delete(self, ids: np.ndarray) -> None:
        """Queues the deletion of ``ids`` (never waits: a delete holds no record)."""
        if ids.size:
            with self._cond:
                self._queue.append(_Batch(ids, None))
                self._cond.notify_all()

    def resolve(
        self, ids: np.ndarray, record_bytes: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(known, present, records)`` for ``ids`` from the queue alone: ``known``
        where a queued batch decides the id (newest first), ``present`` where that
        is a put, ``records`` a ``(len(ids), record_bytes)`` array filled there."""
        n = ids.shape[0]
        known = np.zeros(n, bool)
        present = np.zeros(n, bool)
        records = np.empty((n, record_bytes), np.uint8)
        with self._cond:
            batches = list(self._queue)
        for batch in reversed(batches):
            left = np.flatnonzero(~known)
            if left.size == 0:
                break
            pos = np.minimum(np.searchsorted(batch.ids, ids[left]), batch.ids.size - 1)
            hit = batch.ids[pos] == ids[left]
            at = left[hit]
            known[at] = True
            if batch.records is not None:
                present[at] = True
                records[at] = batch.records[pos[hit]]
        return known, present, records

    def read(self, ids: np.ndarray, record_bytes: int) -> tuple[np.ndarray, np.ndarray]:
        """``(found, records)`` of unique ``ids`` as :meth:`RowStore.read` gives them,
        the queue first (newest first), then one batched read of the store."""
        known, present, records = self.resolve(ids, record_bytes)
        rest = np.flatnonzero(~known)
        if rest.size:
            got, read = self.store.read(ids[rest], record_bytes)
            present[rest[got]] = True
            records[rest[got]] = read
        return present, records[present]

    def take(self, ids: np.ndarray, record_bytes: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`read`, then queues the deletion of the ids found."""
        found, records = self.read(ids, record_bytes)
        self.delete(ids[found])
        return found, records

    # -- the writer --------------------------------------------------------------------
    def _take(self) -> list[_Batch]:
        """The batches to write next (left queued until written), up to
        ``TXN_ROWS`` ids in all (at least one batch): a store's write transaction
        holds its dirty pages in memory (LMDB: up to a page per record). Call
        with the lock."""
        taken, rows = [], 0
        for batch in self._queue:
            if taken and rows + batch.ids.shape[0] > TXN_ROWS:
                break
            taken.append(batch)
            rows += batch.ids.shape[0]
        return taken

    def _write(self, batches: list[_Batch]) -> None:
        """One transaction of ``batches`` (the newest operation on an id wins)."""
        ids = np.concatenate([b.ids for b in batches])
        # the last occurrence of each id: unique over the reversed sequence
        rev_unique, rev_first = np.unique(ids[::-1], return_index=True)
        last = ids.shape[0] - 1 - rev_first
        is_put = np.concatenate([np.full(b.ids.shape[0], b.records is not None) for b in batches])[
            last
        ]
        put_ids = rev_unique[is_put]
        widths = {b.records.shape[1] for b in batches if b.records is not None}
        if put_ids.size:
            (width,) = widths
            all_records = np.concatenate(
                [
                    b.records
                    if b.records is not None
                    else np.empty((b.ids.shape[0], width), np.uint8)
                    for b in batches
                ]
            )
            records = all_records[last[is_put]]
        else:
            records = np.empty((0, 0), np.uint8)
        self.store.write(put_ids, records, rev_unique[~is_put])
        self.bytes_written += int(records.nbytes)

    def _done(self, count: int) -> None:
        """Drops the ``count`` oldest batches (written). Call with the lock."""
        for _ in range(count):
            batch = self._queue.popleft()
            if batch.records is not None:
                self._queued_rows -= batch.ids.shape[0]
        self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (not self._queue or self.error is not None):
                    self._cond.wait()
                if self._closed and (not self._queue or self.error is not None or not self._drain):
                    return
                batches = self._take()
                self._writing = len(batches)
            try:
                self._write(batches)
            except OpError as e:
                with self._cond:
                    self.error = e
                    self._writing = 0
                    self._cond.notify_all()
                continue
            with self._cond:
                self._writing = 0
                self._done(len(batches))

    def check(self) -> None:
        """Raises the writer's error unless a retry of the failed batches now succeeds
        (then the writer goes on).

        Raises:
            OpError: the store's typed error (the disk is still full or read-only).
        """
        with self._cond:
            if self.error is None:
                return
            batches = self._take()
            try:
                self._write(batches)
            except OpError as e:
                self.error = e
                raise
            self._done(len(batches))
            self.error = None
            self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> None:
        """Waits until everything queued is in the store.

        Raises:
            OpError: the writer failed (its typed error).
            DeadlineExceededError: not written within ``timeout`` (default ``wait_s``).
        """
        deadline = time.monotonic() + (self.wait_s if timeout is None else timeout)
        with self._cond:
            while self._queue:
                if self.error is not None:
                    raise self.error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DeadlineExceededError(
                        f"disk tier at {self.store.path!r}: writes not done in {timeout}s"
                    )
                self._cond.wait(left)

    @property
    def queued_rows(self) -> int:
        """Records waiting to be written."""
        return self._queued_rows

    def close(self, drain: bool = True) -> None:
        """Writes what is queued (unless the writer failed, or not ``drain``: the
        store is being discarded), stops the thread and closes the store."""
        with self._cond:
            self._closed = True
            self._drain = drain
            self._cond.notify_all()
        self._thread.join(self.wait_s)
        self.store.close()


class DirectWriter:
    """The writer of a store that queues and writes its own blocks
    (:attr:`RowStore.buffered <psflow.ps.disk_store.RowStore.buffered>`): the same
    calls as :class:`WriteBehind`, passed straight to the store, which reads what
    it has queued itself.

    Args:
        store: a buffered store.
        max_rows: records it may queue before :meth:`put` waits.
    """

    def __init__(self, store: RowStore, max_rows: int) -> None:
        self.store = store
        store.max_queued = max(1, int(max_rows))

    @property
    def error(self) -> OpError | None:
        """The store writer's failure, while it lasts."""
        return self.store.error

    @property
    def bytes_written(self) -> int:
        """Bytes the store wrote."""
        return self.store.bytes_written

    def put(self, ids: np.ndarray, records: np.ndarray) -> None:
        """Writes ``records`` for ``ids`` leaving memory (unique, and not on disk: the
        tiers are exclusive); raises the store's typed error, nothing changed."""
        self.store.write(ids, records, new=True)

    def delete(self, ids: np.ndarray) -> None:
        """Deletes ``ids``."""
        if ids.size:
            self.store.write(ids[:0], np.empty((0, 0), np.uint8), ids)

    def read(self, ids: np.ndarray, record_bytes: int) -> tuple[np.ndarray, np.ndarray]:
        """The store's batched read."""
        return self.store.read(ids, record_bytes)

    def take(self, ids: np.ndarray, record_bytes: int) -> tuple[np.ndarray, np.ndarray]:
        """The store's read-and-delete."""
        return self.store.take(ids, record_bytes)

    def check(self) -> None:
        """The store's check: raises while its writes still fail."""
        self.store.check()

    def flush(self, timeout: float | None = None) -> None:
        """Waits until the store wrote everything."""
        self.store.flush(timeout)

    def close(self, drain: bool = True) -> None:
        """Closes the store (it writes what it queued)."""
        self.store.close()

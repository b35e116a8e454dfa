"""A log-structured row store: fixed-size records appended to segment files.

The disk tier of a dynamic table (:mod:`psflow.ps.tiered_table`) moves a few
thousand rows in and out of memory per request, each at a random id.  A
B-tree (LMDB) dirties a page per random id it writes; this store appends
instead, and keeps where each id's newest record lives in memory:

* **Writes append.** A write encodes its records (a 16-byte header — id,
  kind, checksum — then the record, padded to 8 bytes) into one block, adds
  it to the active segment's queue (segments of :data:`SEGMENT_BYTES`, or a
  32nd of the store once it is bigger) and points the index at it; a background
  thread writes queued blocks with one ``pwritev`` per segment.  Deletes
  append a tombstone (so a reopened store does not bring a row back).
* **Reads gather.** An in-memory index (:class:`~psflow.ps.key_index.KeyIndex`
  plus an ``int64`` location per id: segment << 32 | record) answers which
  ids are held without touching the disk; the records are copied out of the
  segments' memory maps (or out of the queue, for blocks not yet written) in
  one vectorised gather per segment, and every record's checksum and id are
  verified.  Fixed overhead: at most :data:`INDEX_BYTES_PER_ROW` (40) bytes
  of memory per row held (23 when the index is snug), plus the queue.
* **Compaction off the request path.** A record that was overwritten or
  deleted is dead.  When the segments hold more dead records than live ones
  (and more than a segment's worth), the writer thread copies the oldest
  segment's live records to the end of the log, a slice at a time, and
  removes the file.  Oldest first, so a tombstone is only dropped once no
  older segment holds a record of its id.
* **Torn tails are cut.** Opening a directory that holds segments rebuilds
  the index from them in log order, keeping only records whose checksum
  verifies; the tail of the last segment after its last whole record (a
  write a ``kill -9`` cut short) is cut off the file.  The checksum is a
  vectorised 32-bit hash of the header and record (a CRC would need a
  Python call per record on the request path).
* **A failing disk loses nothing.** A write that fails (disk full,
  read-only) stops the writer; its blocks stay queued and readable;
  :meth:`LogStore.check` retries them and raises the typed error naming the
  store's path while they still fail; :meth:`LogStore.write` raises it before
  changing anything once the queue holds ``max_queued`` records.
* **Snapshots** copy the live ids and locations (16 bytes a row) and keep
  the segments they name on disk until closed; appends never overwrite, so
  the view stays consistent while writes and compaction go on.

Example:
    >>> import tempfile, numpy as np
    >>> store = LogStore(tempfile.mkdtemp())
    >>> store.write(np.array([3, 9], np.int64), np.array([[1, 2], [3, 4]], np.uint8))
    >>> found, records = store.read(np.array([9, 5], np.int64), 2)
    >>> found.tolist(), records[0].tolist()
    ([True, False], [3, 4])
    >>> store.close()
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import os
import re
import threading
import time
from collections.abc import Iterator

import numpy as np

from psflow.errors import DataLossError, DeadlineExceededError, InvalidArgumentError, OpError

from .disk_store import RowStore, StoreSnapshot, disk_error
from .key_index import KeyIndex, mix64

__all__ = ["INDEX_BYTES_PER_ROW", "LogStore", "SEGMENT_BYTES"]

SEGMENT_BYTES = 32 << 20  # a segment file's size (sparse until written), at least
MAX_SEGMENT_BYTES = 1 << 30
WAKE_BYTES = 1 << 20  # queued bytes that wake the writer (fewer, larger writes)
# bytes of memory per row held, at most: the index's key (8), liveness (1) and
# location (8), up to half again while its arrays have grown ahead (26), and its
# entry (4 at a load of 0.28 to 0.7: 6 to 15); 23 when the index is snug
INDEX_BYTES_PER_ROW = 40
_MAGIC = b"PSFLOG01"
_FILE_HEADER = 64  # magic, record size, capacity; records start here
_HEADER = 16  # per record: id (8), kind (4), checksum (4)
_PUT, _DELETE = 1, 2
_SLICE = 16384  # records one compaction step moves (under the store's lock)
_NAME = re.compile(r"^seg-(\d{8})\.log$")
_LOW32 = np.uint64(0xFFFFFFFF)


def record_size(record_bytes: int) -> int:
    """Bytes a record of ``record_bytes`` takes in a segment (header and padding)."""
    return _HEADER + -(-record_bytes // 8) * 8


def _weights(words: int) -> np.ndarray:
    """Odd, distinct uint64 weights of a record's words (the checksum's)."""
    return mix64(np.arange(1, words + 1, dtype=np.int64)) | np.uint64(1)


def _checksums(raw: np.ndarray) -> np.ndarray:
    """The uint32 checksum of each ``(n, size)`` raw record, its checksum field aside.

    The record's words times odd weights, summed modulo 2**64 (one pass in C: a
    changed word always changes the sum), then mixed and folded to 32 bits.
    """
    words = raw.view(np.uint64)
    h = mix64(words[:, 0]) ^ (words[:, 1] & _LOW32)  # the kind, not the checksum above it
    if words.shape[1] > 2:
        h += words[:, 2:].dot(_weights(words.shape[1] - 2))
    return (mix64(h) >> np.uint64(32)).astype(np.uint32)


class _Segment:
    """One segment file: its memory map, and how far it is filled and written."""

    def __init__(self, path: str, number: int, size: int, capacity: int, fd: int) -> None:
        self.path = path
        self.number = number
        self.size = size  # bytes per record, header included
        self.capacity = capacity  # records
        self.fd = fd
        self.map = mmap.mmap(fd, _FILE_HEADER + capacity * size, access=mmap.ACCESS_READ)
        self.rows = np.frombuffer(self.map, np.uint8, capacity * size, _FILE_HEADER).reshape(
            capacity, size
        )
        self.appended = 0  # records given a place (queued or written)
        self.written = 0  # records on disk (the queue holds the rest)
        self.live = 0  # records the index points at
        self.compacted = 0  # records compaction has looked at

    @classmethod
    def create(cls, directory: str, number: int, size: int, segment_bytes: int) -> _Segment:
        """A new, empty segment file (sparse: its blocks are taken as it is written)."""
        capacity = max(1, (segment_bytes - _FILE_HEADER) // size)
        path = os.path.join(directory, f"seg-{number:08d}.log")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            header = np.zeros(_FILE_HEADER, np.uint8)
            header[:8] = np.frombuffer(_MAGIC, np.uint8)
            header[8:24] = np.array([size, capacity], np.uint64).view(np.uint8)
            if os.pwrite(fd, header.tobytes(), 0) != _FILE_HEADER:
                raise OSError(28, "short write of the segment header")
            os.ftruncate(fd, _FILE_HEADER + capacity * size)
            return cls(path, number, size, capacity, fd)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise

    @classmethod
    def open(cls, path: str, number: int) -> _Segment | None:
        """An existing segment file (its header checked); None for one a killed
        process left unfinished (no header, or no room for a record), removed.

        Raises:
            DataLossError: the file is not a segment.
        """
        fd = os.open(path, os.O_RDWR)
        try:
            header = os.pread(fd, _FILE_HEADER, 0)
            size, capacity = np.frombuffer(header[8:24].ljust(16, b"\0"), np.uint64).tolist()
            length = os.fstat(fd).st_size
            unfinished = len(header) < _FILE_HEADER or length < _FILE_HEADER + max(size, _HEADER)
            if not unfinished and (header[:8] != _MAGIC or size < _HEADER or size % 8):
                raise DataLossError(f"{path!r} is not a row store segment")
            if not unfinished:
                capacity = min(capacity, (length - _FILE_HEADER) // size)
                return cls(path, number, size, capacity, fd)
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        os.unlink(path)
        return None

    @property
    def disk_bytes(self) -> int:
        return _FILE_HEADER + self.written * self.size

    def close(self, unlink: bool = False) -> None:
        self.rows = np.empty((0, self.size), np.uint8)  # lets go of the map
        with contextlib.suppress(BufferError):  # still viewed: the map goes with the view
            self.map.close()
        os.close(self.fd)
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


class LogStore(RowStore):
    """A log-structured :class:`~psflow.ps.disk_store.RowStore` (see the module doc).

    Args:
        path: the directory (made if missing); segments already there are
            recovered.
        segment_bytes: bytes per segment file (more once the store holds more
            than 32 of them).
        max_queued: records queued for the writer before :meth:`write` waits.
        wait_s: how long :meth:`write`, :meth:`flush` and :meth:`snapshot` wait
            for the writer.

    Raises:
        PermissionDeniedError, ResourceExhaustedError: the directory cannot be
            made or written (the message names it).
        DataLossError: a file in it is not a segment.
    """

    buffered = True
    indexed = True

    def __init__(
        self,
        path: str,
        segment_bytes: int = SEGMENT_BYTES,
        max_queued: int = 1 << 18,
        wait_s: float = 60.0,
    ) -> None:
        if segment_bytes < 4096:
            raise InvalidArgumentError(f"segment_bytes must be >= 4096, got {segment_bytes}")
        self.path = path
        self.segment_bytes = int(segment_bytes)
        self.max_queued = max(1, int(max_queued))
        self.wait_s = wait_s
        self._cond = threading.Condition()
        self._index = KeyIndex(1024)
        self._loc = np.zeros(self._index.capacity, np.int64)
        self._segments: dict[int, _Segment] = {}
        self._active: _Segment | None = None
        self._next_number = 0
        # blocks appended and not yet written: (segment, first record, raw records)
        self._queue: collections.deque[tuple[_Segment, int, np.ndarray]] = collections.deque()
        self._queued = 0
        self._queued_bytes = 0
        self._writing = False
        self._waiters = 0  # callers waiting for the queue to drain
        self._pins = 0  # open snapshots: retired segments stay on disk while > 0
        self._retired: list[_Segment] = []
        self.error: OpError | None = None
        self.bytes_written = 0
        self._closed = False
        try:
            os.makedirs(path, exist_ok=True)
            self._recover()
            probe = os.path.join(path, ".writable")
            with open(probe, "wb"):
                pass
            os.unlink(probe)
        except OSError as e:
            raise disk_error(path, "open", e) from e
        self._thread = threading.Thread(target=self._run, name="psflow-log-writer", daemon=True)
        self._thread.start()

    # -- recovery -------------------------------------------------------------------
    def _recover(self) -> None:
        """Rebuilds the index from the segments on disk, in log order."""
        numbers = sorted(
            int(m.group(1)) for m in map(_NAME.match, os.listdir(self.path)) if m is not None
        )
        for number in numbers:
            segment = _Segment.open(os.path.join(self.path, f"seg-{number:08d}.log"), number)
            self._next_number = number + 1
            if segment is None:
                continue
            self._segments[number] = segment
            last = -1
            for lo in range(0, segment.capacity, 65536):
                raw = segment.rows[lo : lo + 65536]
                words = raw[:, :16].view(np.uint64)
                kind = (words[:, 1] & _LOW32).astype(np.int64)
                stored = (words[:, 1] >> np.uint64(32)).astype(np.uint32)
                valid = ((kind == _PUT) | (kind == _DELETE)) & (stored == _checksums(raw))
                at = np.flatnonzero(valid)
                if at.size:
                    last = lo + int(at[-1])
                    self._replay(segment, lo + at, words[at, 0].view(np.int64), kind[at])
            segment.appended = segment.written = last + 1
        if self._segments:
            tail = self._segments[max(self._segments)]
            # cut what follows the last whole record (a torn write), keeping the file sparse
            end = _FILE_HEADER + tail.written * tail.size
            os.ftruncate(tail.fd, end)
            os.ftruncate(tail.fd, _FILE_HEADER + tail.capacity * tail.size)
            self._active = tail

    def _replay(self, segment: _Segment, records: np.ndarray, ids: np.ndarray, kind) -> None:
        """Applies recovered records (in log order) to the index."""
        # the last record of each id in this batch decides it
        rev_unique, rev_first = np.unique(ids[::-1], return_index=True)
        last = ids.shape[0] - 1 - rev_first
        locs = (np.int64(segment.number) << np.int64(32)) | records[last].astype(np.int64)
        puts = kind[last] == _PUT
        self._drop(rev_unique[~puts])
        self._point(rev_unique[puts], locs[puts])

    # -- the index ------------------------------------------------------------------
    def _count(self, locs: np.ndarray, sign: int) -> None:
        """Adds ``sign`` to the live count of each record's segment at ``locs``."""
        if not locs.size:
            return
        numbers = locs >> np.int64(32)
        low, high = int(numbers.min()), int(numbers.max())
        if low == high:  # the usual case: all in one segment
            self._segments[low].live += sign * locs.size
            return
        counts = np.bincount(numbers - low)
        for number in np.flatnonzero(counts).tolist():
            self._segments[low + number].live += sign * int(counts[number])

    def _kill(self, locs: np.ndarray) -> None:
        """Counts the records at ``locs`` dead."""
        self._count(locs, -1)

    def _point(self, ids: np.ndarray, locs: np.ndarray, new: bool = False) -> None:
        """Points unique ``ids`` at ``locs`` (their old records die); ``new``: none
        of them is held (no probe for old records)."""
        slots = np.full(ids.shape[0], -1, np.int64) if new else self._index.find(ids)
        old = slots >= 0
        if old.any():
            self._kill(self._loc[slots[old]])
        absent = np.flatnonzero(~old)
        if absent.size:
            if self._index.reserve(absent.size):
                grown = np.zeros(self._index.capacity, np.int64)
                grown[: self._loc.shape[0]] = self._loc
                self._loc = grown
            slots[absent] = self._index.insert(ids[absent])
        self._loc[slots] = locs
        self._count(locs, 1)

    def _drop(self, ids: np.ndarray) -> None:
        """Removes ``ids`` from the index (those it holds)."""
        slots, entries = self._index.locate(ids)
        held = slots >= 0
        self._remove(slots[held], entries[held])

    def _remove(self, slots: np.ndarray, entries: np.ndarray) -> None:
        """Removes the ids at index ``slots`` (sitting at ``entries``)."""
        self._kill(self._loc[slots])
        self._index.remove(slots, entries)

    # -- appends --------------------------------------------------------------------
    def _places(self, n: int, size: int) -> list[tuple[_Segment, int, int]]:
        """``(segment, first record, count)`` places for ``n`` records of ``size``
        bytes at the end of the log, making segments as needed (lock held).

        Raises:
            OSError: a segment file cannot be made (nothing is given a place).
        """
        out: list[tuple[_Segment, int, int]] = []
        fresh: list[_Segment] = []
        active = self._active
        pos = 0 if active is None else active.appended
        left = n
        try:
            while left:
                if active is None or active.size != size or pos >= active.capacity:
                    number = self._next_number + len(fresh)
                    active = _Segment.create(self.path, number, size, self._next_segment_bytes())
                    fresh.append(active)
                    pos = 0
                take = min(left, active.capacity - pos)
                out.append((active, pos, take))
                pos += take
                left -= take
        except BaseException:
            for segment in fresh:
                segment.close(unlink=True)
            raise
        for segment in fresh:
            self._segments[segment.number] = segment
        self._next_number += len(fresh)
        for segment, start, take in out:
            segment.appended = start + take
        if out:
            self._active = out[-1][0]
        return out

    def _next_segment_bytes(self) -> int:
        """A new segment's size: ``segment_bytes``, or a 32nd of what the store holds
        once that is more (at most :data:`MAX_SEGMENT_BYTES`), so a big store keeps
        a few hundred files open, not thousands."""
        held = sum(s.appended * s.size for s in self._segments.values())
        return max(self.segment_bytes, min(MAX_SEGMENT_BYTES, held // 32))

    def _append(self, raw: np.ndarray) -> np.ndarray:
        """Queues ``raw`` records at the end of the log; returns their locations."""
        locs = np.empty(raw.shape[0], np.int64)
        done = 0
        for segment, start, take in self._places(raw.shape[0], raw.shape[1]):
            block = raw[done : done + take]
            self._queue.append((segment, start, block))
            locs[done : done + take] = (np.int64(segment.number) << np.int64(32)) + np.arange(
                start, start + take, dtype=np.int64
            )
            done += take
        self._queued += raw.shape[0]
        self._queued_bytes += raw.nbytes
        if self._queued_bytes >= WAKE_BYTES or self._queued * 2 >= self.max_queued:
            self._cond.notify_all()  # a batch worth a write (each wake-up costs a GIL handoff)
        return locs

    def _wait_for_room(self, n: int) -> bool:
        """Waits while the queue is full (lock held); raises the writer's error.
        Returns whether it waited (the lock was let go)."""
        deadline = time.monotonic() + self.wait_s
        if not (self._queued and self._queued + n > self.max_queued):
            return False
        self._waiters += 1
        self._cond.notify_all()
        try:
            while self._queued and self._queued + n > self.max_queued:
                if self.error is not None:
                    raise self.error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DeadlineExceededError(
                        f"disk tier at {self.path!r}: the writer took over "
                        f"{self.wait_s}s to make room"
                    )
                self._cond.wait(left)
        finally:
            self._waiters -= 1
        return True

    def write(
        self,
        ids: np.ndarray,
        records: np.ndarray,
        delete: np.ndarray | None = None,
        new: bool = False,
    ) -> None:
        ids = np.ascontiguousarray(ids, np.int64)
        n = ids.shape[0]
        if records.shape[0] != n:
            raise InvalidArgumentError(
                f"disk tier at {self.path!r}: {n} ids but {records.shape[0]} records"
            )
        values = (
            np.ascontiguousarray(records).view(np.uint8).reshape(n, -1)
            if n
            else np.empty((0, 0), np.uint8)
        )
        if n > 1 and not new and not bool(np.all(ids[1:] > ids[:-1])):
            # a repeated id: its last record wins
            rev_unique, rev_first = np.unique(ids[::-1], return_index=True)
            if rev_unique.shape[0] < n:
                keep = np.sort(n - 1 - rev_first)
                ids, values = ids[keep], values[keep]
                n = ids.shape[0]
        raw = None
        if n:
            raw = np.zeros((n, record_size(values.shape[1])), np.uint8)
            raw[:, :8] = ids.view(np.uint8).reshape(n, 8)
            raw[:, 8:12] = np.array([_PUT], np.uint32).view(np.uint8)
            raw[:, _HEADER : _HEADER + values.shape[1]] = values
            raw[:, 12:16] = _checksums(raw).view(np.uint8).reshape(n, 4)
        with self._cond:
            self._check_open()
            self._wait_for_room(n)
            gone = np.zeros(0, np.int64)
            if delete is not None and delete.size:
                gone = np.unique(np.asarray(delete, np.int64))
                if n:  # an id both put and deleted is put (deletes come first)
                    gone = gone[~np.isin(gone, ids)]
                slots, entries = self._index.locate(gone)
                held = slots >= 0
                gone, slots, entries = gone[held], slots[held], entries[held]
            block = raw
            if gone.size:
                tomb = self._tombstones(gone, self._tomb_size(raw))
                block = tomb if raw is None else np.concatenate([tomb, raw])
            if block is None:
                return
            try:  # one append: the tombstones and the records land together or not at all
                locs = self._append(block)
            except OSError as e:
                raise disk_error(self.path, "write", e) from e
            if gone.size:
                self._remove(slots, entries)
            if raw is not None:
                self._point(ids, locs[gone.size :], new)

    def _tomb_size(self, raw: np.ndarray | None) -> int:
        """Record size of tombstones: the active segment's (so they do not roll it)."""
        if raw is not None:
            return raw.shape[1]
        return self._active.size if self._active is not None else _HEADER

    # -- reads ----------------------------------------------------------------------
    def _segment(self, number: int) -> _Segment:
        segment = self._segments.get(number)
        if segment is None:
            for retired in self._retired:
                if retired.number == number:
                    return retired
            raise DataLossError(f"disk tier at {self.path!r}: segment {number} is gone")
        return segment

    def _gather(self, ids: np.ndarray, locs: np.ndarray, record_bytes: int) -> np.ndarray:
        """The records of ``ids`` at ``locs``, verified (lock held).

        Raises:
            DataLossError: a record of another size, or whose checksum or id is wrong.
        """
        size = record_size(record_bytes)
        if not locs.size:
            return np.empty((0, record_bytes), np.uint8)
        raw = np.empty((locs.shape[0], size), np.uint8)
        numbers = locs >> np.int64(32)
        records = (locs & np.int64(0xFFFFFFFF)).astype(np.int64)
        low, high = int(numbers.min()), int(numbers.max())
        present = np.array([low]) if low == high else np.unique(numbers)
        for number in present.tolist():
            segment = self._segment(number)
            if segment.size != size:
                raise DataLossError(
                    f"disk tier at {self.path!r}: records are {segment.size - _HEADER} "
                    f"bytes, not {record_bytes}"
                )
            at = np.flatnonzero(numbers == number) if present.size > 1 else None
            rec = records if at is None else records[at]
            on_disk = rec < segment.written
            if on_disk.all():
                got = segment.rows[rec]
            else:
                got = np.empty((rec.shape[0], size), np.uint8)
                got[on_disk] = segment.rows[rec[on_disk]]
                self._from_queue(segment, rec, ~on_disk, got)
            if at is None:
                raw = got
            else:
                raw[at] = got
        words = raw[:, :16].view(np.uint64)
        ok = (words[:, 0].view(np.int64) == ids) & (
            (words[:, 1] >> np.uint64(32)).astype(np.uint32) == _checksums(raw)
        )
        if not ok.all():
            raise DataLossError(
                f"disk tier at {self.path!r}: {int((~ok).sum())} records fail their checksum"
            )
        return raw[:, _HEADER : _HEADER + record_bytes]

    def _from_queue(self, segment: _Segment, rec: np.ndarray, want: np.ndarray, out) -> None:
        """Fills ``out[want]`` with records ``rec[want]`` of ``segment`` from the queue."""
        for held, start, block in self._queue:
            if held is not segment:
                continue
            inside = want & (rec >= start) & (rec < start + block.shape[0])
            if inside.any():
                out[inside] = block[rec[inside] - start]

    def read(self, ids: np.ndarray, record_bytes: int) -> tuple[np.ndarray, np.ndarray]:
        ids = np.ascontiguousarray(ids, np.int64)
        with self._cond:
            self._check_open()
            slots = self._index.find(ids)
            found = slots >= 0
            if not found.any():
                return found, np.empty((0, record_bytes), np.uint8)
            return found, self._gather(ids[found], self._loc[slots[found]], record_bytes)

    def take(self, ids: np.ndarray, record_bytes: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`read` and delete ``ids`` (unique) with one probe of the index."""
        ids = np.ascontiguousarray(ids, np.int64)
        with self._cond:
            self._check_open()
            slots, entries = self._index.locate(ids)
            found = slots >= 0
            if not found.any():
                return found, np.empty((0, record_bytes), np.uint8)
            if self._wait_for_room(int(found.sum())):  # the lock was let go meanwhile
                slots, entries = self._index.locate(ids)
                found = slots >= 0
            gone, slots, entries = ids[found], slots[found], entries[found]
            records = self._gather(gone, self._loc[slots], record_bytes)
            tomb = self._tombstones(gone, self._active.size if self._active else _HEADER)
            try:
                self._append(tomb)
            except OSError as e:
                raise disk_error(self.path, "write", e) from e
            self._remove(slots, entries)
            return found, records

    @staticmethod
    def _tombstones(ids: np.ndarray, size: int) -> np.ndarray:
        """Delete records of ``ids``, ``size`` bytes each."""
        tomb = np.zeros((ids.size, size), np.uint8)
        tomb[:, :8] = ids.view(np.uint8).reshape(-1, 8)
        tomb[:, 8:12] = np.array([_DELETE], np.uint32).view(np.uint8)
        tomb[:, 12:16] = _checksums(tomb).view(np.uint8).reshape(-1, 4)
        return tomb

    def _check_open(self) -> None:
        if self._closed:
            raise DataLossError(f"disk tier at {self.path!r} is closed")

    # -- the writer thread ----------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed and (not self._queue or self.error is not None):
                        return
                    if self.error is None and self._queue and self._due():
                        break
                    if self.error is None and not self._closed and self._compaction_due():
                        break
                    self._cond.wait()
                if not self._queue:
                    self._compact_slice()
                    continue  # the lock is let go between slices
                self._writing = True
                blocks = list(self._queue)
            try:
                self._write_blocks(blocks)
            except OSError as e:
                with self._cond:
                    self.error = disk_error(self.path, "write", e)
                    self._writing = False
                    self._cond.notify_all()
                continue
            with self._cond:
                self._written(len(blocks))
                self._writing = False
                self._cond.notify_all()

    def _due(self) -> bool:
        """Whether the writer should write what is queued now (lock held): a batch's
        worth, or someone waits for it (flush, close, a full queue)."""
        return (
            self._queued_bytes >= WAKE_BYTES
            or self._queued * 2 >= self.max_queued
            or self._closed
            or self._waiters > 0
        )

    def _write_blocks(self, blocks: list[tuple[_Segment, int, np.ndarray]]) -> None:
        """Writes queued blocks, one positioned vectored write per run of
        consecutive blocks of a segment (the lock not held: they are immutable)."""
        i = 0
        while i < len(blocks):
            segment, start, _ = blocks[i]
            run = [blocks[i][2]]
            end = start + blocks[i][2].shape[0]
            i += 1
            while i < len(blocks) and blocks[i][0] is segment and blocks[i][1] == end:
                run.append(blocks[i][2])
                end += blocks[i][2].shape[0]
                i += 1
            offset = _FILE_HEADER + start * segment.size
            data = run[0] if len(run) == 1 else np.concatenate(run)
            view = memoryview(data).cast("B")
            while view:
                done = os.pwrite(segment.fd, view, offset)
                if done <= 0:
                    raise OSError(28, "no progress writing a segment")
                view, offset = view[done:], offset + done

    def _written(self, count: int) -> None:
        """The ``count`` oldest queued blocks are on disk (lock held)."""
        for _ in range(count):
            segment, start, block = self._queue.popleft()
            segment.written = max(segment.written, start + block.shape[0])
            self._queued -= block.shape[0]
            self._queued_bytes -= block.nbytes
            self.bytes_written += block.nbytes

    # -- compaction -----------------------------------------------------------------
    def _compaction_due(self) -> bool:
        """Whether dead records outnumber live ones by more than a segment (lock held)."""
        if len(self._segments) < 2:
            return False
        total = sum(s.appended for s in self._segments.values())
        live = self._index.size
        oldest = self._segments[min(self._segments)]
        # dead records may take twice the live ones' room: compaction then copies
        # at most half a segment's records for each segment it frees
        return total - live > max(2 * live, oldest.capacity) and oldest is not self._active

    def _compact_slice(self) -> None:
        """Moves the next slice of the oldest segment's live records to the end of
        the log; removes the segment once it holds none (lock held)."""
        segment = self._segments[min(self._segments)]
        if segment.written < segment.appended:
            return  # still being written: next time
        lo = segment.compacted
        hi = min(segment.appended, lo + _SLICE)
        if segment.live > 0 and hi > lo:
            raw = segment.rows[lo:hi]
            ids = raw[:, :8].copy().view(np.int64).reshape(-1)
            slots = self._index.find(ids)
            locs = (np.int64(segment.number) << np.int64(32)) + np.arange(lo, hi, dtype=np.int64)
            live = (slots >= 0) & (self._loc[np.maximum(slots, 0)] == locs)
            if live.any():
                try:
                    moved = self._append(raw[live].copy())
                except OSError as e:  # no room for a new segment: stop until check()
                    self.error = disk_error(self.path, "compact", e)
                    return
                self._point(ids[live], moved)
        segment.compacted = hi
        if hi >= segment.appended:
            if segment.live:  # cannot happen (nothing appends to it): count again
                held = self._loc[self._index.live_slots()] >> np.int64(32)
                segment.live = int(np.count_nonzero(held == segment.number))
                segment.compacted = 0
                return
            del self._segments[segment.number]
            if self._pins:
                self._retired.append(segment)
            else:
                segment.close(unlink=True)

    # -- the rest of RowStore ---------------------------------------------------------
    def check(self) -> None:
        """Raises the writer's error unless writing the queued blocks now succeeds."""
        with self._cond:
            if self.error is None:
                return
            while self._writing:
                self._cond.wait()
            blocks = list(self._queue)
            try:
                self._write_blocks(blocks)
            except OSError as e:
                self.error = disk_error(self.path, "write", e)
                raise self.error from e
            self._written(len(blocks))
            self.error = None
            self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> None:
        """Waits until every queued block is on disk.

        Raises:
            OpError: the writer failed (its typed error).
            DeadlineExceededError: not written within ``timeout`` (default ``wait_s``).
        """
        deadline = time.monotonic() + (self.wait_s if timeout is None else timeout)
        with self._cond:
            self._waiters += 1
            self._cond.notify_all()
            try:
                while self._queue:
                    if self.error is not None:
                        raise self.error
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise DeadlineExceededError(
                            f"disk tier at {self.path!r}: writes not done in {timeout}s"
                        )
                    self._cond.wait(left)
            finally:
                self._waiters -= 1

    def snapshot(self) -> StoreSnapshot:
        # records still queued are read from the queue, or from their file once written
        with self._cond:
            self._check_open()
            live = self._index.live_slots()
            ids = self._index.keys[live]
            order = np.argsort(ids, kind="stable")
            self._pins += 1
            return _LogSnapshot(self, ids[order], self._loc[live][order])

    def _unpin(self) -> None:
        with self._cond:
            self._pins -= 1
            if not self._pins:
                for segment in self._retired:
                    segment.close(unlink=True)
                self._retired = []

    def scan(self, record_bytes: int, batch: int = 4096) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        with self.snapshot() as snap:
            yield from snap.scan(record_bytes, batch)

    def scan_ids(self, batch: int = 65536) -> Iterator[np.ndarray]:
        with self._cond:
            ids = np.sort(self._index.keys[self._index.live_slots()])
        for lo in range(0, ids.shape[0], batch):
            yield ids[lo : lo + batch]

    def count(self) -> int:
        return self._index.size

    @property
    def index_bytes(self) -> int:
        """Bytes of memory the index takes now."""
        return self._index.nbytes + self._loc.nbytes

    @property
    def disk_bytes(self) -> int:
        with self._cond:
            held = [*self._segments.values(), *self._retired]
            return sum(s.disk_bytes for s in held)

    def clear(self) -> None:
        with self._cond:
            self._check_open()
            while self._writing:
                self._cond.wait()
            self._queue.clear()
            self._queued = self._queued_bytes = 0
            self.error = None
            for segment in self._segments.values():
                if self._pins:
                    self._retired.append(segment)
                else:
                    segment.close(unlink=True)
            self._segments = {}
            self._active = None
            self._index = KeyIndex(1024)
            self._loc = np.zeros(self._index.capacity, np.int64)
            self._cond.notify_all()

    def close(self) -> None:
        """Writes what is queued (unless the writer failed), stops the writer and
        closes the files (their records stay on disk)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._thread.join(self.wait_s)
        with self._cond:
            for segment in [*self._segments.values(), *self._retired]:
                segment.close()
            self._segments, self._retired = {}, []


class _LogSnapshot(StoreSnapshot):
    """The live ids (sorted) and their locations when it was taken."""

    def __init__(self, store: LogStore, ids: np.ndarray, locs: np.ndarray) -> None:
        self._store = store
        self._ids = ids
        self._locs = locs
        self._open = True

    def scan(self, record_bytes: int, batch: int = 4096) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for lo in range(0, self._ids.shape[0], batch):
            ids = self._ids[lo : lo + batch]
            with self._store._cond:
                records = self._store._gather(ids, self._locs[lo : lo + batch], record_bytes)
            yield ids, records

    def read(self, ids: np.ndarray, record_bytes: int) -> tuple[np.ndarray, np.ndarray]:
        ids = np.ascontiguousarray(ids, np.int64)
        if not self._ids.size:
            return np.zeros(ids.shape[0], bool), np.empty((0, record_bytes), np.uint8)
        pos = np.minimum(np.searchsorted(self._ids, ids), self._ids.size - 1)
        found = self._ids[pos] == ids
        with self._store._cond:
            records = self._store._gather(ids[found], self._locs[pos[found]], record_bytes)
        return found, records

    def close(self) -> None:
        if self._open:
            self._open = False
            self._store._unpin()

"""A dynamic table shard in two tiers: warm rows in memory, the rest on local disk.

A :class:`TieredTable` is a :class:`~psflow.ps.dynamic_table.DynamicTable` whose
memory holds at most a budget of rows (``memory_rows``, or ``memory_bytes``
turned into rows); every other row lives in an embedded key-value store
(:mod:`psflow.ps.disk_store`; by default the log-structured
:mod:`psflow.ps.log_store`, or LMDB) with its optimizer slots and its ttl clock
and traffic count, as one fixed-size record.  Guarantees, on top of the dynamic
table's:

* **Same results as all in memory.** A row is moved, never recomputed: its
  bytes go to disk and come back unchanged, and the update rule runs on it in
  memory as it would have.  Lookups, pushes, steps, counters and exported
  state equal an all-in-memory table's, bit for bit (the order of exported
  rows differs: compare by id).
* **Exclusive tiers.** A row is in memory or on disk, never both: bringing one
  in deletes it from disk (the read and the delete are one pass of the log
  store's index); eviction removes it wherever it is.
* **One batched read per request.** A lookup or push reads all its ids that
  missed memory in one read (what is queued for writing first, then the
  store) and brings them in.  The log store knows its ids from memory; over
  LMDB a Bloom filter (:mod:`psflow.ps.id_filter`) spares new ids the read.
* **Demotion off the request path.** When a request leaves more than the
  budget in memory, the rows with the lowest ``traffic / (1 + age)`` (traffic
  counted by the table, age in pushes since the row's last touch) — never the
  request's own, nor rows touched since the last push while others can go
  (another worker's push is about to update them) — are encoded and handed
  to the store, a quarter of the budget at a time: the log store queues them and
  writes them in its own thread; over LMDB a write-behind thread
  (:mod:`psflow.ps.write_behind`) does.
* **Memory bound.** Rows in memory: at most the budget plus the rows of the
  largest single request; records waiting to be written: at most
  ``queue_rows`` (default a quarter of the budget, at least 4096 and, for
  the log store, 8 MiB of records).  The fixed overhead is the store's index
  (log store: at most ``INDEX_BYTES_PER_ROW`` = 40 bytes per row on disk;
  LMDB: a 1-byte-per-row filter and one transaction's dirty pages) and the
  per-request arrays; while a checkpoint may follow as a delta, the ids
  changed on disk since the last one (8 bytes each, up to twice that).
* **A failing disk changes nothing.** A full or read-only disk fails the
  store's writer; the next request raises its typed error (naming the
  store's path) before it changes anything, rows queued for writing stay
  readable, and the first request after the disk recovers writes them and
  goes on.

The worker's hot-row cache asks :meth:`~DynamicTable.hot_ids`, which ranks the
rows in memory (the busiest are there by the demotion order).  A live resize
exports a shard through :meth:`~DynamicTable.export_state`, which reads its
rows on disk into memory for the move (checkpoints stream instead).

The store is scratch, not a checkpoint: it is wiped when the table is made,
and a restarted PS rebuilds the table from its checkpoint.
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import os
import re
import shutil
import tempfile
import uuid
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np

from psflow.errors import InvalidArgumentError, OpError
from psflow.update_rules import UpdateRule, put_rows, take_rows

from .disk_store import disk_error, open_store, store_names
from .dynamic_table import DynamicTable, TableConfig
from .id_filter import IdFilter
from .key_index import unique_ids
from .write_behind import DirectWriter, WriteBehind

__all__ = [
    "RowCodec",
    "TierOptions",
    "TieredTable",
    "memory_budget_rows",
    "safe_name",
    "tier_root",
]

# Bytes a row costs in memory besides its values: key (8), liveness (1), touched
# and traffic (8), index entries (4 at a load of at most 0.7: under 6).
ROW_OVERHEAD_BYTES = 23
# a buffered store's queue of records waiting to be written, by default
QUEUE_BYTES = 8 << 20


@dataclasses.dataclass(frozen=True)
class TierOptions:
    """A PS task's disk tier: where the stores go and the default budget.

    Attributes:
        directory: where each table shard's store lives (a fresh directory per
            shard under it); None: under the system's temporary directory.
        memory_rows: rows per table shard kept in memory for tables whose config
            names no budget (0: those stay all in memory).
        memory_bytes: the same as bytes (rows, slots and bookkeeping); at most
            one of the two.
        backend: the store (:func:`psflow.ps.disk_store.store_names`).
        queue_rows: records that may wait to be written (0: a quarter of the
            budget, at least 4096 and, for the log store, 8 MiB of records).
    """

    directory: str | None = None
    memory_rows: int = 0
    memory_bytes: int = 0
    backend: str = "log"
    queue_rows: int = 0

    def __post_init__(self) -> None:
        for field in ("memory_rows", "memory_bytes", "queue_rows"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgumentError(
                    f"disk tier: {field} must be an integer >= 0, got {value!r}"
                )
        if self.memory_rows and self.memory_bytes:
            raise InvalidArgumentError(
                "disk tier: give memory_rows or memory_bytes, not both "
                f"(got {self.memory_rows} and {self.memory_bytes})"
            )
        if self.backend.strip().lower() not in store_names():  # a bad flag fails at start
            raise InvalidArgumentError(
                f"unknown row store {self.backend!r}; registered: {store_names()}"
            )


class RowCodec:
    """Rows with their slots, ttl clock and traffic as fixed-size byte records.

    A record is the row's values, then each slot's (in ``slot_names`` order),
    then ``touched`` and ``traffic`` as uint32: ``record_bytes`` in all.
    """

    def __init__(self, dim: int, dtype: np.dtype, slot_names: tuple[str, ...]) -> None:
        self.dim = dim
        self.dtype = np.dtype(dtype)
        self.slot_names = tuple(slot_names)
        self.width = dim * self.dtype.itemsize
        self.record_bytes = self.width * (1 + len(self.slot_names)) + 8

    def encode(
        self,
        rows: np.ndarray,
        slots: dict[str, np.ndarray],
        touched: np.ndarray,
        traffic: np.ndarray,
    ) -> np.ndarray:
        """``(n, record_bytes)`` uint8 records of ``n`` rows."""
        n = rows.shape[0]
        out = np.empty((n, self.record_bytes), np.uint8)
        parts = [rows, *(slots[k] for k in self.slot_names)]
        for i, part in enumerate(parts):
            chunk = np.ascontiguousarray(part, self.dtype).view(np.uint8).reshape(n, self.width)
            out[:, i * self.width : (i + 1) * self.width] = chunk
        tail = self.width * len(parts)
        out[:, tail : tail + 4] = (
            np.ascontiguousarray(touched, np.uint32).view(np.uint8).reshape(n, 4)
        )
        out[:, tail + 4 :] = np.ascontiguousarray(traffic, np.uint32).view(np.uint8).reshape(n, 4)
        return out

    def decode(
        self, records: np.ndarray
    ) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray, np.ndarray]:
        """``(rows, slots, touched, traffic)`` of ``records`` (copies)."""
        n = records.shape[0]
        w = self.width

        def floats(i: int) -> np.ndarray:
            return records[:, i * w : (i + 1) * w].copy().view(self.dtype).reshape(n, self.dim)

        slots = {k: floats(i + 1) for i, k in enumerate(self.slot_names)}
        return floats(0), slots, self.touched(records), self.traffic(records)

    def touched(self, records: np.ndarray) -> np.ndarray:
        """The ttl clocks (uint32) of ``records``."""
        tail = self.width * (1 + len(self.slot_names))
        return records[:, tail : tail + 4].copy().view(np.uint32).reshape(-1)

    def traffic(self, records: np.ndarray) -> np.ndarray:
        """The traffic counts (uint32) of ``records``."""
        return records[:, -4:].copy().view(np.uint32).reshape(-1)


def memory_budget_rows(config: TableConfig, memory_bytes: int, slots: int) -> int:
    """Rows of ``config``'s table that ``memory_bytes`` hold with ``slots`` slots each."""
    per_row = (1 + slots) * config.dim * np.dtype(config.dtype).itemsize + ROW_OVERHEAD_BYTES
    return max(1, memory_bytes // per_row)


def safe_name(name: str) -> str:
    """``name`` as a file name: safe characters kept, a hash keeping names apart."""
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)[:64]}-{digest}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def tier_root(directory: str | None, task: str) -> str:
    """This process's directory for task ``task``'s stores under ``directory``
    (None: the system's temporary directory), made now and removed at exit.

    Stores left by a process of the same task that died (a PS killed with
    ``kill -9``) are removed: they were scratch, and the checkpoint is the state.

    Raises:
        PermissionDeniedError, ResourceExhaustedError: it cannot be made (the
            message names it).
    """
    root = directory or os.path.join(tempfile.gettempdir(), "psflow-tier")
    prefix = safe_name(task)
    path = os.path.join(root, f"{prefix}.{os.getpid()}")
    try:
        os.makedirs(path, exist_ok=True)
        for entry in os.listdir(root):
            head, _, pid = entry.rpartition(".")
            if (
                head == prefix
                and pid.isdigit()
                and int(pid) != os.getpid()
                and not _alive(int(pid))
            ):
                shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
    except OSError as e:
        raise disk_error(path, "create the directory", e) from e
    atexit.register(shutil.rmtree, path, True)
    return path


def _discard(writer: WriteBehind, directory: str) -> None:
    """Closes a table's store and removes its files (the table is gone)."""
    try:
        writer.close(drain=False)  # its rows are going with the directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


class TieredTable(DynamicTable):
    """One shard of a dynamic table with a disk tier (see the module doc).

    Args:
        config: what the table is.
        capacity: rows to allocate up front.
        directory: where the store lives; wiped now, removed with the table.
        memory_rows: rows kept in memory (> 0), or
        memory_bytes: bytes of rows, slots and bookkeeping kept in memory.
        backend: the store's name.
        queue_rows: records that may wait to be written (0: the default).

    Raises:
        InvalidArgumentError: no budget, or both kinds.
        ResourceExhaustedError, PermissionDeniedError: the store cannot be
            opened (the message names ``directory``).
    """

    def __init__(
        self,
        config: TableConfig,
        capacity: int | None = None,
        *,
        directory: str,
        memory_rows: int = 0,
        memory_bytes: int = 0,
        backend: str = "log",
        queue_rows: int = 0,
    ) -> None:
        if (memory_rows > 0) == (memory_bytes > 0):
            raise InvalidArgumentError(
                f"table {config.name!r}: a disk tier needs memory_rows or memory_bytes > 0, "
                f"got {memory_rows} and {memory_bytes}"
            )
        super().__init__(config, capacity)
        self.directory = directory
        self._memory_rows = memory_rows
        self._memory_bytes = memory_bytes
        store = open_store(backend, directory)
        store.clear()  # scratch: what a previous process left is not this table's
        budget = self.budget_rows
        self._codec = self._codec_for(self.rule)
        if store.buffered:  # a store that queues its own writes takes them directly
            default = max(4096, budget // 4, QUEUE_BYTES // self._codec.record_bytes)
            self._writer: DirectWriter | WriteBehind = DirectWriter(store, queue_rows or default)
        else:
            self._writer = WriteBehind(store, queue_rows or max(4096, budget // 4))
        self._tier = {"memory_hits": 0, "disk_hits": 0, "disk_bytes_read": 0}
        self._next_disk_scan = 0
        # which ids may be on disk: most misses are new ids, answered without a read
        # (a store that indexes its ids in memory answers that itself)
        self._filter = None if store.indexed else IdFilter(max(16 * budget, 4096))
        # ids whose record on disk changed (put or deleted) since the last checkpoint
        # of this table's chain, and those a checkpoint in progress is writing
        self._dirty: list[np.ndarray] = []
        self._dirty_rows = 0  # ids in _dirty, repeats included
        self._dirty_unique = 0  # ids in _dirty after its last de-duplication
        self._saving: np.ndarray | None = None
        self.chain: str | None = None  # the checkpoint chain the next save may extend
        self.chain_id = uuid.uuid4().hex[:12]
        self._finalizer = weakref.finalize(self, _discard, self._writer, directory)

    def _mark(self, ids: np.ndarray) -> None:
        """Remembers that the records of ``ids`` changed on disk (lock held).

        Only while a checkpoint could be a delta (a chain was committed, or a save
        is under way): without one the next save writes every row anyway.  The
        list is de-duplicated when it doubles, so that costs O(1) per id.
        """
        if not ids.size or (self.chain is None and self._saving is None):
            return
        self._dirty.append(np.array(ids, np.int64))
        self._dirty_rows += ids.size
        if self._dirty_rows > max(65536, 2 * self._dirty_unique):
            self._dirty = [np.unique(np.concatenate(self._dirty))]
            self._dirty_rows = self._dirty_unique = self._dirty[0].size

    def _codec_for(self, rule: UpdateRule | None) -> RowCodec:
        names = () if rule is None else tuple(rule.slot_names)
        return RowCodec(self.config.dim, self.dtype, names)

    @property
    def budget_rows(self) -> int:
        """Rows kept in memory."""
        if self._memory_rows:
            return self._memory_rows
        slots = 0 if self.rule is None else len(self.rule.slot_names)
        return memory_budget_rows(self.config, self._memory_bytes, slots)

    def close(self) -> None:
        """Stops the writer and removes the store's files (the table is unusable)."""
        self._finalizer()

    # -- the hooks ----------------------------------------------------------------------
    def _check_tier(self) -> None:
        self._writer.check()

    def _fetch(self, ids: np.ndarray, take: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """``(present, records of the present ids)``: the write-behind queue first,
        then one batched read of the store; ``take`` (unique ids): the present
        ones leave the disk (they come into memory)."""
        maybe = None if self._filter is None else self._filter.might_contain(ids)
        if maybe is not None and not maybe.all():
            present = np.zeros(ids.shape[0], bool)
            if not maybe.any():
                return present, np.empty((0, self._codec.record_bytes), np.uint8)
            present[maybe], records = self._fetch(ids[maybe], take)
            return present, records
        unique, inverse = unique_ids(ids)
        if unique is not ids:  # peek takes repeated ids
            present, records = self._fetch(unique)
            full = np.empty((unique.shape[0], records.shape[1]), np.uint8)
            full[present] = records
            return present[inverse], full[inverse][present[inverse]]
        rb = self._codec.record_bytes
        present, records = self._writer.take(ids, rb) if take else self._writer.read(ids, rb)
        self._tier["disk_bytes_read"] += int(records.nbytes)
        return present, records

    def _bring_in(self, unique: np.ndarray, found: np.ndarray) -> np.ndarray:
        miss = np.flatnonzero(found < 0)
        self._tier["memory_hits"] += unique.shape[0] - miss.size
        if not miss.size:
            return found
        ids = unique[miss]
        present, records = self._fetch(ids, take=True)
        if not present.any():
            return found
        ids = ids[present]
        rows, slots, touched, traffic = self._codec.decode(records)
        self._reserve(ids.shape[0])
        placed = self._index.insert(ids)
        put_rows(self._rows, placed, rows)
        for k, v in slots.items():
            put_rows(self._slots[k], placed, v)
        self._touched[placed] = touched
        self._traffic[placed] = traffic
        self._mark(ids)
        self._tier["disk_hits"] += ids.shape[0]
        found = found.copy()  # may be a recent lookup's slots: never change those
        found[miss[present]] = placed
        return found

    def _read_held(self, ids: np.ndarray, out: np.ndarray, at: np.ndarray) -> np.ndarray:
        present, records = self._fetch(ids)
        if not present.any():
            return present
        horizon = self._horizon()
        rows, _, touched, _ = self._codec.decode(records)
        live = touched >= horizon if horizon else np.ones(rows.shape[0], bool)
        out[at[present][live]] = rows[live]
        result = present.copy()
        result[present] = live
        return result

    def _settle(self, keep: np.ndarray) -> None:
        budget = self.budget_rows
        over = self._index.size - budget
        if over <= 0 or self._writer.error is not None:
            return
        live = self._index.live_slots()
        movable = np.ones(self._index.capacity, bool)
        movable[keep] = False
        live = live[movable[live]]
        # a quarter of the budget at a time: ranking the rows costs O(budget) per
        # call, so it runs every few requests, not every one (the hit rate drops by
        # under a percent: memory is 75-100% full instead of 97-100%)
        n = min(over + max(1, budget // 4), live.size)
        if n <= 0:
            return
        age = self.step - self._touched[live].astype(np.int64)
        # rows touched since the last push wait for it: another worker's lookup
        # must not send to disk the rows this worker's push is about to update
        # (unless nothing else can go)
        settled = age > 0
        if np.count_nonzero(settled) >= n:
            live, age = live[settled], age[settled]
        score = self._traffic[live] / (1.0 + age)
        victims = live if n == live.size else live[np.argpartition(score, n - 1)[:n]]
        records = self._codec.encode(
            take_rows(self._rows, victims),
            {k: take_rows(v, victims) for k, v in self._slots.items()},
            self._touched[victims],
            self._traffic[victims],
        )
        ids = self._index.keys[victims]
        try:
            self._writer.put(ids, records)
        except OpError:
            return  # they stay in memory; the next request raises the writer's error
        self._mark(ids)
        before = self._index.removals
        self._index.remove(victims)
        self._restamp(victims, before)
        if self._filter is not None:
            self._filter.add(ids)
            if self._filter.full:
                self._rebuild_filter()

    def _restamp(self, victims: np.ndarray, before: int) -> None:
        """Keeps the recent lookups that no victim was part of valid for the pushes
        that follow them (lock held): removing other keys moved none of theirs,
        and a push would otherwise probe the index again for every id."""
        removed = np.zeros(self._index.capacity, bool)
        removed[victims] = True
        for i, (ids, slots, stamp) in enumerate(self._recent):
            if stamp == before and not removed[slots].any():
                self._recent[i] = (ids, slots, self._index.removals)

    def _rebuild_filter(self) -> None:
        """A filter of the ids on disk now, sized for twice as many (lock held)."""
        try:
            self._writer.flush()
        except OpError:
            return  # the filter only grows less exact; the next request raises
        held = list(self._writer.store.scan_ids())
        count = sum(ids.shape[0] for ids in held)
        fresh = IdFilter(max(2 * count, 16 * self.budget_rows, 4096))
        for ids in held:
            fresh.add(ids)
        fresh.added = count
        self._filter = fresh

    def _bind(self, rule: UpdateRule | None) -> None:
        if rule is not None and self.rule is None:
            # rows on disk get the slots the rule starts them with, as memory's do
            codec = self._codec_for(rule)
            self._writer.flush()
            for ids, records in self._writer.store.scan(self._codec.record_bytes):
                rows, _, touched, traffic = self._codec.decode(records)
                self._writer.store.write(
                    ids, codec.encode(rows, rule.init_slots(rows), touched, traffic)
                )
            super()._bind(rule)
            self._codec = codec
            self.chain = None  # every record changed: the next checkpoint is a full one
            return
        super()._bind(rule)

    def _evict(self, full: bool = False) -> None:
        super()._evict(full)
        ttl = self.config.ttl_steps
        # the disk's scan reads every record: at most once per ttl pushes, and
        # whenever a caller observes the table (stats, export)
        if not ttl or (not full and self.step < self._next_disk_scan):
            return
        self._next_disk_scan = self.step + ttl
        horizon = self._horizon()
        if not horizon:
            return
        self._writer.flush()
        stale = [
            ids[self._codec.touched(records) < horizon]
            for ids, records in self._writer.store.scan(self._codec.record_bytes)
        ]
        stale_ids = np.concatenate(stale) if stale else np.zeros(0, np.int64)
        if stale_ids.size:
            self._writer.store.write(
                stale_ids[:0], np.empty((0, self._codec.record_bytes), np.uint8), stale_ids
            )
            self._counters["evicted_rows"] += int(stale_ids.size)
            self._mark(stale_ids)

    def _tier_stats(self) -> dict[str, int]:
        self._writer.flush()
        store = self._writer.store
        return {
            "memory_rows": self._index.size,
            "disk_rows": store.count(),
            "disk_bytes_written": self._writer.bytes_written,
            "disk_bytes": store.disk_bytes,
            **self._tier,
        }

    def _with_held(self, state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self._writer.flush()
        parts: dict[str, list[Any]] = {k: [state[k]] for k in ("ids", "rows", "touched", "traffic")}
        for k in self._slots:
            parts[f"slot/{k}"] = [state[f"slot/{k}"]]
        for ids, records in self._writer.store.scan(self._codec.record_bytes):
            rows, slots, touched, traffic = self._codec.decode(records)
            parts["ids"].append(ids)
            parts["rows"].append(rows)
            parts["touched"].append(touched)
            parts["traffic"].append(traffic)
            for k, v in slots.items():
                parts[f"slot/{k}"].append(v)
        return {**state, **{k: np.concatenate(v) for k, v in parts.items()}}

    def export_chunks(
        self, chunk_rows: int = 65536, delta: bool = False
    ) -> tuple[dict[str, np.ndarray], Iterator[dict[str, np.ndarray]], list[np.ndarray]]:
        """A consistent copy without the disk tier in memory: ``(state, chunks, deleted)``.

        ``state`` is :meth:`export_state` of the rows in memory (with the
        candidates, step and counters); ``chunks`` yields rows on disk (ids, rows,
        slots, clocks, traffic), ``chunk_rows`` at a time, from the store's
        snapshot taken with ``state`` under the table's lock: requests go on while
        the chunks are read, unseen by them.  With ``delta`` only the rows whose
        record changed since the last checkpoint of :attr:`chain` come, and
        ``deleted`` fills (once ``chunks`` is exhausted) with the ids that left
        the disk since.  Exhaust or close ``chunks`` (it holds the snapshot);
        then :meth:`commit_save` or :meth:`abort_save`.
        """
        with self._lock:
            self._evict(full=True)
            self._writer.flush()
            state = self._export_memory()
            snapshot = self._writer.store.snapshot()
            codec = self._codec
            pending = [self._saving] if self._saving is not None else []
            changed = np.unique(np.concatenate([*pending, *self._dirty, np.zeros(0, np.int64)]))
            self._saving, self._dirty = changed, []
            self._dirty_rows = self._dirty_unique = 0
        deleted: list[np.ndarray] = []

        def part(ids: np.ndarray, records: np.ndarray) -> dict[str, np.ndarray]:
            rows, slots, touched, traffic = codec.decode(records)
            return {
                "ids": ids,
                "rows": rows,
                "touched": touched,
                "traffic": traffic,
                **{f"slot/{k}": v for k, v in slots.items()},
            }

        def chunks() -> Iterator[dict[str, np.ndarray]]:
            with snapshot:
                if not delta:
                    for ids, records in snapshot.scan(codec.record_bytes, chunk_rows):
                        yield part(ids, records)
                    return
                for lo in range(0, changed.size, chunk_rows):
                    ids = changed[lo : lo + chunk_rows]
                    found, records = snapshot.read(ids, codec.record_bytes)
                    deleted.append(ids[~found])
                    if found.any():
                        yield part(ids[found], records)

        return state, chunks(), deleted

    def commit_save(self, chain: str) -> None:
        """The checkpoint :meth:`export_chunks` began is committed as ``chain``."""
        with self._lock:
            self._saving = None
            self.chain = chain

    def abort_save(self) -> None:
        """The checkpoint :meth:`export_chunks` began failed: its changes stay due."""
        with self._lock:
            if self._saving is not None:
                self._dirty.insert(0, self._saving)
                self._dirty_rows += self._saving.size
                self._saving = None

    def load_rows(self, part: dict[str, np.ndarray], skip: np.ndarray | None = None) -> None:
        """Writes the rows of ``part`` (ids, rows, slots, clocks, traffic) straight to
        the disk tier, replacing what it holds for them, as a restore streams a
        checkpoint's segments in order; ids in sorted ``skip`` (rows a later part
        holds) are left out.

        Raises:
            OpError: the store's typed error.
        """
        ids = part["ids"]
        if skip is not None and skip.size and ids.size:
            pos = np.minimum(np.searchsorted(skip, ids), skip.size - 1)
            mine = skip[pos] != ids
            part, ids = {k: v[mine] for k, v in part.items()}, ids[mine]
        if not ids.size:
            return
        with self._lock:
            names = self._codec.slot_names
            missing = [k for k in names if f"slot/{k}" not in part]
            if missing and self.rule is not None:  # saved before a rule was bound
                fresh = self.rule.init_slots(part["rows"])
                part = {**part, **{f"slot/{k}": fresh[k] for k in missing}}
            records = self._codec.encode(
                part["rows"],
                {k: part[f"slot/{k}"] for k in names},
                part["touched"],
                part["traffic"],
            )
            self._writer.flush()
            self._writer.store.write(ids, records)
            self._mark(ids)
            if self._filter is not None:
                self._filter.add(ids)
                if self._filter.full:
                    self._rebuild_filter()

    def drop_rows(self, ids: np.ndarray, skip: np.ndarray | None = None) -> None:
        """Deletes ``ids`` from the disk tier (a restore applying a checkpoint's
        deletions; rows in memory stay), less those in sorted ``skip`` (rows a
        later part holds, wherever they are now).

        Raises:
            OpError: the store's typed error.
        """
        if skip is not None and skip.size and ids.size:
            pos = np.minimum(np.searchsorted(skip, ids), skip.size - 1)
            ids = ids[skip[pos] != ids]
        if not ids.size:
            return
        with self._lock:
            ids = ids[self._index.find(ids) < 0]
            self._writer.flush()
            self._writer.store.write(
                ids[:0], np.empty((0, self._codec.record_bytes), np.uint8), ids
            )
            self._mark(ids)

    def gauges(self) -> dict[str, int]:
        """The tier's counters without a flush (disk rows may lag the queued writes)."""
        store = self._writer.store
        return {
            "memory_rows": self._index.size,
            "disk_rows": store.count(),
            "disk_bytes_written": self._writer.bytes_written,
            "disk_bytes": store.disk_bytes,
            **self._tier,
        }

    @property
    def tier_stats(self) -> dict[str, int]:
        """The tier's counters now (memory and disk rows, hits, bytes)."""
        with self._lock:
            return self._tier_stats()

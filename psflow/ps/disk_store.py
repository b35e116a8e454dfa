"""Embedded key-value stores for the disk tier of dynamic tables, behind one interface.

A :class:`RowStore` maps int64 ids to fixed-size byte records on the PS's local
disk.  Backends register a factory by name (:func:`register_store`); the
factory imports its library when called, so a PS without a disk tier never
imports one.  Two are registered, chosen by measurement
(``benchmarks/kv_stores.py``, ``benchmarks/tiered.py``):

* ``"log"`` (the default, :mod:`psflow.ps.log_store`): append-only segment
  files and an in-memory index; it reads, writes and deletes a tier's
  batches 2-4x as fast as LMDB, because the tier writes thousands of random
  ids per request and LMDB dirties a page for each.
* ``"lmdb"``: a copy-on-write B-tree in one file that a killed process cannot
  tear, snapshots by read transaction, and no index in memory (when rows on
  disk are many and memory is very tight); its batched reads ran about twice
  as fast as RocksDB through ``rocksdict``.

Every failure of the disk (full, read-only, gone) raises
:class:`psflow.errors.ResourceExhaustedError` or
:class:`psflow.errors.PermissionDeniedError` naming the store's path; a write
batch is one transaction, so a failed one changes nothing.

Example:
    >>> import tempfile, numpy as np
    >>> store = open_store("lmdb", tempfile.mkdtemp())
    >>> store.write(np.array([3, 9], np.int64), np.array([[1, 2], [3, 4]], np.uint8))
    >>> found, records = store.read(np.array([9, 5], np.int64), 2)
    >>> found.tolist(), records[0].tolist()
    ([True, False], [3, 4])
    >>> store.close()
"""

from __future__ import annotations

import abc
import errno
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from psflow.errors import (
    AlreadyExistsError,
    DataLossError,
    InvalidArgumentError,
    OpError,
    PermissionDeniedError,
    ResourceExhaustedError,
)

__all__ = ["RowStore", "StoreSnapshot", "open_store", "register_store", "store_names"]

# Ids become big-endian keys with the sign bit flipped: byte order is id order,
# so a scan returns ids ascending and batched reads walk the B-tree forwards.
_KEY = np.dtype(">u8")
_SIGN = np.uint64(1 << 63)


def encode_keys(ids: np.ndarray) -> np.ndarray:
    """int64 ``ids`` as 8-byte keys that sort like the ids (rows of a uint8 array)."""
    return (ids.view(np.uint64) ^ _SIGN).astype(_KEY).view(np.uint8).reshape(-1, 8)


def decode_keys(keys: np.ndarray) -> np.ndarray:
    """The inverse of :func:`encode_keys`: ``(n, 8)`` uint8 to int64 ids."""
    return (np.ascontiguousarray(keys).view(_KEY).reshape(-1).astype(np.uint64) ^ _SIGN).view(
        np.int64
    )


class StoreSnapshot(abc.ABC):
    """A read-only, consistent view of a :class:`RowStore` (a context manager)."""

    @abc.abstractmethod
    def scan(self, record_bytes: int, batch: int = 4096) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Every ``(ids, records)`` of the view, ascending by id, ``batch`` at a time."""

    @abc.abstractmethod
    def read(self, ids: np.ndarray, record_bytes: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`RowStore.read` of the view."""

    @abc.abstractmethod
    def close(self) -> None:
        """Releases the view."""

    def __enter__(self) -> StoreSnapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RowStore(abc.ABC):
    """Fixed-size records keyed by int64 id, on disk; thread-safe.

    Attributes:
        path: the directory the store lives in (errors name it).
    """

    path: str
    # True where write() returns once the records are readable through the store
    # and a thread of the store's own puts them on disk (check() and flush() then
    # report and wait for it); the table needs no write-behind queue of its own.
    buffered: bool = False
    # True where the store knows from memory which ids it holds (an absent id
    # costs no disk read); the table needs no id filter of its own.
    indexed: bool = False
    # a buffered store's bound on records waiting to be written (write() waits)
    max_queued: int = 0
    # the first failure of a buffered store's writer, while it lasts
    error: OpError | None = None
    # bytes a buffered store's writer put on disk
    bytes_written: int = 0

    def check(self) -> None:
        """Raises the store's write error unless retrying what failed succeeds now
        (a buffered store; others raise from :meth:`write` itself)."""

    def flush(self, timeout: float | None = None) -> None:
        """Waits until everything written is on disk (a buffered store).

        Raises:
            OpError: the writer failed (its typed error).
            DeadlineExceededError: not done within ``timeout``.
        """

    @abc.abstractmethod
    def read(self, ids: np.ndarray, record_bytes: int) -> tuple[np.ndarray, np.ndarray]:
        """``(found, records)`` of ``ids`` in one batched read: ``found`` a bool mask,
        ``records`` a ``(found.sum(), record_bytes)`` uint8 array in the order of
        the found ids."""

    def take(self, ids: np.ndarray, record_bytes: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`read` of unique ``ids``, then deletes those found: ``(found,
        records)`` of what was held, now gone from the store.

        Raises:
            OpError: the store's typed error; nothing deleted.
        """
        found, records = self.read(ids, record_bytes)
        if found.any():
            self.write(ids[:0], np.empty((0, record_bytes), np.uint8), ids[found])
        return found, records

    @abc.abstractmethod
    def write(
        self,
        ids: np.ndarray,
        records: np.ndarray,
        delete: np.ndarray | None = None,
        new: bool = False,
    ) -> None:
        """Puts ``records`` (uint8, one row per id) and deletes ``delete`` in one
        transaction: all of it lands or (on an error) none.  Of a repeated id the
        last record wins.  ``new``: the caller vouches that ``ids`` are unique and
        none is held (rows leaving a table's memory): a store may skip looking."""

    @abc.abstractmethod
    def scan(self, record_bytes: int, batch: int = 4096) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Every ``(ids, records)``, ascending by id, ``batch`` at a time, from one
        consistent snapshot (writes during the scan are not seen)."""

    @abc.abstractmethod
    def scan_ids(self, batch: int = 65536) -> Iterator[np.ndarray]:
        """Every id, ascending, ``batch`` at a time, from one consistent snapshot."""

    @abc.abstractmethod
    def snapshot(self) -> StoreSnapshot:
        """A consistent, read-only view of the store as it is now: later writes are
        not seen through it (close it: it pins the pages it sees)."""

    @abc.abstractmethod
    def count(self) -> int:
        """Records held."""

    @abc.abstractmethod
    def clear(self) -> None:
        """Deletes every record."""

    @abc.abstractmethod
    def close(self) -> None:
        """Releases the store's files (the data stays on disk)."""

    @property
    @abc.abstractmethod
    def disk_bytes(self) -> int:
        """Bytes the store's files hold on disk."""


def disk_error(path: str, what: str, error: BaseException) -> OpError:
    """The typed psflow error for a failed disk operation on the store at ``path``:
    PermissionDeniedError for a read-only disk, DataLossError for a read that
    fails, ResourceExhaustedError for any other write (a full disk: LMDB reports
    the failed page write of a commit as EIO, so the free space is named too)."""
    code = getattr(error, "errno", None)
    text = f"disk tier at {path!r}: {what} failed: {error}"
    if code in (errno.EACCES, errno.EROFS, errno.EPERM) or "read-only" in str(error).lower():
        return PermissionDeniedError(text)
    if what in ("read", "scan") and code not in (errno.ENOSPC, errno.EDQUOT):
        return DataLossError(text)
    try:
        stat = os.statvfs(path if os.path.isdir(path) else os.path.dirname(path) or ".")
        text += f" ({stat.f_bavail * stat.f_frsize} bytes free on its disk)"
    except OSError:
        pass
    return ResourceExhaustedError(text)


class _LmdbStore(RowStore):
    """LMDB: one memory-mapped B-tree file; reads are batched through a cursor."""

    # Address space only (the file grows as it fills): a table this big is far past
    # any local SSD, and a map that fills raises a typed error, never a crash.
    _MAP_SIZE = 1 << 40

    def __init__(self, path: str, map_size: int | None = None) -> None:
        import lmdb  # lazily: a PS without a disk tier never imports it

        self._lmdb = lmdb
        self.path = path
        try:
            os.makedirs(path, exist_ok=True)
            # sync=False: a killed process loses nothing (the page cache survives it)
            # and a machine crash loses only writes since the last sync; the tier is
            # rebuilt from the checkpoint at restart either way. writemap stays off:
            # a full disk must be an error from write(), not SIGBUS on a mapped page.
            self._env = lmdb.open(
                path,
                map_size=map_size or self._MAP_SIZE,
                subdir=True,
                sync=False,
                metasync=False,
                readahead=False,
                writemap=False,
                max_dbs=0,
                lock=True,
            )
        except (lmdb.Error, OSError) as e:
            raise disk_error(path, "open", e) from e
        self._write_lock = threading.Lock()

    def read(self, ids: np.ndarray, record_bytes: int) -> tuple[np.ndarray, np.ndarray]:
        try:
            with self._env.begin() as txn:
                return self._read_in(txn, ids, record_bytes)
        except self._lmdb.Error as e:
            raise disk_error(self.path, "read", e) from e

    def _read_in(
        self, txn: Any, ids: np.ndarray, record_bytes: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`read` in the transaction ``txn``."""
        order = np.argsort(ids, kind="stable")
        packed = encode_keys(ids[order]).tobytes()
        keys = [packed[i : i + 8] for i in range(0, len(packed), 8)]
        found = np.zeros(ids.shape[0], bool)
        with txn.cursor() as cur:
            got = cur.getmulti(keys, dupdata=False)
        if not got:
            return found, np.empty((0, record_bytes), np.uint8)
        # getmulti returns the found keys in request order (ascending ids)
        hit_ids = decode_keys(np.frombuffer(b"".join(k for k, _ in got), np.uint8).reshape(-1, 8))
        flat = np.frombuffer(b"".join(v for _, v in got), np.uint8)
        if flat.size != len(got) * record_bytes:
            raise DataLossError(
                f"disk tier at {self.path!r}: records are not {record_bytes} bytes each"
            )
        at = order[np.searchsorted(ids[order], hit_ids)]
        found[at] = True
        # the records in the order of the found ids
        records = np.empty((len(got), record_bytes), np.uint8)
        records[np.argsort(np.argsort(at))] = flat.reshape(len(got), record_bytes)
        return found, records

    def write(
        self,
        ids: np.ndarray,
        records: np.ndarray,
        delete: np.ndarray | None = None,
        new: bool = False,
    ) -> None:
        if records.shape[0] != ids.shape[0]:
            raise InvalidArgumentError(
                f"disk tier at {self.path!r}: {ids.shape[0]} ids but {records.shape[0]} records"
            )
        # The write-behind hands over sorted unique ids: skip the argsort and the
        # copy of every record then (duplicates sort stably: the last one wins).
        if ids.shape[0] > 1 and not bool(np.all(ids[1:] > ids[:-1])):
            order = np.argsort(ids, kind="stable")
            ids, records = ids[order], records[order]
        items: Any = None
        if ids.shape[0]:
            # One bytes object per key and per record, made in C by tolist() of a
            # void view (a Python loop of slices cost ~3x as much per batch).
            keys = encode_keys(ids).view(f"V{_KEY.itemsize}").ravel().tolist()
            values = np.ascontiguousarray(records).view(np.uint8).reshape(ids.shape[0], -1)
            rows = (
                values.view(f"V{values.shape[1]}").ravel().tolist()
                if values.shape[1]
                else [b""] * ids.shape[0]
            )
            items = zip(keys, rows)
        try:
            with self._write_lock, self._env.begin(write=True) as txn:
                if delete is not None and delete.size:
                    for key in encode_keys(np.sort(delete)).view("V8").ravel().tolist():
                        txn.delete(key)
                if items is not None:
                    with txn.cursor() as cur:
                        cur.putmulti(items, dupdata=True, overwrite=True)
        except self._lmdb.Error as e:
            raise disk_error(self.path, "write", e) from e

    def scan(self, record_bytes: int, batch: int = 4096) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        with self.snapshot() as snap:
            yield from snap.scan(record_bytes, batch)

    def snapshot(self) -> StoreSnapshot:
        try:
            return _LmdbSnapshot(self, self._env.begin())
        except self._lmdb.Error as e:
            raise disk_error(self.path, "snapshot", e) from e

    def scan_ids(self, batch: int = 65536) -> Iterator[np.ndarray]:
        try:
            with self._env.begin() as txn, txn.cursor() as cur:
                keys: list[bytes] = []
                for key in cur.iternext(keys=True, values=False):
                    keys.append(key)
                    if len(keys) == batch:
                        yield decode_keys(np.frombuffer(b"".join(keys), np.uint8).reshape(-1, 8))
                        keys = []
                if keys:
                    yield decode_keys(np.frombuffer(b"".join(keys), np.uint8).reshape(-1, 8))
        except self._lmdb.Error as e:
            raise disk_error(self.path, "scan", e) from e

    def _batch(
        self, keys: list[bytes], values: list[bytes], record_bytes: int
    ) -> tuple[np.ndarray, np.ndarray]:
        ids = decode_keys(np.frombuffer(b"".join(keys), np.uint8).reshape(-1, 8))
        flat = np.frombuffer(b"".join(values), np.uint8)
        if flat.size != len(values) * record_bytes:
            raise DataLossError(
                f"disk tier at {self.path!r}: records are not {record_bytes} bytes each"
            )
        return ids, flat.reshape(len(values), record_bytes)

    def count(self) -> int:
        return int(self._env.stat()["entries"])

    def clear(self) -> None:
        try:
            with self._write_lock, self._env.begin(write=True) as txn:
                txn.drop(self._env.open_db(txn=txn), delete=False)
        except self._lmdb.Error as e:
            raise disk_error(self.path, "clear", e) from e

    @property
    def disk_bytes(self) -> int:
        info = self._env.info()
        stat = self._env.stat()
        return int((info["last_pgno"] + 1) * stat["psize"])

    def close(self) -> None:
        self._env.close()


class _LmdbSnapshot(StoreSnapshot):
    """An LMDB read transaction: MVCC, so writers go on while it is open."""

    def __init__(self, store: _LmdbStore, txn: Any) -> None:
        self._store = store
        self._txn = txn

    def scan(self, record_bytes: int, batch: int = 4096) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        store = self._store
        try:
            with self._txn.cursor() as cur:
                keys: list[bytes] = []
                values: list[bytes] = []
                for key, value in cur:
                    keys.append(key)
                    values.append(value)
                    if len(keys) == batch:
                        yield store._batch(keys, values, record_bytes)
                        keys, values = [], []
                if keys:
                    yield store._batch(keys, values, record_bytes)
        except store._lmdb.Error as e:
            raise disk_error(store.path, "scan", e) from e

    def read(self, ids: np.ndarray, record_bytes: int) -> tuple[np.ndarray, np.ndarray]:
        try:
            return self._store._read_in(self._txn, ids, record_bytes)
        except self._store._lmdb.Error as e:
            raise disk_error(self._store.path, "read", e) from e

    def close(self) -> None:
        self._txn.abort()


def _lmdb(path: str, **options: object) -> RowStore:
    return _LmdbStore(path, **options)  # type: ignore[arg-type]


def _log(path: str, **options: object) -> RowStore:
    from .log_store import LogStore  # it imports this module

    return LogStore(path, **options)  # type: ignore[arg-type]


_FACTORIES: dict[str, Callable[..., RowStore]] = {"lmdb": _lmdb, "log": _log}
_LOCK = threading.Lock()


def register_store(name: str, factory: Callable[..., RowStore]) -> None:
    """Registers ``factory(path, **options) -> RowStore`` under ``name``.

    Raises:
        AlreadyExistsError: ``name`` is registered to another factory.
    """
    key = name.strip().lower()
    with _LOCK:
        held = _FACTORIES.get(key)
        if held is not None and held is not factory:
            raise AlreadyExistsError(f"row store {name!r} is registered already")
        _FACTORIES[key] = factory


def store_names() -> list[str]:
    """The registered backends' names."""
    with _LOCK:
        return sorted(_FACTORIES)


def open_store(name: str, path: str, **options: object) -> RowStore:
    """Opens (creating) the store ``name`` in directory ``path``.

    Raises:
        InvalidArgumentError: an unknown backend (the registered ones are named).
        ResourceExhaustedError, PermissionDeniedError: the directory cannot be
            created or opened.
    """
    with _LOCK:
        factory = _FACTORIES.get(name.strip().lower())
    if factory is None:
        raise InvalidArgumentError(f"unknown row store {name!r}; registered: {store_names()}")
    return factory(path, **options)

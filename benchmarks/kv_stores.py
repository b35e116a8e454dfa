"""Embedded key-value stores for the disk tier: psflow's log store vs LMDB vs RocksDB (rocksdict).

The disk tier (``psflow/ps/tiered_table.py``) reads the ids of a request that
missed memory in one batch and writes demoted rows in batches; this measures
both on each store, side by side in one run: batched random reads and
batched random writes of fixed-size records (``--record`` bytes, 1 KiB by
default; 72 B is an 8-float row with one Adagrad slot and its two counters)
keyed by random int64 ids, ``--batch`` records a batch, into a store already
holding ``--rows``.  The log store (``psflow.ps.log_store``, the default) and
LMDB go through ``psflow.ps.disk_store``; the log store writes in a thread
of its own, so each write phase ends with its flush (timed).  RocksDB goes
through ``rocksdict`` (raw mode, write-ahead log off, as a scratch tier would
run it) when it is installed (``pip install rocksdict``), else one
``skipped`` line.

Prints JSON lines (stdout) and a table (stderr); ``--quick``: fewer rows.
Format: shared/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
import time

import numpy as np
from _common import emit, progress, table

BENCH = "kv_stores"


def _row_store(name: str):
    def opener(path: str):
        from psflow.ps.disk_store import open_store

        store = open_store(name, path)
        return store.write, lambda ids, width: store.read(ids, width), store.flush

    return opener


def _rocksdict(path: str):
    import rocksdict

    from psflow.ps.disk_store import encode_keys

    db = rocksdict.Rdict(path, options=rocksdict.Options(raw_mode=True))
    options = rocksdict.WriteOptions()
    options.disable_wal = True

    def write(ids: np.ndarray, records: np.ndarray) -> None:
        order = np.argsort(ids)
        keys = encode_keys(ids[order]).tobytes()
        values = records[order].tobytes()
        width = records.shape[1]
        batch = rocksdict.WriteBatch(raw_mode=True)
        for i in range(ids.shape[0]):
            batch.put(keys[8 * i : 8 * i + 8], values[width * i : width * (i + 1)])
        db.write(batch, options)

    def flush() -> None:
        pass  # each write above is synchronous

    def read(ids: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
        # the same work as the row store's read: found mask and one record array
        order = np.argsort(ids)
        keys = encode_keys(ids[order]).tobytes()
        got = db[[keys[i : i + 8] for i in range(0, len(keys), 8)]]
        found = np.zeros(ids.shape[0], bool)
        found[order] = [v is not None for v in got]
        flat = np.frombuffer(b"".join(v for v in got if v is not None), np.uint8)
        records = np.empty((int(found.sum()), width), np.uint8)
        records[np.argsort(order[found[order]])] = flat.reshape(-1, width)
        return found, records

    return write, read, flush


def measure(opener, rows: int, batch: int, width: int, rounds: int) -> dict[str, float]:
    """Rows per second of batched random writes (filling to ``rows``) and reads."""
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as path:
        write, read, flush = opener(path)
        held = []
        start = time.perf_counter()
        for _ in range(rows // batch):
            ids = rng.integers(-(2**63), 2**63 - 1, batch, dtype=np.int64)
            write(ids, rng.integers(0, 255, (batch, width), dtype=np.uint8))
            held.append(ids)
        flush()
        fill = rows / (time.perf_counter() - start)
        every = np.concatenate(held)
        start = time.perf_counter()
        for _ in range(rounds):
            read(rng.choice(every, batch, replace=False), width)
        reads = rounds * batch / (time.perf_counter() - start)
        start = time.perf_counter()
        for _ in range(rounds):
            ids = rng.choice(every, batch, replace=False)
            write(ids, rng.integers(0, 255, (batch, width), dtype=np.uint8))
        flush()
        updates = rounds * batch / (time.perf_counter() - start)
    return {"fill": fill, "read": reads, "update": updates}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer rows")
    p.add_argument("--record", type=int, default=1024, help="bytes per record")
    p.add_argument("--batch", type=int, default=4096, help="records per batch")
    p.add_argument("--rows", type=int, default=0, help="rows to fill (default 200k, quick 40k)")
    args = p.parse_args()
    rows = args.rows or (40_000 if args.quick else 200_000)
    rounds = 10 if args.quick else 30
    stores = {"log": _row_store("log"), "lmdb": _row_store("lmdb")}
    if importlib.util.find_spec("rocksdict") is not None:
        stores["rocksdict"] = _rocksdict
    else:
        emit(BENCH, "rocksdict", "skipped", 0, "", reason="rocksdict is not installed")
    results = {}
    for name, opener in stores.items():
        progress(f"{name}: {rows} rows of {args.record} B, batches of {args.batch}")
        results[name] = measure(opener, rows, args.batch, args.record, rounds)
        for metric, value in results[name].items():
            emit(BENCH, name, f"{metric}_rows_per_s", value, "rows/s", record=args.record,
                 batch=args.batch, rows=rows)  # fmt: skip
    for other in ("lmdb", "rocksdict"):
        if other in results:
            for metric in ("fill", "read", "update"):
                ratio = results["log"][metric] / results[other][metric]
                emit(BENCH, f"log/{other}", f"{metric}_ratio", ratio, "x")
    table(
        ["store", "fill rows/s", "read rows/s", "update rows/s"],
        [
            [n, f"{r['fill']:.0f}", f"{r['read']:.0f}", f"{r['update']:.0f}"]
            for n, r in results.items()
        ],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

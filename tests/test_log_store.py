"""The log-structured row store (psflow.ps.log_store) against a plain dict.

Writes, deletes and repeated ids over many small segments (so compaction runs
while the test writes), snapshots that keep their view while the store moves
on, a reopen that rebuilds the index from the segments, a torn tail that is
cut off and never read as a row, a flipped bit that is a typed error, and a
real process killed with SIGKILL in the middle of its writes whose store
reopens whole.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from psflow import errors
from psflow.ps.disk_store import open_store, store_names
from psflow.ps.log_store import LogStore, record_size

WIDTH = 24


def _records(ids: np.ndarray, version: int) -> np.ndarray:
    """Records that say whose they are: the id's bytes, then the version, twice."""
    out = np.empty((ids.size, WIDTH), np.uint8)
    out[:, :8] = np.ascontiguousarray(ids).view(np.uint8).reshape(-1, 8)
    out[:, 8:16] = np.full(ids.size, version, np.int64).view(np.uint8).reshape(-1, 8)
    out[:, 16:] = out[:, 8:16]
    return out


def _agree(store: LogStore, reference: dict[int, bytes]) -> None:
    want = np.array(sorted(reference), np.int64)
    assert store.count() == want.size
    got = list(store.scan(WIDTH, batch=53))
    ids = np.concatenate([i for i, _ in got]) if got else np.zeros(0, np.int64)
    assert ids.tolist() == want.tolist()
    rows = np.concatenate([r for _, r in got]) if got else np.zeros((0, WIDTH), np.uint8)
    assert rows.tobytes() == b"".join(reference[k] for k in want.tolist())
    probe = np.concatenate([want[::3], np.array([-5, 2**62], np.int64)])
    found, records = store.read(probe, WIDTH)
    assert found.tolist() == [k in reference for k in probe.tolist()]
    assert records.tobytes() == b"".join(reference[k] for k in probe.tolist() if k in reference)


def _churn(store: LogStore, reference: dict[int, bytes], steps: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for step in range(steps):
        ids = rng.integers(-300, 300, 40).astype(np.int64)
        ids[-1] = ids[0]  # a repeat: the last record wins
        records = rng.integers(0, 256, (ids.size, WIDTH), dtype=np.uint8)
        dead = rng.integers(-300, 300, 12).astype(np.int64)
        if step % 5 == 4:
            found, taken = store.take(np.unique(dead), WIDTH)
            gone = np.unique(dead)[found]
            assert taken.tobytes() == b"".join(reference.pop(k) for k in gone.tolist())
        else:
            store.write(ids, records, dead)
            for key in dead.tolist():
                reference.pop(key, None)
            for key, row in zip(ids.tolist(), records):
                reference[key] = row.tobytes()


def test_the_log_store_matches_a_dict_through_compaction_and_a_reopen(tmp_path):
    store = LogStore(str(tmp_path), segment_bytes=8192)
    reference: dict[int, bytes] = {}
    _churn(store, reference, 300, seed=1)
    _agree(store, reference)
    store.flush(10)
    # compaction runs in the writer thread: 300 batches of 40 records of 40 bytes
    # took far more room than what is left once it caught up (dead <= 2x live)
    written = 300 * 40 * record_size(WIDTH)
    deadline = time.monotonic() + 20
    while store.disk_bytes > written / 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.disk_bytes <= written / 3
    assert len(os.listdir(tmp_path)) < 30
    store.close()
    reopened = LogStore(str(tmp_path), segment_bytes=8192)
    _agree(reopened, reference)  # deletes stayed deleted (their tombstones were kept)
    _churn(reopened, reference, 40, seed=2)
    _agree(reopened, reference)
    reopened.close()


def test_a_snapshot_keeps_its_view_while_writes_and_compaction_go_on(tmp_path):
    store = LogStore(str(tmp_path), segment_bytes=4096)
    ids = np.arange(100, dtype=np.int64)
    store.write(ids, _records(ids, 1))
    with store.snapshot() as snap:
        for version in range(2, 40):  # every record dead many times over: compaction
            store.write(ids[::2], _records(ids[::2], version))
            store.write(ids[:0], np.empty((0, WIDTH), np.uint8), ids[1::4])
        store.flush(10)
        seen = list(snap.scan(WIDTH, batch=7))
        assert np.concatenate([i for i, _ in seen]).tolist() == ids.tolist()
        assert np.concatenate([r for _, r in seen]).tobytes() == _records(ids, 1).tobytes()
        found, rows = snap.read(np.array([4, 5, 1000], np.int64), WIDTH)
        assert found.tolist() == [True, True, False]
        assert snap.read(np.array([1000], np.int64), WIDTH)[1].shape == (0, WIDTH)
        assert rows.tobytes() == _records(np.array([4, 5], np.int64), 1).tobytes()
        held = len(os.listdir(tmp_path))
    time.sleep(0.2)
    assert len(os.listdir(tmp_path)) <= held  # retired segments go once the view closes
    reference = {k: _records(np.array([k], np.int64), 39 if k % 2 == 0 else 1).tobytes()
                 for k in range(100) if k % 4 != 1}  # fmt: skip
    _agree(store, reference)
    store.close()


def _last_segment(path) -> str:
    return str(sorted(p for p in path.iterdir() if p.name.startswith("seg-"))[-1])


def test_a_torn_tail_is_cut_off_on_open_and_never_read_as_a_row(tmp_path):
    store = LogStore(str(tmp_path))
    ids = np.arange(10, dtype=np.int64)
    store.write(ids, _records(ids, 1))
    store.write(ids[5:], _records(ids[5:], 2))  # the newest records of 5..9
    store.close()
    size = record_size(WIDTH)
    with open(_last_segment(tmp_path), "r+b") as f:  # the last write half done
        f.seek(64 + 12 * size + size // 2)  # records 12.. (ids 7, 8, 9 of the second)
        f.write(b"\0" * (3 * size))
    store = LogStore(str(tmp_path))
    found, rows = store.read(ids, WIDTH)
    assert found.all()
    # 5 and 6 kept their newest record; 7..9 fall back to the last whole one
    want = np.concatenate([_records(ids[:5], 1), _records(ids[5:7], 2), _records(ids[7:], 1)])
    assert rows.tobytes() == want.tobytes()
    store.write(ids[8:], _records(ids[8:], 3))  # appends where the torn tail was
    store.close()
    store = LogStore(str(tmp_path))
    assert (
        store.read(ids[7:], WIDTH)[1].tobytes()
        == np.concatenate([_records(ids[7:8], 1), _records(ids[8:], 3)]).tobytes()
    )
    store.close()


def test_a_record_whose_bytes_changed_is_a_typed_error_not_a_row(tmp_path):
    store = LogStore(str(tmp_path))
    ids = np.arange(4, dtype=np.int64)
    store.write(ids, _records(ids, 1))
    store.flush(10)
    with open(_last_segment(tmp_path), "r+b") as f:
        f.seek(64 + 2 * record_size(WIDTH) + 20)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(errors.DataLossError, match=str(tmp_path)):
        store.read(ids, WIDTH)
    assert store.read(ids[:2], WIDTH)[1].tobytes() == _records(ids[:2], 1).tobytes()
    store.close()


_WRITER = textwrap.dedent(
    """
    import sys
    import numpy as np
    from psflow.ps.log_store import LogStore

    store = LogStore(sys.argv[1], segment_bytes=1 << 16)
    rng = np.random.default_rng(0)
    for version in range(1, 10**6):
        ids = rng.integers(0, 5000, 500).astype(np.int64)
        rows = np.empty((ids.size, 24), np.uint8)
        rows[:, :8] = ids.view(np.uint8).reshape(-1, 8)
        rows[:, 8:16] = np.full(ids.size, version, np.int64).view(np.uint8).reshape(-1, 8)
        rows[:, 16:] = rows[:, 8:16]
        store.write(ids, rows, rng.integers(0, 5000, 50).astype(np.int64))
        if version % 20 == 0:
            store.flush(30)
            print(version, flush=True)
    """
)


def test_a_process_killed_mid_write_leaves_a_store_that_reopens_whole(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        flushed = 0
        deadline = time.monotonic() + 60
        while flushed < 60 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            flushed = int(line)
        assert flushed >= 60, "the writer made no progress"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(10)
        proc.stdout.close()
    store = LogStore(str(tmp_path), segment_bytes=1 << 16)
    assert store.count() > 1000
    every = np.array(sorted(i for ids in store.scan_ids() for i in ids.tolist()), np.int64)
    found, rows = store.read(every, WIDTH)  # every record verifies: none is torn
    assert found.all()
    assert (rows[:, :8].copy().view(np.int64).ravel() == every).all()
    versions = rows[:, 8:16].copy().view(np.int64).ravel()
    assert (versions == rows[:, 16:].copy().view(np.int64).ravel()).all()
    assert versions.max() >= flushed  # what was flushed before the kill is there
    store.close()


def test_both_stores_are_registered_and_the_log_is_a_row_store(tmp_path):
    assert {"lmdb", "log"} <= set(store_names())
    store = open_store("log", str(tmp_path))
    assert isinstance(store, LogStore) and store.buffered and store.indexed
    store.close()
    with pytest.raises(errors.InvalidArgumentError, match="segment_bytes"):
        LogStore(str(tmp_path), segment_bytes=100)

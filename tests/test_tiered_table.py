"""The disk tier under dynamic tables, in one process: a TieredTable against an
all-in-memory DynamicTable fed the same requests.

Rows only move between memory and disk (their bytes unchanged), so every lookup,
step, counter and exported row must be bit for bit the reference's, for SGD and
Adagrad, with admission and eviction on.  A full disk (a tmpfs this test mounts)
must give a typed error naming the store's path and change nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid

import numpy as np
import pytest

from psflow import errors
from psflow.io.safetensors import load_file
from psflow.ps.disk_store import open_store
from psflow.ps.dynamic_table import DynamicTable, TableConfig
from psflow.ps.key_index import shard_of
from psflow.ps.tables import TableRegistry
from psflow.ps.tiered_table import TieredTable, TierOptions
from psflow.ps.write_behind import WriteBehind, _Batch

DIM = 8
SGD = {"name": "sgd", "learning_rate": 0.1}
ADAGRAD = {"name": "adagrad", "learning_rate": 0.1}


def _stream(seed: int, steps: int, space: int = 4000, batch: int = 64):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        ids = (rng.zipf(1.1, batch) % space).astype(np.int64) * 7919 - 10**6
        yield (
            ids,
            rng.standard_normal((batch, DIM)).astype(np.float32),
            rng.integers(-(10**6), space * 7919, 32).astype(np.int64),
        )


def _by_id(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    order = np.argsort(state["ids"], kind="stable")
    n = order.size
    out = {}
    for k, v in state.items():
        per_row = v.ndim and v.shape[0] == n and not k.startswith("candidate")
        out[k] = v[order] if per_row else v
    return out


def _assert_same_state(a: DynamicTable, b: DynamicTable) -> None:
    sa, sb = _by_id(a.export_state()), _by_id(b.export_state())
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and sa[k].tobytes() == sb[k].tobytes(), k


def _drive(reference: DynamicTable, tiered: DynamicTable, steps: int, push_opt=None) -> None:
    for ids, grads, probe in _stream(1, steps):
        assert tiered.lookup(ids).tobytes() == reference.lookup(ids).tobytes()
        assert tiered.apply_gradients(ids, grads, push_opt) == reference.apply_gradients(
            ids, grads, push_opt
        )
        assert tiered.lookup(probe, read_only=True).tobytes() == (
            reference.lookup(probe, read_only=True).tobytes()
        )
        assert tiered.peek(probe).tobytes() == reference.peek(probe).tobytes()


@pytest.mark.parametrize(
    ("optimizer", "ttl", "min_count", "backend"),
    [
        (SGD, 0, 1, "log"),
        (ADAGRAD, 0, 1, "log"),
        (ADAGRAD, 40, 2, "log"),
        (None, 0, 1, "log"),
        (ADAGRAD, 40, 2, "lmdb"),
    ],
    ids=["sgd", "adagrad", "adagrad-ttl-admission", "rule-bound-by-push", "lmdb"],
)
def test_a_table_many_times_its_memory_budget_equals_one_in_memory(
    tmp_path, optimizer, ttl, min_count, backend
):
    config = TableConfig("t", DIM, optimizer=optimizer, ttl_steps=ttl, min_count=min_count)
    reference = DynamicTable(config)
    tiered = TieredTable(config, directory=str(tmp_path / "store"), memory_rows=40, backend=backend)
    _drive(reference, tiered, 250, None if optimizer else SGD)
    a, b = reference.stats(), tiered.stats()
    assert b.rows == a.rows and b.rows >= 10 * 40  # the table is >= 10x its budget
    assert b.disk_rows > 0 and b.memory_rows <= 40 + 64
    for field in ("candidates", "step", "created", "admitted", "evicted_rows"):
        assert getattr(a, field) == getattr(b, field), field
    for field in ("evicted_candidates", "dropped_gradients", "lookups"):
        assert getattr(a, field) == getattr(b, field), field
    assert b.disk_hits > 0 and b.disk_bytes_read > 0 and b.disk_bytes_written > 0
    _assert_same_state(reference, tiered)
    tiered.close()


def test_hot_rows_stay_in_memory_under_a_skewed_stream(tmp_path):
    budget = 1000  # several requests of 256 ids: the tail passes through
    tiered = TieredTable(
        TableConfig("t", DIM, optimizer=SGD), directory=str(tmp_path / "s"), memory_rows=budget
    )
    rng = np.random.default_rng(0)
    high = 0
    for step in range(400):
        ids = (rng.zipf(1.1, 256) % 100_000).astype(np.int64)
        tiered.lookup(ids)
        tiered.apply_gradients(ids, np.zeros((256, DIM), np.float32))
        high = max(high, tiered.tier_stats["memory_rows"])
        if step == 99:
            early = tiered.stats()
    stats = tiered.stats()
    assert high <= budget + 256  # the budget plus one request's rows
    assert stats.disk_rows > 5 * budget
    # the busiest ids (1, 2, 3, ... under Zipf) are the ones memory keeps
    hot = np.arange(1, 21, dtype=np.int64)
    assert (tiered._index.find(hot) >= 0).all()
    # past warm-up, most rows of a Zipf(1.1) stream are served from memory
    late_hits = stats.memory_hits - early.memory_hits
    late_disk = stats.disk_hits - early.disk_hits
    assert late_hits / (late_hits + late_disk) > 0.8
    tiered.close()


def test_checkpoint_of_a_tiered_registry_restores_in_memory_and_onto_two_tasks(tmp_path):
    config = TableConfig("t", DIM, optimizer=ADAGRAD, memory_rows=30)
    tiered = TableRegistry("ps:0", TierOptions(str(tmp_path / "tier")))
    plain = TableRegistry("ps:0")
    tiered.create(config, 0, 1)
    plain.create(TableConfig("t", DIM, optimizer=ADAGRAD), 0, 1)
    for ids, grads, _ in _stream(3, 60):
        tiered.lookup("t", ids)
        plain.lookup("t", ids)
        tiered.push("t", ids, grads)
        plain.push("t", ids, grads)
    tiered.save(str(tmp_path / "a"), "ps-0")
    plain.save(str(tmp_path / "b"), "ps-0")
    # the tiered checkpoint holds the same rows as the in-memory one
    restored = TableRegistry("ps:0", TierOptions(str(tmp_path / "tier3")))
    restored.restore(str(tmp_path / "a"), 0, 1)
    _assert_same_state(plain.table("t"), restored.table("t"))
    every = plain.table("t").export_state()["ids"]
    assert plain.lookup("t", every).tobytes() == restored.lookup("t", every).tobytes()
    # restored onto two tasks with a tier, the shards hold the same rows between them
    shards = [TableRegistry(f"ps:{i}", TierOptions(str(tmp_path / "tier2"))) for i in range(2)]
    for i, reg in enumerate(shards):
        reg.restore(str(tmp_path / "a"), i, 2)
        assert isinstance(reg.table("t"), TieredTable)  # the config's budget came along
        assert reg.table("t").tier_stats["memory_rows"] <= 30
    rows = sum(reg.stats()["t"].rows for reg in shards)
    assert rows == every.size
    owner = shard_of(every, 2)
    for i, reg in enumerate(shards):
        mine = every[owner == i]
        assert reg.lookup("t", mine, read_only=True).tobytes() == (
            plain.lookup("t", mine, read_only=True).tobytes()
        )


def test_a_tiered_checkpoint_streams_the_disk_tier_to_segments_and_restores_anywhere(tmp_path):
    config = TableConfig("t", DIM, optimizer=ADAGRAD, ttl_steps=30)
    tiered = TableRegistry("ps:0", TierOptions(str(tmp_path / "tier"), memory_rows=25))
    plain = TableRegistry("ps:0")
    for reg in (tiered, plain):
        reg.create(config, 0, 1)
    for ids, grads, _ in _stream(5, 50):
        for reg in (tiered, plain):
            reg.lookup("t", ids)
            reg.push("t", ids, grads)
    tiered.save(str(tmp_path / "ckpt"), "ps-0")
    manifest = json.loads((tmp_path / "ckpt" / "ps-0.tables.json").read_text())
    segments = manifest["tables"]["t"]["segments"]
    assert segments  # the disk tier went to its own files, not through memory
    main = load_file(str(tmp_path / "ckpt" / manifest["data"]))
    assert main["t\x00ids"].size <= 25 + 64
    # a second save replaces the first and leaves no stray files
    tiered.save(str(tmp_path / "ckpt"), "ps-0")
    files = sorted(os.listdir(tmp_path / "ckpt"))
    manifest = json.loads((tmp_path / "ckpt" / "ps-0.tables.json").read_text())
    named = {manifest["data"], *(s["file"] for s in manifest["tables"]["t"]["segments"])}
    assert set(files) == named | {"ps-0.tables.json"}
    # restored all in memory (no tier here, none in the config) and onto three tiered tasks
    flat = TableRegistry("ps:0")
    flat.restore(str(tmp_path / "ckpt"), 0, 1)
    assert not isinstance(flat.table("t"), TieredTable)
    _assert_same_state(plain.table("t"), flat.table("t"))
    every = plain.table("t").export_state()["ids"]
    shards = [
        TableRegistry(f"ps:{i}", TierOptions(str(tmp_path / "t3"), memory_rows=10))
        for i in range(3)
    ]
    for i, reg in enumerate(shards):
        reg.restore(str(tmp_path / "ckpt"), i, 3)
        mine = every[shard_of(every, 3) == i]
        assert reg.stats()["t"].rows == mine.size
        assert reg.lookup("t", mine, read_only=True).tobytes() == (
            plain.lookup("t", mine, read_only=True).tobytes()
        )
    # a corrupt segment is refused before anything changes
    seg = tmp_path / "ckpt" / manifest["tables"]["t"]["segments"][0]["file"]
    raw = bytearray(seg.read_bytes())
    raw[-1] ^= 0xFF
    seg.write_bytes(bytes(raw))
    with pytest.raises(errors.DataLossError):
        shards[0].restore(str(tmp_path / "ckpt"), 0, 3)
    mine = every[shard_of(every, 3) == 0]
    assert shards[0].lookup("t", mine, read_only=True).tobytes() == (
        plain.lookup("t", mine, read_only=True).tobytes()
    )


def test_checkpoints_to_the_same_directory_write_only_the_rows_changed_since(tmp_path):
    config = TableConfig("t", DIM, optimizer=SGD, ttl_steps=25)
    tiered = TableRegistry("ps:0", TierOptions(str(tmp_path / "tier"), memory_rows=20))
    plain = TableRegistry("ps:0")
    for reg in (tiered, plain):
        reg.create(config, 0, 1)
    ckpt = str(tmp_path / "ckpt")

    def train(seed: int, steps: int, space: int) -> None:
        for ids, grads, _ in _stream(seed, steps, space=space):
            for reg in (tiered, plain):
                reg.lookup("t", ids)
                reg.push("t", ids, grads)

    def segments() -> list[dict]:
        manifest = json.loads((tmp_path / "ckpt" / "ps-0.tables.json").read_text())
        return manifest["tables"]["t"]["segments"]

    def restored_equal() -> None:
        for target in (
            TableRegistry("ps:0"),
            TableRegistry("ps:0", TierOptions(str(tmp_path / "r"), 7)),
        ):
            target.restore(ckpt, 0, 1)
            _assert_same_state(plain.table("t"), target.table("t"))
        every = plain.table("t").export_state()["ids"]
        for i in range(2):  # onto two tasks, tiered
            reg = TableRegistry(f"ps:{i}", TierOptions(str(tmp_path / "r2"), 5))
            reg.restore(ckpt, i, 2)
            mine = every[shard_of(every, 2) == i]
            assert reg.stats()["t"].rows == mine.size
            assert reg.lookup("t", mine, read_only=True).tobytes() == (
                plain.lookup("t", mine, read_only=True).tobytes()
            )

    train(7, 20, 4000)
    tiered.save(ckpt, "ps-0")
    base = segments()
    assert base and all(seg["base"] for seg in base)
    disk_rows = tiered.stats()["t"].disk_rows
    assert sum(seg["rows"] for seg in base) == disk_rows
    restored_equal()
    train(8, 3, 50)  # a few ids: promotions, demotions; ttl evicts others from disk
    tiered.save(ckpt, "ps-0")
    chain = segments()
    assert chain[: len(base)] == base  # the full segments are kept, not rewritten
    added = chain[len(base) :]
    assert added and not any(seg["base"] for seg in added)
    assert sum(seg["rows"] for seg in added if not seg.get("deleted")) < disk_rows / 2
    assert any(seg.get("deleted") for seg in added)  # rows that left the disk
    restored_equal()
    files = set(os.listdir(ckpt))
    assert files == {seg["file"] for seg in chain} | {
        json.loads((tmp_path / "ckpt" / "ps-0.tables.json").read_text())["data"],
        "ps-0.tables.json",
    }
    # once the changes outweigh the full segments, the next save is a full one
    for seed in range(9, 30):
        train(seed, 4, 6000)
        tiered.save(ckpt, "ps-0")
        if all(seg["base"] for seg in segments()):
            break
    else:
        raise AssertionError("the chain never compacted")
    restored_equal()


def test_a_push_retried_after_its_rows_were_demoted_applies_once(tmp_path):
    reg = TableRegistry("ps:0", TierOptions(str(tmp_path), memory_rows=8))
    ref = TableRegistry("ps:0")
    config = TableConfig("t", DIM, optimizer=SGD)
    reg.create(config, 0, 1)
    ref.create(config, 0, 1)
    ids = np.arange(5, dtype=np.int64)
    grads = np.ones((5, DIM), np.float32)
    for r in (reg, ref):
        r.lookup("t", ids)
        assert r.push("t", ids, grads, request_id=("w0", 1)) == 1
    other = np.arange(100, 200, dtype=np.int64)  # pushes ids 0..4 to disk
    reg.lookup("t", other)
    ref.lookup("t", other)
    assert (reg.table("t")._index.find(ids) < 0).all()
    for r in (reg, ref):
        assert r.push("t", ids, grads, request_id=("w0", 1)) == 1  # the retry: no effect
    assert reg.lookup("t", ids).tobytes() == ref.lookup("t", ids).tobytes()
    _assert_same_state(ref.table("t"), reg.table("t"))


def test_reads_see_rows_waiting_for_the_writer(tmp_path):
    store = open_store("lmdb", str(tmp_path))
    writer = WriteBehind(store, max_rows=10)
    with writer._cond:  # the writer cannot take the batches while this is held
        writer._queue.append(
            _Batch(np.array([3, 1], np.int64), np.array([[3, 3], [1, 1]], np.uint8))
        )
        writer._queue.append(_Batch(np.array([3], np.int64), None))
        writer._queued_rows = 2
        known, present, records = writer.resolve(np.array([1, 3, 7], np.int64), 2)
        writer._cond.notify_all()
    assert known.tolist() == [True, True, False]  # 3's delete is newer than its put
    assert present.tolist() == [True, False, False]
    assert records[0].tolist() == [1, 1]
    writer.flush(10)
    assert store.read(np.array([1, 3], np.int64), 2)[0].tolist() == [True, False]
    writer.close()


@pytest.mark.parametrize("backend", ["log", "lmdb"])
def test_a_store_write_of_sorted_unsorted_and_repeated_ids_matches_a_dict(tmp_path, backend):
    # write() skips its sort for sorted unique ids and builds keys and records from
    # void views: both paths, ids of both signs, a repeated id (the last record wins),
    # records of zero bytes at the end and deletes must agree with a plain dict.
    store = open_store(backend, str(tmp_path))
    rng = np.random.default_rng(7)
    reference: dict[int, bytes] = {}
    for step in range(6):
        ids = rng.integers(-(2**62), 2**62, 300).astype(np.int64)
        ids[:3] = [-1, 0, 2**63 - 1]
        if step % 2:
            ids = np.unique(ids)  # sorted and unique: no argsort, no copy
        else:
            ids[-1] = ids[5]  # a repeat: the later record wins
        records = rng.integers(0, 256, (ids.size, 12), dtype=np.uint8)
        records[:, -4:] = 0  # trailing zero bytes survive (no NUL stripping)
        dead = np.array(list(reference)[:20], np.int64)
        store.write(ids, records, dead)
        for key in dead.tolist():
            reference.pop(key, None)
        for key, row in zip(ids.tolist(), records):
            reference[key] = row.tobytes()
    want = np.array(sorted(reference), np.int64)
    got_ids, got = zip(*store.scan(12, batch=97))
    assert np.concatenate(got_ids).tolist() == want.tolist()
    assert np.concatenate(got).tobytes() == b"".join(reference[k] for k in want.tolist())
    as_floats = np.arange(8, dtype=np.float32).reshape(2, 4)  # bytes of any dtype
    store.write(np.array([11, 10], np.int64), as_floats)
    found, rows = store.read(np.array([10, 11], np.int64), 16)
    assert found.all() and rows.view(np.float32).tolist() == as_floats[::-1].tolist()
    store.close()


def _can_mount() -> bool:
    return (
        os.geteuid() == 0
        and subprocess.run(["which", "mount"], capture_output=True).returncode == 0
    )


@pytest.mark.skipif(not _can_mount(), reason="mounting a tmpfs needs root")
def test_a_full_disk_gives_a_typed_error_naming_the_path_and_changes_nothing(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], check=True)
    try:
        config = TableConfig("t", 64, optimizer=ADAGRAD)
        directory = str(mount / f"store-{uuid.uuid4().hex[:6]}")
        tiered = TieredTable(config, directory=directory, memory_rows=16, queue_rows=64)
        reference = DynamicTable(config)
        rng = np.random.default_rng(0)
        failed = None
        for _ in range(400):
            ids = np.unique(rng.integers(0, 10**9, 64)).astype(np.int64)
            grads = rng.standard_normal((ids.size, 64)).astype(np.float32)
            before = reference.export_state()
            for op, args in (("lookup", (ids,)), ("apply_gradients", (ids, grads))):
                try:
                    getattr(tiered, op)(*args)
                except errors.OpError as e:
                    failed = e
                    break
                getattr(reference, op)(*args)  # the reference takes what the tier took
            if failed:
                break
        assert isinstance(failed, errors.ResourceExhaustedError), failed
        assert directory in str(failed)
        # the failed request changed nothing: every row the reference holds reads the same
        # (rows the writer could not write are still served from its queue)
        every = before["ids"]
        assert tiered.lookup(every, read_only=True).tobytes() == (
            reference.lookup(every, read_only=True).tobytes()
        )
        with pytest.raises(errors.ResourceExhaustedError, match=directory):
            tiered.lookup(ids)  # still full: still refused
        # room again: the queued rows are written and requests go on, as the reference
        subprocess.run(["mount", "-o", "remount,size=64m", str(mount)], check=True)
        tiered.lookup(ids)
        reference.lookup(ids)
        tiered.apply_gradients(ids, grads)
        reference.apply_gradients(ids, grads)
        _assert_same_state(reference, tiered)
        tiered.close()
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_read_only_store_directory_gives_a_typed_error_naming_it(tmp_path):
    locked = tmp_path / "ro"
    locked.mkdir()
    os.chmod(locked, 0o500)
    try:
        if os.access(locked, os.W_OK):  # root ignores mode bits: bind a read-only mount
            if not _can_mount():
                pytest.skip("cannot make a read-only directory")
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(locked)], check=True
            )
        with pytest.raises(
            (errors.PermissionDeniedError, errors.ResourceExhaustedError), match=str(locked)
        ):
            TieredTable(TableConfig("t", DIM), directory=str(locked / "store"), memory_rows=4)
    finally:
        subprocess.run(["umount", "-l", str(locked)], check=False, capture_output=True)
        os.chmod(locked, 0o700)


def test_bad_budgets_are_refused_with_typed_errors(tmp_path):
    with pytest.raises(errors.InvalidArgumentError, match="memory_rows"):
        TableConfig("t", DIM, memory_rows=-1)
    with pytest.raises(errors.InvalidArgumentError, match="not both"):
        TableConfig("t", DIM, memory_rows=4, memory_bytes=4096)
    with pytest.raises(errors.InvalidArgumentError, match="not both"):
        TierOptions(memory_rows=4, memory_bytes=4096)
    with pytest.raises(errors.InvalidArgumentError, match="unknown row store 'nope'"):
        TableRegistry("ps:0", TierOptions(str(tmp_path), 4, backend="nope")).create(
            TableConfig("t", DIM), 0, 1
        )


def test_interleaved_workers_get_the_same_bits_as_all_in_memory(tmp_path):
    # two workers' lookups before their pushes (as under ParameterServerStrategy):
    # one worker's lookup demotes rows while the other's push is pending, and a
    # push reuses the slots its own lookup found when only other rows left memory
    config = TableConfig("t", DIM, optimizer=ADAGRAD)
    reference = DynamicTable(config)
    tiered = TieredTable(config, directory=str(tmp_path / "store"), memory_rows=48)
    streams = [_stream(11, 120, space=3000), _stream(12, 120, space=3000)]
    for (ids_a, grads_a, _), (ids_b, grads_b, _) in zip(*streams):
        for ids in (ids_a, np.unique(ids_b)):
            assert tiered.lookup(ids).tobytes() == reference.lookup(ids).tobytes()
        for ids, grads in ((ids_a, grads_a), (np.unique(ids_b), grads_b[: np.unique(ids_b).size])):
            assert tiered.apply_gradients(ids, grads) == reference.apply_gradients(ids, grads)
    stats = tiered.stats()
    assert stats.disk_rows > 5 * 48 and stats.dropped_gradients == 0
    _assert_same_state(reference, tiered)
    tiered.close()

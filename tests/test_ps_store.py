"""The variable store in-process: validation, exactly-once, sync steps, threads, checkpoints."""

from __future__ import annotations

import json
import os
import threading

import numpy as np
import pytest

from psflow.errors import (
    AbortedError,
    AlreadyExistsError,
    DataLossError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
)
from psflow.ps.checkpoint import restore_shard, save_shard
from psflow.ps.store import Gradient, VariableMeta, VariableStore
from psflow.ps.tensors import Segments
from psflow.update_rules import rule_from_config

F32 = np.dtype(np.float32)


def make_store(**variables) -> VariableStore:
    store = VariableStore()
    metas = [VariableMeta(n, v.dtype, v.shape) for n, v in variables.items()]
    store.create(metas, list(variables.values()))
    return store


def value(store, name):
    return store.pull([name])[0].value


def snapshot(store):
    return {
        i.meta.name: (value(store, i.meta.name).tobytes(), i.version)
        for i in store.list_variables()
    }


def test_create_is_idempotent_and_conflicts_are_already_exists():
    store = make_store(w=np.ones(3, F32))
    assert store.create([VariableMeta("w", F32, (3,))], [np.zeros(3, F32)]) == [(False, 0)]
    np.testing.assert_array_equal(value(store, "w"), np.ones(3))  # value kept
    with pytest.raises(AlreadyExistsError, match=r"'w'.*float32\[3\].*float32\[4\]"):
        store.create(
            [VariableMeta("v", F32, (2,)), VariableMeta("w", F32, (4,))],
            [np.zeros(2, F32), np.zeros(4, F32)],
        )
    assert [i.meta.name for i in store.list_variables()] == ["w"]  # v not created either


def test_create_rejects_bad_values_without_creating_anything():
    store = VariableStore()
    with pytest.raises(InvalidArgumentError, match="float64"):
        store.create(
            [VariableMeta("a", F32, (2,)), VariableMeta("b", F32, (2,))],
            [np.zeros(2, F32), np.zeros(2)],
        )
    with pytest.raises(InvalidArgumentError, match="unknown optimizer 'nadam'"):
        store.create([VariableMeta("a", F32, (2,))], [np.zeros(2, F32)], [{"name": "nadam"}])
    assert store.list_variables() == []
    assert store.stats_snapshot()["rejected"] == {"invalid_argument": 2}


def test_configure_keeps_slots_when_only_hyperparameters_change():
    store = make_store(w=np.ones(2, F32))
    store.configure_optimizer(["w"], {"name": "adam"})
    store.push([Gradient("w", np.ones(2, F32))], push_id=("c", 1))
    store.configure_optimizer(["w"], {"name": "adam", "learning_rate": 0.1})
    info = store.list_variables()[0]
    assert info.optimizer_step == 1 and json.loads(info.optimizer_json)["learning_rate"] == 0.1
    store.configure_optimizer(["w"], {"name": "adam", "amsgrad": True})  # new slot: reset
    assert store.list_variables()[0].optimizer_step == 0
    with pytest.raises(NotFoundError, match="'nope'"):
        store.configure_optimizer(["w", "nope"], {"name": "sgd"})
    assert json.loads(store.list_variables()[0].optimizer_json)["name"] == "adam"


@pytest.mark.parametrize(
    "grads, error, match",
    [
        ([Gradient("a", np.ones(3, F32)), Gradient("zz", np.ones(3, F32))], NotFoundError, "'zz'"),
        (
            [Gradient("a", np.ones(3, F32)), Gradient("b", np.ones(4, F32))],
            InvalidArgumentError,
            r"\(4,\)",
        ),
        (
            [Gradient("a", np.ones(3, F32)), Gradient("b", np.ones(3))],
            InvalidArgumentError,
            "float64",
        ),
        (
            [Gradient("a", np.ones(3, F32)), Gradient("m", np.ones((2, 3), F32), np.array([0, 9]))],
            InvalidArgumentError,
            "index 9",
        ),
        (
            [Gradient("a", np.ones(3, F32)), Gradient("a", np.ones(3, F32))],
            InvalidArgumentError,
            "twice",
        ),
        (
            [Gradient("a", np.ones(3, F32)), Gradient("n", np.ones(3, F32))],
            FailedPreconditionError,
            "'n' has no optimizer",
        ),
        ([], InvalidArgumentError, "without gradients"),
    ],
    ids=["unknown", "shape", "dtype", "row-range", "twice", "no-optimizer", "empty"],
)
def test_bad_push_changes_nothing(grads, error, match):
    store = make_store(
        a=np.ones(3, F32), b=np.ones(3, F32), m=np.ones((4, 3), F32), n=np.ones(3, F32)
    )
    store.configure_optimizer(["a", "b", "m"], {"name": "sgd", "momentum": 0.5})
    before = snapshot(store)
    with pytest.raises(error, match=match):
        store.push(grads, push_id=("c", 1))
    assert snapshot(store) == before
    # The failed id is not remembered: the same id works once the input is fixed.
    assert store.push([Gradient("a", np.ones(3, F32))], push_id=("c", 1)).applied


def test_concurrent_pushes_to_one_variable_lose_nothing():
    store = make_store(w=np.zeros((64, 64)))
    store.configure_optimizer(["w"], {"name": "sgd", "learning_rate": 1.0})
    threads, per_thread = 8, 50

    def worker(t):
        for i in range(per_thread):
            store.push([Gradient("w", np.full((64, 64), -1.0))], push_id=(f"c{t}", i))

    ts = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not any(t.is_alive() for t in ts)
    np.testing.assert_array_equal(value(store, "w"), threads * per_thread)
    assert store.list_variables()[0].version == threads * per_thread


def test_duplicate_push_id_is_applied_once_even_when_racing():
    store = make_store(w=np.zeros(4))
    store.configure_optimizer(["w"], {"name": "sgd", "learning_rate": 1.0})
    results = []
    barrier = threading.Barrier(6)

    def retry():
        barrier.wait(10)
        results.append(store.push([Gradient("w", -np.ones(4))], push_id=("c", 7)))

    ts = [threading.Thread(target=retry) for _ in range(6)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    np.testing.assert_array_equal(value(store, "w"), np.ones(4))
    assert sorted(r.duplicate for r in results) == [False] + [True] * 5
    assert {r.versions for r in results} == {(1,)}
    assert store.stats_snapshot()["pushes_duplicate"] == 5


def test_ids_older_than_the_window_are_refused():
    store = VariableStore(dedup_window=4)
    store.create([VariableMeta("w", F32, (1,))], [np.zeros(1, F32)])
    store.configure_optimizer(["w"], {"name": "sgd"})
    for seq in range(10):
        store.push([Gradient("w", np.ones(1, F32))], push_id=("c", seq))
    assert store.push([Gradient("w", np.ones(1, F32))], push_id=("c", 9)).duplicate
    with pytest.raises(AbortedError, match="older than"):
        store.push([Gradient("w", np.ones(1, F32))], push_id=("c", 2))
    assert store.list_variables()[0].version == 10


def test_sync_step_applies_the_mean_once_and_rejects_stale_contributions():
    store = make_store(w=np.zeros(3), s=np.zeros((4, 2)))
    store.configure_optimizer(["w", "s"], {"name": "sgd", "learning_rate": 1.0})
    grads = [np.array([1.0, 2.0, 3.0]), np.array([3.0, 2.0, 1.0]), np.array([2.0, 2.0, 5.0])]
    for i, g in enumerate(grads):
        r = store.push(
            [Gradient("w", g), Gradient("s", np.ones((1, 2)), np.array([i]))],
            push_id=(f"w{i}", 0),
            step=5,
            num_required=3,
        )
        assert r.applied == (i == 2)
        assert store.list_variables()[1].version == (1 if i == 2 else 0)
    np.testing.assert_array_equal(value(store, "w"), -np.mean(grads, axis=0))
    np.testing.assert_array_equal(value(store, "s")[:3], -np.ones((3, 2)) / 3)
    assert store.list_variables()[1].sync_step == 5
    with pytest.raises(AbortedError, match="step 5 of 's' was already applied"):
        store.push([Gradient("s", np.ones((4, 2)))], push_id=("late", 0), step=5, num_required=3)
    with pytest.raises(AbortedError, match="already applied"):
        store.push([Gradient("w", np.ones(3))], push_id=("late", 1), step=4, num_required=3)
    assert store.stats_snapshot()["rejected"] == {"stale_step": 2}
    with pytest.raises(InvalidArgumentError, match="needs 3 contributions"):
        store.push([Gradient("w", np.ones(3))], push_id=("a", 0), step=6, num_required=3)
        store.push([Gradient("w", np.ones(3))], push_id=("b", 0), step=6, num_required=2)


def test_a_pending_sync_contribution_is_the_stores_own_copy():
    # the caller's buffers are free once push returns (a data-plane connection reuses
    # its receive buffer): a contribution kept for the step must not change with them
    store = make_store(w=np.zeros(4, F32), s=np.zeros((3, 2), F32))
    store.configure_optimizer(["w", "s"], {"name": "sgd", "learning_rate": 1.0})
    buffer = np.array([1, 2, 3, 4, 5, 5], F32)
    rows, ids = np.full((1, 2), 2, F32), np.array([1])
    dense = Segments(F32, (4,), [(0, buffer[:2]), (2, buffer[2:4])])
    first = [Gradient("w", dense), Gradient("s", rows, ids)]
    assert not store.push(first, push_id=("a", 0), step=1, num_required=2).applied
    buffer[:] = 99
    rows[:] = 99
    ids[:] = 0
    second = [Gradient("w", np.full(4, 3, F32)), Gradient("s", np.full((1, 2), 4, F32), [1])]
    assert store.push(second, push_id=("b", 0), step=1, num_required=2).applied
    np.testing.assert_array_equal(value(store, "w"), -np.array([2, 2.5, 3, 3.5], F32))
    np.testing.assert_array_equal(value(store, "s"), [[0, 0], [-3, -3], [0, 0]])


def test_sync_mean_does_not_depend_on_arrival_order():
    rng = np.random.default_rng(3)
    grads = {f"worker{i}": rng.standard_normal(100).astype(np.float32) for i in range(4)}
    results = []
    for order in (list(grads), list(reversed(grads))):
        store = make_store(w=np.zeros(100, F32))
        store.configure_optimizer(["w"], {"name": "sgd", "learning_rate": 1.0})
        for cid in order:
            store.push([Gradient("w", grads[cid])], push_id=(cid, 1), step=0, num_required=4)
        results.append(value(store, "w").tobytes())
    assert results[0] == results[1]


def test_wait_applied_blocks_until_the_step_completes():
    store = make_store(w=np.zeros(2))
    store.configure_optimizer(["w"], {"name": "sgd", "learning_rate": 1.0})
    replies = {}

    def contribute(i):
        replies[i] = store.push(
            [Gradient("w", np.ones(2))],
            push_id=(f"w{i}", 0),
            step=0,
            num_required=3,
            wait_applied=True,
            timeout=30,
        )

    ts = [threading.Thread(target=contribute, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(0.3)
    assert all(t.is_alive() for t in ts) and not replies  # still waiting for the third
    contribute(2)
    for t in ts:
        t.join(30)
    assert all(r.applied and r.versions == (1,) for r in replies.values()) and len(replies) == 3
    with pytest.raises(DeadlineExceededError, match="1 of 2 contributions"):
        store.push(
            [Gradient("w", np.ones(2))],
            push_id=("x", 0),
            step=1,
            num_required=2,
            wait_applied=True,
            timeout=0.2,
        )


def test_staleness_is_logged_and_bounded():
    store = make_store(w=np.zeros(2))
    store.configure_optimizer(["w"], {"name": "sgd"})
    for i in range(3):
        store.push([Gradient("w", np.ones(2), base_version=0)], push_id=("a", i))
    s = store.stats_snapshot(include_log=True)
    assert s["staleness_histogram"] == {0: 1, 1: 1, 2: 1} and s["max_staleness"] == 2
    assert [(e.base_version, e.applied_version) for e in s["log"]] == [(0, 1), (0, 2), (0, 3)]
    with pytest.raises(AbortedError, match="3 versions stale"):
        store.push([Gradient("w", np.ones(2), base_version=0)], push_id=("a", 9), max_staleness=2)
    assert store.stats_snapshot()["rejected"] == {"staleness_bound": 1}


def test_reads_are_snapshots_while_writers_copy_on_write():
    store = make_store(w=np.zeros(5))
    store.configure_optimizer(["w"], {"name": "sgd", "learning_rate": 1.0})
    with store.reading(["w"]) as (snap,):
        store.push([Gradient("w", -np.ones(5))], push_id=("c", 1))
        np.testing.assert_array_equal(snap.value, np.zeros(5))
        assert snap.version == 0
        np.testing.assert_array_equal(value(store, "w"), np.ones(5))
    store.push([Gradient("w", -np.ones(5))], push_id=("c", 2))
    np.testing.assert_array_equal(value(store, "w"), 2 * np.ones(5))


def test_segmented_gradients_match_whole_arrays_bitwise():
    rng = np.random.default_rng(5)
    init = rng.standard_normal(1000).astype(np.float32)
    grads = [rng.standard_normal(1000).astype(np.float32) for _ in range(3)]
    out = []
    for segmented in (False, True):
        store = make_store(w=init.copy())
        store.configure_optimizer(["w"], {"name": "adam", "learning_rate": 0.01})
        for i, g in enumerate(grads):
            gv = Segments(F32, (1000,), [(0, g[:333]), (333, g[333:700]), (700, g[700:])])
            store.push([Gradient("w", gv if segmented else g)], push_id=("c", i))
        out.append(value(store, "w").tobytes())
    assert out[0] == out[1]


def test_assign_ops_and_exactly_once_assign_add():
    store = make_store(w=np.zeros(3, np.int64), flag=np.zeros(2, bool))
    store.assign("assign", ["w"], [np.array([1, 2, 3])])
    store.assign("assign_add", ["w"], [np.array([1, 1, 1])], request_id=("c", 1))
    store.assign("assign_add", ["w"], [np.array([1, 1, 1])], request_id=("c", 1))
    store.assign("assign_sub", ["w"], [np.array([0, 0, 5])])
    np.testing.assert_array_equal(value(store, "w"), [2, 3, -1])
    with pytest.raises(InvalidArgumentError, match="bool 'flag'"):
        store.assign("assign_add", ["flag"], [np.ones(2, bool)])
    with pytest.raises(InvalidArgumentError, match="int32"):
        store.assign("assign", ["w"], [np.ones(3, np.int32)])


def test_checkpoint_round_trip_and_resharding(tmp_path):
    store = make_store(a=np.arange(6, dtype=F32).reshape(2, 3), b=np.ones(4), i=np.arange(3))
    store.configure_optimizer(["a", "b"], {"name": "adam"})
    for k in range(3):
        store.push(
            [Gradient("a", np.full((2, 3), k, F32)), Gradient("b", np.full(4, -float(k)))],
            push_id=("c", k),
        )
    save_shard(store, str(tmp_path), "ps-0", step=42)
    fresh = VariableStore()
    result = restore_shard(fresh, str(tmp_path), "ps-0")
    assert result.step == 42 and sorted(result.names) == ["a", "b", "i"]
    for name in ("a", "b", "i"):
        assert value(fresh, name).tobytes() == value(store, name).tobytes()
    with store.exporting() as old, fresh.exporting() as new:
        for o, n in zip(old, new, strict=True):
            assert o.version == n.version and o.optimizer_step == n.optimizer_step
            assert {k: s.tobytes() for k, s in o.slots.items()} == {
                k: s.tobytes() for k, s in n.slots.items()
            }
    # a second shard; restore a mix of both by name (a different number of PS tasks)
    other = make_store(c=np.full(2, 7.0))
    save_shard(other, str(tmp_path), "ps-1", step=42)
    mixed = VariableStore()
    assert sorted(restore_shard(mixed, str(tmp_path), "", names=["b", "c"]).names) == ["b", "c"]
    with pytest.raises(NotFoundError, match="'zz'"):
        restore_shard(mixed, str(tmp_path), "", names=["zz"])


def test_corrupt_checkpoint_is_data_loss_and_changes_nothing(tmp_path):
    store = make_store(w=np.arange(100, dtype=F32))
    save_shard(store, str(tmp_path), "ps-0")
    (tensor_file,) = [p for p in os.listdir(tmp_path) if p.endswith(".safetensors")]
    raw = bytearray((tmp_path / tensor_file).read_bytes())
    raw[-1] ^= 1
    (tmp_path / tensor_file).write_bytes(bytes(raw))
    target = make_store(z=np.ones(2))
    with pytest.raises(DataLossError, match="sha256"):
        restore_shard(target, str(tmp_path), "ps-0")
    assert [i.meta.name for i in target.list_variables()] == ["z"]


def test_saving_again_replaces_the_tensor_file(tmp_path):
    store = make_store(w=np.zeros(2))
    save_shard(store, str(tmp_path), "ps-0")
    store.assign("assign", ["w"], [np.ones(2)])
    save_shard(store, str(tmp_path), "ps-0")
    assert len([p for p in os.listdir(tmp_path) if p.endswith(".safetensors")]) == 1
    fresh = VariableStore()
    restore_shard(fresh, str(tmp_path), "ps-0")
    np.testing.assert_array_equal(value(fresh, "w"), np.ones(2))


def test_rules_on_the_store_match_local_application():
    rng = np.random.default_rng(9)
    for cfg in (
        {"name": "sgd", "momentum": 0.9, "nesterov": True},
        {"name": "rmsprop", "centered": True, "momentum": 0.5},
        {"name": "adagrad"},
        {"name": "adam"},
    ):
        init = rng.standard_normal((8, 3)).astype(np.float32)
        store = make_store(w=init.copy())
        store.configure_optimizer(["w"], cfg)
        rule = rule_from_config(cfg)
        local, slots = init.copy(), rule.init_slots(init)
        for step in range(1, 4):
            g = rng.standard_normal((8, 3)).astype(np.float32)
            store.push([Gradient("w", g)], push_id=("c", step))
            rule.apply_dense(local, g, slots, step)
        assert value(store, "w").tobytes() == local.tobytes(), cfg


def test_a_refused_push_of_several_variables_leaves_none_of_their_locks_held():
    # the staleness bound is checked with every lock of the push held (name order);
    # a refusal must release them all, or the next push of either variable hangs
    store = make_store(b=np.zeros(2, F32), a=np.zeros(3, F32))
    store.configure_optimizer(["a", "b"], {"name": "sgd", "learning_rate": 1.0})
    store.push([Gradient("a", np.ones(3, F32)), Gradient("b", np.ones(2, F32))], push_id=("c", 1))
    store.push([Gradient("a", np.ones(3, F32)), Gradient("b", np.ones(2, F32))], push_id=("c", 2))
    stale = [Gradient("b", np.ones(2, F32), base_version=0), Gradient("a", np.ones(3, F32))]
    with pytest.raises(AbortedError, match="2 versions stale"):
        store.push(stale, push_id=("c", 3), max_staleness=1)
    for name in ("a", "b"):
        lock = store._get(name).lock
        assert lock.acquire(timeout=5), f"{name}'s lock is still held"
        lock.release()
    store.push([Gradient("b", np.ones(2, F32)), Gradient("a", np.ones(3, F32))], push_id=("c", 4))
    np.testing.assert_array_equal(value(store, "a"), -3 * np.ones(3))
    np.testing.assert_array_equal(value(store, "b"), -3 * np.ones(2))

"""Elastic parameter servers without processes: the planner, a store's moves, embedded resizes."""

from __future__ import annotations

import numpy as np
import pytest

import psflow as pf
from psflow import errors
from psflow.distribute.ps.placement import PlacementMap, plan_resize
from psflow.ps.push_types import Gradient
from psflow.ps.store import VariableMeta, VariableStore


def _map(owners: dict[str, int], n: int) -> PlacementMap:
    return PlacementMap(3, owners, tuple(f"h:{i}" for i in range(n)))


def _loads(owners: dict[str, int], sizes: dict[str, int], n: int) -> list[int]:
    loads = [0] * n
    for k, t in owners.items():
        loads[t] += sizes[k]
    return loads


def _apply(placement: PlacementMap, moves) -> dict[str, int]:
    owners = dict(placement.owners)
    for m in moves:
        assert owners[m.key] == m.source
        owners[m.key] = m.target
    return owners


@pytest.mark.parametrize("old,new", [(1, 2), (2, 3), (2, 5), (3, 1), (5, 2), (4, 4)])
def test_plan_resize_balances_by_bytes_and_moves_only_what_it_must(old, new):
    rng = np.random.default_rng(old * 10 + new)
    sizes = {f"v{i:02d}": int(rng.integers(1, 100)) for i in range(40)}
    placement = _map({k: i % old for i, k in enumerate(sizes)}, old)
    moves = plan_resize(placement, new, sizes)
    owners = _apply(placement, moves)
    assert set(owners.values()) <= set(range(new))
    for m in moves:  # minimal: a key moves only off a removed task, or onto an added one
        assert m.source >= new or m.target >= old, m
    loads = _loads(owners, sizes, new)
    if new < old or new > old:
        # balanced: no task more than the largest variable above the mean
        assert max(loads) - sum(loads) / new <= max(sizes.values()), loads
    else:
        assert moves == []


def test_plan_resize_is_deterministic_whatever_the_map_order():
    sizes = {f"k{i}": (i * 7) % 13 + 1 for i in range(20)}
    owners = {k: i % 2 for i, k in enumerate(sizes)}
    a = plan_resize(_map(owners, 2), 3, sizes)
    b = plan_resize(_map(dict(reversed(list(owners.items()))), 2), 3, sizes)
    assert a == b
    assert plan_resize(_map(owners, 2), 3, sizes) == a


def test_plan_resize_rejects_zero_tasks():
    with pytest.raises(errors.InvalidArgumentError, match="0 parameter servers"):
        plan_resize(_map({"a": 0}, 1), 0, {"a": 4})


def _store(task: str) -> VariableStore:
    store = VariableStore(task=task)
    metas = [VariableMeta(n, np.dtype("float32"), (3,)) for n in ("a", "b")]
    store.create(metas, [np.arange(3, dtype="float32"), np.ones(3, "float32")])
    store.configure_optimizer(["a", "b"], {"name": "adam", "learning_rate": 0.1})
    return store


def _grad(name: str, value: float = 1.0) -> Gradient:
    return Gradient(name, np.full(3, value, "float32"))


def test_a_moved_variable_keeps_value_slots_versions_and_redirects_at_its_old_owner():
    old, new = _store("ps:0"), VariableStore(task="ps:1")
    old.push([_grad("a"), _grad("b")], push_id=("closure-1/push", 1))
    before = {i.meta.name: i for i in old.list_variables()}
    new.import_shard(old.export_shard(["a"]), 1)
    old.release(["a"], 1, "127.0.0.1:9", 1)

    (info,) = new.list_variables()
    assert (info.version, info.optimizer_step, info.slot_names) == (
        before["a"].version,
        before["a"].optimizer_step,
        before["a"].slot_names,
    )
    # the next update from the moved state equals the one the old owner would have made
    reference = _store("ref")
    reference.push([_grad("a"), _grad("b")], push_id=("closure-1/push", 1))
    reference.push([_grad("a", 0.5)], push_id=("c", 2))
    new.push([_grad("a", 0.5)], push_id=("c", 2))
    np.testing.assert_array_equal(new.pull(["a"])[0].value, reference.pull(["a"])[0].value)

    with pytest.raises(errors.MovedError) as e:
        old.pull(["a"])
    assert (e.value.key, e.value.owner, e.value.address, e.value.version) == (
        "a",
        1,
        "127.0.0.1:9",
        1,
    )
    # a push naming a moved variable is rejected whole: "b" is not changed either
    b_before = old.pull(["b"])[0]
    with pytest.raises(errors.MovedError):
        old.push([_grad("b"), _grad("a")], push_id=("c", 3))
    assert old.pull(["b"])[0].version == b_before.version


def test_a_push_retried_after_its_variable_moved_is_applied_once_at_the_new_owner():
    old, new = _store("ps:0"), VariableStore(task="ps:1")
    old.push([_grad("a"), _grad("b")], push_id=("closure-7/push", 1))
    new.import_shard(old.export_shard(["a"]), 1)
    old.release(["a"], 1, "h:1", 1)
    value = new.pull(["a"])[0]

    reply = new.push([_grad("a")], push_id=("closure-7/push", 1))  # the closure, re-run
    assert reply.duplicate
    assert new.pull(["a"])[0].version == value.version
    np.testing.assert_array_equal(new.pull(["a"])[0].value, value.value)
    # the same id at the old owner, for what stayed there: a duplicate too
    assert old.push([_grad("b")], push_id=("closure-7/push", 1)).duplicate
    # a new id is applied
    assert not new.push([_grad("a")], push_id=("closure-7/push", 2)).duplicate
    assert new.pull(["a"])[0].version == value.version + 1


def test_bad_moves_change_nothing():
    store = _store("ps:0")
    with pytest.raises(errors.NotFoundError, match="nope"):
        store.release(["a", "nope"], 1, "h:1", 1)
    assert [v.meta.name for v in store.list_variables()] == ["a", "b"]
    with pytest.raises(errors.DataLossError):
        store.import_shard(b"\x05\x00\x00\x00\x00\x00\x00\x00{bad", 1)
    with pytest.raises(errors.FailedPreconditionError, match="still holds 2"):
        store.drain()
    assert not store.drained.is_set()
    store.release(["a", "b"], 1, "h:1", 1)
    store.drain()
    assert store.drained.is_set()


def _embedded_training(resizes: dict[int, int]) -> tuple[list[np.ndarray], list]:
    pf.random.set_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(48, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 1))).astype("float32")
    strategy = pf.distribute.ParameterServerStrategy()
    with strategy.scope():
        model = pf.keras.Sequential(
            [
                pf.keras.layers.Dense(4, activation="tanh", input_shape=(5,)),
                pf.keras.layers.Dense(1),
            ]
        )
        model.compile(optimizer=pf.keras.optimizers.Adam(0.01), loss="mse")
    reports = []

    class Resize(pf.keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch in resizes:
                reports.append(strategy.resize_parameter_servers(resizes[epoch]))

    model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=[Resize()])
    return [w.numpy() for w in model.weights], reports


def test_embedded_training_through_1_3_1_servers_equals_a_fixed_layout_bit_for_bit():
    fixed, _ = _embedded_training({})
    elastic, reports = _embedded_training({0: 3, 1: 1})
    for a, b in zip(fixed, elastic):
        np.testing.assert_array_equal(a, b)
    assert [(r.old_num_ps, r.new_num_ps) for r in reports] == [(1, 3), (3, 1)]
    assert [(r.version_before, r.version_after) for r in reports] == [(0, 1), (1, 2)]
    assert all(r.shards_moved > 0 and r.bytes_moved > 0 for r in reports)


def test_embedded_resize_rejects_a_bad_count_and_changes_nothing():
    strategy = pf.distribute.ParameterServerStrategy()
    with strategy.scope():
        pf.Variable([1.0], name="v")
    before = strategy.placement()
    for bad in (0, -1, 1.5, True):
        with pytest.raises(errors.InvalidArgumentError, match="num_ps"):
            strategy.resize_parameter_servers(bad)
    assert strategy.placement() == before


def test_writes_during_a_handover_wait_and_land_only_at_the_new_owner():
    old, new = _store("ps:0"), VariableStore(task="ps:1")
    state = old.export_shard(["a"])
    version = old.pull(["a"])[0].version
    with pytest.raises(errors.UnavailableError, match="handed over"):
        old.push([_grad("b"), _grad("a")], push_id=("c", 1))
    with pytest.raises(errors.UnavailableError):
        old.assign("assign", ["a"], [np.zeros(3, "float32")])
    assert old.pull(["a"])[0].version == version  # nothing applied; reads still served
    assert old.pull(["b"])[0].version == version
    old.unfence(["a"])  # the move was abandoned: writes are served again
    old.push([_grad("a")], push_id=("c", 1))
    state = old.export_shard(["a"])
    new.import_shard(state, 1)
    old.release(["a"], 1, "h:1", 1)
    with pytest.raises(errors.MovedError):
        old.push([_grad("a")], push_id=("c", 2))
    assert new.push([_grad("a")], push_id=("c", 2)).applied
    assert new.list_variables()[0].optimizer_step == 2


def test_a_closure_re_run_after_its_variables_moved_is_applied_once():
    strategy = pf.distribute.ParameterServerStrategy()
    with strategy.scope():
        variables = [pf.Variable(np.full(3, i, "float32"), name=f"w{i}") for i in range(4)]
    session = strategy._session
    optimizer = pf.keras.optimizers.SGD(0.5)
    pairs = [(pf.constant(np.ones(3, "float32")), v) for v in variables]
    with session.step(1, "session-1/closure-9"):
        session.apply_optimizer(optimizer, pairs, 1)
    after = [v.numpy() for v in variables]
    report = strategy.resize_parameter_servers(3)
    assert report.shards_moved == 2
    with session.step(1, "session-1/closure-9"):  # the same closure, run again elsewhere
        session.apply_optimizer(optimizer, pairs, 1)
    for v, want in zip(variables, after):
        np.testing.assert_array_equal(v.numpy(), want)
    assert sum(s["pushes_duplicate"] for s in strategy.ps_stats()) == 3  # one per task
    with session.step(2, "session-1/closure-10"):  # a new closure is applied
        session.apply_optimizer(optimizer, pairs, 2)
    for v, want in zip(variables, after):
        np.testing.assert_array_equal(v.numpy(), want - 0.5)


def test_partitioned_variables_move_shard_by_shard_and_read_back_whole():
    strategy = pf.distribute.ParameterServerStrategy(
        variable_partitioner=pf.distribute.experimental.partitioners.FixedShardsPartitioner(4)
    )
    with strategy.scope():
        table = pf.Variable(np.arange(24, dtype="float32").reshape(8, 3), name="table")
    report = strategy.resize_parameter_servers(4)
    assert report.shards_moved == 3
    assert sorted(s.ps_index for s in table.variables) == [0, 1, 2, 3]
    np.testing.assert_array_equal(table.numpy(), np.arange(24, dtype="float32").reshape(8, 3))
    rows = pf.nn.embedding_lookup(table, pf.constant([7, 0, 3]))
    np.testing.assert_array_equal(
        rows.numpy(), np.arange(24, dtype="float32").reshape(8, 3)[[7, 0, 3]]
    )


def test_embedded_dynamic_tables_come_through_a_resize_and_a_refused_one_changes_nothing(
    monkeypatch,
):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    strategy = pf.distribute.ParameterServerStrategy()
    with strategy.scope():
        model = pf.keras.Sequential(
            [
                pf.keras.layers.DynamicEmbedding(2, input_shape=(3,)),
                pf.keras.layers.Flatten(),
                pf.keras.layers.Dense(1),
            ]
        )
        model.compile(optimizer="sgd", loss="mse")
    model.fit(np.arange(12).reshape(4, 3), np.ones((4, 1), "float32"), batch_size=2, verbose=0)
    table = model.layers[0].table
    rows = table.backend.client.lookup(table.config.name, np.arange(12))
    assert strategy.resize_parameter_servers(2).new_num_ps == 2  # the table is the layer's own
    np.testing.assert_array_equal(
        table.backend.client.lookup(table.config.name, np.arange(12)), rows
    )
    model.fit(np.arange(12).reshape(4, 3), np.ones((4, 1), "float32"), batch_size=2, verbose=0)

    before = strategy.placement()
    strategy._session.refuse_resize("a test's reason")
    with pytest.raises(errors.UnimplementedError, match="a test's reason"):
        strategy.resize_parameter_servers(1)
    assert strategy.placement() == before


def test_placement_module_examples_run():
    import doctest

    from psflow.distribute.ps import placement

    result = doctest.testmod(placement)
    assert result.attempted > 0 and result.failed == 0

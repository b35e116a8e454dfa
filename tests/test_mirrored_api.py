"""MirroredStrategy's API, checked against the behaviour TensorFlow documents (and shows).

The expected values are those of TensorFlow's documentation and of TensorFlow
2.21 run on the same inputs (``tests/test_mirrored_tf_reference.py`` checks
them against TensorFlow itself when it is installed).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import psflow as pf
from psflow import errors
from psflow.distribute.values import MirroredVariable, PerReplica
from tests.test_mirrored_training import logical_cpus


@pytest.fixture
def two() -> Iterator[Any]:
    """A MirroredStrategy over two logical CPU devices."""
    with logical_cpus(2):
        yield pf.distribute.MirroredStrategy()


@pytest.fixture
def three() -> Iterator[Any]:
    """A MirroredStrategy over three logical CPU devices."""
    with logical_cpus(3):
        yield pf.distribute.MirroredStrategy()


def local(strategy: Any, value: Any) -> list[Any]:
    """The per-replica components of ``value`` as Python lists."""
    return [np.asarray(v).tolist() for v in strategy.experimental_local_results(value)]


def replica_id() -> int:
    return int(pf.distribute.get_replica_context().replica_id_in_sync_group)


# -- input distribution ---------------------------------------------------------------------------
def test_distribute_dataset_splits_tf_documented_example(two: Any) -> None:
    # TF's docs: range(6).batch(4) over 2 replicas gives [0, 1], [2, 3] and then [4], [5]
    dist = two.experimental_distribute_dataset(pf.data.Dataset.range(6).batch(4))
    assert [local(two, b) for b in dist] == [[[0, 1], [2, 3]], [[4], [5]]]


@pytest.mark.parametrize(
    ("n", "batch", "expected"),
    [
        (7, 5, [[[0, 1], [2, 3], [4]], [[5], [6], []]]),
        (10, 4, [[[0, 1], [2, 3], []], [[4, 5], [6, 7], []], [[8], [9], []]]),
        (3, 1, [[[0], [], []], [[1], [], []], [[2], [], []]]),
    ],
)
def test_distribute_dataset_rebatches_like_tensorflow(
    three: Any, n: int, batch: int, expected: list
) -> None:
    # every replica but the last gets ceil(b / N) examples, as TensorFlow 2.21 does
    dist = three.experimental_distribute_dataset(pf.data.Dataset.range(n).batch(batch))
    assert [local(three, b) for b in dist] == expected


def test_distributed_iterator_get_next_raises_out_of_range_at_the_end(two: Any) -> None:
    it = iter(two.experimental_distribute_dataset(pf.data.Dataset.range(4).batch(4)))
    assert local(two, it.get_next()) == [[0, 1], [2, 3]]
    with pytest.raises(errors.OutOfRangeError):
        it.get_next()


def test_distribute_dataset_rejects_unbatched_scalars(two: Any) -> None:
    dist = two.experimental_distribute_dataset(pf.data.Dataset.range(3))
    with pytest.raises(errors.InvalidArgumentError, match="scalar"):
        next(iter(dist))


def test_distribute_datasets_from_function_gives_input_context(three: Any) -> None:
    contexts = []

    def dataset_fn(ctx: Any) -> Any:
        contexts.append(ctx)
        return pf.data.Dataset.range(7).batch(ctx.get_per_replica_batch_size(6))

    batches = [local(three, b) for b in three.distribute_datasets_from_function(dataset_fn)]
    assert len(contexts) == 1  # one input pipeline on one machine
    ctx = contexts[0]
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (1, 0, 3)
    # replicas take consecutive per-replica batches; at the end, empty ones
    assert batches == [[[0, 1], [2, 3], [4, 5]], [[6], [], []]]


def test_input_context_rejects_indivisible_global_batch() -> None:
    ctx = pf.distribute.InputContext(1, 0, 4)
    assert ctx.get_per_replica_batch_size(8) == 2
    with pytest.raises(errors.InvalidArgumentError, match=r"\(6\).*\(4\)"):
        ctx.get_per_replica_batch_size(6)


def test_distribute_values_from_function(three: Any) -> None:
    value = three.experimental_distribute_values_from_function(
        lambda ctx: pf.constant([float(ctx.replica_id_in_sync_group), ctx.num_replicas_in_sync])
    )
    assert isinstance(value, PerReplica)
    assert local(three, value) == [[0.0, 3.0], [1.0, 3.0], [2.0, 3.0]]
    assert np.asarray(three.gather(value, axis=0)).tolist() == [0, 3, 1, 3, 2, 3]


# -- run, collectives, reduce ---------------------------------------------------------------------
def test_run_returns_per_replica_results_printed_like_tensorflow(two: Any) -> None:
    with two.scope():
        t = pf.constant([1, 2, 3, 4, 5])
        res = two.run(lambda x: x + 1, args=(t,))
    assert isinstance(res, PerReplica)
    expected = (
        "PerReplica:{\n"
        "  0: psflow.Tensor([2 3 4 5 6], shape=(5,), dtype=int32),\n"
        "  1: psflow.Tensor([2 3 4 5 6], shape=(5,), dtype=int32)\n"
        "}"
    )
    assert str(res) == expected
    assert re.fullmatch(
        r"PerReplica:\{\n  0: <psflow\.Tensor.*>,\n  1: <psflow\.Tensor.*>\n\}", repr(res)
    )


def test_all_reduce_of_nested_values_tf_documented_example(two: Any) -> None:
    # TF's ReplicaContext.all_reduce docs: {'a': 1, 'b': [40, 1]} and {'a': 3, 'b': [2, 98]}
    def step() -> Any:
        ctx = pf.distribute.get_replica_context()
        raw = {"a": 1.0, "b": [40.0, 1.0]} if replica_id() == 0 else {"a": 3.0, "b": [2.0, 98.0]}
        value = {"a": pf.constant(raw["a"]), "b": [pf.constant(v) for v in raw["b"]]}
        return ctx.all_reduce("SUM", value), ctx.all_reduce(pf.distribute.ReduceOp.MEAN, value)

    total, mean = two.run(step)
    assert local(two, total["a"]) == [4.0, 4.0]
    assert [local(two, b) for b in total["b"]] == [[42.0, 42.0], [99.0, 99.0]]
    assert local(two, mean["a"]) == [2.0, 2.0]
    assert [local(two, b) for b in mean["b"]] == [[21.0, 21.0], [49.5, 49.5]]


def test_all_gather_concatenates_replicas_in_order(three: Any) -> None:
    def step() -> Any:
        ctx = pf.distribute.get_replica_context()
        mine = pf.fill([replica_id() + 1, 2], float(replica_id()))
        return ctx.all_gather(mine, axis=0)

    for gathered in local(three, three.run(step)):
        assert gathered == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0], [2.0, 2.0], [2.0, 2.0], [2.0, 2.0]]


def test_reduce_with_axis_divides_by_the_global_batch(three: Any) -> None:
    # TF's numerator/denominator MEAN: partial batches weigh by their examples
    dist = three.experimental_distribute_dataset(
        pf.data.Dataset.range(7).map(lambda x: pf.cast(x, pf.float32)).batch(5)
    )
    got = []
    for batch in dist:
        doubled = three.run(lambda x: x * 2, args=(batch,))
        sums = three.run(lambda x: pf.reduce_sum(x), args=(batch,))
        got.append(
            (
                float(three.reduce("MEAN", batch, axis=0)),
                float(three.reduce("SUM", batch, axis=0)),
                float(three.reduce("MEAN", doubled, axis=0)),
                float(three.reduce("SUM", sums, axis=None)),
                float(three.reduce("MEAN", sums, axis=None)),
                np.asarray(three.gather(batch, axis=0)).tolist(),
            )
        )
    np.testing.assert_allclose(
        [g[:5] for g in got], [(2.0, 10.0, 4.0, 10.0, 10 / 3), (5.5, 11.0, 11.0, 11.0, 11 / 3)]
    )
    assert [g[5] for g in got] == [[0, 1, 2, 3, 4], [5, 6]]


def test_reduce_of_nested_per_replica_values(two: Any) -> None:
    value = two.run(lambda: {"id": pf.cast(replica_id(), pf.float32), "one": pf.constant(1.0)})
    reduced = two.reduce("MEAN", value, axis=None)
    assert float(reduced["id"]) == 0.5
    assert float(reduced["one"]) == 1.0
    assert float(two.reduce("SUM", value, axis=None)["one"]) == 2.0


def test_reduce_sum_of_a_non_distributed_value_raises_naming_it(two: Any) -> None:
    with pytest.raises(errors.InvalidArgumentError, match=r"non-distributed value.*1\.5.*SUM"):
        two.reduce("SUM", pf.constant(1.5), axis=None)
    # MEAN of the same value on every replica is the value itself, as in TensorFlow
    assert float(two.reduce("MEAN", pf.constant(1.5), axis=None)) == 1.5
    with pytest.raises(errors.InvalidArgumentError, match="'MAX'"):
        two.reduce("MAX", two.run(lambda: pf.constant(1.0)), axis=None)


def test_experimental_local_results(two: Any) -> None:
    t = pf.constant(3.0)
    assert two.experimental_local_results(t) == (t,)
    res = two.run(lambda: pf.cast(replica_id(), pf.int32))
    assert local(two, res) == [0, 1]
    with two.scope():
        v = pf.Variable([1.0, 2.0])
    parts = two.experimental_local_results(v)
    assert len(parts) == 2 and parts == v.values
    assert [p.name for p in parts] == ["Variable:0", "Variable/replica_1:0"]


def test_gather_of_a_non_distributed_value_is_the_value(two: Any) -> None:
    t = pf.constant([[1.0, 2.0]])
    assert np.asarray(two.gather(t, axis=0)).tolist() == [[1.0, 2.0]]


# -- contexts and merge_call ----------------------------------------------------------------------
def test_contexts_outside_in_scope_and_in_run(two: Any) -> None:
    default = pf.distribute.get_strategy()
    assert not pf.distribute.has_strategy()
    assert not pf.distribute.in_cross_replica_context()
    assert pf.distribute.get_replica_context() is not None  # the default replica context
    assert default.num_replicas_in_sync == 1
    with two.scope():
        assert pf.distribute.has_strategy()
        assert pf.distribute.get_strategy() is two
        assert pf.distribute.in_cross_replica_context()
        assert pf.distribute.get_replica_context() is None

    def inside() -> tuple:
        ctx = pf.distribute.get_replica_context()
        return (
            pf.distribute.has_strategy(),
            pf.distribute.get_strategy() is two,
            pf.distribute.in_cross_replica_context(),
            ctx.num_replicas_in_sync,
            ctx.strategy is two,
            ctx.devices[0],
        )

    results = two.run(inside)
    assert [r.values if isinstance(r, PerReplica) else (r, r) for r in results] == [
        (True, True),
        (True, True),
        (False, False),
        (2, 2),
        (True, True),
        two.extended.worker_devices,
    ]
    assert not pf.distribute.has_strategy()  # nothing leaks out of run or scope


def test_scope_of_another_strategy_inside_a_scope_raises(two: Any) -> None:
    other = pf.distribute.OneDeviceStrategy("/cpu:0")
    with two.scope(), pytest.raises(errors.InvalidArgumentError, match="Mixing"), other.scope():
        pass


def test_merge_call_runs_once_in_cross_replica_context(three: Any) -> None:
    calls = []

    def merge_fn(strategy: Any, value: Any) -> Any:
        calls.append((strategy, pf.distribute.in_cross_replica_context(), value))
        # a per-replica result: every replica gets its own component back
        return PerReplica([v * 10 for v in value.values])

    def step() -> Any:
        ctx = pf.distribute.get_replica_context()
        got = ctx.merge_call(merge_fn, args=(pf.constant(float(replica_id())),))
        return got + 1.0  # a tensor here, not a PerReplica (TensorFlow's select_replica)

    assert local(three, three.run(step)) == [1.0, 11.0, 21.0]
    assert len(calls) == 1
    strategy, cross, value = calls[0]
    assert strategy is three and cross
    assert local(three, value) == [0.0, 1.0, 2.0]


def test_merge_call_error_reaches_every_replica_and_run(two: Any) -> None:
    def step() -> Any:
        def merge_fn(strategy: Any) -> None:
            raise errors.InvalidArgumentError("bad merge 42")

        return pf.distribute.get_replica_context().merge_call(merge_fn)

    with pytest.raises(errors.InvalidArgumentError, match="bad merge 42"):
        two.run(step)
    assert local(two, two.run(lambda: pf.constant(1.0))) == [1.0, 1.0]


# -- variables ------------------------------------------------------------------------------------
def test_variable_created_inside_run_is_one_mirrored_variable(three: Any) -> None:
    created = []

    def step() -> Any:
        v = pf.Variable(float(replica_id()) + 5.0)
        created.append(v)
        return v

    with three.scope():
        result = three.run(step)
    assert isinstance(result, MirroredVariable)
    assert len(created) == 3 and all(v is result for v in created)
    # every copy has the value replica 0 proposed, on its own device
    assert [float(np.asarray(c._value)) for c in result.values] == [5.0, 5.0, 5.0]


def test_variable_in_scope_reads_its_own_copy_per_replica(two: Any) -> None:
    with two.scope():
        v = pf.Variable(1.0)
    v.values[1].assign(7.0)  # make the copies differ, to see which one a replica reads
    assert local(two, two.run(lambda: v.read_value())) == [1.0, 7.0]
    v.assign(3.0)  # cross-replica assign writes every copy
    assert [float(np.asarray(c._value)) for c in v.values] == [3.0, 3.0]


@pytest.mark.parametrize(
    ("aggregation", "method", "expected"),
    [
        (pf.VariableAggregation.SUM, "assign_add", 1.0 + (1 + 2 + 3)),
        (pf.VariableAggregation.MEAN, "assign", (1 + 2 + 3) / 3),
        (pf.VariableAggregation.MEAN, "assign_sub", 1.0 - 2.0),
        (pf.VariableAggregation.ONLY_FIRST_REPLICA, "assign", 1.0),
    ],
)
def test_mirrored_variable_update_in_replica_context_aggregates(
    three: Any, aggregation: Any, method: str, expected: float
) -> None:
    with three.scope():
        v = pf.Variable(1.0, aggregation=aggregation)

    def step() -> Any:
        getattr(v, method)(pf.cast(replica_id() + 1, pf.float32))
        return v.read_value()

    assert local(three, three.run(step)) == [expected] * 3
    assert [float(np.asarray(c._value)) for c in v.values] == [expected] * 3


def test_mirrored_variable_update_without_aggregation_raises_and_changes_nothing(
    two: Any,
) -> None:
    with two.scope():
        v = pf.Variable(1.0, name="no_agg")
    with pytest.raises(errors.FailedPreconditionError, match=r"no_agg.*aggregation"):
        two.run(lambda: v.assign(2.0))
    assert [float(np.asarray(c._value)) for c in v.values] == [1.0, 1.0]
    assert local(two, two.run(lambda: pf.constant(0.0))) == [0.0, 0.0]  # still usable


# -- OneDeviceStrategy ----------------------------------------------------------------------------
def test_one_device_strategy(two: Any) -> None:
    s = pf.distribute.OneDeviceStrategy("/cpu:1")
    assert s.num_replicas_in_sync == 1
    assert int(s.run(lambda x: x + 1, args=(pf.constant(1),))) == 2
    with s.scope():
        assert pf.distribute.get_strategy() is s
        v = pf.Variable(3.0)
        assert pf.backend.current_device() == pf.backend.parse_device("/cpu:1")
    assert not isinstance(v, MirroredVariable)
    assert float(s.reduce("SUM", pf.constant([1.0, 2.0]), axis=0)) == 3.0
    assert float(s.reduce("MEAN", pf.constant([1.0, 2.0]), axis=None)[1]) == 2.0
    ds = pf.data.Dataset.range(3).batch(2)
    assert [np.asarray(b).tolist() for b in s.experimental_distribute_dataset(ds)] == [[0, 1], [2]]
    with pytest.raises(errors.InvalidArgumentError, match="'/tpu:0'"):
        pf.distribute.OneDeviceStrategy("/tpu:0")


# -- constructor arguments ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        (
            {"devices": ["/cpu:0", "/cpu:7"]},
            errors.InvalidArgumentError,
            r"'/cpu:7' does not exist",
        ),
        ({"devices": ["/cpu:1", "/cpu:1"]}, errors.InvalidArgumentError, r"duplicate.*'/cpu:1'"),
        ({"devices": []}, errors.InvalidArgumentError, "at least one device"),
        ({"devices": ["/tpu:0"]}, errors.InvalidArgumentError, r"'/tpu:0'"),
        ({"devices": ["/gpu:0"]}, errors.InvalidArgumentError, r"'/gpu:0' does not exist"),
        ({"compute_devices": ["/cpu:5"]}, errors.InvalidArgumentError, r"'/cpu:5' is not among"),
        (
            {"devices": ["/cpu:0"], "compute_devices": ["/cpu:1"]},
            errors.InvalidArgumentError,
            r"'/cpu:1' is not among",
        ),
        (
            {"cluster_spec": {"worker": ["host1:2222", "host2:2222"]}},
            errors.InvalidArgumentError,
            r"host2:2222.*2 tasks",
        ),
        ({"cross_device_ops": "bogus"}, errors.NotFoundError, r"'bogus'.*ring"),
        ({"cross_device_ops": 3}, errors.InvalidArgumentError, "got 3"),
        ({"communication_options": {"timeout_seconds": 1}}, errors.InvalidArgumentError, "got {"),
    ],
)
def test_constructor_rejects_bad_arguments_naming_them(
    three: Any, kwargs: dict, error: type, pattern: str
) -> None:
    with pytest.raises(error, match=pattern):
        pf.distribute.MirroredStrategy(**kwargs)


def test_compute_devices_and_cluster_spec(three: Any) -> None:
    s = pf.distribute.MirroredStrategy(
        devices=["/cpu:0", "/cpu:1", "/cpu:2"],
        compute_devices=["/cpu:2", "/cpu:0"],
        cluster_spec={"worker": ["localhost:2222"]},
    )
    assert s.num_replicas_in_sync == 2
    assert s.extended.worker_devices == (
        "/job:localhost/replica:0/task:0/device:CPU:2",
        "/job:localhost/replica:0/task:0/device:CPU:0",
    )
    assert s.cluster_spec.as_dict() == {"worker": ["localhost:2222"]}
    assert local(s, s.run(lambda: pf.distribute.get_replica_context().devices[0])) == [
        "/job:localhost/replica:0/task:0/device:CPU:2",
        "/job:localhost/replica:0/task:0/device:CPU:0",
    ]


def test_default_devices_and_repr(three: Any) -> None:
    s = pf.distribute.MirroredStrategy()
    assert s.num_replicas_in_sync == 3
    assert s.extended.worker_devices == tuple(
        f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(3)
    )
    assert repr(s).startswith("MirroredStrategy(devices=['/job:localhost/")
    assert s.cross_device_ops.name == "ring"
    named = pf.distribute.MirroredStrategy(cross_device_ops="reduce_to_one")
    assert named.cross_device_ops.name == "reduce_to_one"

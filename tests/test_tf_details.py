"""The TensorFlow details a tutorial trips on, each as TensorFlow 2.21 shows it.

Expected values are TensorFlow's, observed on the same inputs;
``test_tf_reference_gives_the_same_results`` reruns the distribute part under
TensorFlow itself where it is installed.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import psflow as pf
from psflow import errors
from tests.test_mirrored_training import logical_cpus
from tests.tf_reference import run_reference_program


@pytest.fixture
def two() -> Iterator[Any]:
    """A MirroredStrategy over two logical CPU devices."""
    with logical_cpus(2):
        yield pf.distribute.MirroredStrategy()


def _rid() -> Any:
    return pf.distribute.get_replica_context().replica_id_in_sync_group


def _plain(x: Any) -> Any:
    """Tensors as (dtype name, list); structures kept."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_plain(v) for v in x)
    a = np.asarray(x)
    return (a.dtype.name, a.tolist())


# -- experimental_local_results of nested structures ---------------------------------------------
def test_local_results_of_a_dict_from_all_reduce_is_a_tuple_of_per_replica_dicts(two):
    def step():
        ctx = pf.distribute.get_replica_context()
        r = pf.cast(_rid(), pf.float32)
        return ctx.all_reduce("SUM", {"a": r + 1.0}), {"r": r, "b": [pf.constant(7), r * 10.0]}

    summed, mixed = two.run(step)
    assert isinstance(summed, dict)
    assert _plain(two.experimental_local_results(summed)) == (
        {"a": ("float32", 3.0)},
        {"a": ("float32", 3.0)},
    )
    assert _plain(two.experimental_local_results(mixed)) == (
        {"r": ("float32", 0.0), "b": [("int32", 7), ("float32", 0.0)]},
        {"r": ("float32", 1.0), "b": [("int32", 7), ("float32", 10.0)]},
    )


def test_local_results_of_plain_values(two):
    assert two.experimental_local_results(5) == (5,)
    # a structure without distributed values: one copy per replica, as TensorFlow
    assert two.experimental_local_results({"x": 1}) == ({"x": 1}, {"x": 1})
    default = pf.distribute.get_strategy()
    assert default.experimental_local_results({"x": 1}) == ({"x": 1},)


# -- integer MEAN ----------------------------------------------------------------------------------
def _int_values(two):
    def step():
        ctx = pf.distribute.get_replica_context()
        v = pf.constant([1, 2, 5]) + pf.constant([0, 1, 2]) * pf.cast(_rid(), pf.int32)
        return v, ctx.all_reduce("MEAN", v), ctx.all_reduce("SUM", v)

    return two.run(step)  # replica 0: [1, 2, 5]; replica 1: [1, 3, 7]


def test_integer_mean_is_a_true_division_into_float64_as_in_tensorflow(two):
    v, mean, total = _int_values(two)
    assert _plain(two.reduce("MEAN", v, axis=None)) == ("float64", [1.0, 2.5, 6.0])
    assert _plain(two.reduce("MEAN", v, axis=0)) == ("float64", 19 / 6)
    assert _plain(two.reduce("SUM", v, axis=None)) == ("int32", [2, 5, 12])
    assert _plain(two.reduce("SUM", v, axis=0)) == ("int32", 19)
    assert _plain(two.experimental_local_results(mean)) == (("float64", [1.0, 2.5, 6.0]),) * 2
    assert _plain(two.experimental_local_results(total)) == (("int32", [2, 5, 12]),) * 2


def test_integer_mean_of_negative_values_does_not_round_down(two):
    v = two.run(lambda: pf.constant([-3, 3]) - 2 * pf.cast(_rid(), pf.int32))  # [-3,3], [-5,1]
    assert _plain(two.reduce("MEAN", v, axis=None)) == ("float64", [-4.0, 2.0])
    odd = two.run(lambda: pf.constant([-3]) + pf.cast(_rid(), pf.int32) * 0)  # -3, -3
    half = two.run(lambda: pf.constant([-3]) + pf.cast(_rid(), pf.int32))  # -3, -2
    assert _plain(two.reduce("MEAN", odd, axis=None)) == ("float64", [-3.0])
    assert _plain(two.reduce("MEAN", half, axis=None)) == ("float64", [-2.5])  # floor: -3


def test_small_integer_mean_is_float32_and_one_replica_keeps_the_value():
    with logical_cpus(2):
        two = pf.distribute.MirroredStrategy()
        v = two.run(lambda: pf.cast(pf.constant([1, 2]) + pf.cast(_rid(), pf.int32), pf.int16))
        assert _plain(two.reduce("MEAN", v, axis=None)) == ("float32", [1.5, 2.5])
    one = pf.distribute.MirroredStrategy(["/cpu:0"])

    def step():
        return pf.distribute.get_replica_context().all_reduce("MEAN", pf.constant([1, 2]))

    assert _plain(one.run(step)) == ("int32", [1, 2])  # one replica: nothing to average
    default = pf.distribute.get_strategy()
    assert _plain(default.reduce("MEAN", pf.constant([1, 2]), axis=None)) == ("int32", [1, 2])
    assert _plain(default.reduce("MEAN", pf.constant([1, 2]), axis=0)) == ("float64", 1.5)


# -- per-replica values of different shapes -----------------------------------------------------
def test_reduce_of_per_replica_values_of_different_shapes_raises_naming_them(two):
    ragged = two.run(lambda: pf.ones(pf.stack([_rid() + 1])))  # shapes [1] and [2]
    for op in ("SUM", "MEAN"):
        with pytest.raises(
            errors.InvalidArgumentError, match=r"replica 0: \[1\].*replica 1: \[2\]"
        ):
            two.reduce(op, ragged, axis=None)
    # over axis 0 each replica's part sums to a scalar first: TensorFlow allows it
    assert _plain(two.reduce("SUM", ragged, axis=0)) == ("float32", 3.0)
    wide = two.run(lambda: pf.ones(pf.stack([1, _rid() + 2])))  # [1, 2] and [1, 3]
    with pytest.raises(errors.InvalidArgumentError, match=r"axis=0.*\[2\].*\[3\]"):
        two.reduce("SUM", wide, axis=0)


# -- Keras: the learning rate --------------------------------------------------------------------
def _data(n: int = 32) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 3)).astype(np.float32)
    return x, (x @ np.array([1.0, -2.0, 0.5])).astype(np.float32).reshape(-1, 1)


def _model(lr: float = 0.05) -> Any:
    pf.random.set_seed(0)
    model = pf.keras.Sequential(
        [pf.keras.layers.Dense(4, input_shape=(3,)), pf.keras.layers.Dense(1)]
    )
    model.compile(optimizer=pf.keras.optimizers.SGD(lr), loss="mse")
    return model


def _decay(epoch: int) -> float:
    """TensorFlow's tutorial schedule: the epoch alone."""
    if epoch < 3:
        return 1e-3
    if epoch < 7:
        return 1e-4
    return 1e-5


def test_learning_rate_scheduler_takes_a_one_argument_schedule_as_the_tutorial_writes_it():
    x, y = _data()
    model = _model()
    rates: list[Any] = []
    record = pf.keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: rates.append(model.optimizer.learning_rate.numpy())
    )
    scheduler = pf.keras.callbacks.LearningRateScheduler(_decay)
    model.fit(x, y, epochs=8, batch_size=16, verbose=0, callbacks=[scheduler, record])
    # TF 2.21 reports np.float32 values: 1e-3 for epochs 0-2, 1e-4 for 3-6, 1e-5 after
    assert all(type(r) is np.float32 for r in rates)
    assert rates == [np.float32(r) for r in [1e-3] * 3 + [1e-4] * 4 + [1e-5]]


def test_a_type_error_inside_a_two_argument_schedule_is_not_swallowed():
    x, y = _data()
    model = _model()

    def broken(epoch, lr):
        return lr + "oops"  # a bug in the user's schedule: a TypeError

    with pytest.raises(TypeError, match=r"'str'"):
        model.fit(
            x, y, epochs=1, verbose=0, callbacks=[pf.keras.callbacks.LearningRateScheduler(broken)]
        )
    assert float(model.optimizer.learning_rate) == 0.05  # unchanged


def test_learning_rate_has_numpy_and_assign_and_still_behaves_as_a_float():
    opt = pf.keras.optimizers.SGD(0.5)
    for lr in (opt.learning_rate, opt.lr):
        assert lr.numpy() == np.float32(0.5) and type(lr.numpy()) is np.float32
        assert lr * 2 == 1.0 and lr / 2 == 0.25 and lr - 0.5 == 0.0 and lr == 0.5
        assert f"{lr:.2f}" == "0.50" and json.loads(json.dumps({"lr": lr})) == {"lr": 0.5}
        assert lr.dtype == pf.float32
    v = pf.Variable(np.ones(2), dtype="float64")
    assert float(opt.learning_rate.assign(0.25)) == 0.25
    opt.apply_gradients([(pf.constant(np.ones(2)), v)])
    np.testing.assert_allclose(v.numpy(), 1.0 - 0.25)  # the assigned rate is the one applied
    opt.learning_rate = 0.1  # plain assignment keeps working
    assert opt.learning_rate.numpy() == np.float32(0.1)
    import pickle

    snapshot = pickle.loads(pickle.dumps(opt.learning_rate))
    assert type(snapshot) is float and snapshot == 0.1


def test_learning_rate_of_a_schedule_follows_the_step_and_bad_assign_changes_nothing():
    schedule = pf.keras.optimizers.schedules.ExponentialDecay(1.0, decay_steps=1, decay_rate=0.5)
    opt = pf.keras.optimizers.SGD(schedule)
    v = pf.Variable(np.zeros(1), dtype="float64")
    seen = []
    for _ in range(3):
        seen.append(opt.learning_rate.numpy())
        opt.apply_gradients([(pf.constant(np.ones(1)), v)])
    assert seen == [np.float32(1.0), np.float32(0.5), np.float32(0.25)]
    with pytest.raises(errors.InvalidArgumentError, match="-1"):
        opt.learning_rate.assign(-1.0)
    assert opt.learning_rate.numpy() == np.float32(0.125)  # still the schedule
    import copy

    orphan = copy.copy(opt.learning_rate)  # copies are plain floats
    assert type(orphan) is float
    detached = pf.keras.optimizers.learning_rate.LearningRate(0.3)
    with pytest.raises(errors.FailedPreconditionError, match=r"0\.3"):
        detached.assign(0.1)


# -- Keras: ModelCheckpoint + train.latest_checkpoint ---------------------------------------------
def test_tutorial_checkpoint_flow_loads_the_last_epochs_weights(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the tutorial's relative './training_checkpoints'
    checkpoint_dir = "./training_checkpoints"
    checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt_{epoch}")
    assert pf.train.latest_checkpoint(checkpoint_dir) is None  # nothing yet, as TensorFlow
    x, y = _data()
    model = _model()
    callbacks = [
        pf.keras.callbacks.ModelCheckpoint(filepath=checkpoint_prefix, save_weights_only=True)
    ]
    model.fit(x, y, epochs=3, batch_size=16, verbose=0, callbacks=callbacks)
    latest = pf.train.latest_checkpoint(checkpoint_dir)
    assert latest is not None and os.path.basename(latest) == "ckpt_3"
    fresh = _model(lr=0.05)
    fresh.predict(x[:1], verbose=0)  # built, with other weights than the trained model
    assert not np.allclose(fresh.get_weights()[0], model.get_weights()[0])
    fresh.load_weights(pf.train.latest_checkpoint(checkpoint_dir))
    for a, b in zip(fresh.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    monkeypatch.chdir("/")  # the recorded path holds from another working directory
    assert os.path.exists(pf.train.latest_checkpoint(tmp_path / "training_checkpoints"))


def test_latest_checkpoint_is_the_last_file_saved_when_only_the_best_are_saved(tmp_path):
    x, y = _data()
    model = _model()
    scripted = iter([3.0, 1.0, 2.0])  # epoch 2 is the best: epoch 3 is not saved

    class Loss(pf.keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            logs["loss"] = next(scripted)

    saver = pf.keras.callbacks.ModelCheckpoint(
        str(tmp_path / "w_{epoch}"), monitor="loss", save_best_only=True
    )
    model.fit(x, y, epochs=3, verbose=0, callbacks=[Loss(), saver])
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "w_1", "w_2"]
    assert pf.train.latest_checkpoint(str(tmp_path)) == str(tmp_path / "w_2")


def test_weights_saved_under_the_state_files_own_name_are_not_clobbered(tmp_path):
    x, y = _data()
    model = _model()
    saver = pf.keras.callbacks.ModelCheckpoint(str(tmp_path / "checkpoint"))
    model.fit(x, y, epochs=1, verbose=0, callbacks=[saver])
    fresh = _model()
    fresh.predict(x[:1], verbose=0)
    fresh.load_weights(str(tmp_path / "checkpoint"))  # still the weights, not a state file
    for a, b in zip(fresh.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)


# -- namespaces: hasattr never raises ---------------------------------------------------------------
NAMESPACES = {
    "psflow": ["TensorSpec", "data", "keras", "distribute", "config", "train", "math", "nn"],
    "psflow.keras": ["datasets", "backend"],
    "psflow.collective": ["NcclAllReduce"],
    "psflow.distribute.experimental": ["coordinator", "partitioners", "ParameterServerStrategy"],
}


@pytest.mark.parametrize("namespace", sorted(NAMESPACES))
def test_every_lazy_attribute_resolves_and_a_missing_one_is_just_absent(namespace):
    module = importlib.import_module(namespace)
    lazy = set(NAMESPACES[namespace]) | set(getattr(module, "_LAZY", {}))
    for name in sorted(lazy):
        assert hasattr(module, name), f"{namespace}.{name}"
        assert getattr(module, name) is not None
    for missing in ("saved_model", "no_such_attribute"):
        assert not hasattr(module, missing)
        with pytest.raises(AttributeError, match=missing):
            getattr(module, missing)


def test_hasattr_psflow_saved_model_is_false():
    assert hasattr(pf, "saved_model") is False


# -- ClusterCoordinator: an exhausted per-worker iterator -----------------------------------------
def _schedule_past_the_end(strategy) -> tuple[Any, list[Any]]:
    coordinator = pf.distribute.coordinator.ClusterCoordinator(strategy)
    iterator = iter(coordinator.create_per_worker_dataset(lambda: pf.data.Dataset.range(3)))
    values = [coordinator.schedule(lambda it: int(next(it)), args=(iterator,)) for _ in range(5)]
    return coordinator, values


def test_exhausted_per_worker_iterator_raises_out_of_range_at_join():
    strategy = pf.distribute.ParameterServerStrategy()
    coordinator, values = _schedule_past_the_end(strategy)
    try:
        with pytest.raises(errors.OutOfRangeError, match="exhausted") as info:
            coordinator.join()
        assert not isinstance(info.value, StopIteration)
        assert [v.fetch() for v in values[:3]] == [0, 1, 2]
        with pytest.raises(errors.OutOfRangeError):
            values[3].fetch()
    finally:
        coordinator.shutdown()


@pytest.mark.slow
def test_exhausted_per_worker_iterator_on_a_worker_process_raises_out_of_range(start_cluster):
    cluster = start_cluster(num_ps=1, num_workers=1)
    strategy = pf.distribute.ParameterServerStrategy(cluster.resolver())
    coordinator, values = _schedule_past_the_end(strategy)
    with pytest.raises(errors.OutOfRangeError, match="exhausted") as info:
        coordinator.join()
    assert info.value.task == "worker:0"
    # two closures may be in flight on the worker, so the order they ran in is not fixed
    assert sorted(_fetched(values)) == [0, 1, 2]


def _fetched(values: list[Any]) -> list[Any]:
    """The values of the closures that succeeded; the others raised ``OutOfRangeError``/``Cancelled``."""
    out = []
    for v in values:
        with contextlib.suppress(errors.OutOfRangeError, errors.CancelledError):
            out.append(v.fetch())
    return out


# -- the same program under TensorFlow ----------------------------------------------------------
PROGRAM = r"""
import json, sys
if sys.argv[1] == "tf":
    import tensorflow as tf
else:
    import psflow as tf
import numpy as np

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
s = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
out = {}

def plain(x):
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    a = np.asarray(x)
    return [a.dtype.name, a.tolist()]

def rid():
    return tf.distribute.get_replica_context().replica_id_in_sync_group

def step():
    ctx = tf.distribute.get_replica_context()
    r = tf.cast(rid(), tf.float32)
    v = tf.constant([1, 2, 5]) + tf.constant([0, 1, 2]) * tf.cast(rid(), tf.int32)
    small = tf.cast(tf.constant([1, 2]) + tf.cast(rid(), tf.int32), tf.int16)
    return (ctx.all_reduce("SUM", {"a": r + 1.0}), {"r": r, "b": [tf.constant(7), r * 10.0]},
            v, ctx.all_reduce("MEAN", v), small)
summed, mixed, v, mean, small = s.run(step)
out["local/all_reduce_dict"] = plain(s.experimental_local_results(summed))
out["local/mixed"] = plain(s.experimental_local_results(mixed))
out["local/plain"] = plain(s.experimental_local_results({"x": 1}))
out["mean/none"] = plain(s.reduce("MEAN", v, axis=None))
out["mean/axis0"] = plain(s.reduce("MEAN", v, axis=0))
out["sum/none"] = plain(s.reduce("SUM", v, axis=None))
out["sum/axis0"] = plain(s.reduce("SUM", v, axis=0))
out["all_reduce_mean"] = plain(s.experimental_local_results(mean))
out["mean/int16"] = plain(s.reduce("MEAN", small, axis=None))
half = s.run(lambda: tf.constant([-3]) + tf.cast(rid(), tf.int32))
out["mean/negative"] = plain(s.reduce("MEAN", half, axis=None))
ragged = s.run(lambda: tf.ones(tf.stack([rid() + 1])))
for op in ("SUM", "MEAN"):
    try:
        s.reduce(op, ragged, axis=None)
        out["ragged/" + op] = "no error"
    except Exception as e:
        out["ragged/" + op] = "InvalidArgumentError" if "InvalidArgument" in type(e).__name__ else repr(e)
out["ragged/axis0"] = plain(s.reduce("SUM", ragged, axis=0))
d = tf.distribute.get_strategy()
out["default/axis0"] = plain(d.reduce("MEAN", tf.constant([1, 2]), axis=0))
print("RESULT " + json.dumps(out))
"""


def _run_program(framework: str) -> dict:
    return run_reference_program(PROGRAM, framework)


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None, reason="TensorFlow is not installed"
)
def test_tf_reference_gives_the_same_results() -> None:
    theirs = _run_program("tf")
    ours = _run_program("psflow")
    assert ours.keys() == theirs.keys()
    for key in theirs:
        assert ours[key] == theirs[key], key


@pytest.mark.parametrize(
    "name", ["psflow.keras.optimizers.learning_rate", "psflow.distribute.values"]
)
def test_docstring_examples_run(name):
    import doctest

    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0 and result.failed == 0

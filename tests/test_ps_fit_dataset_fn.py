"""``fit``/``evaluate`` on dataset functions: ``DatasetCreator``, a bare ``dataset_fn``, and
``distribute_datasets_from_function``, under ParameterServerStrategy and the others.

The model's loss is linear in its weights (the prediction itself), so a step's
gradient is its batch's mean input whatever the weights are: after SGD the
kernel is ``-lr * sum of the trained batches' means``, computed here in NumPy.
A batch trained twice, or skipped, or an iterator restarted each epoch, shows
as a different kernel, whatever order asynchronous workers trained in.
"""

from __future__ import annotations

import functools
import os
import pathlib
import signal

import numpy as np
import pytest

import psflow as pf
from psflow import errors

N, D, BATCH, LR = 48, 3, 4, 0.1
STEPS = 4  # steps_per_epoch: 3 epochs read all 12 batches of the (finite) data once


def _rows() -> np.ndarray:
    return np.random.default_rng(7).normal(size=(N, D)).astype(np.float32)


def dataset_fn(input_context, record_dir: str | None = None):
    """The data sharded by the pipeline's context, batched per replica; no shuffle, no repeat."""
    if record_dir is not None:  # which process built which pipeline
        name = (
            f"pipeline-{input_context.input_pipeline_id}-of-"
            f"{input_context.num_input_pipelines}-pid-{os.getpid()}"
        )
        pathlib.Path(record_dir, name).touch()
    x = _rows()
    dataset = pf.data.Dataset.from_tensor_slices((x, np.zeros((N, 1), np.float32)))
    dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    return dataset.batch(input_context.get_per_replica_batch_size(BATCH))


def _batch_means(num_pipelines: int) -> list[np.ndarray]:
    x = _rows()
    means = []
    for p in range(num_pipelines):
        part = x[p::num_pipelines]
        means += [part[i : i + BATCH].mean(axis=0) for i in range(0, len(part), BATCH)]
    return means


def prediction_as_loss(y_true, y_pred):
    """The loss is the prediction: its gradient is the batch's mean input."""
    return pf.reduce_sum(y_pred, axis=-1)


def _model(strategy, learning_rate: float = LR):
    with strategy.scope():
        model = pf.keras.Sequential(
            [pf.keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")]
        )
        model.compile(optimizer=pf.keras.optimizers.SGD(learning_rate), loss=prediction_as_loss)
    model.build((None, D))
    return model


def _strategy(name: str):
    if name == "default":
        return pf.distribute.get_strategy()
    if name == "mirrored":
        return pf.distribute.MirroredStrategy()
    return pf.distribute.ParameterServerStrategy()


def _input(kind: str, strategy, fn=dataset_fn):
    if kind == "creator":
        return pf.keras.utils.experimental.DatasetCreator(fn)
    if kind == "function":
        return fn
    return strategy.distribute_datasets_from_function(fn)


@pytest.mark.parametrize("kind", ["creator", "function", "from_function"])
@pytest.mark.parametrize("name", ["ps", "default", "mirrored"])
def test_fit_on_a_dataset_function_trains_each_batch_once_across_epochs(name, kind):
    strategy = _strategy(name)
    model = _model(strategy)
    history = model.fit(_input(kind, strategy), epochs=3, steps_per_epoch=STEPS, verbose=0)
    assert len(history.history["loss"]) == 3
    assert int(model.optimizer.iterations) == 3 * STEPS
    want = -LR * np.sum(_batch_means(1), axis=0)
    np.testing.assert_allclose(model.weights[0].numpy()[:, 0], want, rtol=1e-5, atol=1e-6)


def test_evaluate_and_validation_on_a_dataset_function_start_over_each_time():
    strategy = _strategy("ps")
    model = _model(strategy, learning_rate=0.0)  # weights stay: every evaluation is the same
    model.set_weights([np.array([[1.0], [-2.0], [0.5]], np.float32)])
    creator = pf.keras.utils.experimental.DatasetCreator(dataset_fn)
    kernel = model.weights[0].numpy()[:, 0]
    want = float(np.mean([m @ kernel for m in _batch_means(1)[:3]]))
    assert model.evaluate(creator, steps=3, verbose=0) == pytest.approx(want, rel=1e-5)
    assert model.evaluate(creator, steps=3, verbose=0) == pytest.approx(want, rel=1e-5)
    history = model.fit(
        creator,
        epochs=2,
        steps_per_epoch=2,
        validation_data=creator,
        validation_steps=3,
        verbose=0,
    )
    np.testing.assert_allclose(history.history["val_loss"], [want, want], rtol=1e-5)


@pytest.mark.parametrize(
    ("call", "argument"),
    [
        (lambda m, c: m.fit(c, epochs=1, verbose=0), "steps_per_epoch"),
        (
            lambda m, c: m.fit(c, steps_per_epoch=2, validation_data=c, verbose=0),
            "validation_steps",
        ),
        (lambda m, c: m.evaluate(c, verbose=0), "`steps`"),
        (lambda m, c: m.fit(c, steps_per_epoch=2, batch_size=8, verbose=0), "batch_size=8"),
    ],
)
@pytest.mark.parametrize("kind", ["creator", "function", "from_function"])
def test_a_dataset_function_without_its_step_count_is_rejected_by_name(call, argument, kind):
    strategy = _strategy("ps")
    model = _model(strategy)
    before = model.get_weights()
    with pytest.raises(errors.InvalidArgumentError, match=argument):
        call(model, _input(kind, strategy))
    assert int(model.optimizer.iterations) == 0
    np.testing.assert_array_equal(model.get_weights()[0], before[0])


def test_dataset_creator_needs_a_callable():
    with pytest.raises(TypeError, match="int"):
        pf.keras.utils.experimental.DatasetCreator(3)


@pytest.mark.parametrize("name", ["ps", "default"])
def test_a_dataset_function_that_runs_out_raises_out_of_range(name):
    strategy = _strategy(name)
    model = _model(strategy)
    creator = pf.keras.utils.experimental.DatasetCreator(dataset_fn)
    # 12 batches: two epochs of 6, then none for the third
    with pytest.raises(errors.OutOfRangeError, match="ran out of data"):
        model.fit(creator, epochs=3, steps_per_epoch=6, verbose=0)
    assert int(model.optimizer.iterations) == 12


class _KillAfterEpoch(pf.keras.callbacks.Callback):
    """Kills a worker process at the end of the first epoch."""

    def __init__(self, pid: int) -> None:
        super().__init__()
        self.pid = pid

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            os.kill(self.pid, signal.SIGKILL)


def _built_pipelines(record_dir: pathlib.Path) -> set[tuple[int, int, int]]:
    built = set()
    for path in record_dir.iterdir():
        _, pipeline, _, of, _, pid = path.name.split("-")
        built.add((int(pipeline), int(of), int(pid)))
    return built


@pytest.mark.slow
@pytest.mark.parametrize("case", ["plain", "worker_dies", "two_devices_per_worker"])
def test_two_workers_build_their_own_pipelines_and_train_each_batch_once(
    start_cluster, tmp_path, case
):
    # two devices: each step's element is split over the worker's replicas, gradients summed
    devices = "2" if case == "two_devices_per_worker" else "1"
    cluster = start_cluster(num_ps=1, num_workers=2, worker_env={"PSFLOW_NUM_CPU_DEVICES": devices})
    strategy = pf.distribute.ParameterServerStrategy(cluster.resolver())
    model = _model(strategy)
    record_dir = tmp_path / "pipelines"
    record_dir.mkdir()
    creator = pf.keras.utils.experimental.DatasetCreator(
        functools.partial(dataset_fn, record_dir=str(record_dir))
    )
    victim = cluster.workers[1].proc.pid
    callbacks = [_KillAfterEpoch(victim)] if case == "worker_dies" else []
    model.fit(creator, epochs=3, steps_per_epoch=STEPS, verbose=0, callbacks=callbacks)
    assert int(model.optimizer.iterations) == 3 * STEPS
    (stats,) = strategy.ps_stats()
    assert stats["pushes_applied"] == 3 * STEPS  # a re-run step pushed once
    want = -LR * np.sum(_batch_means(2), axis=0)
    np.testing.assert_allclose(model.weights[0].numpy()[:, 0], want, rtol=1e-5, atol=1e-6)
    built = _built_pipelines(record_dir)
    workers = {cluster.workers[0].proc.pid, victim}
    assert {(p, n) for p, n, _ in built} == {(0, 2), (1, 2)}  # each pipeline knows its index
    assert {pid for _, _, pid in built} <= workers  # built on the workers, not here
    if case == "worker_dies":  # the survivor built the lost worker's pipeline and finished it
        assert (1, 2, cluster.workers[0].proc.pid) in built

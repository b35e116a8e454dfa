"""psflow's GPU code paths, run on CPU under a strict CuPy double (tests/strict_cupy.py).

The double refuses every implicit mix of host and device arrays, as real CuPy
does, so these tests catch a NumPy array reaching a CuPy kernel (or the other
way round) in local, mirrored and parameter-server training. Every result is
compared with the same computation on NumPy (the CPU device). They check
device discipline; they do not replace a run on a real GPU
(benchmarks/gpu_check.py).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import psflow as pf
from psflow import backend, errors
from tests import strict_cupy

FEATURES, HIDDEN, CLASSES = 6, 8, 3


@pytest.fixture
def gpu() -> Iterator[strict_cupy.Transfers]:
    """Two strict fake GPUs for the test's duration."""
    with strict_cupy.installed(devices=2) as transfers:
        yield transfers


def _data(n: int = 32, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=n).astype(np.int64)
    return x, y


def _weights(seed: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [
        rng.normal(0, 0.4, (FEATURES, HIDDEN)).astype(np.float32),
        rng.normal(0, 0.1, (HIDDEN,)).astype(np.float32),
        rng.normal(0, 0.4, (HIDDEN, CLASSES)).astype(np.float32),
        rng.normal(0, 0.1, (CLASSES,)).astype(np.float32),
    ]


def _given(value: np.ndarray) -> Callable[..., Any]:
    return lambda shape, dtype=None, **kwargs: value


def _model(activation: str = "relu", metrics: Any = ("accuracy",), cls: Any = None) -> Any:
    """A compiled MLP with fixed initial weights, created in the current strategy/device."""
    w1, b1, w2, b2 = _weights()
    model = (cls or pf.keras.Sequential)(
        [
            pf.keras.layers.Dense(
                HIDDEN,
                activation=activation,
                kernel_initializer=_given(w1),
                bias_initializer=_given(b1),
            ),
            pf.keras.layers.Dense(
                CLASSES, kernel_initializer=_given(w2), bias_initializer=_given(b2)
            ),
        ]
    )
    model.compile(
        optimizer=pf.keras.optimizers.SGD(0.1),
        loss=pf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=list(metrics),
    )
    return model


def _host_weights(model: Any) -> list[np.ndarray]:
    return [np.array(w) for w in model.get_weights()]


def _devices_of(model: Any) -> set[str]:
    return {backend.device_of(v._array()).device_type for v in model.trainable_variables}


def _assert_histories_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key)


# -- the double itself -------------------------------------------------------------------------
def test_the_double_refuses_implicit_host_device_mixing_like_cupy(gpu):
    import cupy

    host = np.arange(3, dtype=np.float32)
    dev = cupy.asarray(host)
    with pytest.raises(TypeError, match="Implicit conversion to a NumPy array"):
        np.asarray(dev)
    for mix in (lambda: dev + host, lambda: host + dev, lambda: np.concatenate([host, dev])):
        with pytest.raises(TypeError, match="Unsupported type"):
            mix()
    with pytest.raises(TypeError, match="get"):
        dev.tobytes()
    with pytest.raises(ValueError, match=r"non-scalar numpy\.ndarray"):
        cupy.copyto(dev, host)
    with pytest.raises(ValueError, match=r"non-scalar numpy\.ndarray"):
        dev[:] = host
    dev[np.array([0, 2])] = host[:2]  # an advanced index copies host values over, as CuPy
    # where CuPy reads an argument on the host (split points, shapes), host arrays are fine
    assert [p.shape for p in cupy.split(dev, np.array([1]))] == [(1,), (2,)]
    with cupy.cuda.Device(1):
        other = cupy.zeros(3, np.float32)
    with pytest.raises(ValueError, match="different from the current device"):
        dev + other
    # the explicit ways across work, and are counted
    gpu.reset()
    np.testing.assert_array_equal(cupy.asnumpy(dev * 2), [0, 2, 2])
    assert (gpu.to_host, type(dev.sum()).__module__) == (1, "cupy")


# -- local training ----------------------------------------------------------------------------
def _local_run(x: np.ndarray, y: np.ndarray) -> tuple[dict, list[Any], list[np.ndarray], set]:
    model = _model(metrics=("accuracy", pf.keras.metrics.SparseTopKCategoricalAccuracy(k=2)))
    history = model.fit(
        x, y, batch_size=8, epochs=2, verbose=0, shuffle=False, validation_data=(x[:8], y[:8])
    )
    evaluated = model.evaluate(x, y, batch_size=16, verbose=0)
    predicted = model.predict(x[:5], verbose=0)
    return history.history, [evaluated, predicted], _host_weights(model), _devices_of(model)


def test_fit_with_numpy_arrays_on_a_gpu_equals_the_cpu(gpu):
    x, y = _data()
    got = _local_run(x, y)
    with pf.device("/cpu:0"):
        want = _local_run(x, y)
    assert (got[3], want[3]) == ({"GPU"}, {"CPU"})
    _assert_histories_close(got[0], want[0])
    np.testing.assert_allclose(got[1][0], want[1][0], rtol=1e-5)
    np.testing.assert_allclose(got[1][1], want[1][1], rtol=1e-5, atol=1e-6)
    for g, w in zip(got[2], want[2]):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


class _OwnStep(pf.keras.Sequential):
    """A user's ``train_step``: TensorFlow's documented override, with no placement of its own."""

    def train_step(self, data: Any) -> dict[str, Any]:
        x, y = data
        with pf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x, y, y_pred)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return self._update_metrics(loss, y, y_pred, None, int(x.shape[0]))


@pytest.mark.parametrize("own_step", [False, True], ids=["train_step", "own_train_step"])
def test_fit_with_a_dataset_and_train_on_batch_on_a_gpu_equal_the_cpu(gpu, own_step):
    x, y = _data()

    def run() -> tuple[dict, list[np.ndarray]]:
        model = _model(cls=_OwnStep if own_step else None)
        ds = pf.data.Dataset.from_tensor_slices((x, y)).shuffle(32, seed=3).batch(8)
        history = model.fit(ds, epochs=2, verbose=0)
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
        model.train_on_batch(x[:4], y[:4])
        return history.history, _host_weights(model)

    got = run()
    with pf.device("/cpu:0"):
        want = run()
    _assert_histories_close(got[0], want[0])
    for g, w in zip(got[1], want[1]):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_exact_gelu_and_its_gradient_on_a_gpu_equal_the_cpu(gpu):
    values = np.linspace(-4, 4, 17, dtype=np.float32)

    def run() -> tuple[np.ndarray, np.ndarray]:
        x = pf.constant(values)
        with pf.GradientTape() as tape:
            tape.watch(x)
            z = pf.nn.gelu(x, approximate=False)
        return backend.to_numpy(z._array()), backend.to_numpy(tape.gradient(z, x)._array())

    z_gpu, g_gpu = run()
    with pf.device("/cpu:0"):
        z_cpu, g_cpu = run()
    np.testing.assert_allclose(z_gpu, z_cpu, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(g_gpu, g_cpu, rtol=1e-6, atol=1e-7)
    # and against the definition: x * Phi(x), with Phi from the error function
    from math import erf, sqrt

    np.testing.assert_allclose(
        z_cpu, [v * 0.5 * (1 + erf(v / sqrt(2))) for v in values.tolist()], rtol=1e-6, atol=1e-7
    )


def test_place_moves_an_array_to_the_gpu_it_is_asked_for(gpu):
    import cupy

    with pf.device("/gpu:0"):
        on0 = backend.place(np.arange(4, dtype=np.float32))
    moved = backend.place(on0, backend.Device("GPU", 1))
    assert (on0.device.id, moved.device.id) == (0, 1)
    with cupy.cuda.Device(1):
        np.testing.assert_array_equal((moved + 1).get(), np.arange(4) + 1)
    assert backend.place(on0, backend.Device("GPU", 0)) is on0  # already there: no copy
    np.testing.assert_array_equal(backend.place(moved[::2], backend.Device("GPU", 0)).get(), [0, 2])


def test_host_weights_assign_save_and_restore_into_gpu_variables(gpu, tmp_path):
    x, _ = _data(4)
    model = _model()
    model.build((None, FEATURES))
    want = [w + 1.0 for w in _weights()]
    model.set_weights(want)  # host arrays into GPU variables
    assert _devices_of(model) == {"GPU"}
    before = model.predict(x, verbose=0)
    path = str(tmp_path / "w.weights.h5")
    model.save_weights(path)
    ckpt = pf.train.Checkpoint(model=model)
    saved = ckpt.save(str(tmp_path / "ckpt"))
    model.set_weights(_weights())
    model.load_weights(path)
    np.testing.assert_array_equal(model.predict(x, verbose=0), before)
    model.set_weights(_weights())
    ckpt.restore(saved)
    for got, w in zip(_host_weights(model), want):
        np.testing.assert_array_equal(got, w)
    assert _devices_of(model) == {"GPU"}


def test_with_only_the_second_gpu_visible_arrays_live_on_it_as_logical_gpu_0(gpu):
    visible = pf.config.list_physical_devices("GPU")[1]
    pf.config.set_visible_devices([visible], "GPU")
    assert len(pf.config.list_logical_devices("GPU")) == 1
    with pf.device("/gpu:0"):
        v = pf.Variable(np.zeros(3, np.float32))
        model = _model()
        model.fit(*_data(8), batch_size=4, epochs=1, verbose=0)
    assert v._array().device.id == 1  # CUDA device 1 ...
    assert backend.device_of(v._array()) == backend.Device("GPU", 0)  # ... is logical GPU 0
    assert v.device.endswith("device:GPU:0")
    v.assign(np.arange(3, dtype=np.float32))  # host values land on CUDA device 1
    v.assign_add(np.ones(3, np.float32))  # computed there too, from any current device
    v.assign_sub([1.0, 1.0, 1.0])
    model.set_weights(_weights())
    assert v._array().device.id == 1 and {w.device for w in model.weights} == {v.device}
    np.testing.assert_array_equal(v.numpy(), [0, 1, 2])


def test_a_bad_host_value_for_a_gpu_variable_is_refused_and_changes_nothing(gpu):
    v = pf.Variable(np.zeros((2, 2), np.float32))
    with pytest.raises(errors.InvalidArgumentError, match=r"shape \(2, 2\) got shape \(3,\)"):
        v.assign(np.ones(3, np.float32))
    assert backend.device_of(v._array()).is_gpu
    np.testing.assert_array_equal(v.numpy(), np.zeros((2, 2)))


def test_metrics_copy_a_steps_outputs_to_the_host_once_not_once_per_metric(gpu):
    x, y = _data(16)

    def transfers_per_step(metrics: tuple) -> float:
        model = _model(metrics=metrics)
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # build, warm up
        gpu.reset()
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        return gpu.to_host / 2

    one = transfers_per_step(("accuracy",))
    four = transfers_per_step(
        (
            "accuracy",
            pf.keras.metrics.SparseTopKCategoricalAccuracy(k=2),
            pf.keras.metrics.SparseCategoricalAccuracy(name="acc2"),
            pf.keras.metrics.SparseTopKCategoricalAccuracy(k=1, name="top1"),
        )
    )
    assert four == one, (one, four)
    assert one <= 4  # loss, labels, predictions, and the label-range check of the loss


# -- mirrored ----------------------------------------------------------------------------------
def test_mirrored_fit_on_two_gpus_equals_one_cpu(gpu):
    x, y = _data()
    strategy = pf.distribute.MirroredStrategy()
    assert strategy.num_replicas_in_sync == 2
    with strategy.scope():
        model = _model()
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False).history
    copies = {
        backend.device_of(c._value).index for v in model.trainable_variables for c in v.values
    }
    assert copies == {0, 1}
    with pf.device("/cpu:0"):
        ref = _model()
        want = ref.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False).history
    np.testing.assert_allclose(history["loss"], want["loss"], rtol=1e-5)
    for g, w in zip(_host_weights(model), _host_weights(ref)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_mirrored_custom_loop_on_two_gpus_equals_single_device_training(gpu):
    x, y = _data()
    strategy = pf.distribute.MirroredStrategy()
    with strategy.scope():
        model = _model()
        model.build((None, FEATURES))
        opt = pf.keras.optimizers.SGD(0.1)
        loss_obj = pf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def step(inputs: Any) -> Any:
        features, labels = inputs
        with pf.GradientTape() as tape:
            per_example = loss_obj(labels, model(features, training=True))
            loss = pf.nn.compute_average_loss(per_example, global_batch_size=16)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    ds = strategy.experimental_distribute_dataset(
        pf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    )
    losses = [float(strategy.reduce("SUM", strategy.run(step, args=(b,)), axis=None)) for b in ds]
    with pf.device("/cpu:0"):
        ref = _model()
        want = [float(ref.train_on_batch(x[i : i + 16], y[i : i + 16])[0]) for i in (0, 16)]
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    for v, w in zip(model.trainable_variables, _host_weights(ref)):
        for c in v.values:
            np.testing.assert_allclose(backend.to_numpy(c._value), w, rtol=1e-5, atol=1e-6)


def test_integer_mean_over_gpu_arrays_is_refused_and_changes_nothing(gpu):
    import cupy

    from psflow.collective.gpu import CupyKernels

    with cupy.cuda.Device(1):
        second = cupy.asarray(np.array([3, 5], np.int32))
    first = cupy.asarray(np.array([1, 2], np.int32))
    ops = pf.collective.create_cross_device_ops("ring")
    try:
        with pytest.raises(errors.InvalidArgumentError, match="integer dtype int32"):
            ops.all_reduce([[first], [second]], "MEAN")
    finally:
        ops.close()
    kernels = CupyKernels([0, 1])
    with pytest.raises(errors.InvalidArgumentError, match="int32"):
        kernels.divide(1, second, 2)
    assert (first.get().tolist(), second.get().tolist()) == ([1, 2], [3, 5])


# -- a parameter-server worker on a GPU, against a real PS process ------------------------------
def _ps_step(strategy: Any, x: np.ndarray, ids: list[int], prefix: str) -> list[np.ndarray]:
    """One SGD step of a dense kernel and an embedding table held by the PS."""
    with strategy.scope():
        kernel = pf.Variable(_weights()[0], name=f"{prefix}kernel")
        table = pf.Variable(np.arange(30, dtype=np.float32).reshape(10, 3), name=f"{prefix}table")
        opt = pf.keras.optimizers.SGD(0.1)
    with pf.GradientTape() as tape:
        h = pf.matmul(pf.constant(x), kernel)
        rows = pf.nn.embedding_lookup(table, pf.constant(ids))
        loss = pf.reduce_mean(h * h) + pf.reduce_sum(rows * rows) / 10.0
    grads = tape.gradient(loss, [kernel, table])
    assert isinstance(grads[1], pf.IndexedSlices)  # only the looked-up rows travel
    opt.apply_gradients(zip(grads, [kernel, table]))
    return [kernel.numpy(), table.numpy()]


@pytest.mark.slow
def test_a_gpu_worker_pulls_and_pushes_dense_and_sparse_like_numpy(start_ps, gpu):
    x, _ = _data(8)
    ids = [1, 4, 1, 7]
    ps = start_ps()
    results = {}
    for device in ("/gpu:0", "/cpu:0"):  # one PS serves both sides, under their own names
        with pf.device(device):
            strategy = pf.distribute.ParameterServerStrategy._for_worker([ps.address], 1, "w:0")
            gpu.reset()
            results[device] = _ps_step(strategy, x, ids, prefix=device.strip("/") + "/")
            if device == "/gpu:0":
                assert gpu.to_device > 0 and gpu.to_host > 0  # pulls went up, pushes came down
    # by hand: d mean((xW)^2)/dW = 2 x^T (xW) / size, and each lookup of row r adds 2 r / 10
    w = _weights()[0].astype(np.float64)
    want_kernel = w - 0.1 * 2 * x.T @ (x @ w) / (x.shape[0] * w.shape[1])
    want_table = np.arange(30, dtype=np.float64).reshape(10, 3)
    for r in set(ids):
        want_table[r] *= 1 - 0.1 * ids.count(r) * 2 / 10
    for got_kernel, got_table in results.values():
        np.testing.assert_allclose(got_kernel, want_kernel, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got_table, want_table, rtol=1e-6)


def test_the_embedded_ps_strategy_fits_on_a_gpu_like_on_the_cpu(gpu):
    x, y = _data()

    def run() -> tuple[dict, list[np.ndarray]]:
        strategy = pf.distribute.ParameterServerStrategy()
        with strategy.scope():
            model = _model()
        history = model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False).history
        return history, _host_weights(model)

    got = run()
    with pf.device("/cpu:0"):
        want = run()
    _assert_histories_close(got[0], want[0])
    for g, w in zip(got[1], want[1]):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_the_double_is_gone_after_the_fixture():
    with strict_cupy.installed(devices=1):
        assert backend.gpu_count() == 1
    assert getattr(sys.modules.get("cupy"), "__file__", None) != strict_cupy.__file__
    assert getattr(backend.cupy_or_none(), "__file__", None) != strict_cupy.__file__


_GPU_CHECK_UNDER_THE_DOUBLE = """
import contextlib
import sys
sys.path.insert(0, "benchmarks")
from tests import strict_cupy
import gpu_check
with strict_cupy.installed(devices=1, cudnn=True):
    code = gpu_check.main(["--quick", "--mb", "0.25"])
sys.exit(code)
"""


@pytest.mark.slow
def test_gpu_check_runs_its_gpu_branches_and_skips_nccl_on_one_gpu():
    import json
    import subprocess

    from tests.conftest import ROOT, child_env

    result = subprocess.run(
        [sys.executable, "-c", _GPU_CHECK_UNDER_THE_DOUBLE],
        capture_output=True,
        text=True,
        timeout=240,
        env=child_env(),
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = {r["case"]: r for r in map(json.loads, result.stdout.splitlines())}
    for case in ("fit_arrays", "metrics", "ps_worker", "train_step", "mirrored", "ring"):
        assert records[f"gpu/{case}"]["value"] == "pass", records[f"gpu/{case}"]
        assert records[f"cpu/{case}"]["value"] == "pass", records[f"cpu/{case}"]
    conv = records["gpu/conv_cudnn"]
    assert conv["value"] == "pass" and "skipped" not in conv, conv
    assert conv["max_rel_err_vs_cpu"] < 1e-10 and conv["layer_ms_cudnn"] > 0, conv
    nccl = records["gpu/nccl"]
    assert (nccl["metric"], nccl["reason"]) == ("skipped", "fewer than 2 GPUs (1)")
    cross = records["gpu/nccl_cross_host"]
    assert cross["metric"] == "skipped" and cross["reason"].startswith("needs 2 GPUs"), cross
    assert records["summary"]["failed"] == []


@pytest.mark.slow
def test_keras_fit_on_arrays_with_a_gpu_worker_process_equals_local_training(start_ps, tmp_path):
    """The docker/compose.gpu.yaml job: a chief's ``fit(numpy arrays)`` run by a GPU worker."""
    from psflow.distribute.cluster_resolver import ClusterSpec, SimpleClusterResolver
    from psflow.distribute.coordinator.cluster_coordinator import shutdown_all
    from tests.conftest import start_server

    ps = start_ps()
    worker = start_server(
        "tests.gpu_worker",
        ["--port", "0", "--task", "worker:0", "--ps", ps.address, "--workers", "1"],
        "PSFLOW_READY worker",
        log_dir=tmp_path,
    )
    x, y = _data()
    try:
        spec = {"ps": [ps.address], "worker": [worker.address], "chief": ["127.0.0.1:1"]}
        resolver = SimpleClusterResolver(ClusterSpec(spec), task_type="chief", task_id=0)
        strategy = pf.distribute.ParameterServerStrategy(resolver, mode="sync")
        with strategy.scope():
            model = _model()
        history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
        evaluated = model.evaluate(x, y, batch_size=16, verbose=0)
        predicted = model.predict(x[:4], verbose=0)
        weights = _host_weights(model)
    finally:
        shutdown_all()
        worker.reap()
    assert "raised" not in worker.log_tail(), worker.log_tail()
    ref = _model()
    want = ref.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    _assert_histories_close(history, want)
    np.testing.assert_allclose(evaluated, ref.evaluate(x, y, batch_size=16, verbose=0), rtol=1e-5)
    np.testing.assert_allclose(predicted, ref.predict(x[:4], verbose=0), rtol=1e-5, atol=1e-6)
    for g, w in zip(weights, _host_weights(ref)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


class _CTR(pf.keras.Model):
    """The ps_embedding_ctr example's model: an embedding joined to dense features."""

    def __init__(self) -> None:
        super().__init__()
        table = np.random.default_rng(2).normal(0, 0.1, (20, 3)).astype(np.float32)
        kernel = np.random.default_rng(3).normal(0, 0.3, (3 + FEATURES, 1)).astype(np.float32)
        self.user = pf.keras.layers.Embedding(20, 3, embeddings_initializer=_given(table))
        self.out = pf.keras.layers.Dense(1, activation="sigmoid", kernel_initializer=_given(kernel))

    def call(self, inputs: Any, training: Any = None) -> Any:
        return self.out(pf.concat([self.user(inputs["user"]), inputs["x"]], axis=1))


@pytest.mark.parametrize(
    ("where", "gpus"),
    [
        ("local", 2),
        ("sharded_ps", 1),
        # a replica whose batch touches no row of a shard has no gradient for it
        ("sharded_ps", 2),
    ],
)
def test_an_embedding_model_with_concat_fits_on_a_gpu_like_on_the_cpu(where, gpus):
    x, _ = _data()
    features = {"user": np.arange(32) % 20, "x": x}
    labels = (x[:, :1] > 0).astype(np.float32)

    def run() -> tuple[dict, list[np.ndarray]]:
        if where == "sharded_ps":
            partitioner = pf.distribute.experimental.partitioners.FixedShardsPartitioner(2)
            scope = pf.distribute.ParameterServerStrategy(variable_partitioner=partitioner).scope()
        else:
            scope = contextlib.nullcontext()
        with scope:
            model = _CTR()
            model.compile(optimizer=pf.keras.optimizers.Adagrad(0.5), loss="binary_crossentropy")
        history = model.fit(features, labels, batch_size=8, epochs=2, shuffle=False, verbose=0)
        return history.history, _host_weights(model)

    with strict_cupy.installed(devices=gpus):
        got = run()
        with pf.device("/cpu:0"):
            want = run()
    _assert_histories_close(got[0], want[0])
    for g, w in zip(got[1], want[1]):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_text_and_rank1_columns_fit_on_a_gpu_like_on_the_cpu(gpu):
    # text stays on the host (lookups read it there); numbers and lookups' outputs go to the GPU
    from tests.test_keras_column_inputs import BATCH, _columns, _model

    def run() -> tuple[list[np.ndarray], np.ndarray]:
        x, y = _columns()
        model = _model()
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        return [np.asarray(w) for w in model.get_weights()], model.predict(x, verbose=0)

    got = run()
    with pf.device("/cpu:0"):
        want = run()
    for g, w in zip(got[0], want[0]):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-6)

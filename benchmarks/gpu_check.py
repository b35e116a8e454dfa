"""GPU check: psflow's CuPy path is correct, and how fast its collectives are.

On a machine where CuPy imports and sees a GPU it checks, each on its own
(a failing check is reported and the next one runs):

* ``gpu/assign_host_values``: ``Variable.assign`` and ``Model.set_weights``
  of NumPy values into variables on ``/GPU:0``;
* ``gpu/train_step``: one training step of an MLP on ``/GPU:0`` (gradients by
  psflow's tape, SGD update) against the same step computed by hand in NumPy;
* ``gpu/fit_arrays``: ``model.fit`` on NumPy arrays (host batches the step must
  move to the device), its weights and reported loss/accuracy against NumPy;
* ``gpu/metrics``: ``model.evaluate`` with several metrics against NumPy;
* ``gpu/ps_worker``: a parameter-server worker computing on ``/GPU:0`` against
  a local PS process (``python -m ps_server``): dense pulls and pushes, and an
  embedding table's sparse row pulls and pushes, against NumPy;
* ``gpu/mirrored``: MirroredStrategy over N logical GPUs split from GPU 0
  (``psflow.config.set_logical_device_configuration``), a few steps of TF's
  custom loop against NumPy on the global batches; every replica's copy equal;
* ``gpu/conv_cudnn``: convolutions through cuDNN (``psflow/ops/conv_gpu.py``):
  the fused layer's output and its input, kernel and bias gradients on
  ``/GPU:0`` against the CPU path for several geometries (float64), and the
  tutorial CNN's first layer (forward and backward, batch 256, float32)
  timed through cuDNN and through the im2col path (``PSFLOW_CUDNN=0``);
  *skipped* where CuPy has no cuDNN;
* ``gpu/ring``: the ring all-reduce of N replicas' CuPy arrays on GPU 0
  against a NumPy sum, with its bus bandwidth next to a device-to-device copy
  bandwidth measured here;
* ``gpu/nccl``: ``psflow.collective.NcclAllReduce`` over the physical GPUs
  (one replica per GPU) where CuPy has NCCL, same measurements; reported as
  *skipped* (not passed) with fewer than 2 GPUs or without NCCL.
* ``gpu/nccl_cross_host``: ``MultiWorkerMirroredStrategy`` with
  ``implementation=NCCL`` in 2 worker processes on this machine, one GPU each
  (``CUDA_VISIBLE_DEVICES``): the unique id over the workers' authenticated
  ring, an all-reduce of the size above against a NumPy sum, the same bits on
  both workers, and its bus bandwidth; *skipped* with fewer than 2 GPUs (NCCL
  takes one rank per GPU) or without NCCL.

The same checks run on NumPy first (``cpu/...``: logical CPU devices, host
copies), everywhere. Without a GPU the GPU part is skipped, saying so in a JSON
line with ``"metric": "skipped"``.

Bandwidth formulas (nccl-tests'): for S bytes per replica reduced in t seconds,
``algbw = S / t`` and ``busbw = algbw * 2 (N - 1) / N``; a copy of S bytes in t
seconds is ``S / t``.

Usage::

    python benchmarks/gpu_check.py            # default sizes
    python benchmarks/gpu_check.py --quick    # small sizes, few repetitions (< 60 s on 2 CPUs)

stdout: one JSON object per result; stderr: progress and a summary table.
Exit status: 0 when every check that ran passed (skips included), 1 when a
check failed, 2 when the script could not run at all.
"""

from __future__ import annotations

import argparse
import atexit
import faulthandler
import json
import logging
import pathlib
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

BENCH = "gpu_check"
LAYERS = (64, 32, 10)  # the MLP of the training checks: 64 -> 32 (ReLU) -> 10 logits
LEARNING_RATE = 0.1
RTOL = 1e-4  # float32 on two kinds of hardware: relative to each array's largest value

logger = logging.getLogger(BENCH)
_results: list[dict[str, Any]] = []


def emit(record: dict[str, Any]) -> None:
    """Prints one JSON result line and keeps it for the summary."""
    record = {"bench": BENCH, **record}
    _results.append(record)
    print(json.dumps(record), flush=True)


def run_check(case: str, fn: Callable[[], dict[str, Any]]) -> None:
    """Runs one check; any exception becomes a failed result naming it (never propagates)."""
    logger.info("check %s ...", case)
    start = time.perf_counter()
    try:
        extra = fn()
        ok = bool(extra.pop("ok", True))
        emit({"case": case, "metric": "check", "value": "pass" if ok else "fail", **extra})
    except Exception as exc:  # report and go on: the next check may still tell something
        emit(
            {
                "case": case,
                "metric": "check",
                "value": "fail",
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(limit=6),
            }
        )
    logger.info("check %s done in %.1f s", case, time.perf_counter() - start)


def rel_err(got: Any, want: np.ndarray) -> float:
    """max |got - want| / max |want| (0 for two zero arrays)."""
    import psflow as pf

    g = np.asarray(pf.backend.to_numpy(got), dtype=np.float64)
    w = np.asarray(want, dtype=np.float64)
    scale = max(float(np.max(np.abs(w))) if w.size else 0.0, 1e-30)
    return float(np.max(np.abs(g - w))) / scale if w.size else 0.0


# -- the MLP, by hand in NumPy (the reference) ----------------------------------------------------
def init_weights(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    w1 = rng.normal(0, 0.2, size=(LAYERS[0], LAYERS[1])).astype(np.float32)
    b1 = rng.normal(0, 0.1, size=(LAYERS[1],)).astype(np.float32)
    w2 = rng.normal(0, 0.2, size=(LAYERS[1], LAYERS[2])).astype(np.float32)
    b2 = rng.normal(0, 0.1, size=(LAYERS[2],)).astype(np.float32)
    return [w1, b1, w2, b2]


def make_data(batch: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, LAYERS[0])).astype(np.float32)
    y = rng.integers(0, LAYERS[2], size=(batch,)).astype(np.int64)
    return x, y


def numpy_gradients(weights: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    """Gradients of the mean softmax cross-entropy, in float64 (backprop written out)."""
    w1, b1, w2, b2 = (w.astype(np.float64) for w in weights)
    pre = x @ w1 + b1
    h = np.maximum(pre, 0.0)
    logits = h @ w2 + b2
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    d_logits = p
    d_logits[np.arange(len(y)), y] -= 1.0
    d_logits /= len(y)
    d_h = (d_logits @ w2.T) * (pre > 0)
    return [x.T @ d_h, d_h.sum(axis=0), h.T @ d_logits, d_logits.sum(axis=0)]


def numpy_sgd(
    weights: list[np.ndarray], batches: list[tuple[np.ndarray, np.ndarray]]
) -> list[np.ndarray]:
    ws = [w.astype(np.float64) for w in weights]
    for x, y in batches:
        ws = [w - LEARNING_RATE * g for w, g in zip(ws, numpy_gradients(ws, x, y))]
    return ws


def numpy_forward(weights: list[np.ndarray], x: np.ndarray) -> np.ndarray:
    """The MLP's logits, in float64."""
    w1, b1, w2, b2 = (w.astype(np.float64) for w in weights)
    return np.maximum(x @ w1 + b1, 0.0) @ w2 + b2


def numpy_loss_and_hits(
    weights: list[np.ndarray], x: np.ndarray, y: np.ndarray, k: int = 1
) -> tuple[float, float]:
    """Mean softmax cross-entropy and the fraction of labels among the top-``k`` logits."""
    logits = numpy_forward(weights, x)
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_p = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    loss = float(-log_p[np.arange(len(y)), y].mean())
    top = np.argsort(-logits, axis=1)[:, :k]
    return loss, float((top == y[:, None]).any(axis=1).mean())


def psflow_model(weights: list[np.ndarray]) -> Any:
    """The MLP with these initial weights, created on the current device.

    The weights come in through initializers, i.e. as the variables' initial
    values (placed where the variables are), not through ``set_weights``:
    assigning host arrays to GPU variables is checked on its own.
    """
    import psflow as pf

    def given(value: np.ndarray) -> Callable[..., Any]:
        return lambda shape, dtype=None, **kwargs: value

    w1, b1, w2, b2 = weights
    model = pf.keras.Sequential(
        [
            pf.keras.layers.Dense(
                LAYERS[1],
                activation="relu",
                kernel_initializer=given(w1),
                bias_initializer=given(b1),
            ),
            pf.keras.layers.Dense(
                LAYERS[2], kernel_initializer=given(w2), bias_initializer=given(b2)
            ),
        ]
    )
    model.build((None, LAYERS[0]))
    return model


def check_assign_host_values(device: str) -> dict[str, Any]:
    """``Variable.assign`` and ``Model.set_weights`` with host (NumPy) values on ``device``."""
    import psflow as pf

    weights = init_weights()
    with pf.device(device):
        v = pf.Variable(np.zeros(3, np.float32))
        v.assign(np.arange(3, dtype=np.float32))
        model = psflow_model([np.zeros_like(w) for w in weights])
        model.set_weights(weights)
    err = max(rel_err(a._array(), w) for a, w in zip(model.trainable_variables, weights))
    ok = pf.backend.to_numpy(v._array()).tolist() == [0.0, 1.0, 2.0] and err == 0.0
    return {"ok": ok, "weight_rel_err": err}


# -- the checks -----------------------------------------------------------------------------------
def check_train_step(device: str, batch: int) -> dict[str, Any]:
    """One step on ``device``: gradients and updated weights against NumPy."""
    import psflow as pf

    weights = init_weights()
    x, y = make_data(batch)
    with pf.device(device):
        model = psflow_model(weights)
        loss_fn = pf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        opt = pf.keras.optimizers.SGD(LEARNING_RATE)
        xt, yt = pf.constant(x), pf.constant(y)
        with pf.GradientTape() as tape:
            loss = loss_fn(yt, model(xt, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        on_device = [pf.backend.device_of(g._array()).device_type for g in grads]
        opt.apply_gradients(zip(grads, model.trainable_variables))
    want_grads = numpy_gradients(weights, x, y)
    want_weights = numpy_sgd(weights, [(x, y)])
    grad_err = max(rel_err(g._array(), w) for g, w in zip(grads, want_grads))
    weight_err = max(
        rel_err(v._array(), w) for v, w in zip(model.trainable_variables, want_weights)
    )
    expected_type = pf.backend.parse_device(device).device_type
    ok = grad_err <= RTOL and weight_err <= RTOL and all(t == expected_type for t in on_device)
    return {
        "ok": ok,
        "grad_rel_err": grad_err,
        "weight_rel_err": weight_err,
        "arrays_on": sorted(set(on_device)),
    }


def check_fit_arrays(device: str, batch: int, steps: int) -> dict[str, Any]:
    """``fit`` on NumPy arrays on ``device``: weights, loss and accuracy against NumPy."""
    import psflow as pf

    weights = init_weights()
    x, y = make_data(batch * steps, seed=4)
    batches = [(x[i : i + batch], y[i : i + batch]) for i in range(0, len(x), batch)]
    with pf.device(device):
        model = psflow_model(weights)
        model.compile(
            optimizer=pf.keras.optimizers.SGD(LEARNING_RATE),
            loss=pf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        start = time.perf_counter()
        history = model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0).history
        seconds = time.perf_counter() - start
        placed = {pf.backend.device_of(v._array()).device_type for v in model.trainable_variables}
    # the reported figures are means over the epoch, each batch seen before its update
    ws, losses, hits = [w.astype(np.float64) for w in weights], [], []
    for bx, by in batches:
        loss, hit = numpy_loss_and_hits(ws, bx, by)
        losses.append(loss)
        hits.append(hit)
        ws = numpy_sgd(ws, [(bx, by)])
    weight_err = max(rel_err(v._array(), w) for v, w in zip(model.trainable_variables, ws))
    loss_err = abs(history["loss"][0] - float(np.mean(losses))) / max(float(np.mean(losses)), 1e-30)
    acc_ok = abs(history["accuracy"][0] - float(np.mean(hits))) <= 1e-6
    expected = pf.backend.parse_device(device).device_type
    return {
        "ok": weight_err <= RTOL and loss_err <= RTOL and acc_ok and placed == {expected},
        "weight_rel_err": weight_err,
        "loss_rel_err": loss_err,
        "accuracy": history["accuracy"][0],
        "steps_per_s": round(steps / seconds, 2),
    }


def check_metrics(device: str, batch: int) -> dict[str, Any]:
    """``evaluate`` with loss, accuracy and top-2 accuracy on ``device`` against NumPy."""
    import psflow as pf

    weights = init_weights()
    x, y = make_data(batch * 2, seed=5)
    with pf.device(device):
        model = psflow_model(weights)
        model.compile(
            optimizer="sgd",
            loss=pf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy", pf.keras.metrics.SparseTopKCategoricalAccuracy(k=2)],
        )
        loss, acc, top2 = model.evaluate(x, y, batch_size=batch, verbose=0)
    want_loss, want_acc = numpy_loss_and_hits(weights, x, y)
    _, want_top2 = numpy_loss_and_hits(weights, x, y, k=2)
    loss_err = abs(loss - want_loss) / max(want_loss, 1e-30)
    ok = loss_err <= RTOL and abs(acc - want_acc) <= 1e-6 and abs(top2 - want_top2) <= 1e-6
    return {"ok": ok, "loss_rel_err": loss_err, "accuracy": acc, "top2": top2}


class LocalPS:
    """A ``python -m ps_server`` process on loopback, for the worker checks."""

    def __init__(self, timeout: float = 60.0) -> None:
        import os
        import selectors
        import subprocess

        env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}  # a loopback PS only
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ps_server", "--port", "0", "--bind", "127.0.0.1"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            cwd=ROOT,
        )
        deadline = time.monotonic() + timeout
        line = b""
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while b"\n" not in line:
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    self.close()
                    raise RuntimeError("the PS process did not become ready")
                if sel.select(min(left, 0.5)):
                    line += os.read(self.proc.stdout.fileno(), 4096)
        fields = dict(f.split("=", 1) for f in line.decode().split() if "=" in f)
        self.address = f"127.0.0.1:{fields['port']}"

    def close(self) -> None:
        """Stops the process (SIGTERM, then SIGKILL) and reaps it."""
        import subprocess

        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)


def check_ps_worker(device: str, ps_address: str, batch: int, steps: int) -> dict[str, Any]:
    """A PS worker on ``device``: dense and sparse pulls and pushes against NumPy."""
    import psflow as pf

    weights = init_weights()
    x, y = make_data(batch * steps, seed=6)
    batches = [(x[i : i + batch], y[i : i + batch]) for i in range(0, len(x), batch)]
    rows = 16
    table0 = np.random.default_rng(7).normal(size=(rows, LAYERS[0])).astype(np.float32)
    prefix = f"gpu_check/{device.strip('/').replace(':', '')}/"  # one PS serves both sides
    with pf.device(device):
        strategy = pf.distribute.ParameterServerStrategy._for_worker([ps_address], 1, "worker:0")
        with strategy.scope():
            variables = [pf.Variable(w, name=f"{prefix}{i}") for i, w in enumerate(weights)]
            table = pf.Variable(table0, name=f"{prefix}table")
            opt = pf.keras.optimizers.SGD(LEARNING_RATE)
        loss_fn = pf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        start = time.perf_counter()
        for step, (bx, by) in enumerate(batches):
            ids = pf.constant([step % rows, (3 * step + 1) % rows])
            with pf.GradientTape() as tape:
                w1, b1, w2, b2 = variables
                h = pf.nn.relu(pf.matmul(pf.constant(bx), w1) + b1)
                loss = loss_fn(pf.constant(by), pf.matmul(h, w2) + b2)
                loss = loss + pf.reduce_sum(pf.nn.embedding_lookup(table, ids))
            grads = tape.gradient(loss, [*variables, table])
            sparse = isinstance(grads[-1], pf.IndexedSlices)
            opt.apply_gradients(zip(grads, [*variables, table]))
        seconds = time.perf_counter() - start
        got = [v.numpy() for v in variables]
        got_table = table.numpy()
    want = numpy_sgd(weights, batches)
    want_table = table0.astype(np.float64)
    for step in range(len(batches)):  # d(sum of rows)/d(row) = 1 per lookup
        for r in (step % rows, (3 * step + 1) % rows):
            want_table[r] -= LEARNING_RATE
    dense_err = max(rel_err(g, w) for g, w in zip(got, want))
    sparse_err = rel_err(got_table, want_table)
    return {
        "ok": dense_err <= RTOL and sparse_err <= RTOL and sparse,
        "dense_rel_err": dense_err,
        "sparse_rel_err": sparse_err,
        "sparse_gradient": sparse,
        "steps_per_s": round(len(batches) / seconds, 2),
    }


def configure_logical(kind: str, replicas: int) -> list[str]:
    """Splits CPU or GPU 0 into ``replicas`` logical devices; returns their names."""
    import psflow as pf

    physical = pf.config.list_physical_devices(kind)[0]
    pf.config.set_logical_device_configuration(
        physical, [pf.config.LogicalDeviceConfiguration() for _ in range(replicas)]
    )
    return [f"/{kind}:{i}" for i in range(replicas)]


def check_mirrored(kind: str, replicas: int, global_batch: int, steps: int) -> dict[str, Any]:
    """TF's custom loop under MirroredStrategy over logical devices, against NumPy."""
    import psflow as pf

    devices = configure_logical(kind, replicas)
    strategy = pf.distribute.MirroredStrategy(devices=devices)
    weights = init_weights()
    x, y = make_data(global_batch * steps, seed=2)
    with strategy.scope():
        model = psflow_model(weights)
        opt = pf.keras.optimizers.SGD(LEARNING_RATE)
        loss_obj = pf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def train_step(inputs: Any) -> Any:
        features, labels = inputs
        with pf.GradientTape() as tape:
            per_example = loss_obj(labels, model(features, training=True))
            loss = pf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    dataset = pf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch)
    start = time.perf_counter()
    for inputs in strategy.experimental_distribute_dataset(dataset):
        strategy.reduce("SUM", strategy.run(train_step, args=(inputs,)), axis=None)
    seconds = time.perf_counter() - start
    want = numpy_sgd(
        weights,
        [
            (x[i : i + global_batch], y[i : i + global_batch])
            for i in range(0, len(x), global_batch)
        ],
    )
    err, identical, placed = 0.0, True, set()
    for var, w in zip(model.trainable_variables, want):
        copies = var.values if hasattr(var, "values") else (var,)
        first = pf.backend.to_numpy(copies[0]._value)
        for c in copies:
            placed.add(pf.backend.device_of(c._value).device_type)
            err = max(err, rel_err(c._value, w))
            identical = identical and np.array_equal(pf.backend.to_numpy(c._value), first)
    return {
        "ok": err <= RTOL and identical and placed == {kind},
        "replicas": replicas,
        "cross_device_ops": strategy.cross_device_ops.name,
        "weight_rel_err": err,
        "replicas_identical": identical,
        "steps_per_s": round(steps / seconds, 2),
    }


CONV_GEOMETRY = [  # (input hw, kernel hw, stride, padding, dilation), as tests/test_conv_cudnn.py
    ((7, 6), (3, 3), 1, "SAME", 1),
    ((8, 8), (3, 3), 2, "SAME", 1),
    ((9, 7), (2, 3), 1, "SAME", 2),
    ((10, 9), (3, 3), 3, "VALID", 1),
]


def _conv_layer_and_grads(device: str, x, w, b, stride, padding, dil) -> list[np.ndarray]:
    import psflow as pf
    from psflow.ops import conv_ops

    with pf.device(device):
        xv, wv, bv = pf.constant(x), pf.constant(w), pf.constant(b)
        with pf.GradientTape() as tape:
            tape.watch([xv, wv, bv])
            y = conv_ops.conv_layer(xv, wv, bv, 2, (stride,) * 2, padding, (dil,) * 2, True)
            loss = pf.reduce_sum(y * y)
        grads = tape.gradient(loss, [xv, wv, bv])
    return [pf.backend.to_numpy(t._array()) for t in (y, *grads)]


def check_conv_cudnn(batch: int, reps: int) -> dict[str, Any]:
    """cuDNN's convolutions against the CPU path, then timed against the GPU's im2col path."""
    import os

    import psflow as pf
    from psflow import settings
    from psflow.ops import conv_gpu, conv_ops

    if conv_gpu.cudnn_or_none("float32") is None:
        return {"ok": True, "skipped": "CuPy has no cuDNN (cupyx.cudnn does not import)"}
    rng = np.random.default_rng(0)
    worst = 0.0
    for hw, khw, stride, padding, dil in CONV_GEOMETRY:
        x = rng.standard_normal((2, *hw, 3))
        w = rng.standard_normal((*khw, 3, 4))
        b = rng.standard_normal(4)
        got = _conv_layer_and_grads("/gpu:0", x, w, b, stride, padding, dil)
        want = _conv_layer_and_grads("/cpu:0", x, w, b, stride, padding, dil)
        worst = max([worst, *(rel_err(g, r) for g, r in zip(got, want))])
    cp = pf.backend.cupy_or_none()
    x = rng.standard_normal((batch, 28, 28, 1)).astype(np.float32)
    w = (rng.standard_normal((3, 3, 1, 32)) * 0.3).astype(np.float32)
    b = np.zeros(32, np.float32)

    def layer_step() -> None:
        with pf.device("/gpu:0"):
            xv, wv, bv = pf.constant(x), pf.Variable(w), pf.Variable(b)
            with pf.GradientTape() as tape:
                y = conv_ops.conv_layer(xv, wv, bv, 2, (1, 1), "VALID", (1, 1), True)
            tape.gradient(y, [wv, bv])

    def sync() -> None:
        cp.cuda.get_current_stream().synchronize()

    timings = {}
    for name, value in (("cudnn", None), ("im2col", "0")):
        if value is None:
            os.environ.pop(settings.ENV_CUDNN, None)
        else:
            os.environ[settings.ENV_CUDNN] = value
        try:
            layer_step()
            timings[name] = _median_seconds(layer_step, sync, reps)
        finally:
            os.environ.pop(settings.ENV_CUDNN, None)
    return {
        "ok": worst < 1e-10,
        "max_rel_err_vs_cpu": worst,
        "layer_ms_cudnn": timings["cudnn"] * 1e3,
        "layer_ms_im2col": timings["im2col"] * 1e3,
        "im2col_over_cudnn": timings["im2col"] / timings["cudnn"],
        "batch": batch,
    }


def _median_seconds(fn: Callable[[], None], sync: Callable[[], None], reps: int) -> float:
    fn()  # warm-up (CuPy compiles kernels on first use)
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def check_all_reduce(
    kind: str, ops_name: str, replicas: int, elements: int, reps: int
) -> dict[str, Any]:
    """All-reduce of ``replicas`` float32 arrays against a NumPy sum; bandwidth against a copy.

    ``kind`` "CPU": NumPy arrays (logical CPU devices). "GPU" with the ring:
    every replica's array on GPU 0. "GPU" with NCCL: one replica per physical GPU.
    """
    import psflow as pf
    from psflow.collective import CommunicationOptions, create_cross_device_ops

    rng = np.random.default_rng(3)
    host = [rng.standard_normal(elements).astype(np.float32) for _ in range(replicas)]
    want = np.sum(np.stack(host).astype(np.float64), axis=0)
    if kind == "CPU":
        arrays = [[h] for h in host]

        def sync() -> None:
            pass

        src, dst = host[0], np.empty_like(host[0])

        def copy() -> None:
            np.copyto(dst, src)

        gpus = []
    else:
        cp = pf.backend.cupy_or_none()
        gpus = [i if ops_name == "nccl" else 0 for i in range(replicas)]
        arrays = []
        for g, h in zip(gpus, host):
            with cp.cuda.Device(g):
                arrays.append([cp.asarray(h)])

        def sync() -> None:
            for g in sorted(set(gpus)):
                cp.cuda.Device(g).synchronize()

        with cp.cuda.Device(0):
            src, dst = cp.asarray(host[0]), cp.empty_like(arrays[0][0])

        def copy() -> None:
            with cp.cuda.Device(0):
                cp.copyto(dst, src)

    ops = create_cross_device_ops(ops_name, options=CommunicationOptions(timeout_seconds=60.0))
    try:
        results = ops.all_reduce(arrays, "sum")
        sync()
        err = max(rel_err(r[0], want) for r in results)
        identical = all(
            np.array_equal(pf.backend.to_numpy(r[0]), pf.backend.to_numpy(results[0][0]))
            for r in results
        )
        del results
        t = _median_seconds(lambda: ops.all_reduce(arrays, "sum"), sync, reps)
    finally:
        ops.close()
    t_copy = _median_seconds(copy, sync, reps)
    nbytes = elements * 4
    algbw = nbytes / t / 1e9
    busbw = algbw * 2 * (replicas - 1) / replicas
    copy_bw = nbytes / t_copy / 1e9
    # float32 sums in another order: allow a few ulps per added replica
    ok = err <= 1e-6 * max(replicas, 1) * 10 and identical
    return {
        "ok": ok,
        "replicas": replicas,
        "gpus": gpus,
        "MB": round(nbytes / 1e6, 1),
        "rel_err": err,
        "replicas_identical": identical,
        "algbw_GBps": round(algbw, 3),
        "busbw_GBps": round(busbw, 3),
        "copy_GBps": round(copy_bw, 3),
        "busbw_over_copy": round(busbw / copy_bw, 3) if copy_bw else None,
        "formula": "algbw=S/t, busbw=algbw*2(N-1)/N, copy=S/t_copy",
    }


_PEER_TOKEN = "gpu-check-cross-host-token-0123456789"


def check_nccl_cross_host(elements: int, reps: int) -> dict[str, Any]:
    """Two worker processes, one GPU each, all-reduce through NCCL across them."""
    import os
    import socket
    import subprocess

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    workers = [f"127.0.0.1:{p}" for p in ports]
    procs = []
    for rank in range(2):
        env = dict(os.environ)
        env.update(
            TF_CONFIG=json.dumps(
                {"cluster": {"worker": workers}, "task": {"type": "worker", "index": rank}}
            ),
            CUDA_VISIBLE_DEVICES=str(rank),
            PSFLOW_AUTH_TOKEN=_PEER_TOKEN,
            PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p),
        )
        cmd = [sys.executable, __file__, "--cross-host-peer", str(elements), str(reps)]
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=240)
            if p.returncode != 0:
                raise RuntimeError(f"peer exited with {p.returncode}: {err[-2000:]}")
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    same = outs[0]["digest"] == outs[1]["digest"]
    seconds = max(o["seconds"] for o in outs)
    nbytes = elements * 4
    algbw = nbytes / seconds / 1e9
    return {
        "ok": all(o["nccl"] and o["rel_err"] <= 1e-6 for o in outs) and same,
        "workers": 2,
        "MB": round(nbytes / 1e6, 1),
        "rel_err": max(o["rel_err"] for o in outs),
        "workers_identical": same,
        "algbw_GBps": round(algbw, 3),
        "busbw_GBps": round(algbw, 3),  # 2(N-1)/N = 1 for N = 2
        "formula": "algbw=S/t, busbw=algbw*2(N-1)/N",
    }


def cross_host_peer(elements: int, reps: int) -> int:
    """One worker of ``gpu/nccl_cross_host`` (TF_CONFIG from the parent); prints one JSON line."""
    import hashlib

    import psflow as pf
    from psflow.collective import CommunicationOptions

    options = CommunicationOptions(implementation="NCCL", timeout_seconds=120.0)
    strategy = pf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    rank = strategy.cluster_resolver.task_id
    host = [
        np.random.default_rng(20 + r).standard_normal(elements).astype(np.float32) for r in (0, 1)
    ]
    want = host[0].astype(np.float64) + host[1]
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: pf.constant(host[rank])
    )

    def step(x: Any) -> Any:
        return pf.distribute.get_replica_context().all_reduce("SUM", x)

    got = pf.backend.to_numpy(strategy.run(step, args=(value,))._array())
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        strategy.run(step, args=(value,))  # returns once NCCL's event says it is done
        times.append(time.perf_counter() - start)
    print(
        json.dumps(
            {
                "nccl": strategy.nccl is not None,
                "rel_err": rel_err(got, want),
                "digest": hashlib.sha256(np.ascontiguousarray(got).tobytes()).hexdigest(),
                "seconds": statistics.median(times),
            }
        )
    )
    return 0


# -- main -----------------------------------------------------------------------------------------
def gpu_available() -> tuple[bool, str]:
    """Whether CuPy imports and sees a GPU, and why not."""
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no CuPy, no driver, no device
        return False, f"{type(exc).__name__}: {exc}"
    return (count > 0), f"{count} GPU(s)"


def main(argv: list[str] | None = None) -> int:
    """Runs the checks; returns the exit status (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repetitions")
    parser.add_argument("--replicas", type=int, default=None, help="logical devices (default 2/4)")
    parser.add_argument("--mb", type=float, default=None, help="all-reduce size per replica, MB")
    parser.add_argument("--cpu-only", action="store_true", help="skip the GPU part")
    parser.add_argument(
        "--deadline", type=float, default=540.0, help="seconds before the script dumps and exits"
    )
    parser.add_argument("--cross-host-peer", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cross_host_peer:  # a worker process of gpu/nccl_cross_host
        return cross_host_peer(*args.cross_host_peer)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    # a hung device call must not eat a machine's time: dump every thread's stack and exit
    faulthandler.dump_traceback_later(args.deadline, exit=True)

    try:
        import psflow as pf
        from psflow.collective import nccl_available
    except Exception as exc:
        logger.error("cannot import psflow: %s", exc)
        return 2

    replicas = args.replicas or (2 if args.quick else 4)
    mb = args.mb or (4.0 if args.quick else 64.0)
    elements = max(1, int(mb * 1e6 / 4))
    reps = 3 if args.quick else 10
    cpu_reps = 3 if args.quick else 5
    batch = 16 * replicas
    steps = 3

    # -- the same code paths on NumPy ------------------------------------------------------
    run_check("cpu/assign_host_values", lambda: check_assign_host_values("/cpu:0"))
    run_check("cpu/train_step", lambda: check_train_step("/cpu:0", batch))
    run_check("cpu/fit_arrays", lambda: check_fit_arrays("/cpu:0", batch, steps))
    run_check("cpu/metrics", lambda: check_metrics("/cpu:0", batch))
    try:
        ps: LocalPS | None = LocalPS()
    except Exception as exc:  # reported as a failed check; the others still run
        ps = None
        emit({"case": "ps", "metric": "check", "value": "fail", "error": str(exc)})
    if ps is not None:
        atexit.register(ps.close)  # reaped even if a later step raises
        run_check("cpu/ps_worker", lambda: check_ps_worker("/cpu:0", ps.address, batch, steps))
    run_check("cpu/mirrored", lambda: check_mirrored("CPU", replicas, batch, steps))
    run_check(
        "cpu/ring",
        lambda: check_all_reduce("CPU", "ring", replicas, min(elements, 4 << 20), cpu_reps),
    )

    # -- the GPU part ------------------------------------------------------------------------
    has_gpu, why = (False, "--cpu-only") if args.cpu_only else gpu_available()
    if not has_gpu:
        emit({"case": "gpu", "metric": "skipped", "value": None, "reason": why})
    else:
        emit({"case": "gpu", "metric": "devices", "value": pf.backend.gpu_count(), "detail": why})
        run_check("gpu/assign_host_values", lambda: check_assign_host_values("/gpu:0"))
        run_check("gpu/train_step", lambda: check_train_step("/gpu:0", batch))
        run_check("gpu/fit_arrays", lambda: check_fit_arrays("/gpu:0", batch, steps))
        run_check("gpu/metrics", lambda: check_metrics("/gpu:0", batch))
        if ps is not None:
            run_check("gpu/ps_worker", lambda: check_ps_worker("/gpu:0", ps.address, batch, steps))
        run_check("gpu/mirrored", lambda: check_mirrored("GPU", replicas, batch, steps))
        run_check("gpu/conv_cudnn", lambda: check_conv_cudnn(64 if args.quick else 256, reps))
        run_check("gpu/ring", lambda: check_all_reduce("GPU", "ring", replicas, elements, reps))
        gpus = pf.backend.gpu_count()
        if gpus < 2:  # one GPU proves nothing about NCCL: say so, do not pass it
            reason = f"fewer than 2 GPUs ({gpus})"
            emit({"case": "gpu/nccl", "metric": "skipped", "value": None, "reason": reason})
        elif not nccl_available():
            emit({"case": "gpu/nccl", "metric": "skipped", "value": None, "reason": "no NCCL"})
        else:
            run_check("gpu/nccl", lambda: check_all_reduce("GPU", "nccl", gpus, elements, reps))
        if gpus < 2:  # two processes on one GPU would be two NCCL ranks on one GPU: refused
            reason = f"needs 2 GPUs, one per worker process (NCCL takes one rank per GPU): {gpus}"
            emit(
                {
                    "case": "gpu/nccl_cross_host",
                    "metric": "skipped",
                    "value": None,
                    "reason": reason,
                }
            )
        elif not nccl_available():
            emit(
                {
                    "case": "gpu/nccl_cross_host",
                    "metric": "skipped",
                    "value": None,
                    "reason": "no NCCL",
                }
            )
        else:
            run_check("gpu/nccl_cross_host", lambda: check_nccl_cross_host(elements, reps))
    if ps is not None:
        ps.close()

    faulthandler.cancel_dump_traceback_later()
    checks = [r for r in _results if r["metric"] == "check"]
    failed = [r["case"] for r in checks if r["value"] != "pass"]
    print(f"{'case':16} {'result':7} details", file=sys.stderr)
    for r in _results:
        detail = {k: v for k, v in r.items() if k not in ("bench", "case", "metric", "traceback")}
        print(f"{r['case']:16} {r.get('value')!s:7} {detail}", file=sys.stderr)
    emit(
        {
            "case": "summary",
            "metric": "checks_passed",
            "value": len(checks) - len(failed),
            "of": len(checks),
            "failed": failed,
        }
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Local ``model.fit`` throughput: psflow.keras against tf.keras on the same models.

Two models (``--models``), each trained with ``model.fit`` on seeded synthetic
data at batch 64 and 256 with softmax cross-entropy from logits:

- ``mlp``: the 784 -> 512 -> 512 -> 10 MLP of BENCHMARKS.md (ReLU, SGD 0.1);
- ``cnn``: the model of TensorFlow's "Distributed training with Keras" tutorial
  on 28x28x1 inputs: Conv2D 32x3x3 ReLU -> MaxPooling2D -> Flatten -> Dense 64
  ReLU -> Dense 10 (SGD 0.01 here; the tutorial's optimizer does not change
  what is compared, the engines).

Each side runs in its own worker process
(so TensorFlow's thread pools never share a process with psflow's NumPy), both
idle while the other measures, and the measurements alternate A B A B.

What is measured, per (side, batch): one ``fit`` epoch of ``steps`` steps.
``steps/s`` counts the steps after the first, over the time from the end of the
first step to the end of the last (so per-call setup is excluded);
``examples/s = steps/s * batch``. The median of ``reps`` epochs is reported, with
``fit_s``, the median wall time of the whole ``fit`` call.

For the MLP, the psflow worker also times, after each of its ``fit`` epochs, the
step's matrix products alone (``products``): the step's GEMMs with its shapes and
in its order (two forward products and the last layer's, the backward pairs, the
first layer's kernel gradient), once through psflow's kernel threads as ``fit``
runs them (``psflow kernels``) and once as plain NumPy products on the BLAS's own
threads (``numpy blas``), the median ms per step of each. Next to tf.keras's step
time from the same repetitions this gives the floor of any MLP step on this host:
``budget 1.5x`` is tf.keras's ms per step / 1.5 (the step a 1.5x lead needs), and
``share`` the faster products' ms over it. Above 1 (or near it) no amount of work
outside the products gets psflow to 1.5x on this machine.

stdout: JSON lines (BENCHMARKS.md); stderr: a table and progress.

    python benchmarks/train_local.py            # 5 alternating repetitions
    python benchmarks/train_local.py --quick    # 3 repetitions, fewer steps (< 60 s)
    python benchmarks/train_local.py --no-tf    # psflow only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import selectors
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

BENCH = "train_local"
SIDES = ("psflow", "tf.keras")
DIMS = (784, 512, 512, 10)
IMAGE = (28, 28, 1)
LEARNING_RATE = {"mlp": 0.1, "cnn": 0.01}
CASE = {"mlp": "mlp-784-512-512-10", "cnn": "cnn-conv32-pool-dense64-10-28x28"}
MODELS = tuple(CASE)
SEED = 1234


# -- the workers ---------------------------------------------------------------------------


def _data(model: str, examples: int) -> tuple[Any, Any]:
    """Seeded synthetic inputs (standard normal) and integer labels, the same on both sides."""
    import numpy as np

    rng = np.random.default_rng(SEED)
    shape = (DIMS[0],) if model == "mlp" else IMAGE
    x = rng.standard_normal((examples, *shape), dtype=np.float32)
    y = rng.integers(0, DIMS[-1], examples).astype(np.int64)
    return x, y


def _layers(keras: Any, model: str) -> list[Any]:
    """The model's layers in either framework's Keras (the same names in both)."""
    L = keras.layers
    if model == "mlp":
        return [
            L.Dense(DIMS[1], activation="relu"),
            L.Dense(DIMS[2], activation="relu"),
            L.Dense(DIMS[3]),
        ]
    return [
        L.Conv2D(32, 3, activation="relu"),
        L.MaxPooling2D(),
        L.Flatten(),
        L.Dense(64, activation="relu"),
        L.Dense(DIMS[3]),
    ]


def _compile(keras: Any, model: Any, name: str) -> Any:
    model.compile(
        optimizer=keras.optimizers.SGD(LEARNING_RATE[name]),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model, keras.callbacks.Callback


def _input_shape(model: str) -> tuple[int, ...]:
    return (DIMS[0],) if model == "mlp" else IMAGE


def _psflow_model(name: str) -> Any:
    import psflow as pf
    from psflow import keras

    pf.random.set_seed(SEED)
    model = keras.Sequential([keras.Input(_input_shape(name)), *_layers(keras, name)])
    return _compile(keras, model, name)


def _tf_model(name: str, threads: int | None) -> Any:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    if threads:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    tf.keras.utils.set_random_seed(SEED)
    keras = tf.keras
    model = keras.Sequential([keras.Input(_input_shape(name)), *_layers(keras, name)])
    return _compile(keras, model, name)


def _version(side: str) -> str:
    if side == "psflow":
        import psflow

        return psflow.__version__
    import tensorflow as tf

    return tf.__version__


def _stamper(callback_cls: type) -> Any:
    """A callback (of the side's Keras) that notes when each training step ends."""

    class Stamp(callback_cls):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.stamps: list[float] = []

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self.stamps.append(time.perf_counter())

    return Stamp()


def worker(side: str, threads: int | None) -> None:
    """Serves ``{"model": M, "batch": B, "steps": S}`` requests on stdin with timings on stdout."""
    import numpy as np

    make = _psflow_model if side == "psflow" else lambda name: _tf_model(name, threads)
    models: dict[tuple[str, int], Any] = {}
    data: dict[tuple[str, int, int], Any] = {}
    reply = sys.stdout
    reply.write(json.dumps({"ready": True, "version": _version(side)}) + "\n")
    reply.flush()
    for line in sys.stdin:  # ends when the parent closes stdin
        request = json.loads(line)
        name, batch, steps = request["model"], int(request["batch"]), int(request["steps"])
        if request.get("products"):
            reply.write(json.dumps(_products(batch, steps)) + "\n")
            reply.flush()
            continue
        if (name, batch) not in models:
            models[name, batch] = make(name)
        model, callback_cls = models[name, batch]
        if (name, batch, steps) not in data:
            data[name, batch, steps] = _data(name, batch * steps)
        x, y = data[name, batch, steps]
        stamper = _stamper(callback_cls)
        start = time.perf_counter()
        history = model.fit(
            x, y, batch_size=batch, epochs=1, shuffle=True, verbose=0, callbacks=[stamper]
        )
        stamps = stamper.stamps
        fit_s = time.perf_counter() - start
        loss = float(np.asarray(history.history["loss"][-1]))
        result = {
            "steps": len(stamps),
            "steady_s": stamps[-1] - stamps[0],
            "fit_s": fit_s,
            "loss": loss,
        }
        reply.write(json.dumps(result) + "\n")
        reply.flush()


def _products(batch: int, steps: int) -> dict[str, float]:
    """Median ms per step of the MLP step's GEMMs alone: through psflow's kernel threads
    (the calls ``fit`` makes) and as plain NumPy products on the BLAS's own threads."""
    import numpy as np

    from psflow.ops import kernel_pool as kp

    rng = np.random.default_rng(SEED)
    d = DIMS
    x = rng.standard_normal((batch, d[0]), dtype=np.float32)
    w = [rng.standard_normal((d[i], d[i + 1]), dtype=np.float32) for i in range(3)]
    h = [rng.standard_normal((batch, d[i + 1]), dtype=np.float32) for i in range(3)]

    def kernels() -> None:
        kp.dense(x, w[0]), kp.dense(h[0], w[1]), kp.dense(h[1], w[2])
        kp.matmuls([(h[2], w[2].T), (h[1].T, h[2])])
        kp.matmuls([(h[1], w[1].T), (h[0].T, h[1])])
        kp.matmul(x.T, h[0])

    def blas() -> None:
        x @ w[0], h[0] @ w[1], h[1] @ w[2]
        h[2] @ w[2].T, h[1].T @ h[2], h[1] @ w[1].T, h[0].T @ h[1], x.T @ h[0]

    out = {}
    for key, step in (("kernels_ms", kernels), ("blas_ms", blas)):
        for _ in range(3):
            step()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        out[key] = statistics.median(times) * 1e3
        time.sleep(0.2)  # the BLAS's own threads stop spinning before the next side
    return out


# -- the parent ----------------------------------------------------------------------------------


class Worker:
    """A worker process, with every read bounded by a timeout."""

    def __init__(
        self, side: str, threads: int | None, timeout: float, extra_env: dict[str, str]
    ) -> None:
        self.side, self.timeout = side, timeout
        env = {**os.environ, **extra_env}
        # The worker imports psflow from this checkout, whatever is installed.
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        if threads and side == "psflow":
            for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
                env[var] = str(threads)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        args = [sys.executable, os.path.abspath(__file__), "--worker", side]
        if threads:
            args += ["--threads", str(threads)]
        self._stderr = open(os.devnull, "w")  # noqa: SIM115 - TF logs are not read
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env=env,
        )
        self._sel = selectors.DefaultSelector()
        assert self.proc.stdout is not None
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)
        hello = self._read()
        self.version = hello["version"]

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        if not self._sel.select(self.timeout):
            raise TimeoutError(f"{self.side} worker gave no answer in {self.timeout:.0f}s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.side} worker exited with status {self.proc.wait(10)}")
        return json.loads(line)

    def run(self, model: str, batch: int, steps: int, products: bool = False) -> dict[str, Any]:
        """One timed ``fit`` epoch of ``model`` in the worker (``products``: the MLP step's
        products alone, ``steps`` times)."""
        assert self.proc.stdin is not None
        request = {"model": model, "batch": batch, "steps": steps, "products": products}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        """Ends the worker (closing its stdin), killing it if it lingers."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except (subprocess.TimeoutExpired, BrokenPipeError, OSError):
            self.proc.kill()
            self.proc.wait(timeout=10)
        finally:
            self._sel.close()
            self._stderr.close()


def _emit(record: dict[str, Any]) -> None:
    print(json.dumps({"bench": BENCH, **record}), flush=True)


def _load() -> float:
    """The 1-minute load average: other work on a shared machine skews every figure."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else -1.0


def _log(message: str, err: TextIO = sys.stderr) -> None:
    print(message, file=err, flush=True)


def _has_tensorflow() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorflow") is not None


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark; returns 0 when it ran."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (< 60 s)")
    parser.add_argument("--no-tf", action="store_true", help="skip the tf.keras side")
    parser.add_argument("--reps", type=int, default=None, help="alternating repetitions")
    parser.add_argument("--batches", default="64,256", help="batch sizes (64,256)")
    parser.add_argument("--models", default="mlp,cnn", help="models among mlp,cnn (both)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads per side")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per answer")
    parser.add_argument(
        "--psflow-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable for the psflow worker only (repeatable), e.g. "
        "MALLOC_MMAP_THRESHOLD_=4294967296 to try an allocator setting",
    )
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.threads)
        return 0

    reps = args.reps or (3 if args.quick else 5)
    batches = [int(b) for b in args.batches.split(",")]
    models = [m.strip() for m in args.models.split(",")]
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        parser.error(f"unknown models {unknown}; known: {list(MODELS)}")
    # Examples per timed epoch: long enough to average over many steps on 2 cores.
    epoch_examples = 4096 if args.quick else 25600
    steps = {b: max(8, epoch_examples // b) for b in batches}
    sides = ["psflow"]
    if args.no_tf:
        _emit({"case": "tf.keras", "metric": "skipped", "reason": "--no-tf"})
    elif not _has_tensorflow():
        _emit({"case": "tf.keras", "metric": "skipped", "reason": "tensorflow is not installed"})
    else:
        sides.append("tf.keras")

    load_start = _load()
    workers: dict[str, Worker] = {}
    results: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    floors: dict[int, list[dict[str, float]]] = {}  # the MLP step's products alone, per batch
    try:
        for side in sides:
            _log(f"starting the {side} worker...")
            extra = dict(kv.split("=", 1) for kv in args.psflow_env) if side == "psflow" else {}
            workers[side] = Worker(side, args.threads, args.timeout, extra)
        for side in sides:  # warm-up: build each model, first steps
            for name in models:
                for b in batches:
                    workers[side].run(name, b, 4)
        for rep in range(reps):
            for name in models:
                for b in batches:
                    order = sides if rep % 2 == 0 else sides[::-1]  # A B, then B A
                    for side in order:
                        r = workers[side].run(name, b, steps[b])
                        results.setdefault((name, side, b), []).append(r)
                        if side == "psflow" and name == "mlp":
                            p = workers[side].run(name, b, steps[b], products=True)
                            floors.setdefault(b, []).append(p)
                        _log(
                            f"rep {rep + 1}/{reps} {name} batch {b:4d} {side:9s} "
                            f"{(r['steps'] - 1) / r['steady_s']:8.1f} steps/s"
                        )
    finally:
        for w in workers.values():
            w.close()

    versions = {side: w.version for side, w in workers.items()}
    load = {"loadavg_1m_start": load_start, "loadavg_1m_end": _load(), "cpus": os.cpu_count()}
    table = []
    for name in models:
        for b in batches:
            rates = {}
            case = f"fit/{CASE[name]}/b{b}"
            for side in sides:
                runs = results[(name, side, b)]
                step_rates = [(r["steps"] - 1) / r["steady_s"] for r in runs]
                rate = statistics.median(step_rates)
                rates[side] = rate * b
                common = {
                    "case": case,
                    "side": side,
                    "version": versions[side],
                    "n": len(runs),
                    "steps_per_epoch": steps[b],
                    "fit_s": statistics.median(r["fit_s"] for r in runs),
                    "final_loss": runs[-1]["loss"],
                    "threads": args.threads or "default",
                    "env": args.psflow_env if side == "psflow" else [],
                    **load,
                }
                _emit(
                    {
                        **common,
                        "metric": "steps_per_s",
                        "value": rate,
                        "unit": "steps/s",
                        "min": min(step_rates),
                        "max": max(step_rates),
                    }
                )
                _emit(
                    {**common, "metric": "examples_per_s", "value": rate * b, "unit": "examples/s"}
                )
                table.append((name, b, side, rate, rate * b))
            if "tf.keras" in rates:
                _emit(
                    {
                        "case": case,
                        "metric": "ratio",
                        "value": rates["psflow"] / rates["tf.keras"],
                        "unit": "x",
                        "numerator": "psflow examples/s",
                        "baseline": f"tf.keras {versions['tf.keras']} examples/s",
                    }
                )

    floor_rows = _floor_records(floors, table)
    _log(
        f"\nmodel.fit, SGD {LEARNING_RATE}, {platform.processor() or 'cpu'}, "
        f"{os.cpu_count()} CPUs, threads {args.threads or 'default'}, "
        f"load average {load_start} -> {load['loadavg_1m_end']}, median of {reps}"
    )
    _log(
        f"{'model':5} {'batch':>5} {'side':9} {'steps/s':>9} {'examples/s':>11} {'vs tf.keras':>11}"
    )
    for name, b, side, rate, ex in table:
        tf_ex = next(
            (e for n, bb, s, _, e in table if n == name and bb == b and s == "tf.keras"), None
        )
        ratio = f"{ex / tf_ex:10.2f}x" if tf_ex else " " * 11
        _log(f"{name:5} {b:5d} {side:9} {rate:9.1f} {ex:11.0f} {ratio}")
    if floor_rows:
        _log("\nthe MLP step's products alone, ms per step (median), against tf.keras's step / 1.5")
        _log(f"{'batch':>5} {'kernels':>8} {'numpy':>8} {'tf step':>8} {'budget':>8} {'share':>6}")
        for b, kernels_ms, blas_ms, tf_ms, budget, share in floor_rows:
            _log(f"{b:5d} {kernels_ms:8.2f} {blas_ms:8.2f} {tf_ms:8.2f} {budget:8.2f} {share:6.2f}")
    return 0


def _floor_records(
    floors: dict[int, list[dict[str, float]]], table: list[tuple[str, int, str, float, float]]
) -> list[tuple[int, float, float, float, float, float]]:
    """Emits the products' records; the table's rows (with tf.keras's step where it ran)."""
    rows = []
    for b, runs in sorted(floors.items()):
        kernels_ms = statistics.median(r["kernels_ms"] for r in runs)
        blas_ms = statistics.median(r["blas_ms"] for r in runs)
        case = f"products/{CASE['mlp']}/b{b}"
        for side, ms in (("psflow kernels", kernels_ms), ("numpy blas", blas_ms)):
            _emit({"case": case, "side": side, "metric": "ms_per_step", "value": ms,
                   "unit": "ms", "n": len(runs)})  # fmt: skip
        tf_rate = next(
            (r for n, bb, s, r, _ in table if (n, bb, s) == ("mlp", b, "tf.keras")), None
        )
        if tf_rate:
            tf_ms = 1e3 / tf_rate
            budget = tf_ms / 1.5
            share = min(kernels_ms, blas_ms) / budget
            _emit({"case": case, "metric": "share_of_1.5x_budget", "value": share, "unit": "x",
                   "numerator": "the faster products' ms per step",
                   "baseline": "tf.keras ms per step / 1.5"})  # fmt: skip
            rows.append((b, kernels_ms, blas_ms, tf_ms, budget, share))
    return rows


if __name__ == "__main__":
    sys.exit(main())

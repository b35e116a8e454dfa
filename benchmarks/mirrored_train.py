"""MirroredStrategy training throughput: psflow vs TensorFlow on 1, 2 and 4 logical CPU devices.

The workload is the 784->512->512->10 MLP (ReLU, softmax cross-entropy from
logits, SGD 0.1) on seeded synthetic data (standard normal features, uniform
labels), global batches of 64 and 256, trained with TensorFlow's custom loop:
``strategy.run(train_step, args=(batch,))`` over
``experimental_distribute_dataset``, the step computing
``compute_average_loss(..., global_batch_size=B)`` under ``GradientTape`` and
calling ``optimizer.apply_gradients``, then ``strategy.reduce("SUM", ...)``.
The distributed step is a ``tf.function`` (as TensorFlow users write it; in
psflow it is a plain call).

Logical devices are fixed per process, so each (framework, devices) pair runs
in its own subprocess, which measures every batch size. The two frameworks
alternate (A B, then B A) and each figure is the median over the repeats.

Formulas: steps/s = timed steps / wall seconds of those steps (after warm-up
steps, then an idle second, so that one-time work the first steps start in the
background, psflow loading its compiled loops, ends untimed); examples/s =
steps/s * global batch; CPU ms/step = process CPU time (all threads) / timed
steps.

Usage::

    python benchmarks/mirrored_train.py            # the default run (a few minutes)
    python benchmarks/mirrored_train.py --quick    # the same cases, < 60 s on 2 cores

stdout: one JSON object per measurement; stderr: progress and a table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Any

BENCH = "mirrored_train"
ROOT = pathlib.Path(__file__).resolve().parent.parent
LAYERS = (784, 512, 512, 10)
LEARNING_RATE = 0.1
CHILD_TIMEOUT_S = 300.0
WARMUP_IDLE_S = 1.0
"""Seconds of idle time after each run's warm-up steps, before the timed ones."""
SIDES = ("psflow", "tensorflow")

logger = logging.getLogger(BENCH)


# -- the child: one framework on one device count, in its own process ----------------------------
def _make_step(tf: Any, strategy: Any, batch: int) -> Any:
    """Builds the model and returns TF's distributed training step for global batch ``batch``."""
    with strategy.scope():
        tf.random.set_seed(7)
        model = tf.keras.Sequential(
            [
                tf.keras.layers.Dense(LAYERS[1], activation="relu"),
                tf.keras.layers.Dense(LAYERS[2], activation="relu"),
                tf.keras.layers.Dense(LAYERS[3]),
            ]
        )
        model.build((None, LAYERS[0]))
        optimizer = tf.keras.optimizers.SGD(LEARNING_RATE)
        loss_object = tf.keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="none"
        )

    def train_step(inputs: Any) -> Any:
        features, labels = inputs
        with tf.GradientTape() as tape:
            logits = model(features, training=True)
            loss = tf.nn.compute_average_loss(loss_object(labels, logits), global_batch_size=batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def distributed_step(inputs: Any) -> Any:
        per_replica = strategy.run(train_step, args=(inputs,))
        return strategy.reduce("SUM", per_replica, axis=None)

    return distributed_step


def _child(
    framework: str, devices: int, batches: list[int], steps: int, warmup: int
) -> list[dict[str, Any]]:
    """Trains ``warmup + steps`` steps per batch size; returns the timing of the last ``steps``."""
    import numpy as np

    if framework == "tensorflow":
        import tensorflow as tf
    else:
        import psflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(devices)]
    )
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(devices)])
    results = []
    for batch in batches:
        rng = np.random.default_rng(1234)
        n_batches = 8
        x = rng.standard_normal((n_batches * batch, LAYERS[0]), dtype=np.float32)
        y = rng.integers(0, LAYERS[-1], size=(n_batches * batch,)).astype(np.int64)
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)
        dist = iter(strategy.experimental_distribute_dataset(dataset.repeat()))
        distributed_step = _make_step(tf, strategy, batch)

        first_loss = float(distributed_step(next(dist)))
        for _ in range(warmup - 1):
            distributed_step(next(dist))
        # then an idle second: one-time work a process's first steps start in the background
        # (psflow loads its compiled loops in a thread, ~0.4 s holding the GIL much of it)
        # ends outside the timing; the steps stay a fixed count, so the losses compare
        time.sleep(WARMUP_IDLE_S)
        cpu_start = time.process_time()
        start = time.perf_counter()
        for _ in range(steps):
            loss = distributed_step(next(dist))
        last_loss = float(loss)  # also waits for the last step to finish
        seconds = time.perf_counter() - start
        cpu_seconds = time.process_time() - cpu_start
        results.append(
            {
                "framework": framework,
                "devices": devices,
                "batch": batch,
                "steps": steps,
                "steps_per_s": steps / seconds,
                "cpu_ms_per_step": cpu_seconds / steps * 1e3,
                "first_loss": first_loss,
                "last_loss": last_loss,
                "version": tf.__version__ if framework == "tensorflow" else None,
            }
        )
    return results


# -- the parent: alternate the two sides, each configuration in a subprocess --------------------
def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(ROOT), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env["CUDA_VISIBLE_DEVICES"] = ""  # logical CPU devices on both sides
    env.pop("PSFLOW_NUM_CPU_DEVICES", None)
    return env


def _run_child(
    framework: str, devices: int, batches: list[int], steps: int, warmup: int
) -> list[dict]:
    cmd = [
        sys.executable,
        str(pathlib.Path(__file__).resolve()),
        "--child",
        framework,
        "--devices",
        str(devices),
        "--batches",
        ",".join(map(str, batches)),
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_child_env()
    )
    try:
        out, err = proc.communicate(timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        logger.warning(
            "%s on %d devices timed out after %.0f s", framework, devices, CHILD_TIMEOUT_S
        )
        return []
    if proc.returncode != 0:
        logger.warning(
            "%s on %d devices failed (exit %d):\n%s",
            framework,
            devices,
            proc.returncode,
            err[-3000:],
        )
        return []
    lines = [line for line in out.splitlines() if line.startswith("[")]
    return json.loads(lines[-1]) if lines else []


def _emit(record: dict[str, Any]) -> None:
    print(json.dumps({"bench": BENCH, **record}), flush=True)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark (or, with ``--child``, one framework on one device count)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats (< 60 s)")
    parser.add_argument("--devices", default="1,2,4", help="logical CPU device counts")
    parser.add_argument("--batches", default="64,256", help="global batch sizes")
    parser.add_argument("--repeats", type=int, default=None, help="runs per configuration")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per run (>= 1)")
    parser.add_argument("--no-tf", action="store_true", help="leave TensorFlow out")
    parser.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    devices, batches = _ints(args.devices), _ints(args.batches)
    steps = args.steps or (20 if args.quick else 100)
    warmup = max(1, args.warmup or (3 if args.quick else 10))

    if args.child:
        print(json.dumps(_child(args.child, devices[0], batches, steps, warmup)), flush=True)
        return 0

    repeats = args.repeats or (1 if args.quick else 3)
    with_tf = not args.no_tf and importlib.util.find_spec("tensorflow") is not None
    if not with_tf:
        reason = "--no-tf" if args.no_tf else "tensorflow is not installed"
        _emit({"case": "tensorflow", "metric": "skipped", "value": None, "reason": reason})
    sides = list(SIDES) if with_tf else ["psflow"]
    runs: dict[tuple[str, int, int], list[dict]] = {}
    started = time.perf_counter()
    for rep in range(repeats):
        for i, n in enumerate(devices):
            order = sides if (rep + i) % 2 == 0 else sides[::-1]
            for side in order:
                logger.info("repeat %d/%d: %s on %d device(s)", rep + 1, repeats, side, n)
                for r in _run_child(side, n, batches, steps, warmup):
                    runs.setdefault((side, n, r["batch"]), []).append(r)

    medians: dict[tuple[str, int, int], float] = {}
    for (side, n, batch), rs in sorted(runs.items()):
        rates = [r["steps_per_s"] for r in rs]
        med = medians[(side, n, batch)] = statistics.median(rates)
        _emit(
            {
                "case": f"{side}/devices={n}/batch={batch}",
                "metric": "throughput",
                "value": round(med, 2),
                "unit": "steps/s",
                "n": len(rates),
                "runs": [round(x, 2) for x in rates],
                "examples_per_s": round(med * batch, 1),
                "cpu_ms_per_step": round(statistics.median(r["cpu_ms_per_step"] for r in rs), 2),
                "timed_steps": steps,
                "final_loss": round(rs[-1]["last_loss"], 5),
                **({"tf_version": rs[0]["version"]} if side == "tensorflow" else {}),
            }
        )
    for batch in batches:
        for n in devices:
            ours, theirs = medians.get(("psflow", n, batch)), medians.get(("tensorflow", n, batch))
            if ours and theirs:
                _emit(
                    {
                        "case": f"psflow_vs_tensorflow/devices={n}/batch={batch}",
                        "metric": "ratio",
                        "value": round(ours / theirs, 3),
                        "numerator": f"psflow steps/s on {n} devices",
                        "denominator": f"tensorflow steps/s on {n} devices",
                    }
                )
            for side in sides:
                one, many = medians.get((side, 1, batch)), medians.get((side, n, batch))
                if n != 1 and one and many:
                    _emit(
                        {
                            "case": f"{side}_scaling/devices={n}/batch={batch}",
                            "metric": "ratio",
                            "value": round(many / one, 3),
                            "numerator": f"{side} steps/s on {n} devices",
                            "denominator": f"{side} steps/s on 1 device",
                        }
                    )

    def cell(v: float | None) -> str:
        return f"{v:10.1f}" if v else f"{'-':>10}"

    print(
        f"{'batch':>6} {'devices':>7} {'psflow':>10} {'tensorflow':>10} {'ratio':>6}  (steps/s)",
        file=sys.stderr,
    )
    for batch in batches:
        for n in devices:
            ours, theirs = medians.get(("psflow", n, batch)), medians.get(("tensorflow", n, batch))
            ratio = f"{ours / theirs:6.2f}" if ours and theirs else f"{'-':>6}"
            print(f"{batch:>6} {n:>7} {cell(ours)} {cell(theirs)} {ratio}", file=sys.stderr)
    logger.info("done in %.0f s", time.perf_counter() - started)
    return 0 if runs else 1


if __name__ == "__main__":
    sys.exit(main())

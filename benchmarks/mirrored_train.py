"""MirroredStrategy training throughput: psflow vs TensorFlow, on 1, 2 and 4 logical CPU devices.

The workload is the 784->512->512->10 MLP (ReLU, softmax cross-entropy from
logits, SGD 0.1) on seeded synthetic data, trained with TensorFlow's custom
loop: ``strategy.run(train_step, args=(batch,))`` over
``experimental_distribute_dataset``, the step computing
``compute_average_loss(..., global_batch_size=B)`` under ``GradientTape`` and
calling ``optimizer.apply_gradients``; TensorFlow's step is a ``tf.function``
(as TensorFlow users write it). Logical devices are fixed per process, so
every (framework, devices, batch) configuration runs in its own subprocess;
psflow and TensorFlow alternate (A B A B) and the median of the repeats is
reported.

Formula: steps/s = timed steps / wall seconds of those steps (after warm-up);
examples/s = steps/s * global batch.

Usage::

    python benchmarks/mirrored_train.py            # the default run (a few minutes)
    python benchmarks/mirrored_train.py --quick    # the same cases, < 60 s on 2 cores

stdout: one JSON object per measurement; stderr: progress and a table.
"""

from __future__ import annotations

import argparse
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
CHILD_TIMEOUT_S = 240.0

logger = logging.getLogger(BENCH)


# -- the child: one configuration in its own process ----------------------------------------------
def _child(framework: str, devices: int, batch: int, steps: int, warmup: int) -> dict[str, Any]:
    """Trains ``warmup + steps`` steps and returns the timing of the last ``steps``."""
    import numpy as np

    if os.environ.get("XSWITCH"):
        sys.setswitchinterval(float(os.environ["XSWITCH"]))
    if framework == "tf":
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        import tensorflow as tf
    else:
        import psflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(devices)]
    )
    names = [f"/cpu:{i}" for i in range(devices)]
    strategy = tf.distribute.MirroredStrategy(names)

    rng = np.random.default_rng(1234)
    n_batches = 8
    x = rng.standard_normal((n_batches * batch, LAYERS[0]), dtype=np.float32)
    y = rng.integers(0, LAYERS[-1], size=(n_batches * batch,)).astype(np.int64)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)
    dataset = dataset.repeat()
    if framework == "tf":
        dataset = dataset.prefetch(2)
    dist = iter(strategy.experimental_distribute_dataset(dataset))

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

    first_loss = last_loss = None
    for _ in range(warmup):
        loss = distributed_step(next(dist))
        first_loss = float(loss) if first_loss is None else first_loss
    cpu_start = time.process_time()
    start = time.perf_counter()
    for _ in range(steps):
        loss = distributed_step(next(dist))
    last_loss = float(loss)  # also waits for the last step to finish
    seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start
    out = {
        "framework": framework,
        "devices": devices,
        "batch": batch,
        "steps": steps,
        "seconds": seconds,
        "steps_per_s": steps / seconds,
        "cpu_ms_per_step": cpu_seconds / steps * 1e3,
        "first_loss": first_loss,
        "last_loss": last_loss,
    }
    if framework == "tf":
        out["tf_version"] = tf.__version__
    return out


# -- the parent: alternate the two sides, each configuration in a subprocess --------------------
def _tf_available() -> bool:
    """Whether TensorFlow imports here (checked in a subprocess: it is slow and noisy)."""
    probe = subprocess.run(
        [sys.executable, "-c", "import tensorflow"],
        capture_output=True,
        timeout=CHILD_TIMEOUT_S,
        env=_child_env(),
    )
    return probe.returncode == 0


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(ROOT), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env.pop("PSFLOW_NUM_CPU_DEVICES", None)
    return env


def _run_child(framework: str, devices: int, batch: int, steps: int, warmup: int) -> dict | None:
    cmd = [
        sys.executable,
        str(pathlib.Path(__file__).resolve()),
        "--child",
        framework,
        "--devices",
        str(devices),
        "--batch",
        str(batch),
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
        logger.warning("%s devices=%d batch=%d timed out", framework, devices, batch)
        return None
    if proc.returncode != 0:
        logger.warning(
            "%s devices=%d batch=%d failed (exit %d):\n%s",
            framework,
            devices,
            batch,
            proc.returncode,
            err[-2000:],
        )
        return None
    lines = [line for line in out.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else None


def _emit(record: dict[str, Any]) -> None:
    print(json.dumps({"bench": BENCH, **record}), flush=True)


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark (or, with ``--child``, one configuration); returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats (< 60 s)")
    parser.add_argument("--devices", default="1,2,4", help="logical CPU device counts")
    parser.add_argument("--batches", default="64,256", help="global batch sizes")
    parser.add_argument("--repeats", type=int, default=None, help="runs per configuration")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per run")
    parser.add_argument("--no-tf", action="store_true", help="skip TensorFlow")
    parser.add_argument("--child", choices=["psflow", "tf"], help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=64, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)

    if args.child:
        result = _child(
            args.child, int(args.devices), args.batch, args.steps or 50, args.warmup or 5
        )
        print(json.dumps(result), flush=True)
        return 0

    devices = [int(d) for d in args.devices.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    repeats = args.repeats or (1 if args.quick else 3)
    steps = args.steps or (30 if args.quick else 150)
    warmup = args.warmup or (3 if args.quick else 10)
    with_tf = not args.no_tf and _tf_available()
    if not with_tf:
        _emit(
            {
                "case": "tensorflow",
                "metric": "skipped",
                "value": None,
                "reason": "--no-tf" if args.no_tf else "tensorflow is not installed",
            }
        )
    sides = ["psflow", "tf"] if with_tf else ["psflow"]
    runs: dict[tuple[str, int, int], list[dict]] = {}
    for batch in batches:
        for rep in range(repeats):
            for n in devices:
                order = sides if rep % 2 == 0 else sides[::-1]
                for side in order:
                    logger.info(
                        "run %d/%d: %s devices=%d batch=%d", rep + 1, repeats, side, n, batch
                    )
                    r = _run_child(side, n, batch, steps, warmup)
                    if r is not None:
                        runs.setdefault((side, n, batch), []).append(r)

    table = []
    for batch in batches:
        for n in devices:
            medians: dict[str, float] = {}
            for side in sides:
                rs = runs.get((side, n, batch), [])
                if not rs:
                    continue
                rates = [r["steps_per_s"] for r in rs]
                med = statistics.median(rates)
                medians[side] = med
                extra = {"tf_version": rs[0]["tf_version"]} if side == "tf" else {}
                _emit(
                    {
                        "case": f"{side}/devices={n}/batch={batch}",
                        "metric": "throughput",
                        "value": round(med, 2),
                        "unit": "steps/s",
                        "n": len(rates),
                        "runs": [round(x, 2) for x in rates],
                        "examples_per_s": round(med * batch, 1),
                        "steps": steps,
                        "final_loss": rs[-1]["last_loss"],
                        **extra,
                    }
                )
            if "psflow" in medians and "tf" in medians:
                _emit(
                    {
                        "case": f"devices={n}/batch={batch}",
                        "metric": "ratio",
                        "value": round(medians["psflow"] / medians["tf"], 3),
                        "numerator": "psflow steps/s",
                        "denominator": "tensorflow steps/s",
                    }
                )
            base = runs.get(("psflow", 1, batch))
            if n != 1 and base and "psflow" in medians:
                single = statistics.median(r["steps_per_s"] for r in base)
                _emit(
                    {
                        "case": f"psflow/devices={n}/batch={batch}",
                        "metric": "ratio",
                        "value": round(medians["psflow"] / single, 3),
                        "numerator": f"psflow steps/s on {n} devices",
                        "denominator": "psflow steps/s on 1 device",
                    }
                )
            table.append((batch, n, medians.get("psflow"), medians.get("tf")))

    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:8.1f}"

    print(
        f"{'batch':>6} {'devices':>7} {'psflow':>9} {'tensorflow':>10} {'ratio':>6}",
        file=sys.stderr,
    )
    for batch, n, ours, theirs in table:
        ratio = f"{ours / theirs:6.2f}" if ours and theirs else "     -"
        print(f"{batch:>6} {n:>7} {fmt(ours)} {fmt(theirs):>10} {ratio}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Engine benchmark: one forward+backward step of a 784-512-512-10 MLP through GradientTape.

Side A is psflow: ReLU layers, ``psflow.nn.sparse_softmax_cross_entropy_with_logits``,
the mean loss, ``tape.gradient`` for the six weights. Side B is the same float32
computation in plain NumPy with a hand-written backward pass. Both run in this
process on the same NumPy, BLAS pinned to ``--threads`` threads, timed A B A B.
The ratio A/B is the tape's cost; its target is <= 1.10 at batch 64.

When TensorFlow is installed, a subprocess times ``tf.GradientTape`` on the same
data (eager and inside ``tf.function``) alternating with the same NumPy step,
so ``psflow / tensorflow = (psflow / numpy) / (tensorflow / numpy)`` compares
runs made minutes apart without trusting their absolute times.

    python benchmarks/engine.py [--quick] [--threads 1] [--batches 64 256]
                                [--clock wall|cpu] [--no-tf]

FLOPs per step (reported, not used in the ratio): forward 2*B*sum(n_in*n_out),
backward twice that for the weight and input gradients (the first layer's
input gradient is skipped by both sides).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from _common import alternate, blas_env, emit, pin_blas_threads, progress, summary, table

BENCH = "engine"
SIZES = (784, 512, 512, 10)


def make_problem(batch: int, seed: int = 0) -> dict[str, Any]:
    """Weights (Glorot-scaled), zero-free biases, inputs and integer labels, all float32."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ws = [
        (rng.standard_normal((i, o)) * np.sqrt(2.0 / (i + o))).astype(np.float32)
        for i, o in itertools.pairwise(SIZES)
    ]
    bs = [(rng.standard_normal(o) * 0.01).astype(np.float32) for o in SIZES[1:]]
    x = rng.standard_normal((batch, SIZES[0])).astype(np.float32)
    y = rng.integers(0, SIZES[-1], batch).astype(np.int32)
    return {"ws": ws, "bs": bs, "x": x, "y": y}


def numpy_step(p: dict[str, Any]) -> Any:
    """A step function in plain NumPy: forward, mean cross-entropy, hand-written backward."""
    import numpy as np

    (w1, w2, w3), (b1, b2, b3), x, y = p["ws"], p["bs"], p["x"], p["y"]
    rows = np.arange(x.shape[0])
    inv_batch = np.float32(1.0 / x.shape[0])

    def step() -> tuple[Any, ...]:
        h1 = np.maximum(x @ w1 + b1, 0)
        h2 = np.maximum(h1 @ w2 + b2, 0)
        logits = h2 @ w3 + b3
        shifted = logits - logits.max(axis=1, keepdims=True)
        e = np.exp(shifted)
        s = e.sum(axis=1, keepdims=True)
        loss = (np.log(s[:, 0]) - shifted[rows, y]).mean()
        d3 = e / s
        d3[rows, y] -= 1
        d3 *= inv_batch
        d2 = (d3 @ w3.T) * (h2 > 0)
        d1 = (d2 @ w2.T) * (h1 > 0)
        return loss, x.T @ d1, d1.sum(0), h1.T @ d2, d2.sum(0), h2.T @ d3, d3.sum(0)

    return step


def psflow_step(p: dict[str, Any]) -> Any:
    """The same step through psflow's GradientTape."""
    import psflow as pf

    ws = [pf.Variable(w, name=f"w{i}") for i, w in enumerate(p["ws"])]
    bs = [pf.Variable(b, name=f"b{i}") for i, b in enumerate(p["bs"])]
    x, y = pf.constant(p["x"]), pf.constant(p["y"])
    params = [ws[0], bs[0], ws[1], bs[1], ws[2], bs[2]]

    def step() -> tuple[Any, ...]:
        with pf.GradientTape() as tape:
            h = pf.nn.relu(pf.matmul(x, ws[0]) + bs[0])
            h = pf.nn.relu(pf.matmul(h, ws[1]) + bs[1])
            logits = pf.matmul(h, ws[2]) + bs[2]
            per_example = pf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
            loss = pf.reduce_mean(per_example)
        return (loss, *tape.gradient(loss, params))

    return step


def max_difference(a: Any, b: Any) -> float:
    """Largest absolute difference between the two sides' loss and gradients."""
    import numpy as np

    return max(float(np.abs(np.asarray(u) - np.asarray(v)).max()) for u, v in zip(a(), b()))


def flops(batch: int) -> int:
    """Multiply-adds x2 of one step (see the module docstring)."""
    layers = list(itertools.pairwise(SIZES))
    fwd = sum(2 * batch * i * o for i, o in layers)
    bwd = 2 * fwd - 2 * batch * SIZES[0] * SIZES[1]
    return fwd + bwd


def tf_worker(batches: list[int], rounds: int, number: int, threads: int, clock: str) -> None:
    """In a subprocess: TensorFlow eager and tf.function steps against the NumPy step."""
    import logging
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    logging.getLogger("tensorflow").setLevel(logging.ERROR)
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    for batch in batches:
        p = make_problem(batch)
        ws = [tf.Variable(w) for w in p["ws"]]
        bs = [tf.Variable(b) for b in p["bs"]]
        x, y = tf.constant(p["x"]), tf.constant(p["y"])
        params = [ws[0], bs[0], ws[1], bs[1], ws[2], bs[2]]

        def eager() -> Any:
            with tf.GradientTape() as tape:
                h = tf.nn.relu(tf.matmul(x, ws[0]) + bs[0])  # noqa: B023
                h = tf.nn.relu(tf.matmul(h, ws[1]) + bs[1])  # noqa: B023
                logits = tf.matmul(h, ws[2]) + bs[2]  # noqa: B023
                loss = tf.reduce_mean(
                    tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)  # noqa: B023
                )
            grads = tape.gradient(loss, params)  # noqa: B023
            return loss, grads

        graph = tf.function(eager)
        reference = numpy_step(p)
        for name, fn in (("eager", eager), ("function", graph)):
            t_tf, t_np = alternate(
                lambda f=fn: f()[0].numpy(), reference, rounds, number, clock=clock
            )
            line = {"batch": batch, "mode": name, "tf_version": tf.__version__}
            line.update(tf=summary(t_tf), numpy=summary(t_np))
            print(json.dumps(line), flush=True)


def run_tensorflow(
    batches: list[int], rounds: int, number: int, threads: int, clock: str
) -> list[dict]:
    """Runs :func:`tf_worker` in a bounded subprocess; its result lines, or [] on failure."""
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--tf-worker",
        "--threads",
        str(threads),
        "--rounds",
        str(rounds),
        "--number",
        str(number),
        "--clock",
        clock,
        "--batches",
        *map(str, batches),
    ]
    try:
        proc = subprocess.run(
            cmd, env=blas_env(threads), capture_output=True, text=True, timeout=300
        )
    except subprocess.TimeoutExpired:
        progress("tensorflow subprocess timed out")
        return []
    if proc.returncode != 0:
        progress(f"tensorflow subprocess failed:\n{proc.stderr[-2000:]}")
        return []
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (< 60 s)")
    parser.add_argument("--threads", type=int, default=1, help="BLAS threads for every side")
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--rounds", type=int, default=None, help="A/B rounds per case")
    parser.add_argument("--number", type=int, default=None, help="steps per timed sample")
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall time, or process CPU time (steadier on a busy machine, single thread only)",
    )
    parser.add_argument("--no-tf", action="store_true", help="skip the TensorFlow side")
    parser.add_argument("--tf-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    rounds = args.rounds or (12 if args.quick else 40)
    number = args.number or (4 if args.quick else 10)
    if args.tf_worker:
        tf_worker(args.batches, rounds, number, args.threads, args.clock)
        return 0
    pin_blas_threads(args.threads)

    import numpy as np

    import psflow as pf

    rows = []
    ratios: dict[int, float] = {}
    for batch in args.batches:
        progress(f"batch {batch}: {rounds} rounds x {number} steps per side, A B A B ...")
        p = make_problem(batch)
        a, b = psflow_step(p), numpy_step(p)
        diff = max_difference(a, b)
        t_pf, t_np = alternate(a, b, rounds, number, clock=args.clock)
        s_pf, s_np = summary(t_pf), summary(t_np)
        gflop = flops(batch) / 1e9
        for side, s in (("psflow-tape", s_pf), ("numpy-manual", s_np)):
            ms = {k: v * 1e3 for k, v in s.items() if k != "n"}
            emit(BENCH, f"mlp/batch{batch}/{side}", "step_time", ms["median"], "ms",
                 p50=ms["p50"], p99=ms["p99"], n=s["n"], steps_per_sample=number,
                 gflops=gflop / s["median"], threads=args.threads, dtype="float32",
                 clock=args.clock)  # fmt: skip
        ratio = s_pf["median"] / s_np["median"]
        ratios[batch] = ratio
        emit(BENCH, f"mlp/batch{batch}", "ratio", ratio, "x", a="psflow-tape",
             b="numpy-manual", overhead_pct=(ratio - 1) * 100, max_abs_diff=diff,
             numpy_version=np.__version__, psflow_version=pf.__version__)  # fmt: skip
        rows.append([batch, "psflow tape", s_pf["median"] * 1e3, ratio])
        rows.append([batch, "numpy by hand", s_np["median"] * 1e3, 1.0])

    tf_found = importlib.util.find_spec("tensorflow") is not None
    if args.no_tf or not tf_found:
        why = "--no-tf" if args.no_tf else "tensorflow not installed"
        emit(BENCH, "mlp/tensorflow", "skipped", 0, "", reason=why)
    else:
        progress("tensorflow: eager and tf.function in a subprocess ...")
        results = run_tensorflow(args.batches, rounds, number, args.threads, args.clock)
        if not results:
            emit(BENCH, "mlp/tensorflow", "skipped", 0, "", reason="tensorflow run failed")
        for r in results:
            batch, mode, version = r["batch"], r["mode"], r["tf_version"]
            tf_vs_np = r["tf"]["median"] / r["numpy"]["median"]
            emit(BENCH, f"mlp/batch{batch}/tensorflow-{mode}", "step_time",
                 r["tf"]["median"] * 1e3, "ms", p50=r["tf"]["p50"] * 1e3,
                 p99=r["tf"]["p99"] * 1e3, n=r["tf"]["n"], tf_version=version,
                 numpy_same_run_ms=r["numpy"]["median"] * 1e3)  # fmt: skip
            pf_vs_tf = ratios[batch] / tf_vs_np
            emit(BENCH, f"mlp/batch{batch}/vs-tensorflow-{mode}", "ratio", pf_vs_tf, "x",
                 a="psflow-tape", b=f"tensorflow-{mode}", tf_vs_numpy=tf_vs_np,
                 tf_version=version)  # fmt: skip
            rows.append([batch, f"tf {mode}", r["tf"]["median"] * 1e3, tf_vs_np])
    progress("")
    table(["batch", "side", "median ms/step", "x numpy"], sorted(rows, key=lambda r: r[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The compute-only bound, with and without psflow's thread budget.

BENCHMARKS.md's compute-only bound of a distributed workload: the same model
and batch trained on local variables by the same number of worker processes on
one host, no PS, no chief, aggregate steps/s. This runs it twice side by side:

- ``default``: every trainer process left at its BLAS library's default
  thread count (OpenBLAS: as many threads as cores, in each process);
- ``budget``: every trainer process given psflow's budget, as ``psflow local``
  gives its workers (``PSFLOW_BLAS_THREADS`` from
  :func:`psflow.thread_budget.share_cores`, applied at start with threadpoolctl
  by :func:`psflow.thread_budget.start_process_budget`).

The model is BENCHMARKS.md's 784 -> 512 -> 512 -> 10 MLP (ReLU, SGD 0.1,
softmax cross-entropy from logits) in ``psflow.keras``, trained with ``fit`` on
seeded normal data. Each trainer is a long-lived process; per (side, batch) all
trainers of a side run one ``fit`` epoch at once, and the sides alternate
(A B A B) while the other side's trainers idle. ``steps/s`` of one trainer
counts the steps after its first, over the time from the end of the first to
the end of the last; the side's figure is the sum over its trainers (the
median over rounds). ``ratio`` = budget / default.

stdout: JSON lines (BENCHMARKS.md); stderr: a table and progress.

    python benchmarks/bound.py              # 5 rounds
    python benchmarks/bound.py --quick      # 2 rounds, fewer steps (< 60 s on 2 cores)
    python benchmarks/bound.py --processes 3
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import statistics
import subprocess
import sys
import time
from typing import Any

from _common import emit, progress, table

BENCH = "bound"
SIDES = ("default", "budget")
DIMS = (784, 512, 512, 10)
SEED = 1234
THREAD_VARIABLES = (
    "OPENBLAS_NUM_THREADS",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "PSFLOW_BLAS_THREADS",
)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- a trainer process ----------------------------------------------------------------------
def trainer(side: str) -> None:
    """Serves ``{"batch": B, "steps": S}`` lines on stdin with one timed fit epoch each."""
    from psflow import thread_budget

    if side == "budget":
        thread_budget.start_process_budget("worker")
    import numpy as np

    import psflow as pf
    from psflow import keras

    class Stamp(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.stamps: list[float] = []

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self.stamps.append(time.perf_counter())

    rng = np.random.default_rng(SEED)
    models: dict[int, Any] = {}
    print(json.dumps({"blas_threads": thread_budget.current_blas_threads()}), flush=True)
    for line in sys.stdin:  # ends when the parent closes stdin
        request = json.loads(line)
        batch, steps = int(request["batch"]), int(request["steps"])
        if batch not in models:
            pf.random.set_seed(SEED)
            L = keras.layers
            model = keras.Sequential(
                [
                    keras.Input((DIMS[0],)),
                    L.Dense(DIMS[1], activation="relu"),
                    L.Dense(DIMS[2], activation="relu"),
                    L.Dense(DIMS[3]),
                ]
            )
            model.compile(
                optimizer=keras.optimizers.SGD(0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
            models[batch] = model
        x = rng.standard_normal((batch * steps, DIMS[0]), dtype=np.float32)
        y = rng.integers(0, DIMS[-1], batch * steps).astype(np.int64)
        stamp = Stamp()
        models[batch].fit(x, y, batch_size=batch, epochs=1, verbose=0, callbacks=[stamp])
        s = stamp.stamps
        print(json.dumps({"steps": len(s) - 1, "seconds": s[-1] - s[0]}), flush=True)


class Trainer:
    """A trainer process; every read bounded by ``timeout``."""

    def __init__(self, side: str, env: dict[str, str], timeout: float) -> None:
        self.side, self.timeout = side, timeout
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--trainer", side],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)
        self.blas_threads = self.read()["blas_threads"]

    def send(self, batch: int, steps: int) -> None:
        self.proc.stdin.write(json.dumps({"batch": batch, "steps": steps}) + "\n")
        self.proc.stdin.flush()

    def read(self) -> dict[str, Any]:
        if not self._sel.select(self.timeout):
            raise TimeoutError(f"{self.side} trainer gave no answer in {self.timeout:.0f}s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.side} trainer exited with status {self.proc.wait(10)}")
        return json.loads(line)

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except (subprocess.TimeoutExpired, OSError):
            self.proc.kill()
            self.proc.wait(timeout=10)
        finally:
            self._sel.close()
            self.proc.stdout.close()


def _env(side: str, threads: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    if side == "budget":
        env["PSFLOW_BLAS_THREADS"] = str(threads)
    return env


def _together(trainers: list[Trainer], batch: int, steps: int) -> float:
    """Aggregate steps/s of ``trainers`` each running one epoch at the same time."""
    for t in trainers:
        t.send(batch, steps)
    return sum(r["steps"] / r["seconds"] for r in (t.read() for t in trainers))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 rounds, fewer steps")
    p.add_argument("--processes", type=int, default=2, help="trainer processes per side")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds for any one answer")
    p.add_argument("--trainer", choices=SIDES, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trainer:
        trainer(args.trainer)
        return 0
    sys.path.insert(0, ROOT)
    from psflow.thread_budget import available_cores, share_cores

    cores = available_cores()
    _, threads = share_cores(cores, 0, args.processes)
    rounds = 2 if args.quick else 5
    steps = {64: 120, 256: 40} if args.quick else {64: 400, 256: 120}
    sides: dict[str, list[Trainer]] = {}
    try:
        for side in SIDES:
            sides[side] = [
                Trainer(side, _env(side, threads), args.timeout) for _ in range(args.processes)
            ]
        counts = {s: [t.blas_threads for t in ts] for s, ts in sides.items()}
        progress(f"{cores} cores, {args.processes} trainers per side, BLAS threads {counts}")
        for batch in steps:  # warm-up: build the models, fault the buffers in
            for side in SIDES:
                _together(sides[side], batch, 5)
        rates: dict[tuple[str, int], list[float]] = {}
        for r in range(rounds):
            for batch, n in steps.items():
                for side in SIDES:
                    rate = _together(sides[side], batch, n)
                    rates.setdefault((side, batch), []).append(rate)
                    progress(f"round {r + 1}/{rounds} batch {batch} {side}: {rate:.1f} steps/s")
                    time.sleep(0.2)  # the other side's spinning BLAS threads go to sleep
    finally:
        for trainers in sides.values():
            for t in trainers:
                t.close()
    rows = []
    for batch in steps:
        median = {s: statistics.median(rates[s, batch]) for s in SIDES}
        for side in SIDES:
            emit(
                BENCH,
                f"mlp/batch{batch}/{side}",
                "throughput",
                round(median[side], 2),
                "steps/s",
                processes=args.processes,
                blas_threads=counts[side],
                cores=cores,
                n=rounds,
                samples=[round(v, 2) for v in rates[side, batch]],
            )
        ratio = median["budget"] / median["default"]
        emit(BENCH, f"mlp/batch{batch}", "ratio", round(ratio, 3), "x",
             sides=["budget", "default"])  # fmt: skip
        rows.append([batch, median["default"], median["budget"], ratio])
    table(["batch", "default steps/s", "budget steps/s", "budget/default"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The compute-only bound of PS training, and PS training's share of it, in one run.

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

Then PS training of the same model on the same host, as ``psflow local``
starts it: 2 parameter servers and 2 workers (separate processes on loopback,
each given psflow's thread budget) and this process as the chief, running
``pss_train.py``'s custom loop (a closure per batch through the
ClusterCoordinator), in async and sync mode, with the parameter servers'
shared memory on (``--shm auto``, the default) and off. ``async-waiting`` is
async mode with the workers' ``PSFLOW_PUSH_BEHIND=off`` (each closure's push
applied before the next closure starts, as before pushes went behind the
compute); its ratio to ``async`` is printed per round.  ``fit`` and ``fit-spe``
are the path users take: Keras ``fit`` in async mode from the same dataset
function (each worker builds its own pipeline), with ``steps_per_execution`` 1
and ``--steps-per-execution`` (default 4: that many batches per closure, so the
chief's and the worker's cost per closure is paid once per that many batches). A PS case's
``steps/s`` counts batches trained per second by all workers together (a sync
step of 2 workers is 2 batches), as the bound counts them; its ``share`` is
that over the bound's ``budget`` side (the bound BENCHMARKS.md defines: each
trainer given its fair share of the cores) measured in the same round. The CPU
each role used per batch (``cpu_ms_per_step``: both parameter servers, both
workers, the chief) is printed beside it, so the share can be read: on one
host the parameter servers and the chief take cores from the workers.
``cpu_share`` is the bound's CPU per batch over the CPU per batch of all PS
roles together: the share where all cores stay busy and nothing else runs (on
a machine loaded by other work the wall-clock ``share`` says more about the
scheduler than about psflow: more processes get more of the cores).

stdout: JSON lines (BENCHMARKS.md); stderr: a table and progress.

    python benchmarks/bound.py              # 5 rounds
    python benchmarks/bound.py --quick      # 2 rounds, fewer steps (< 60 s on 2 cores)
    python benchmarks/bound.py --processes 3
    python benchmarks/bound.py --no-ps      # the bound alone
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import selectors
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import _cluster
from _common import emit, progress, table

BENCH = "bound"
SIDES = ("default", "budget")
# "async-waiting": async with the workers' pushes waited for before the next closure
# (PSFLOW_PUSH_BEHIND=off), what async was before pushes went behind the compute;
# "fit" / "fit-spe": Keras fit (async, a dataset function, the path users take) with
# steps_per_execution 1 / --steps-per-execution
PS_MODES = ("async", "async-waiting", "sync", "fit", "fit-spe")
FIT_MODES = ("fit", "fit-spe")
PS_SHM = ("auto", "off")
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
        cpu = time.process_time()
        models[batch].fit(x, y, batch_size=batch, epochs=1, verbose=0, callbacks=[stamp])
        cpu = time.process_time() - cpu
        s = stamp.stamps
        print(json.dumps({"steps": len(s) - 1, "seconds": s[-1] - s[0],
                          "cpu_ms_per_step": cpu * 1e3 / len(s)}), flush=True)  # fmt: skip


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


def _together(trainers: list[Trainer], batch: int, steps: int) -> tuple[float, float]:
    """Aggregate steps/s of ``trainers`` each running one epoch at the same time, and
    their CPU ms per step (the mean over trainers)."""
    for t in trainers:
        t.send(batch, steps)
    replies = [t.read() for t in trainers]
    rate = sum(r["steps"] / r["seconds"] for r in replies)
    return rate, statistics.mean(r["cpu_ms_per_step"] for r in replies)


# -- PS training on the same host ------------------------------------------------------------
class PSCluster:
    """2 parameter servers and 2 workers on loopback, budgeted as ``psflow local`` does."""

    def __init__(self, shm: str, behind: bool, ps_threads: int, compute_threads: int) -> None:
        self.shm = shm
        self.strategy: Any = None  # the fit cases' (built on first use)
        self.fit_models: dict[tuple[int, int], Any] = {}
        self.procs = _cluster.Processes()
        self.roles: dict[str, list[int]] = {"ps": [], "worker": []}
        self.spec: dict[str, list[str]] = {"ps": [], "worker": []}
        try:
            for role, threads in (("ps", ps_threads), ("worker", compute_threads)):
                env = {"PSFLOW_BLAS_THREADS": str(threads)}
                if role == "ps":
                    spec = _cluster.psflow_cluster(self.procs, 2, 0, env, shm=shm)
                    self.spec["ps"] = spec["ps"]
                else:
                    self.spec["worker"] = self._workers(
                        {**env, "PSFLOW_PUSH_BEHIND": "on" if behind else "off"}
                    )
                self.roles[role] = [p.pid for p in self.procs.procs[-2:]]
        except BaseException:
            self.procs.close()
            raise

    def _workers(self, env: dict[str, str]) -> list[str]:
        workers = []
        for i in range(2):
            args = [
                "--port", "0", "--task", f"worker:{i}", "--ps", ",".join(self.spec["ps"]),
                "--workers", "2", "--log-level", "WARNING", "--bind", "127.0.0.1",
            ]  # fmt: skip
            workers.append(f"127.0.0.1:{self.procs.start_role('worker', args, 'worker', env).port}")
        return workers

    def cpu(self) -> dict[str, float]:
        """CPU seconds used so far per role (the chief: this process)."""
        out = {
            role: sum(_cluster.cpu_seconds(p) for p in pids) for role, pids in self.roles.items()
        }
        out["chief"] = time.process_time()
        return out

    def close(self) -> None:
        self.procs.close()


def _ps_rate(cluster: PSCluster, batch: int, mode: str, steps: int) -> tuple[float, dict]:
    """Batches/s of PS training on ``cluster`` and the CPU ms per batch of each role."""
    from pss_train import run_psflow

    used: dict[str, float] = {}

    @contextlib.contextmanager
    def timed() -> Iterator[None]:
        before = cluster.cpu()
        yield
        after = cluster.cpu()
        used.update({role: (after[role] - before[role]) * 1e3 / steps for role in after})

    rate = run_psflow(cluster.spec, batch, mode, steps, timed)
    return rate, {role: round(ms, 2) for role, ms in used.items()}


def _fit_rate(cluster: PSCluster, batch: int, spe: int, steps: int) -> tuple[float, dict]:
    """Batches/s of Keras ``fit`` (async, ``steps_per_execution=spe``) on ``cluster`` and
    the CPU ms per batch of each role, over ``steps`` batches of one epoch from a
    dataset function (each worker builds its own pipeline, as pss_train.py's loop does).

    The model is built once per (batch, spe) on the cluster's strategy, and warmed
    up.  Only the epoch's steady state is timed, from the end of its first
    ``2 * spe`` batches (at least 8) to its last: each ``fit`` call sends the
    dataset function, with the arrays it captures (12.8 MB), to every worker, a
    cost per call that a short benchmark epoch would otherwise spread over its
    few batches."""
    import numpy as np
    from pss_train import MODEL_CODE

    import psflow as pf

    key = (batch, spe)
    if key not in cluster.fit_models:
        from psflow.distribute.cluster_resolver import ClusterSpec, SimpleClusterResolver

        if cluster.strategy is None:
            resolver = SimpleClusterResolver(
                ClusterSpec({**cluster.spec, "chief": ["127.0.0.1:1"]}),
                task_type="chief",
                task_id=0,
            )
            cluster.strategy = pf.distribute.ParameterServerStrategy(resolver, mode="async")
        namespace: dict = {}
        exec(MODEL_CODE, namespace)
        x, y = namespace["make_data"](np)
        pf.random.set_seed(0)
        with cluster.strategy.scope():
            model = namespace["make_model"](pf)
            model.compile(
                optimizer=pf.keras.optimizers.SGD(0.1),
                loss=pf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                steps_per_execution=spe,
            )

        def dataset_fn(ctx: Any) -> Any:
            ds = pf.data.Dataset.from_tensor_slices((x, y)).shard(
                ctx.num_input_pipelines, ctx.input_pipeline_id
            )
            return ds.repeat().batch(batch)

        model.fit(dataset_fn, epochs=1, steps_per_epoch=10 * spe, verbose=0)  # warm-up
        cluster.fit_models[key] = (model, dataset_fn)
    model, dataset_fn = cluster.fit_models[key]
    warm = -(-max(8, 2 * spe) // spe) * spe  # whole executions
    steps = max(spe, steps // spe * spe)
    marks: list[tuple[int, float, dict[str, float]]] = []

    class Mark(pf.keras.callbacks.Callback):
        """Takes the time and each role's CPU after the warm batches and after the last."""

        def on_train_batch_end(self, index: int, logs: Any = None) -> None:
            if (not marks and index >= warm - 1) or index >= warm + steps - 1:
                marks.append((index, time.perf_counter(), cluster.cpu()))

    model.fit(dataset_fn, epochs=1, steps_per_epoch=warm + steps, verbose=0, callbacks=[Mark()])
    (first, start, before), (last, end, after) = marks[0], marks[-1]
    n = last - first
    return n / (end - start), {
        role: round((after[role] - before[role]) * 1e3 / n, 2) for role in after
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 rounds, fewer steps")
    p.add_argument("--processes", type=int, default=2, help="trainer processes per side")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds for any one answer")
    p.add_argument("--no-ps", action="store_true", help="the compute-only bound alone")
    p.add_argument("--no-fit", action="store_true", help="no Keras fit PS cases")
    p.add_argument("--steps-per-execution", type=int, default=4, metavar="N",
                   help="steps_per_execution of the fit-spe case (default 4)")  # fmt: skip
    p.add_argument("--trainer", choices=SIDES, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.steps_per_execution < 1:
        p.error(f"--steps-per-execution must be >= 1, got {args.steps_per_execution}")
    if args.trainer:
        trainer(args.trainer)
        return 0
    sys.path.insert(0, ROOT)
    from psflow.thread_budget import available_cores, share_cores

    cores = available_cores()
    _, threads = share_cores(cores, 0, args.processes)
    # what `psflow local` gives 2 parameter servers, 2 workers and the chief
    ps_threads, compute_threads = share_cores(cores, 2, 3)
    rounds = 2 if args.quick else 5
    steps = {64: 120, 256: 40} if args.quick else {64: 400, 256: 120}
    modes = [m for m in PS_MODES if not (args.no_fit and m in FIT_MODES)]
    ps_cases = [] if args.no_ps else [(m, shm) for m in modes for shm in PS_SHM]
    sides: dict[str, list[Trainer]] = {}
    clusters: dict[tuple[str, bool], PSCluster] = {}
    ps_rates: dict[tuple[str, str, int], list[float]] = {}
    ps_cpu: dict[tuple[str, str, int], list[dict]] = {}
    shares: dict[tuple[str, str, int], list[float]] = {}
    for name in THREAD_VARIABLES:  # the PS cluster and this chief take psflow's budget
        os.environ.pop(name, None)
    try:
        for side in SIDES:
            sides[side] = [
                Trainer(side, _env(side, threads), args.timeout) for _ in range(args.processes)
            ]
        counts = {s: [t.blas_threads for t in ts] for s, ts in sides.items()}
        progress(f"{cores} cores, {args.processes} trainers per side, BLAS threads {counts}")
        for mode, shm in ps_cases:
            key = (shm, mode != "async-waiting")
            if key not in clusters:
                clusters[key] = PSCluster(shm, key[1], ps_threads, compute_threads)
                from pss_train import warm_up

                warm_up(clusters[key].spec)
        if ps_cases:
            from psflow import thread_budget

            thread_budget.apply_budget(
                thread_budget.resolve_budget("chief", {"PSFLOW_BLAS_THREADS": str(compute_threads)})
            )
            progress(f"PS clusters (shm, push behind) {sorted(clusters)}: BLAS threads ps {ps_threads}, "
                     f"worker and chief {compute_threads}")  # fmt: skip
        for batch in steps:  # warm-up: build the models, fault the buffers in
            for side in SIDES:
                _together(sides[side], batch, 5)
        # an idle second: the trainers load psflow's compiled loops in a background thread
        # after their first large update (~0.4 s, much of it holding the GIL); timed, it
        # would slow the bound's first round and flatter every share measured against it
        time.sleep(1.0)
        rates: dict[tuple[str, int], list[float]] = {}
        bound_cpu: dict[tuple[str, int], list[float]] = {}
        for r in range(rounds):
            for batch, n in steps.items():
                for side in SIDES:
                    rate, cpu_ms = _together(sides[side], batch, n)
                    rates.setdefault((side, batch), []).append(rate)
                    bound_cpu.setdefault((side, batch), []).append(cpu_ms)
                    progress(f"round {r + 1}/{rounds} batch {batch} {side}: {rate:.1f} steps/s, "
                             f"CPU {cpu_ms:.2f} ms/step")  # fmt: skip
                    time.sleep(0.2)  # the other side's spinning BLAS threads go to sleep
                for mode, shm in ps_cases:
                    behind = mode != "async-waiting"
                    if mode in FIT_MODES:
                        spe = args.steps_per_execution if mode == "fit-spe" else 1
                        rate, cpu = _fit_rate(clusters[shm, behind], batch, spe, n)
                    else:
                        run_mode = "async" if mode == "async-waiting" else mode
                        rate, cpu = _ps_rate(clusters[shm, behind], batch, run_mode, n)
                    key = (mode, shm, batch)
                    ps_rates.setdefault(key, []).append(rate)
                    ps_cpu.setdefault(key, []).append(cpu)
                    share = rate / rates["budget", batch][-1]
                    shares.setdefault(key, []).append(share)
                    progress(f"round {r + 1}/{rounds} batch {batch} ps {mode} shm {shm}: "
                             f"{rate:.1f} steps/s ({share:.0%} of the bound), CPU ms/step {cpu}")  # fmt: skip
    finally:
        for trainers in sides.values():
            for t in trainers:
                t.close()
        for cluster in clusters.values():
            cluster.close()
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
                cpu_ms_per_step=round(statistics.median(bound_cpu[side, batch]), 2),
            )
        ratio = median["budget"] / median["default"]
        emit(BENCH, f"mlp/batch{batch}", "ratio", round(ratio, 3), "x",
             sides=["budget", "default"])  # fmt: skip
        rows.append([batch, median["default"], median["budget"], ratio])
    table(["batch", "default steps/s", "budget steps/s", "budget/default"], rows)
    if not ps_cases:
        return 0
    rows = []
    for mode, shm in ps_cases:
        for batch in steps:
            key = (mode, shm, batch)
            rate, share = statistics.median(ps_rates[key]), statistics.median(shares[key])
            cpu = {
                role: round(statistics.median(c[role] for c in ps_cpu[key]), 2)
                for role in ps_cpu[key][0]
            }
            # CPU per batch of the bound's trainer over that of every PS role together:
            # the share on a host with nothing else running, where all cores stay busy
            cpu_share = statistics.median(bound_cpu["budget", batch]) / sum(cpu.values())
            case = f"ps/{mode}/shm-{shm}/batch{batch}"
            emit(BENCH, case, "throughput", round(rate, 2), "steps/s", n=rounds,
                 samples=[round(v, 2) for v in ps_rates[key]], cpu_ms_per_step=cpu)  # fmt: skip
            emit(BENCH, case, "share", round(share, 3), "x", sides=["ps", "budget"],
                 samples=[round(v, 3) for v in shares[key]])  # fmt: skip
            emit(BENCH, case, "cpu_share", round(cpu_share, 3), "x", sides=["budget", "ps"])
            rows.append([f"{mode} shm {shm}", batch, rate, median_bound(rates, batch), share,
                         cpu_share, cpu["ps"], cpu["worker"], cpu["chief"]])  # fmt: skip
    table(["PS training", "batch", "steps/s", "bound steps/s", "share", "cpu share",
           "ps cpu ms/step", "worker cpu ms/step", "chief cpu ms/step"], rows)  # fmt: skip
    rows = []
    for shm in PS_SHM:  # the pushes behind the compute against waiting for them, per round
        for batch in steps:
            behind, waiting = (
                ps_rates.get(("async", shm, batch)),
                ps_rates.get(("async-waiting", shm, batch)),
            )
            if not behind or not waiting:
                continue
            per_round = [a / b for a, b in zip(behind, waiting)]
            ratio = statistics.median(per_round)
            emit(BENCH, f"ps/async/shm-{shm}/batch{batch}", "ratio", round(ratio, 3), "x",
                 sides=["async", "async-waiting"], samples=[round(v, 3) for v in per_round])  # fmt: skip
            rows.append([f"shm {shm}", batch, ratio])
    if rows:
        table(["async: pushes behind / waited for", "batch", "ratio"], rows)
    return 0


def median_bound(rates: dict[tuple[str, int], list[float]], batch: int) -> float:
    """The bound (the budget side) at ``batch``: the median over rounds."""
    return statistics.median(rates["budget", batch])


if __name__ == "__main__":
    sys.exit(main())

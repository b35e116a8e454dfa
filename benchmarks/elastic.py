"""Training pause per resize of the parameter servers, against bytes moved; real processes.

For each model size (10 MB and 100 MB with ``--quick``; also 1 GB by default),
a cluster of parameter servers and one worker on loopback, this process the
chief, trains: each step is a closure updating a small dense variable on the
worker, while ``size`` bytes of other variables (8 equal shards, like the
embedding tables of a large model) sit on the parameter servers.  Measured:

* **elastic** (psflow): ``coordinator.resize_parameter_servers`` called from
  another thread while this one keeps training (async mode: variables move in
  fenced batches, closures go on), 2 -> 3 tasks (a balanced share moves to the
  new task) and 3 -> 2 (the drained task's shards move back, then it exits);
* **reference** (no system resizes live; what DLRover or TensorFlow users do):
  stop, write a checkpoint (psflow's own: every PS writes its shard), stop the
  processes, start the new count of parameter servers and a worker, create the
  variables, restore (re-sharded for the new count), run the next step.

The pause is the longest gap between two completed steps while the resize
ran (``pause_s``; ``steps_during``: steps completed meanwhile), the elastic
report's bytes moved and longest per-batch fence come with it; the ratio
line compares the reference's pause with the elastic one measured in the
same run, cases alternating (elastic, reference) per size.  The goal: a
pause under 1 s per resize at 100 MB.

JSON lines on stdout, a table on stderr (format: shared/BENCHMARKS.md).
Loopback only; every process is killed and reaped.
"""

from __future__ import annotations

import argparse
import os
import select
import statistics
import sys
import tempfile
import threading
import time

import _cluster
import numpy as np
from _common import emit, progress, table

BENCH = "elastic"
SHARDS = 8
MB = 1e6


def _start(procs: _cluster.Processes, num_ps: int, env: dict[str, str]) -> dict:
    """Starts ``num_ps`` parameter servers and one worker at once (not one after another).

    Ports are picked first, so every process starts in parallel and the
    reference's restart costs what one process start costs, not the sum.
    """
    ports = _cluster.free_ports(num_ps + 1)
    ps = [f"127.0.0.1:{p}" for p in ports[:num_ps]]
    common = ["--bind", "127.0.0.1", "--log-level", "WARNING"]
    started = [
        procs.start([sys.executable, "-m", "ps_server", "--port", str(port), "--task", f"ps:{i}",
                     *common], None, env)[0]
        for i, port in enumerate(ports[:num_ps])
    ]  # fmt: skip
    worker = [sys.executable, "-m", "worker", "--port", str(ports[-1]), "--task", "worker:0",
              "--ps", ",".join(ps), "--workers", "1", *common]  # fmt: skip
    started.append(procs.start(worker, None, env)[0])
    deadline = time.monotonic() + 120
    waiting = {proc.stdout.fileno(): proc for proc in started}
    buffers = dict.fromkeys(waiting, b"")
    while waiting:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(waiting)} processes not ready within 120 s")
        for proc in list(waiting.values()):
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args[:4]} exited with {proc.returncode} at start")
        readable, _, _ = select.select(list(waiting), [], [], 0.2)
        for fd in readable:
            buffers[fd] += os.read(fd, 4096)
            if b"PSFLOW_READY" in buffers[fd]:
                del waiting[fd]
    return {"ps": ps, "worker": [f"127.0.0.1:{ports[-1]}"]}


def _strategy(path: str, cluster: dict, num_ps: int):
    import psflow as pf
    from psflow.distribute.cluster_resolver import ClusterFileResolver, write_cluster_file

    view = {"ps": cluster["ps"][:num_ps], "worker": cluster["worker"], "chief": ["127.0.0.1:1"]}
    write_cluster_file(path, view)
    resolver = ClusterFileResolver(path, task_type="chief", task_id=0)
    strategy = pf.distribute.ParameterServerStrategy(resolver)
    coordinator = pf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    return strategy, coordinator, resolver


def _model(strategy, size: int, init: bool):
    """The dense variable trained each step, and ``SHARDS`` big ones (random or zeros)."""
    import psflow as pf

    rng = np.random.default_rng(0)
    rows = max(1, size // SHARDS // (4 * 256))
    with strategy.scope():
        dense = pf.Variable(np.zeros((64, 64), "float32"), name="dense")
        big = [
            pf.Variable(
                rng.standard_normal((rows, 256), dtype="float32")
                if init
                else np.zeros((rows, 256), "float32"),
                name=f"table{i}",
            )
            for i in range(SHARDS)
        ]
    return dense, big


def _step_fn(dense):
    def step():
        dense.assign_add(np.full((64, 64), 0.001, "float32"))
        return 0

    return step


def _steps(coordinator, step, n: int, stamps: list[float]) -> None:
    for _ in range(n):
        coordinator.schedule(step).fetch()
        stamps.append(time.perf_counter())


def _elastic(size: int, tmp: str, env: dict[str, str]) -> list[dict]:
    """Resizes 2 -> 3 -> 2 from another thread while this one trains; one result per resize.

    The training loop never stops on purpose: in async mode the coordinator
    moves variables in fenced batches while closures run, so the pause is the
    longest gap between two completed steps while the resize ran.
    """
    from psflow.distribute.cluster_resolver import write_cluster_file
    from psflow.distribute.coordinator import cluster_coordinator
    from psflow.errors import OpError

    out = []
    with _cluster.Processes() as procs:
        cluster = _start(procs, 3, env)
        path = os.path.join(tmp, "cluster.json")
        strategy, coordinator, resolver = _strategy(path, cluster, 2)
        try:
            dense, _ = _model(strategy, size, init=True)
            step = _step_fn(dense)
            stamps: list[float] = []
            _steps(coordinator, step, 20, stamps)
            for new in (3, 2):  # what psflow local does: publish the view, the chief follows
                view = {"ps": cluster["ps"][:new], "worker": cluster["worker"]}
                write_cluster_file(path, {**view, "chief": ["127.0.0.1:1"]})
                resolver.refresh()
                result: dict = {}

                def resize(new=new, result=result) -> None:
                    result["start"] = time.perf_counter()
                    try:
                        result["report"] = coordinator.resize_parameter_servers(new, timeout=600)
                    except OpError as e:  # reported, not fatal: the other cases still run
                        result["error"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
                    result["end"] = time.perf_counter()

                resizer = threading.Thread(target=resize, name="bench-resize")
                resizer.start()
                try:
                    while resizer.is_alive():
                        _steps(coordinator, step, 1, stamps)
                    _steps(coordinator, step, 5, stamps)
                except OpError as e:
                    result.setdefault("error", f"{type(e).__name__}: {str(e).splitlines()[0]}")
                resizer.join(600)
                if "error" in result:
                    out.append({"case": f"{5 - new}->{new}", "error": result["error"]})
                    break
                report = result["report"]
                # every gap that overlaps the resize, the one spanning its end included
                during = [
                    b - a
                    for a, b in zip(stamps, stamps[1:])
                    if b >= result["start"] and a <= result["end"]
                ]
                out.append(
                    {
                        "case": f"{report.old_num_ps}->{report.new_num_ps}",
                        "pause_s": max(during),
                        "steps_during": len(during) - 1,
                        "bytes_moved": report.bytes_moved,
                        "shards_moved": report.shards_moved,
                        "fence_s": report.longest_fence_seconds,
                        "resize_s": report.seconds,
                        "step_s": float(np.median(np.diff(stamps[:20]))),
                    }
                )
        finally:
            cluster_coordinator.shutdown_all()
    return out


def _reference(size: int, tmp: str, env: dict[str, str]) -> dict:
    """Stop, checkpoint, restart on 3 PS, restore, next step; returns the pause."""
    import psflow as pf
    from psflow.distribute.coordinator import cluster_coordinator

    ckpt = os.path.join(tmp, f"ckpt-{time.monotonic_ns()}")
    with _cluster.Processes() as procs:
        cluster = _start(procs, 2, env)
        strategy, coordinator, _ = _strategy(os.path.join(tmp, "ref.json"), cluster, 2)
        dense, big = _model(strategy, size, init=True)
        step = _step_fn(dense)
        stamps: list[float] = []
        _steps(coordinator, step, 20, stamps)
        pf.train.Checkpoint(dense=dense, **{f"t{i}": v for i, v in enumerate(big)}).write(ckpt)
        saved = time.perf_counter()
        cluster_coordinator.shutdown_all()
    with _cluster.Processes() as procs:
        cluster = _start(procs, 3, env)
        started = time.perf_counter()
        strategy, coordinator, _ = _strategy(os.path.join(tmp, "ref3.json"), cluster, 3)
        try:
            dense, big = _model(strategy, size, init=False)
            objects = {"dense": dense, **{f"t{i}": v for i, v in enumerate(big)}}
            pf.train.Checkpoint(**objects).restore(ckpt)
            restored = time.perf_counter()
            _steps(coordinator, _step_fn(dense), 1, stamps)
        finally:
            cluster_coordinator.shutdown_all()
    return {
        "case": "2->3",
        "pause_s": stamps[-1] - stamps[-2],
        "save_s": saved - stamps[-2],
        "restart_s": started - saved,
        "restore_s": restored - started,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="10 MB and 100 MB, once each")
    args = p.parse_args()
    sizes = [10_000_000, 100_000_000] + ([] if args.quick else [1_000_000_000])
    repeats = 1 if args.quick else 2
    env = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    rows = []
    with tempfile.TemporaryDirectory(prefix="psflow-bench-elastic-") as tmp:
        for size in sizes:
            elastic: list[list[dict]] = []
            reference: list[dict] = []
            for r in range(repeats):  # alternate: elastic, reference, elastic, reference
                progress(f"{size / MB:g} MB: elastic resize 2->3->2, run {r + 1}/{repeats}")
                elastic.append(_elastic(size, tmp, env))
                progress(f"{size / MB:g} MB: checkpoint-restart 2->3, run {r + 1}/{repeats}")
                reference.append(_reference(size, tmp, env))
            label = f"{size / MB:g}MB"
            for i, case in enumerate(("2->3", "3->2")):
                runs = [e[i] for e in elastic if i < len(e)]
                failed = [r["error"] for r in runs if "error" in r]
                if failed or not runs:
                    emit(BENCH, f"{label}/elastic/{case}", "skipped", 0, "",
                         reason=failed[0] if failed else "not reached")  # fmt: skip
                    rows.append([label, f"elastic {case}", "failed", "-", "-", "-"])
                    continue
                pause = statistics.median(r["pause_s"] for r in runs)
                moved = statistics.median(r["bytes_moved"] for r in runs)
                fence = statistics.median(r["fence_s"] for r in runs)
                emit(
                    BENCH, f"{label}/elastic/{case}", "pause", pause, "s", n=len(runs),
                    steps_during=statistics.median(r["steps_during"] for r in runs),
                    bytes_moved=moved, shards_moved=runs[0]["shards_moved"],
                    longest_fence_s=fence, resize_s=statistics.median(r["resize_s"] for r in runs),
                    step_s=statistics.median(r["step_s"] for r in runs), model_bytes=size,
                )  # fmt: skip
                rows.append([label, f"elastic {case}", round(pause, 3), f"{moved / MB:.1f}",
                             round(fence, 3), "-"])  # fmt: skip
            ref_pause = statistics.median(r["pause_s"] for r in reference)
            emit(
                BENCH, f"{label}/checkpoint-restart/2->3", "pause", ref_pause, "s",
                n=len(reference), model_bytes=size,
                save_s=statistics.median(r["save_s"] for r in reference),
                restart_s=statistics.median(r["restart_s"] for r in reference),
                restore_s=statistics.median(r["restore_s"] for r in reference),
                baseline="stop, checkpoint, restart on 3 PS, restore (psflow checkpoints)",
            )  # fmt: skip
            ups = [e[0]["pause_s"] for e in elastic if e and "pause_s" in e[0]]
            if ups:
                up = statistics.median(ups)
                emit(
                    BENCH, f"{label}/2->3", "ratio", ref_pause / up, "",
                    compares="checkpoint-restart pause / elastic resize pause",
                )  # fmt: skip
            rows.append([label, "checkpoint-restart 2->3", round(ref_pause, 3), f"{size / MB:g}",
                         "-", f"x{ref_pause / up:.1f}" if ups else "-"])  # fmt: skip
    table(["model", "how", "pause (s)", "MB moved", "longest fence (s)", "ref/elastic"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

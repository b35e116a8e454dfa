"""What one closure costs the chief and the worker: gRPC's ``RunClosure`` against the
worker's data plane, alternated in one run.

A parameter server and a worker run as processes on loopback (the worker serving
its data plane for closures, as by default); this process is the chief.  Each
round runs, per transport, ``--closures`` closures that do nothing:

* ``direct``: one after another through ``GrpcWorker.run`` (one in flight);
* ``coordinator``: scheduled on a ``ClusterCoordinator`` in async mode (two in
  flight per worker, as training runs them), then joined.

The transports alternate (A B, then B A) so drift hits both.  Per closure:
the chief's CPU (this process's ``process_time``: its dispatch threads and
gRPC's), the worker's (user + system from /proc, at the clock tick's
resolution: hence many closures per sample) and the wall time; medians over
the rounds.  stdout: JSON lines (BENCHMARKS.md); stderr: a table.

    python benchmarks/closure_cost.py            # 6 rounds of 400 closures
    python benchmarks/closure_cost.py --quick    # 2 rounds of 200 (under a minute)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator

import _cluster
from _common import emit, progress, table

BENCH = "closure_cost"
TRANSPORTS = ("plane", "grpc")


def _noop() -> None:
    return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 rounds of 200 closures")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--closures", type=int, default=400, help="closures per sample")
    args = p.parse_args()
    rounds, n = (2, 200) if args.quick else (args.rounds, args.closures)
    sys.path.insert(0, str(_cluster.ROOT))
    import psflow as pf
    from psflow.distribute.cluster_resolver import ClusterSpec, SimpleClusterResolver
    from psflow.distribute.coordinator import closure as closure_lib
    from psflow.distribute.coordinator.remote_value import RemoteValue
    from psflow.distribute.coordinator.workers import Closure, GrpcWorker

    samples: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    with _cluster.Processes() as procs:
        cluster = _cluster.psflow_cluster(procs, 1, 1)
        worker_pid = procs.procs[-1].pid
        spec = ClusterSpec({**cluster, "chief": ["127.0.0.1:1"]})
        resolver = SimpleClusterResolver(spec, task_type="chief", task_id=0)
        functions = closure_lib.FunctionCache()
        ids = iter(range(1, 1 << 62))
        clients = {
            t: GrpcWorker(0, cluster["worker"][0], data_plane=t == "plane") for t in TRANSPORTS
        }

        def direct(transport: str) -> None:
            for _ in range(n):
                i = next(ids)
                closure = Closure(i, _noop, (), {}, RemoteValue(i))
                clients[transport].run("closure-cost", closure, functions)

        @contextlib.contextmanager
        def coordinator(transport: str) -> Iterator[Callable[[], None]]:
            os.environ["PSFLOW_CLOSURE_PLANE"] = "on" if transport == "plane" else "off"
            strategy = pf.distribute.ParameterServerStrategy(resolver)
            c = pf.distribute.coordinator.ClusterCoordinator(strategy)
            for _ in range(20):  # warm: the function sent, the plane asked for
                c.schedule(_noop)
            c.join()

            def run() -> None:
                for _ in range(n):
                    c.schedule(_noop)
                c.join()

            try:
                yield run
            finally:
                c.shutdown()

        def measure(case: str, transport: str, run: Callable[[], None]) -> None:
            chief, worker = time.process_time(), _cluster.cpu_seconds(worker_pid)
            wall = time.perf_counter()
            run()
            sample = (
                (time.process_time() - chief) * 1e3 / n,
                (_cluster.cpu_seconds(worker_pid) - worker) * 1e3 / n,
                (time.perf_counter() - wall) * 1e3 / n,
            )
            samples.setdefault((case, transport), []).append(sample)

        try:
            for transport in TRANSPORTS:  # warm-up
                direct(transport)
            for r in range(rounds):
                for transport in TRANSPORTS if r % 2 == 0 else TRANSPORTS[::-1]:
                    measure("direct", transport, lambda t=transport: direct(t))
                    with coordinator(transport) as run:
                        measure("coordinator", transport, run)
                progress(f"round {r + 1}/{rounds}")
        finally:
            for client in clients.values():
                client.close()
    load = os.getloadavg()
    rows = []
    for (case, transport), got in sorted(samples.items()):
        medians = []
        for i, metric in enumerate(("chief_cpu", "worker_cpu", "wall")):
            values = [s[i] for s in got]
            medians.append(statistics.median(values))
            emit(BENCH, f"{case}/{transport}", metric, round(medians[-1], 4), "ms/closure",
                 n=n, rounds=rounds, samples=[round(v, 4) for v in values],
                 loadavg=[round(x, 2) for x in load])  # fmt: skip
        rows.append([case, transport, *medians])
    table(["case", "transport", "chief cpu ms", "worker cpu ms", "wall ms"], rows)
    progress(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What a PS's shared-memory mirrors cost per push: lazy mirrors against none and eager ones.

PS processes on 127.0.0.1, side by side, each pushed the same float32
gradients (SGD applied on the PS) by a client in this process through a
``GrpcPSConnection``, as a worker on the PS's host pushes (the bytes in a
shared-memory segment, the RPC naming it), so the PS's own work per push is
small and what a mirror adds shows:

* ``off``: ``--shm off``: no mirror at all (the reference);
* ``lazy``: ``--shm auto`` (mirrors as shipped: lazy); no client on this host
  reads them, so no push should pay a copy into shared memory;
* ``eager``: ``--shm auto --shm-idle 1e9`` and one read through a
  ``GrpcPSConnection`` at the start: the mirror follows every push from then
  on, as every mirror did before they were lazy (a copy per push);
* ``lazy+reader``: a fourth PS as ``lazy``, while a client on this host pulls
  through its mirror after each push (the copy it needs; the reader's own CPU
  is not counted, only the PS's).

Metric: the PS process's CPU time (user + system, from /proc/<pid>/stat) per
push, over a batch of pushes; batches alternate between the sides (A B C A B
C...) so drift hits all of them; median of the batches.  Ratios are against
``off``.  stdout: JSON lines (BENCHMARKS.md); stderr: a table.  ``--quick``
finishes in under a minute.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import statistics
import sys

import _cluster
import _common
import numpy as np

BENCH = "shm_mirror"
MB = 1 << 20
_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime (fields 14, 15)


def _batch(server: tuple, name: str, grad: np.ndarray, count: int, read: bool = False) -> float:
    """PS CPU seconds per push over ``count`` pushes (each pulled back, with ``read``)."""
    from psflow.distribute.ps.connection import Grad
    from psflow.ps.push_types import PushContext

    pid, conn, ids = server
    before = _cpu_seconds(pid)
    for _ in range(count):
        conn.push([Grad(name, grad)], PushContext(("bench", next(ids))))
        if read:
            conn.pull([name])
    return (_cpu_seconds(pid) - before) / count


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; returns 0 when it ran (2 when it could not)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer sizes and batches (< 60 s)")
    p.add_argument("--sizes", default="", help="MB per gradient, comma-separated")
    p.add_argument("--batches", type=int, default=0, help="batches of pushes per side")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s] or ([4, 64] if args.quick else [1, 16, 64])
    batches = args.batches or (3 if args.quick else 7)

    from psflow.distribute.ps.connection import VarSpec
    from psflow.distribute.ps.grpc_connection import GrpcPSConnection
    from psflow.transport import shm

    if not shm.enabled():
        _common.emit(BENCH, "all", "skipped", 0, "", reason="no usable /dev/shm here")
        return 0
    sides = {
        "off": ["--shm", "off"],
        "lazy": ["--shm", "auto"],
        "eager": ["--shm", "auto", "--shm-idle", "1e9"],
        "lazy+reader": ["--shm", "auto"],
    }
    rng = np.random.default_rng(0)
    rows, results = [], {}
    with _cluster.Processes() as procs:
        servers = {}
        for side, extra in sides.items():
            ready = procs.start_role(
                "ps_server", ["--port", "0", "--log-level", "WARNING", *extra], "ps"
            )
            address = f"127.0.0.1:{ready.port}"
            conn = GrpcPSConnection(address, timeout=120)
            servers[side] = (procs.procs[-1].pid, conn, itertools.count(1))
        try:
            for size in sizes:
                n = size * MB // 4
                name = f"g{size}MB"
                value = rng.standard_normal(n).astype(np.float32)
                grad = (rng.standard_normal(n) * 1e-3).astype(np.float32)
                # ~1 GB pushed per batch: far above the CPU clock's tick (10 ms)
                per_batch = max(4, (256 if args.quick else 1024) // size)
                for _, conn, _ in servers.values():
                    spec = VarSpec(name, value.dtype, value.shape, True)
                    conn.create([spec], [value])
                    conn.configure_optimizer([name], {"name": "sgd", "learning_rate": 0.01})
                servers["eager"][1].pull([name])  # wakes it; --shm-idle 1e9 keeps it copying

                run = functools.partial(_batch, name=name, grad=grad, count=per_batch)
                cases = {side: functools.partial(run, server) for side, server in servers.items()}
                cases["lazy+reader"] = functools.partial(run, servers["lazy+reader"], read=True)
                for fn in cases.values():  # warm up
                    fn()
                samples: dict[str, list[float]] = {c: [] for c in cases}
                for _ in range(batches):
                    for case, fn in cases.items():
                        samples[case].append(fn())
                _common.progress(f"{size} MB: done")
                base = statistics.median(samples["off"])
                for case, vals in samples.items():
                    ms = statistics.median(vals) * 1000
                    results[(case, size)] = ms
                    _common.emit(
                        BENCH,
                        f"{case}/{size}MB",
                        "ps_cpu_per_push",
                        round(ms, 3),
                        "ms",
                        n=batches,
                        pushes_per_batch=per_batch,
                        min=round(min(vals) * 1000, 3),
                        max=round(max(vals) * 1000, 3),
                    )
                    if case != "off":
                        ratio = ms / (base * 1000) if base > 0 else float("nan")
                        _common.emit(
                            BENCH,
                            f"{case}/{size}MB",
                            "ratio",
                            round(ratio, 3),
                            "x",
                            baseline="off",
                            metric_of="ps_cpu_per_push",
                        )
                    rows.append(
                        (
                            f"{case}/{size}MB",
                            ms,
                            ms / (base * 1000) if base > 0 else float("nan"),
                        )
                    )
        finally:
            for _, conn, _ in servers.values():
                conn.close()
    _common.table(["case", "PS CPU ms/push", "vs off"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

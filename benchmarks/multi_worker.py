"""Cross-process all-reduce of MultiWorkerMirroredStrategy's ring, next to a bare TCP stream.

Each case starts N worker processes on 127.0.0.1 (``TF_CONFIG`` as
``psflow local --mode multi-worker`` sets it); each builds a
``MultiWorkerMirroredStrategy`` and times ``CrossHostRing.all_reduce`` of one
float32 array of S bytes (after warm-up calls).  In the same run a bare
stream is measured: one process ``sendall``s S bytes to another over
loopback, which ``recv_into``s them into a preallocated buffer.

Formulas (NCCL's): algorithm bandwidth = S / seconds per all-reduce; bus
bandwidth = algbw * 2(N-1)/N (the bytes each worker moves); the stream's
bandwidth = S / seconds.  The issue's goal: bus bandwidth >= 0.8x the stream.
TensorFlow's ``MultiWorkerMirroredStrategy`` (RING) runs only where
TensorFlow is installed; it is not a psflow dependency, so without it the
rows say so.

Usage::

    python benchmarks/multi_worker.py            # 1-64 MB, 2 and 4 workers
    python benchmarks/multi_worker.py --quick    # 1 and 16 MB, 2 workers, < 60 s

stdout: one JSON object per measurement; stderr: a table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import threading
import time

BENCH = "multi_worker"
ROOT = pathlib.Path(__file__).resolve().parent.parent
CHILD_TIMEOUT_S = 300.0


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _worker(sizes: list[int], repeats: int) -> None:
    """One worker: times the ring's all-reduce for each size; rank 0 prints the medians."""
    import numpy as np

    import psflow as pf

    strategy = pf.distribute.MultiWorkerMirroredStrategy()
    ring = strategy._ring  # the cross-process collective itself, without the step around it
    out = {}
    for size in sizes:
        x = np.ones(size // 4, np.float32)
        for _ in range(2):
            ring.all_reduce([x])
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            ring.all_reduce([x])
            times.append(time.perf_counter() - start)
        out[size] = statistics.median(times)
    if ring.rank == 0:
        print(json.dumps(out), flush=True)


def ring_case(workers: int, sizes: list[int], repeats: int) -> dict[int, float]:
    """Seconds per all-reduce for each size, median over ``repeats``, with ``workers`` processes."""
    ports = _free_ports(workers)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    procs = []
    for i in range(workers):
        env = {
            **os.environ,
            "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}}),
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
        }
        code = (
            f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
            f"from benchmarks.multi_worker import _worker\n_worker({sizes!r}, {repeats})\n"
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True
            )
        )
    try:
        first, _ = procs[0].communicate(timeout=CHILD_TIMEOUT_S)
        for p in procs[1:]:
            p.wait(CHILD_TIMEOUT_S)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    return {int(k): v for k, v in json.loads(first.strip().splitlines()[-1]).items()}


def stream_case(size: int, repeats: int) -> float:
    """Seconds to stream ``size`` bytes over loopback, one socket, median over ``repeats``."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    code = (
        "import socket, sys\n"
        f"s = socket.create_connection(('127.0.0.1', {server.getsockname()[1]}))\n"
        f"data = bytes({size})\n"
        f"for _ in range({repeats + 1}):\n"
        "    s.sendall(data)\n"
        "    s.recv(1)\n"
    )
    sender = subprocess.Popen([sys.executable, "-c", code])
    try:
        conn, _ = server.accept()
        buf = memoryview(bytearray(size))
        times = []
        for i in range(repeats + 1):
            start = time.perf_counter()
            got = 0
            while got < size:
                got += conn.recv_into(buf[got:])
            if i:  # the first transfer warms the connection up
                times.append(time.perf_counter() - start)
            conn.sendall(b"k")
        conn.close()
    finally:
        sender.wait(60)
        server.close()
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    mb = 1 << 20
    sizes = [1 * mb, 16 * mb] if args.quick else [1 * mb, 4 * mb, 16 * mb, 64 * mb]
    counts = [2] if args.quick else [2, 4]
    repeats = 3 if args.quick else 5
    has_tf = importlib.util.find_spec("tensorflow") is not None
    rows = []
    streams = {s: stream_case(s, repeats) for s in sizes}
    for n in counts:
        seconds = ring_case(n, sizes, repeats)
        for s in sizes:
            algbw = s / seconds[s] / 1e9
            row = {
                "bench": BENCH,
                "side": "psflow",
                "workers": n,
                "bytes": s,
                "seconds": seconds[s],
                "algbw_GBps": algbw,
                "busbw_GBps": algbw * 2 * (n - 1) / n,
                "stream_GBps": s / streams[s] / 1e9,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
        print(
            json.dumps(
                {
                    "bench": BENCH,
                    "side": "tensorflow",
                    "workers": n,
                    "skipped": "TensorFlow runs in its own benchmark run"
                    if has_tf
                    else "TensorFlow is not installed",
                }
            ),
            flush=True,
        )
    sys.stderr.write(
        f"{'workers':>7} {'MB':>5} {'algbw':>8} {'busbw':>8} {'stream':>8} {'bus/stream':>10}\n"
    )
    for r in rows:
        sys.stderr.write(
            f"{r['workers']:>7} {r['bytes'] // mb:>5} {r['algbw_GBps']:>7.2f}G {r['busbw_GBps']:>7.2f}G "
            f"{r['stream_GBps']:>7.2f}G {r['busbw_GBps'] / r['stream_GBps']:>10.2f}\n"
        )
    return 0


if __name__ == "__main__":
    threading.current_thread().name = BENCH
    sys.exit(main())

"""MultiWorkerMirroredStrategy across processes: psflow vs TensorFlow vs a bare TCP stream.

Three measurements, each side by side in one run:

* **all-reduce**: N worker processes (``TF_CONFIG`` as ``psflow local --mode
  multi-worker`` sets it) each all-reduce one seeded float32 array of S bytes,
  timed after warm-up calls.  psflow times ``CrossHostRing.all_reduce`` (the
  strategy's cross-process collective: on loopback its default, the same-host
  path through shared memory, and ``psflow-tcp``, the TCP ring with
  ``PSFLOW_SHM=0``, in the same run; across the veth link with 2 workers, the
  TCP ring; with 4, two in each namespace, the hierarchy of
  :mod:`psflow.collective.shm_hier` (shared memory inside each namespace, TCP
  rings across the veth), beside ``psflow-tcp``, the flat TCP ring);
  TensorFlow 2.21's
  ``MultiWorkerMirroredStrategy`` (``CommunicationOptions(implementation=RING)``)
  times a ``tf.function`` running ``ReplicaContext.all_reduce("SUM", x)``.
* **bare stream**: one process ``sendall``s S bytes to another, which
  ``recv_into``s them into a preallocated buffer, between the same endpoints.
* **bare ring stream**: the all-reduce's own traffic with nothing else: the
  same N processes on the same endpoints, each ``sendall``ing ``2(N-1)/N * S``
  bytes to its right neighbour while it ``recv_into``s as many from its left
  one (plain sockets, no framing, no reduction), once with the kernel's default
  socket options and once with psflow's (no Nagle delay, large buffers); each
  size's bound is the better of the two (the shorter median, the lower CPU).
* **training**: 2 workers train the 784-512-512-10 MLP (the custom loop of
  ``benchmarks/mirrored_train.py``) at global batch 64 and 256.

Each runs on loopback and (all-reduce and stream, as root) across a veth link
between two network namespaces made for the run and removed after it
(:mod:`benchmarks._netns`): even ranks in one namespace, odd in the other, so
every ring link crosses the veth.

Every group times 9 calls (transfers) per size after its warm-up and reports
their median (and its mean CPU per call); the ring streams and psflow's groups
run in alternating order round by round.

Formulas (NCCL's): algorithm bandwidth = S / seconds per all-reduce; bus
bandwidth = algbw * 2(N-1)/N (the bytes each worker sends); the stream's
bandwidth = S / seconds; steps/s = timed steps / their wall seconds; CPU
ms/step = a worker's process CPU time (all threads) / timed steps, which a
host loaded by other work inflates far less than wall time.  All N
workers share this one host's cores, which a bare stream has to itself, so
bus bandwidth cannot pass stream / N here (N workers each send and receive
2(N-1)/N of S, the stream sends S once): N * busbw / stream is reported too,
1.0 meaning the ring moves bytes as fast as the bare stream does.  The bare
ring stream's bus bandwidth (2(N-1)/N * S / seconds) is the like-for-like
bound on one host: same processes, directions and bytes, so psflow / ring
stream is the share of the pattern's bare speed the all-reduce keeps.  CPU
ms/call (rank 0's process CPU, all threads, over the timed all-reduces or
ring-stream transfers only) says what each costs: where psflow's is about the
ring stream's but its wall time is longer, the gap is the ring's 2(N-1)
dependent steps waiting on each other's processes, which N workers sharing 2
cores with other work wait for; the bare ring stream has no such chain.  The
issue's goals: bus bandwidth >= 0.8x the stream and >= 3x TensorFlow's; MLP
steps/s >= 1.5x TensorFlow's.  psflow's workers get the BLAS threads ``psflow
local`` gives them; TensorFlow runs with its defaults.  TensorFlow is not a
psflow dependency: without it one ``skipped`` line says so.

Usage::

    python benchmarks/multi_worker.py            # 1-64 MB, 2 and 4 workers, batches 64/256
    python benchmarks/multi_worker.py --quick    # 1 and 16 MB, 2 workers, fewer steps
    # (--quick: one round per case, and the loopback all-reduce group trains the MLP too,
    # so each side's processes start once for both; ~40 s with TensorFlow on 2 cores)
    python benchmarks/multi_worker.py --no-tf --no-veth
    # the 4-worker veth all-reduce only, at 1-64 MB (as root)
    python benchmarks/multi_worker.py --no-tf --no-train --no-loopback --workers 4

stdout: one JSON object per measurement; stderr: progress and a table.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

BENCH = "multi_worker"
ROOT = pathlib.Path(__file__).resolve().parent.parent
GROUP_TIMEOUT_S = 240.0
SIDES = ("psflow", "tensorflow")
# psflow with its shared-memory all-reduces off: the flat TCP ring, measured beside the
# default on loopback (shared memory when every worker is on this host) and on veth from 4
# workers (the hierarchy: two namespaces of 2 or more workers each; 2 workers are TCP)
TCP_SIDE = "psflow-tcp"
MB = 1 << 20
VETH_PORT = 23411  # a fresh namespace has no other listeners


def _emit(record: dict[str, Any]) -> None:
    print(json.dumps({"bench": BENCH, **record}), flush=True)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- children ----------------------------------------------------------------------------------
def _import(framework: str) -> Any:
    if framework == "tensorflow":
        import tensorflow as tf

        return tf
    import psflow as tf  # psflow and TCP_SIDE (PSFLOW_SHM=0 in its environment)

    return tf


def _strategy(tf: Any) -> Any:
    opts = tf.distribute.experimental.CommunicationOptions(implementation="RING")
    if tf.__name__ == "tensorflow":
        opts = tf.distribute.experimental.CommunicationOptions(
            implementation=tf.distribute.experimental.CommunicationImplementation.RING
        )
    return tf.distribute.MultiWorkerMirroredStrategy(communication_options=opts)


def _time(fn: Callable[[], Any], warmup: int, repeats: int) -> tuple[float, float]:
    """The median wall seconds of ``repeats`` calls, and this process's CPU seconds per call."""
    for _ in range(warmup):
        fn()
    times = []
    cpu = time.process_time()
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), (time.process_time() - cpu) / repeats


def _tf_all_reduce(tf: Any, strategy: Any, tx: Any) -> Any:
    """TensorFlow's all-reduce of the captured tensor ``tx`` as one ``tf.function``."""

    @tf.function
    def reduce_once() -> Any:
        return strategy.run(lambda: tf.distribute.get_replica_context().all_reduce("SUM", tx))

    return reduce_once


def _child_allreduce(
    framework: str, sizes: list[int], repeats: int, strategy: Any = None
) -> dict[str, Any]:
    """Seconds per all-reduce of each size (the median over ``repeats``)."""
    import numpy as np

    tf = _import(framework)
    strategy = strategy or _strategy(tf)
    rng = np.random.default_rng(1234)
    out: dict[str, Any] = {"rank": None, "seconds": {}, "cpu_s": {}, "version": tf.__version__}
    for size in sizes:
        x = rng.standard_normal(size // 4, dtype=np.float32)
        if framework == "tensorflow":
            reduce_once = _tf_all_reduce(tf, strategy, tf.constant(x))

            def call(reduce_once: Any = reduce_once) -> Any:
                return reduce_once().numpy()

            out["rank"] = strategy.cluster_resolver.task_id
        else:
            ring = strategy._ring  # the cross-process collective, without a step around it

            def call(ring: Any = ring, x: Any = x) -> Any:
                return ring.all_reduce([x])

            out["rank"] = ring.rank
        out["seconds"][str(size)], out["cpu_s"][str(size)] = _time(call, 2, repeats)
        if framework != "tensorflow":  # which path the agreement took (known after a call)
            hier = getattr(ring, "hier", None)
            out["path"] = (
                "hierarchy"
                if hier is not None and hier.active
                else "shared memory"
                if ring.shm.active
                else "tcp ring"
            )
    return out


def _child_train(
    framework: str, batches: list[int], steps: int, warmup: int, strategy: Any = None
) -> dict[str, Any]:
    """Steps/s of the MLP's custom loop at each global batch."""
    import numpy as np

    sys.path.insert(0, str(ROOT))
    from benchmarks.mirrored_train import LAYERS, _make_step

    tf = _import(framework)
    strategy = strategy or _strategy(tf)
    out: dict[str, Any] = {
        "rank": strategy.cluster_resolver.task_id,
        "steps_per_s": {},
        "cpu_ms_per_step": {},
    }
    for batch in batches:
        rng = np.random.default_rng(1234)
        x = rng.standard_normal((8 * batch, LAYERS[0]), dtype=np.float32)
        y = rng.integers(0, LAYERS[-1], size=(8 * batch,)).astype(np.int64)
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.DATA
        )
        dist = iter(
            strategy.experimental_distribute_dataset(dataset.repeat().with_options(options))
        )
        step = _make_step(tf, strategy, batch)
        for _ in range(warmup):
            step(next(dist))
        # an idle second (every worker, so the steps stay in lockstep): psflow loads its
        # compiled loops in a background thread after the first large arrays, ~0.4 s
        # that would otherwise land in the timed steps
        time.sleep(1.0)
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            loss = step(next(dist))
        float(loss)  # waits for the last step
        out["steps_per_s"][str(batch)] = steps / (time.perf_counter() - start)
        # this worker's CPU (all its threads) per step: what a loaded host cannot inflate
        out["cpu_ms_per_step"][str(batch)] = (time.process_time() - cpu) / steps * 1e3
    return out


def _child_stream_recv(host: str, port: int, sizes: list[int], repeats: int) -> dict[str, Any]:
    server = socket.create_server((host, port))
    server.settimeout(60)
    conn, _ = server.accept()
    conn.settimeout(60)
    out = {}
    for size in sizes:
        buf = memoryview(bytearray(size))
        times = []
        for i in range(repeats + 1):
            start = time.perf_counter()
            got = 0
            while got < size:
                n = conn.recv_into(buf[got:])
                if not n:
                    raise ConnectionError("the sender closed early")
                got += n
            if i:  # the first transfer of each size warms the connection up
                times.append(time.perf_counter() - start)
            conn.sendall(b"k")
        out[str(size)] = statistics.median(times)
    conn.close()
    server.close()
    return {"rank": 0, "seconds": out}


def _child_stream_send(host: str, port: int, sizes: list[int], repeats: int) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=60)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    for size in sizes:
        data = os.urandom(size)
        for _ in range(repeats + 1):
            sock.sendall(data)
            if sock.recv(1) != b"k":
                raise ConnectionError("the receiver closed early")
    sock.close()
    return {"rank": 1}


def _child_ring_stream(sizes: list[int], repeats: int, tuned: bool = False) -> dict[str, Any]:
    """Seconds per bare ring transfer: each of the N workers ``sendall``s ``2(N-1)/N * S``
    bytes to its right neighbour while it ``recv_into``s as many from its left one.

    The all-reduce's traffic pattern (same processes, same links, same directions, same
    bytes per worker) with nothing else: no framing, no reduction, no Python per piece.
    ``tuned``: with the socket options psflow's links run with (no Nagle delay, the
    data plane's large kernel buffers) instead of the kernel's defaults and autotuning.
    """
    import threading

    config = json.loads(os.environ["TF_CONFIG"])
    addresses, rank = config["cluster"]["worker"], config["task"]["index"]
    n = len(addresses)
    host, port = addresses[rank].rsplit(":", 1)
    server = socket.create_server((host, int(port)))
    server.settimeout(60)
    accepted: list[socket.socket] = []
    acceptor = threading.Thread(target=lambda: accepted.append(server.accept()[0]), daemon=True)
    acceptor.start()
    right_host, right_port = addresses[(rank + 1) % n].rsplit(":", 1)
    deadline = time.monotonic() + 30
    while True:
        try:
            right = socket.create_connection((right_host, int(right_port)), timeout=60)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    acceptor.join(60)
    if not accepted:
        raise ConnectionError("the left neighbour did not connect")
    left = accepted[0]
    if tuned:
        from psflow.transport.dataplane.stream import tune

        tune(left)
        tune(right)
    left.settimeout(60)
    out, cpu_out = {}, {}
    for size in sizes:
        nbytes = size * 2 * (n - 1) // n
        data = memoryview(os.urandom(nbytes))
        buf = memoryview(bytearray(nbytes))
        times = []
        # one sender thread per size, woken for each transfer (as a ring's sender thread is)
        go, sent = threading.Semaphore(0), threading.Semaphore(0)

        def send_all(data: memoryview = data, go: Any = go, sent: Any = sent) -> None:
            for _ in range(repeats + 1):
                go.acquire()
                right.sendall(data)
                sent.release()

        sender = threading.Thread(target=send_all, daemon=True)
        sender.start()
        cpu = 0.0
        for i in range(repeats + 1):
            cpu_start = time.process_time()  # both threads; the sender's sends start below
            start = time.perf_counter()
            go.release()
            got = 0
            while got < nbytes:
                k = left.recv_into(buf[got:])
                if not k:
                    raise ConnectionError("the left neighbour closed early")
                got += k
            if not sent.acquire(timeout=60):
                raise TimeoutError("the right neighbour did not take the data")
            if i:  # the first transfer of each size warms the connections up
                times.append(time.perf_counter() - start)
                cpu += time.process_time() - cpu_start
            right.sendall(b"k")  # the next round starts once the left neighbour is done too
            if left.recv(1) != b"k":
                raise ConnectionError("the left neighbour closed early")
        sender.join(60)
        out[str(size)] = statistics.median(times)
        cpu_out[str(size)] = cpu / repeats
    for sock in (left, right, server):
        sock.close()
    return {"rank": rank, "seconds": out, "cpu_s": cpu_out}


# -- the parent: process groups, bounded, every child reaped ------------------------------------
def _group(
    net: Any, count: int, args: list[str], env_of: Callable[[int], dict]
) -> dict[str, Any] | None:
    """Runs ``count`` children (rank order); returns rank 0's result, or None when one failed."""
    procs = []
    for rank in range(count):
        argv = [sys.executable, str(pathlib.Path(__file__).resolve()), *args]
        if net is not None:
            argv = net.exec_in("a" if rank % 2 == 0 else "b", argv)
        procs.append(
            subprocess.Popen(
                argv,
                env=env_of(rank),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results, failed = [], []
    deadline = time.monotonic() + GROUP_TIMEOUT_S
    try:
        for rank, p in enumerate(procs):
            try:
                out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                failed.append(f"rank {rank} timed out after {GROUP_TIMEOUT_S:.0f} s")
                break
            if p.returncode != 0:
                failed.append(f"rank {rank} exit {p.returncode}: {err[-1500:]}")
                break
            lines = [line for line in out.splitlines() if line.startswith("{")]
            if lines:
                results.append(json.loads(lines[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.communicate(timeout=30)
    if failed:
        _progress("  failed: " + failed[0])
        return None
    return next((r for r in results if r.get("rank") == 0), None)


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(ROOT), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.pop("PSFLOW_NUM_CPU_DEVICES", None)
    env.update(extra)
    return env


def _endpoints(net: Any, n: int) -> tuple[list[str], list[int]]:
    if net is None:
        socks = [socket.socket() for _ in range(n)]
        try:
            for s in socks:
                s.bind(("127.0.0.1", 0))
            return ["127.0.0.1"] * n, [s.getsockname()[1] for s in socks]
        finally:
            for s in socks:
                s.close()
    hosts = [net.addresses["a" if r % 2 == 0 else "b"] for r in range(n)]
    return hosts, [VETH_PORT + r for r in range(n)]


def _worker_env(framework: str, n: int) -> dict[str, str]:
    """What ``psflow local`` adds to a peer's environment (its BLAS threads); nothing for TF."""
    if framework == TCP_SIDE:
        return {**_worker_env("psflow", n), "PSFLOW_SHM": "0"}
    if framework != "psflow":
        return {}
    token = {"PSFLOW_AUTH_TOKEN": os.environ.get("PSFLOW_AUTH_TOKEN") or os.urandom(16).hex()}
    from chief.thread_plan import plan_threads
    from psflow.thread_budget import available_cores

    plan = plan_threads(0, n - 1, None, os.environ, cores=available_cores())
    return {**token, **plan.env("worker")}


def run_workers(
    net: Any, framework: str, n: int, child: str, args: list[str]
) -> dict[str, Any] | None:
    """One group of ``n`` workers of ``framework`` running ``child``; rank 0's result."""
    hosts, ports = _endpoints(net, n)
    cluster = {"worker": [f"{h}:{p}" for h, p in zip(hosts, ports)]}
    extra = _worker_env(framework, n)

    def env_of(rank: int) -> dict[str, str]:
        task = {"cluster": cluster, "task": {"type": "worker", "index": rank}}
        return _env({**extra, "TF_CONFIG": json.dumps(task)})

    return _group(net, n, ["--child", child, "--framework", framework, *args], env_of)


def run_stream(net: Any, sizes: list[int], repeats: int) -> dict[str, float] | None:
    """Seconds per bare-stream transfer of each size between two processes."""
    hosts, ports = _endpoints(net, 2)
    common = ["--sizes", ",".join(map(str, sizes)), "--repeats", str(repeats)]
    common += ["--host", hosts[0], "--port", str(ports[0])]
    res = _group(
        net,
        2,
        ["--child", "stream", *common],
        lambda rank: _env({"STREAM_ROLE": "recv" if rank == 0 else "send"}),
    )
    return None if res is None else {int(k): v for k, v in res["seconds"].items()}


def run_ring_stream(
    net: Any, n: int, sizes: list[int], repeats: int, tuned: bool = False
) -> dict[int, tuple[float, float]] | None:
    """Seconds and rank 0's CPU seconds per bare ring transfer of each size, ``n`` processes
    (``tuned``: with psflow's socket options)."""
    hosts, ports = _endpoints(net, n)
    cluster = {"worker": [f"{h}:{p}" for h, p in zip(hosts, ports)]}
    child = "ringstream-tuned" if tuned else "ringstream"
    args = ["--child", child, "--sizes", ",".join(map(str, sizes))]
    res = _group(
        net,
        n,
        [*args, "--repeats", str(repeats)],
        lambda rank: _env(
            {
                "TF_CONFIG": json.dumps(
                    {"cluster": cluster, "task": {"type": "worker", "index": rank}}
                )
            }
        ),
    )
    if res is None:
        return None
    # size -> (median seconds per transfer, rank 0's CPU seconds per transfer)
    return {int(k): (v, res["cpu_s"][k]) for k, v in res["seconds"].items()}


def best_ring_stream(
    net: Any, net_name: str, n: int, sizes: list[int], repeats: int
) -> tuple[dict[int, float], dict[int, float]] | None:
    """The bare ring stream with the kernel's default socket options and with psflow's;
    per size the better of the two: the shorter median transfer, and the lower CPU.

    The bound is never held back by options psflow chose for itself (psflow's large
    buffers made a 1 MB transfer cheaper and a 16 MB one slower here), nor by the defaults.
    """
    got = []
    for tuned in (False, True):
        how = "psflow's socket options" if tuned else "default options"
        _progress(f"{net_name}: bare ring stream, {n} workers, {how}")
        one = run_ring_stream(net, n, sizes, repeats, tuned)
        if one:
            got.append(one)
    if not got:
        return None
    return (
        {s: min(g[s][0] for g in got) for s in sizes},
        {s: min(g[s][1] for g in got) for s in sizes},
    )


# -- main --------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark (or, with ``--child``, one process of it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-tf", action="store_true", help="leave TensorFlow out")
    parser.add_argument("--no-veth", action="store_true", help="loopback only")
    parser.add_argument("--no-loopback", action="store_true", help="veth only (as root)")
    parser.add_argument("--workers", default="", help="worker counts (default 2,4; --quick 2)")
    parser.add_argument("--mb", default="", help="all-reduce sizes in MB (default 1,4,16,64)")
    parser.add_argument("--no-train", action="store_true", help="leave the MLP out")
    parser.add_argument("--no-allreduce", action="store_true", help="the MLP only")
    parser.add_argument(
        "--child",
        choices=("allreduce", "train", "both", "stream", "ringstream", "ringstream-tuned"),
        help=argparse.SUPPRESS,
    )
    parser.add_argument("--framework", choices=(*SIDES, TCP_SIDE), help=argparse.SUPPRESS)
    parser.add_argument("--sizes", default="", help=argparse.SUPPRESS)
    parser.add_argument("--batches", default="64,256", help="global batch sizes")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None, help="groups per case (A B A B)")
    parser.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",") if b]
    # each group's figure is the median of its timed calls: enough of them that one slow
    # call (another process got the core) does not decide a ratio
    repeats = args.repeats or 9
    steps = args.steps or (30 if args.quick else 100)
    rounds = args.rounds or (1 if args.quick else 2)
    train_rounds = args.rounds or (1 if args.quick else 3)

    if args.child:
        sizes = [int(s) for s in args.sizes.split(",") if s]
        if args.child == "allreduce":
            res = _child_allreduce(args.framework, sizes, repeats)
        elif args.child == "train":
            res = _child_train(args.framework, batches, steps, max(3, steps // 5))
        elif args.child == "both":  # --quick: one start-up (TF's is seconds) for both cases
            strategy = _strategy(_import(args.framework))
            res = _child_allreduce(args.framework, sizes, repeats, strategy)
            res.update(_child_train(args.framework, batches, steps, max(3, steps // 5), strategy))
        elif args.child in ("ringstream", "ringstream-tuned"):
            res = _child_ring_stream(sizes, repeats, tuned=args.child == "ringstream-tuned")
        elif os.environ.get("STREAM_ROLE") == "recv":
            res = _child_stream_recv(args.host, args.port, sizes, repeats)
        else:
            res = _child_stream_send(args.host, args.port, sizes, repeats)
        print(json.dumps(res), flush=True)
        return 0

    sizes = [1 * MB, 16 * MB] if args.quick else [1 * MB, 4 * MB, 16 * MB, 64 * MB]
    if args.mb:
        sizes = [int(m) * MB for m in args.mb.split(",") if m]
    counts = [2] if args.quick else [2, 4]
    if args.workers:
        counts = [int(n) for n in args.workers.split(",") if n]
    with_tf = not args.no_tf and importlib.util.find_spec("tensorflow") is not None
    if not with_tf:
        why = "--no-tf" if args.no_tf else "tensorflow is not installed"
        _emit({"case": "tensorflow", "metric": "skipped", "value": None, "reason": why})
    sides = list(SIDES) if with_tf else ["psflow"]
    tf_version = {"tf_version": None}
    nets: list[str] = [] if args.no_loopback else ["loopback"]
    if not args.no_veth:
        sys.path.insert(0, str(ROOT))
        from benchmarks import _netns

        why = _netns.unavailable()
        if why is None:
            nets.append("veth")
        else:
            _emit({"case": "veth", "metric": "skipped", "value": None, "reason": why})
    started = time.perf_counter()
    table: list[tuple] = []
    train_runs: dict[str, list[dict[int, float]]] = {}
    train_cpu: dict[str, list[dict[int, float]]] = {}

    def add_train(side: str, res: dict[str, Any]) -> None:
        train_runs.setdefault(side, []).append({int(k): v for k, v in res["steps_per_s"].items()})
        train_cpu.setdefault(side, []).append(
            {int(k): v for k, v in res["cpu_ms_per_step"].items()}
        )

    # --quick: the 2-worker loopback all-reduce group trains the MLP too (one process start-up
    # for both cases); the default run keeps them in separate groups, as before
    fused = args.quick and not args.no_train and "loopback" in nets and not args.no_allreduce
    for net_name in [] if args.no_allreduce else nets:
        with contextlib.ExitStack() as stack:
            net = None
            if net_name == "veth":
                _netns.remove_stale()
                net = stack.enter_context(_netns.VethPair())
            streams: list[dict[int, float]] = []
            for n in counts:
                runs: dict[str, list[dict[int, float]]] = {}
                paths: dict[str, str | None] = {}
                cpus: dict[str, list[dict[int, float]]] = {}
                rings: list[dict[int, float]] = []
                ring_cpus: list[dict[int, float]] = []
                for rnd in range(rounds):
                    _progress(f"{net_name}: bare stream")
                    got = run_stream(net, sizes, repeats)
                    if got:
                        streams.append(got)
                    # the ring streams and the all-reduces alternate round by round, so that
                    # neither always runs first on a host whose load drifts
                    if rnd % 2 == 0 and (
                        best := best_ring_stream(net, net_name, n, sizes, repeats)
                    ):
                        rings.append(best[0])
                        ring_cpus.append(best[1])
                    # psflow runs twice where its default is not the flat TCP ring: shared
                    # memory on loopback, the hierarchy on veth from 4 workers
                    twice = net_name == "loopback" or n >= 4
                    group = [*sides, TCP_SIDE] if twice else sides
                    for side in group if (rnd + n // 2) % 2 else group[::-1]:
                        _progress(f"{net_name}: {side} all-reduce, {n} workers, round {rnd + 1}")
                        both = fused and net_name == "loopback" and n == 2
                        res = run_workers(
                            net,
                            side,
                            n,
                            "both" if both else "allreduce",
                            ["--sizes", ",".join(map(str, sizes)), "--repeats", str(repeats)]
                            + (["--batches", args.batches, "--steps", str(steps)] if both else []),
                        )
                        if res is not None and both:
                            add_train(side, res)
                        if res is not None:
                            if side == "tensorflow":
                                tf_version["tf_version"] = res.get("version")
                            secs = {int(k): v for k, v in res["seconds"].items()}
                            runs.setdefault(side, []).append(secs)
                            paths[side] = res.get("path")
                            cpus.setdefault(side, []).append(
                                {int(k): v for k, v in res["cpu_s"].items()}
                            )
                    if rnd % 2 == 1 and (
                        best := best_ring_stream(net, net_name, n, sizes, repeats)
                    ):
                        rings.append(best[0])
                        ring_cpus.append(best[1])

                def medians(rs: list) -> dict | None:
                    """Per size, the median over the rounds ``rs`` (None: no rounds)."""
                    if not rs:
                        return None
                    return {s: statistics.median(r[s] for r in rs) for s in sizes}

                seconds = {side: medians(rs) for side, rs in runs.items()}
                stream = medians(streams)
                ring_stream = medians(rings)
                # rank 0's CPU seconds per call (all its threads): what a loaded host inflates
                # far less than wall time, so the two sides' costs compare across noisy rounds
                cpu_of = {side: medians(rs) for side, rs in cpus.items()}
                ring_cpu = medians(ring_cpus)
                for s in sizes:
                    bus: dict[str, float] = {}
                    for side, secs in seconds.items():
                        algbw = s / secs[s] / 1e9
                        bus[side] = algbw * 2 * (n - 1) / n
                        _emit(
                            {
                                "case": f"allreduce/{net_name}/workers={n}/{s // MB}MB/{side}",
                                "metric": "busbw",
                                "value": round(bus[side], 4),
                                "unit": "GB/s",
                                "algbw_GBps": round(algbw, 4),
                                "seconds": secs[s],
                                "cpu_ms_per_call": round(cpu_of[side][s] * 1e3, 3),
                                **({"path": paths[side]} if paths.get(side) else {}),
                                **(tf_version if side == "tensorflow" else {}),
                            }
                        )
                    stream_bw = s / stream[s] / 1e9 if stream else None
                    if stream_bw:
                        _emit(
                            {
                                "case": f"stream/{net_name}/{s // MB}MB",
                                "metric": "throughput",
                                "value": round(stream_bw, 4),
                                "unit": "GB/s",
                            }
                        )
                    ring_bw = s / ring_stream[s] / 1e9 * 2 * (n - 1) / n if ring_stream else None
                    if ring_bw:
                        _emit(
                            {
                                "case": f"ring_stream/{net_name}/workers={n}/{s // MB}MB",
                                "metric": "busbw",
                                "value": round(ring_bw, 4),
                                "unit": "GB/s",
                                "seconds": ring_stream[s],
                                "cpu_ms_per_call": round(ring_cpu[s] * 1e3, 3)
                                if ring_cpu
                                else None,
                                "formula": "each worker sends 2(N-1)/N * S to its right while "
                                "receiving as much from its left; busbw = that / seconds",
                                "options": "per size the better of default and psflow's "
                                "socket options (the shorter median, the lower CPU)",
                            }
                        )
                    ours, theirs = bus.get("psflow"), bus.get("tensorflow")
                    tcp = bus.get(TCP_SIDE)
                    for name, num, den in (
                        ("psflow_vs_stream", ours, stream_bw),
                        ("psflow_vs_ring_stream", ours, ring_bw),
                        ("psflow_tcp_vs_stream", tcp, stream_bw),
                        ("psflow_tcp_vs_ring_stream", tcp, ring_bw),
                        ("psflow_vs_tensorflow", ours, theirs),
                        ("tensorflow_vs_stream", theirs, stream_bw),
                        ("tensorflow_vs_ring_stream", theirs, ring_bw),
                    ):
                        if num and den:
                            _emit(
                                {
                                    "case": f"{name}/{net_name}/workers={n}/{s // MB}MB",
                                    "metric": "ratio",
                                    "value": round(num / den, 3),
                                }
                            )
                    ours_cpu = cpu_of.get("psflow", {}).get(s)
                    if ours_cpu and ring_cpu and ring_cpu[s]:
                        _emit(
                            {
                                "case": f"psflow_vs_ring_stream_cpu/{net_name}/workers={n}/"
                                f"{s // MB}MB",
                                "metric": "ratio",
                                "value": round(ours_cpu / ring_cpu[s], 3),
                                "numerator": "psflow CPU ms per all-reduce (rank 0, all threads)",
                                "denominator": "bare ring stream CPU ms per transfer (rank 0)",
                            }
                        )
                    for side, bw in bus.items():
                        if stream_bw:  # every worker's bytes cross the one host's cores
                            _emit(
                                {
                                    "case": f"host_share/{net_name}/workers={n}/{s // MB}MB/{side}",
                                    "metric": "ratio",
                                    "value": round(n * bw / stream_bw, 3),
                                    "formula": "N * busbw / stream (1.0: the ring's workers "
                                    "together move bytes as fast as the bare stream)",
                                }
                            )
                    cpu_ratio = ours_cpu / ring_cpu[s] if ours_cpu and ring_cpu else None
                    table.append(
                        (net_name, n, s // MB, ours, tcp, theirs, stream_bw, ring_bw, cpu_ratio)
                    )

    train_rows = []
    if not args.no_train:
        for rnd in range(0 if fused else train_rounds):
            for side in sides if rnd % 2 == 0 else sides[::-1]:
                _progress(f"loopback: {side} MLP training, 2 workers, round {rnd + 1}")
                res = run_workers(
                    None,
                    side,
                    2,
                    "train",
                    ["--batches", args.batches, "--steps", str(steps)],
                )
                if res is not None:
                    add_train(side, res)
        rates = {
            side: {b: statistics.median(r[b] for r in rs) for b in batches}
            for side, rs in train_runs.items()
        }
        cpu_ms = {
            side: {b: statistics.median(r[b] for r in rs) for b in batches}
            for side, rs in train_cpu.items()
        }
        for b in batches:
            for side, r in rates.items():
                _emit(
                    {
                        "case": f"train/mlp/workers=2/batch={b}/{side}",
                        "metric": "throughput",
                        "value": round(r[b], 2),
                        "unit": "steps/s",
                        "timed_steps": steps,
                        "cpu_ms_per_step": round(cpu_ms[side][b], 2),
                    }
                )
            ours, theirs = rates.get("psflow", {}).get(b), rates.get("tensorflow", {}).get(b)
            if ours and theirs:
                _emit(
                    {
                        "case": f"psflow_vs_tensorflow/train/workers=2/batch={b}",
                        "metric": "ratio",
                        "value": round(ours / theirs, 3),
                    }
                )
            cpu_ours = cpu_ms.get("psflow", {}).get(b)
            cpu_theirs = cpu_ms.get("tensorflow", {}).get(b)
            if cpu_ours and cpu_theirs:
                _emit(
                    {
                        "case": f"tensorflow_vs_psflow/train_cpu/workers=2/batch={b}",
                        "metric": "ratio",
                        "value": round(cpu_theirs / cpu_ours, 3),
                        "numerator": "tensorflow CPU ms per step per worker",
                        "denominator": "psflow CPU ms per step per worker",
                    }
                )
            train_rows.append((b, ours, theirs, cpu_ours, cpu_theirs))

    def cell(v: float | None, fmt: str = "8.2f") -> str:
        return format(v, fmt) if v else f"{'-':>8}"

    _progress(
        f"{'net':>8} {'workers':>7} {'MB':>4} {'psflow':>8} {'ps-tcp':>8} {'TF':>8} {'stream':>8} "
        f"{'ringstr':>8} {'ps/stream':>9} {'N*ps/str':>8} {'ps/ring':>7} {'ps/TF':>6}"
        f" {'cpu ps/ring':>11}   (bus bandwidth, GB/s; CPU per call, rank 0)"
    )
    for net_name, n, mb, ours, tcp, theirs, stream_bw, ring_bw, cpu_ratio in table:
        _progress(
            f"{net_name:>8} {n:>7} {mb:>4} {cell(ours)} {cell(tcp)} {cell(theirs)} "
            f"{cell(stream_bw)} "
            f"{cell(ring_bw)} "
            f"{cell(ours / stream_bw if ours and stream_bw else None, '9.2f')} "
            f"{cell(n * ours / stream_bw if ours and stream_bw else None, '8.2f')} "
            f"{cell(ours / ring_bw if ours and ring_bw else None, '7.2f')} "
            f"{cell(ours / theirs if ours and theirs else None, '6.2f')} "
            f"{cell(cpu_ratio, '11.2f')}"
        )
    for b, ours, theirs, cpu_ours, cpu_theirs in train_rows:
        ratio = cell(ours / theirs if ours and theirs else None, "6.2f")
        _progress(
            f"MLP batch {b:>4}: psflow {cell(ours)} TF {cell(theirs)} steps/s, ratio {ratio}; "
            f"CPU ms/step/worker psflow {cell(cpu_ours)} TF {cell(cpu_theirs)}"
        )
    _progress(f"done in {time.perf_counter() - started:.0f} s")
    return 0 if table or train_rows else 1


if __name__ == "__main__":
    sys.exit(main())

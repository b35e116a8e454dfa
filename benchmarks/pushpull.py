"""Push/pull throughput of the psflow PS against bare grpcio and raw TCP, side by side.

Starts three servers as separate processes on 127.0.0.1: ``python -m ps_server``,
a bare grpcio server (generic handlers, bytes in and out, no protobuf), and a raw
TCP server.  Then, alternating the sides (A B A B...) so drift hits all of them:

* ``push/<size>``: ``PSClient.push`` of one float32 gradient, SGD applied on the PS,
  over the PS's raw TCP data plane (the default, see psflow/transport/dataplane);
* ``pull/<size>``: ``PSClient.pull`` of that variable into a preallocated array (the
  data plane too);
* ``grpc-push|grpc-pull/<size>``: the same with ``data_plane=False``: over gRPC;
* ``grpc-raw-up|down/<size>``: a bare client/server stream of the same bytes in
  the same chunk size (prebuilt bytes objects, the receiver only counts them);
* ``tcp-up|down/<size>``: the same bytes over one TCP connection (``sendall`` /
  ``recv_into`` a preallocated buffer);
* ``shm-push|pull/<size>``: the same push and pull through ``GrpcPSConnection``,
  which a worker on the PS's host uses: the PS mirrors its values into shared
  memory and the pushed bytes travel in a segment (skipped with ``PSFLOW_SHM=0``
  or where /dev/shm is unusable);
* ``push-bf16/<size>``: the push with ``compression="bf16"`` (encoded on this
  side, decoded on the PS; half the bytes on the wire); its throughput counts
  the float32 gradient's bytes, so it compares directly with ``push``;
* ``pull/4B`` (data plane) and ``grpc-pull/4B`` vs ``grpc-raw-unary/4B``: round-trip
  latency.

Paths: first on loopback (``--shm on``, the default, adds the shared-memory
cases and lets the PS mirror its values; ``--shm off`` starts the PS with
``--shm off`` as on a host of its own), then, where the machine allows it
(root and ``ip``; otherwise one ``"metric": "skipped"`` line), the same cases
across two network namespaces joined by a veth link (benchmarks/_netns.py):
servers in one, this client in the other, so neither loopback's shortcuts nor
shared memory apply.  Those cases are prefixed ``veth/``, and TensorFlow's side
runs across the same link.  ``--netns off`` skips that leg, ``--netns only``
runs it alone.

Throughput = payload bytes / wall seconds of one call (GB/s = 1e9 B/s), median
of the repetitions; latencies are p50/p99 of many calls.  stdout: JSON lines
(BENCHMARKS.md); stderr: a table.  ``--quick`` finishes in under a minute.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import pathlib
import selectors
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Sequence

import _netns
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCH = "pushpull"
MB = 1 << 20
# "veth/" in the run across namespaces: every case of that leg carries it
_CASE_PREFIX = ""


# --- the bare servers (run as subprocesses of this script) ---------------------
def _serve_bare_grpc(host: str) -> None:
    import grpc

    from psflow.memory import tune_malloc
    from psflow.transport.options import server_options

    tune_malloc()  # as the PS does

    def ident(b: bytes) -> bytes:
        return b

    chunks: dict[int, bytes] = {}

    def up(request_iterator, context):
        n = 0
        for chunk in request_iterator:
            n += len(chunk)
        return struct.pack("<Q", n)

    def down(request, context):
        total, size = struct.unpack("<QQ", request)
        if size not in chunks:
            chunks[size] = np.random.default_rng(size).bytes(size)
        chunk = chunks[size]
        for _ in range(total // size):
            yield chunk

    def echo(request, context):
        return request

    handler = grpc.method_handlers_generic_handler(
        "bench.Bare",
        {
            "Up": grpc.stream_unary_rpc_method_handler(up, ident, ident),
            "Down": grpc.unary_stream_rpc_method_handler(down, ident, ident),
            "Echo": grpc.unary_unary_rpc_method_handler(echo, ident, ident),
        },
    )
    server = grpc.server(
        concurrent.futures.ThreadPoolExecutor(8), options=server_options(), handlers=[handler]
    )
    port = server.add_insecure_port(f"{host}:0")
    server.start()
    print(f"READY port={port}", flush=True)
    server.wait_for_termination()


def _recv_exact(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if not n:
            raise ConnectionError("peer closed")
        got += n


def _serve_tcp(host: str) -> None:
    listener = socket.create_server((host, 0))
    print(f"READY port={listener.getsockname()[1]}", flush=True)
    buffer = bytearray(64 * MB)
    payload = np.random.default_rng(1).bytes(64 * MB)
    while True:
        conn, _ = listener.accept()
        with conn:
            head = bytearray(9)
            while True:
                try:
                    _recv_exact(conn, memoryview(head))
                except ConnectionError:
                    break
                op, n = head[:1], struct.unpack("<Q", head[1:])[0]
                if len(buffer) < n:
                    buffer = bytearray(n)
                if op == b"U":
                    _recv_exact(conn, memoryview(buffer)[:n])
                    conn.sendall(b"k")
                elif op == b"D":
                    conn.sendall(memoryview(payload)[:n])


def _serve_tf_ps(cluster_json: str) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    cluster = tf.train.ClusterSpec(json.loads(cluster_json))
    server = tf.distribute.Server(cluster, job_name="ps", task_index=0, protocol="grpc")
    print("READY port=0", flush=True)
    server.join()


def _tf_client(reps: int, net: _netns.VethPair | None = None) -> None:
    """TensorFlow's PS side: a tf.distribute.Server PS task, eager remote ops from a worker.

    pull = read the PS variable into a NumPy array on the worker; push = send a
    gradient from the worker and ``assign_sub`` it (SGD) on the PS.  Prints JSON lines.
    With ``net``, the PS runs in namespace "a" (this process must be in "b").
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    ps_host, worker_host = (
        (_netns.SERVER_ADDR, _netns.CLIENT_ADDR) if net else ("127.0.0.1", "127.0.0.1")
    )
    cluster = {"ps": [f"{ps_host}:{ports[0]}"], "worker": [f"{worker_host}:{ports[1]}"]}
    ps, _ = _start(
        [__file__, "--serve", "tf", json.dumps(cluster)],
        "READY",
        timeout=120,
        prefix=net.exec_in("a", []) if net else (),
    )
    try:
        import tensorflow as tf
        from tensorflow.python.distribute.cluster_resolver import SimpleClusterResolver

        resolver = SimpleClusterResolver(
            tf.train.ClusterSpec(cluster), task_type="worker", task_id=0, rpc_layer="grpc"
        )
        tf.config.experimental_connect_to_cluster(
            resolver, job_name="worker", task_index=0, make_master_device_default=False
        )
        n = 64 * MB // 4
        with tf.device("/job:ps/task:0"):
            var = tf.Variable(tf.random.normal([n], seed=1))
        with tf.device("/job:worker/task:0"):
            grad = tf.random.normal([n], seed=2) * 1e-3

        def pull():
            with tf.device("/job:worker/task:0"):
                return tf.identity(var.read_value()).numpy()

        def fresh_grad(i):
            # A new worker tensor each time: eager may cache a tensor's copy on
            # the PS, and a cached gradient would not travel at all.
            with tf.device("/job:worker/task:0"):
                g = grad + float(i)
            g.numpy()[:1]  # make sure it exists before the clock starts
            return g

        def push(g):
            with tf.device("/job:ps/task:0"):
                var.assign_sub(g * 0.01)
                return var[:1].numpy()  # waits for the update

        pull()
        push(fresh_grad(0))
        out = {"tf-pull/64MB": [], "tf-push/64MB": []}
        for i in range(reps):
            out["tf-pull/64MB"].append(64 * MB / _timed(pull) / 1e9)
            g = fresh_grad(i + 1)
            out["tf-push/64MB"].append(64 * MB / _timed(lambda g=g: push(g)) / 1e9)
        print(json.dumps({"tf_version": tf.__version__, **out}), flush=True)
    finally:
        ps.kill()
        ps.wait(10)


# --- process management ----------------------------------------------------------
def _start(
    args: list[str], ready: str, timeout: float = 60.0, prefix: Sequence[str] = ()
) -> tuple[subprocess.Popen, int]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        [*prefix, sys.executable, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    deadline = time.monotonic() + timeout
    buffer = b""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline and proc.poll() is None:
            if sel.select(0.5):
                buffer += os.read(proc.stdout.fileno(), 4096)
                for line in buffer.decode().splitlines():
                    if line.startswith(ready):
                        port = int(line.split("port=")[1].split()[0])
                        return proc, port
    proc.kill()
    proc.wait(10)
    raise RuntimeError(f"{args} did not start")


@contextlib.contextmanager
def _servers(shm_on: bool, net: _netns.VethPair | None):
    """The PS, bare grpcio and TCP servers: on loopback, or in namespace "a" of ``net``."""
    host = _netns.SERVER_ADDR if net else "127.0.0.1"
    prefix = net.exec_in("a", []) if net else ()
    ps_args = ["-m", "ps_server", "--port", "0", "--bind", host, "--log-level", "WARNING"]
    ps_args += ["--shm", "auto" if shm_on else "off"]
    if net:  # a private namespace; the bare servers authenticate nobody either
        ps_args.append("--insecure")
    procs = []
    try:
        ps, ps_port = _start(ps_args, "PSFLOW_READY ps", prefix=prefix)
        procs.append(ps)
        bare, bare_port = _start([__file__, "--serve", "grpc", host], "READY", prefix=prefix)
        procs.append(bare)
        tcp, tcp_port = _start([__file__, "--serve", "tcp", host], "READY", prefix=prefix)
        procs.append(tcp)
        yield ps_port, bare_port, tcp_port
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)


# --- measurement -------------------------------------------------------------------
def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _emit(case: str, metric: str, value: float, unit: str, **extra) -> None:
    line = {
        "bench": BENCH,
        "case": _CASE_PREFIX + case,
        "metric": metric,
        "value": round(value, 4),
        "unit": unit,
        "path": "veth" if _CASE_PREFIX else "loopback",
    }
    line.update(extra)
    print(json.dumps(line), flush=True)


def _run_tf(args: argparse.Namespace, results: dict[str, list[float]]) -> list[tuple[str, str]]:
    """TensorFlow's PS pull/push of 64 MB in a subprocess (after ours: not interleaved)."""
    import importlib.util

    if args.no_tf or importlib.util.find_spec("tensorflow") is None:
        _emit("tensorflow", "skipped", 0, "", reason="--no-tf" if args.no_tf else "not installed")
        return []
    if 64 not in args.sizes:
        _emit("tensorflow", "skipped", 0, "", reason="the TF side measures 64 MB only")
        return []
    sys.stderr.write("tensorflow side (its own processes, ~30 s to start)...\n")
    reps = 3 if args.quick else 7
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    try:
        done = subprocess.run(
            [sys.executable, __file__, "--tf-client", str(reps)]
            + (["--netns-child", args.netns_child] if args.netns_child else []),
            capture_output=True,
            text=True,
            timeout=240,
            env=env,
        )
        tf_res = json.loads(done.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, IndexError, json.JSONDecodeError) as e:
        _emit("tensorflow", "skipped", 0, "", reason=f"TF side failed: {type(e).__name__}")
        return []
    rows = []
    for ours, theirs in (("pull/64MB", "tf-pull/64MB"), ("push/64MB", "tf-push/64MB")):
        vals = tf_res[theirs]
        _emit(
            theirs,
            "throughput",
            float(np.median(vals)),
            "GB/s",
            n=len(vals),
            tf_version=tf_res["tf_version"],
            interleaved=False,
        )
        text = f"{np.median(vals):6.2f} GB/s  psflow/tf ratio"
        for case in (ours, f"grpc-{ours}", f"shm-{ours}"):
            if case not in results:
                continue
            ratio = float(np.median(results[case]) / np.median(vals))
            _emit(case, "ratio", ratio, "x", baseline=theirs.split("/")[0], interleaved=False)
            text += f"  {case.split('/')[0]} {ratio:5.2f}"
        rows.append((theirs, text))
    return rows


def run(args: argparse.Namespace) -> int:
    """Measures every case against its baselines; prints JSON lines and a table."""
    import grpc

    from psflow.distribute.ps.connection import Grad
    from psflow.distribute.ps.grpc_connection import GrpcPSConnection
    from psflow.memory import tune_malloc
    from psflow.ps.push_types import PushContext
    from psflow.transport import shm
    from psflow.transport.client import PSClient
    from psflow.transport.options import channel_options

    # As a psflow worker would; it applies to both sides of every comparison here.
    tuned = tune_malloc()

    sizes = args.sizes
    reps = args.reps or (5 if args.quick else 15)
    lat_n = 300 if args.quick else 2000
    chunk = args.chunk_bytes
    results: dict[str, list[float]] = {}
    table: list[tuple[str, str]] = []
    net = _netns.VethPair.attach(args.netns_child) if args.netns_child else None
    host = _netns.SERVER_ADDR if net else "127.0.0.1"
    shm_on = args.shm == "on" and net is None and shm.enabled()
    sys.stderr.write(
        f"pushpull: sizes {sizes} MB, {reps} reps, chunk {chunk} B, malloc tuned: {tuned}, "
        f"path {'veth' if net else 'loopback'}, shm {'on' if shm_on else 'off'}\n"
    )
    with _servers(shm_on, net) as (ps_port, bare_port, tcp_port):
        client = PSClient(
            f"{host}:{ps_port}", timeout=120, chunk_bytes=chunk, stream_threshold=chunk
        )
        grpc_client = PSClient(
            f"{host}:{ps_port}",
            timeout=120,
            chunk_bytes=chunk,
            stream_threshold=chunk,
            data_plane=False,
        )
        channel = grpc.insecure_channel(f"{host}:{bare_port}", options=channel_options())
        up = channel.stream_unary("/bench.Bare/Up")
        down = channel.unary_stream("/bench.Bare/Down")
        echo = channel.unary_unary("/bench.Bare/Echo")
        tcp = socket.create_connection((host, tcp_port))
        tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rng = np.random.default_rng(0)
        tcp_buf = bytearray(64 * MB)
        conn = GrpcPSConnection(f"{host}:{ps_port}", timeout=120) if shm_on else None
        push_ids = iter(range(1 << 30))

        def shm_push(name: str, grad: np.ndarray) -> None:
            conn.push([Grad(name, grad)], PushContext(("bench", next(push_ids))))

        def shm_pull(name: str) -> None:
            ((value, _version),) = conn.pull([name])
            if value.nbytes != grad_bytes[name]:
                raise RuntimeError(f"shm pull of {name}: {value.nbytes} bytes")

        grad_bytes: dict[str, int] = {}

        def tcp_up(data: bytes) -> None:
            tcp.sendall(b"U" + struct.pack("<Q", len(data)))
            tcp.sendall(data)
            _recv_exact(tcp, memoryview(bytearray(1)))

        def tcp_down(n: int) -> None:
            tcp.sendall(b"D" + struct.pack("<Q", n))
            _recv_exact(tcp, memoryview(tcp_buf)[:n])

        for size in sizes:
            n = size * MB // 4
            name = f"v{size}MB"
            value = rng.standard_normal(n).astype(np.float32)
            grad = (rng.standard_normal(n) * 1e-3).astype(np.float32)
            out = np.empty_like(value)
            out[:] = 1.0  # touch it once: a worker's copy of the variable
            client.create_variable(name, value, optimizer={"name": "sgd", "learning_rate": 0.01})
            prebuilt = [rng.bytes(chunk) for _ in range(max(1, size * MB // chunk))]
            raw = grad.tobytes()
            down_req = struct.pack("<QQ", size * MB, chunk)
            cases = {
                f"push/{size}MB": lambda g=grad, nm=name: client.push({nm: g}),
                f"push-bf16/{size}MB": lambda g=grad, nm=name: client.push(
                    {nm: g}, compression="bf16"
                ),
                f"grpc-push/{size}MB": lambda g=grad, nm=name: grpc_client.push({nm: g}),
                f"grpc-raw-up/{size}MB": lambda p=prebuilt: up(iter(p), timeout=120),
                f"pull/{size}MB": lambda nm=name, o=out: client.pull(nm, out=[o]),
                f"grpc-pull/{size}MB": lambda nm=name, o=out: grpc_client.pull(nm, out=[o]),
                f"grpc-raw-down/{size}MB": lambda r=down_req: sum(
                    len(c) for c in down(r, timeout=120)
                ),
                f"tcp-up/{size}MB": lambda r=raw: tcp_up(r),
                f"tcp-down/{size}MB": lambda s=size: tcp_down(s * MB),
            }
            grad_bytes[name] = value.nbytes
            if conn is not None:
                cases[f"shm-push/{size}MB"] = lambda g=grad, nm=name: shm_push(nm, g)
                cases[f"shm-pull/{size}MB"] = lambda nm=name: shm_pull(nm)
            for fn in cases.values():  # warm up
                fn()
            for _ in range(reps):
                for case, fn in cases.items():  # A B A B ...
                    results.setdefault(case, []).append(size * MB / _timed(fn) / 1e9)
            for case in cases:
                vals = results[case]
                _emit(
                    case,
                    "throughput",
                    float(np.median(vals)),
                    "GB/s",
                    n=reps,
                    min=round(min(vals), 4),
                    max=round(max(vals), 4),
                    chunk_bytes=chunk,
                )
            ratio = float(
                np.median(results[f"push-bf16/{size}MB"]) / np.median(results[f"push/{size}MB"])
            )
            _emit(
                f"push-bf16/{size}MB",
                "ratio",
                ratio,
                "x",
                baseline="push",
                wire_bytes=size * MB // 2,
                gradient_bytes=size * MB,
            )
            table.append(
                (
                    f"push-bf16/{size}MB",
                    f"{np.median(results[f'push-bf16/{size}MB']):6.2f} GB/s (of float32)  "
                    f"vs push {ratio:5.2f}x, half the wire bytes",
                )
            )
            for prefix in ("", "grpc-", "shm-") if conn is not None else ("", "grpc-"):
                for ours, bare in (
                    (f"{prefix}push/{size}MB", f"grpc-raw-up/{size}MB"),
                    (f"{prefix}pull/{size}MB", f"grpc-raw-down/{size}MB"),
                ):
                    ratio = float(np.median(results[ours]) / np.median(results[bare]))
                    _emit(ours, "ratio", ratio, "x", baseline=bare.split("/")[0])
                    tcp_rate = np.median(results[bare.replace("grpc-raw", "tcp")])
                    table.append(
                        (
                            ours,
                            f"{np.median(results[ours]):6.2f} GB/s  "
                            f"bare grpc {np.median(results[bare]):5.2f}  ratio {ratio:5.2f}  "
                            f"tcp {tcp_rate:5.2f}",
                        )
                    )
        # Latency: 4-byte pull vs a bare unary round trip, interleaved.
        client.create_variable("tiny", np.ones(1, np.float32), trainable=False)
        tiny = np.empty(1, np.float32)
        for _ in range(50):
            client.pull("tiny", out=[tiny])
            grpc_client.pull("tiny", out=[tiny])
            echo(b"abcd", timeout=10)
        ours_lat, grpc_lat, bare_lat = [], [], []
        for _ in range(lat_n):
            ours_lat.append(_timed(lambda: client.pull("tiny", out=[tiny])) * 1e6)
            grpc_lat.append(_timed(lambda: grpc_client.pull("tiny", out=[tiny])) * 1e6)
            bare_lat.append(_timed(lambda: echo(b"abcd", timeout=10)) * 1e6)
        for case, lat in (
            ("pull/4B", ours_lat),
            ("grpc-pull/4B", grpc_lat),
            ("grpc-raw-unary/4B", bare_lat),
        ):
            _emit(
                case,
                "latency_p50",
                float(np.percentile(lat, 50)),
                "us",
                n=lat_n,
                p99=round(float(np.percentile(lat, 99)), 1),
            )
        for case, lat in (("pull/4B", ours_lat), ("grpc-pull/4B", grpc_lat)):
            ratio = float(np.percentile(lat, 50) / np.percentile(bare_lat, 50))
            _emit(case, "ratio", ratio, "x", baseline="grpc-raw-unary", metric_of="latency_p50")
            table.append(
                (
                    case,
                    f"p50 {np.percentile(lat, 50):6.0f} us  "
                    f"bare unary {np.percentile(bare_lat, 50):5.0f} us  ratio {ratio:4.2f}  "
                    f"p99 {np.percentile(lat, 99):.0f} / {np.percentile(bare_lat, 99):.0f} us",
                )
            )
        client.close()
        grpc_client.close()
        if conn is not None:
            conn.close()
        channel.close()
        tcp.close()
    table += _run_tf(args, results)
    sys.stderr.write("\n".join(f"{_CASE_PREFIX + c:21s} {t}" for c, t in table) + "\n")
    return 0


def run_veth(args: argparse.Namespace, argv: list[str]) -> int:
    """The same benchmark across a veth link: this script again, inside namespace "b"."""
    reason = _netns.unavailable()
    if reason is not None:
        _emit("veth", "skipped", 0, "", reason=f"no network namespaces: {reason}")
        return 0
    _netns.remove_stale()
    with _netns.VethPair() as net:
        sys.stderr.write(f"veth leg: servers in {net.names['a']}, client in {net.names['b']}\n")
        cmd = net.exec_in("b", [sys.executable, __file__, *argv, "--netns-child", net.base])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        child = subprocess.Popen(cmd, env=env)
        try:
            return child.wait(timeout=900)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(10)


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark (or, with --serve, one of its bare servers)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (< 60 s)")
    parser.add_argument("--chunk-bytes", type=int, default=MB)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 16, 64], help="MB")
    parser.add_argument("--reps", type=int, help="repetitions per case")
    parser.add_argument("--no-tf", action="store_true", help="skip the TensorFlow side")
    parser.add_argument(
        "--shm",
        choices=["on", "off"],
        default="on",
        help="loopback leg: let the PS use shared memory (and measure it), or not",
    )
    parser.add_argument(
        "--netns",
        choices=["auto", "off", "only"],
        default="auto",
        help="the leg across a veth link between network namespaces (needs root and ip)",
    )
    parser.add_argument("--serve", choices=["grpc", "tcp", "tf"], help=argparse.SUPPRESS)
    parser.add_argument("--tf-client", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--netns-child", help=argparse.SUPPRESS)
    parser.add_argument("cluster", nargs="?", help=argparse.SUPPRESS)
    raw_argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(raw_argv)
    if args.serve == "tf":
        _serve_tf_ps(args.cluster)
        return 0
    if args.tf_client:
        net = _netns.VethPair.attach(args.netns_child) if args.netns_child else None
        _tf_client(args.tf_client, net)
        return 0
    if args.serve == "grpc":
        _serve_bare_grpc(args.cluster)
        return 0
    if args.serve == "tcp":
        _serve_tcp(args.cluster)
        return 0
    if args.netns_child:
        global _CASE_PREFIX
        _CASE_PREFIX = "veth/"
        return run(args)
    rc = 0 if args.netns == "only" else run(args)
    if args.netns != "off":
        rc = rc or run_veth(args, raw_argv)
    return rc


if __name__ == "__main__":
    sys.exit(main())

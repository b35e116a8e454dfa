"""Load on one parameter server: 16 concurrent clients pushing to one variable, side by side.

Every case starts a fresh ``python -m ps_server`` on 127.0.0.1 and
``--processes`` client processes (16) sharing ``--clients`` threads (16), each
thread with its own ``PSClient``,
pushing integer-valued float64 gradients of ``--elements`` values to the same
variable (SGD, learning rate 1) for the case's seconds.  Cases, alternated
round by round (A B C D A B C D) so drift hits all of them:

* ``plain``: no authentication, no metrics (the reference);
* ``token``: bearer-token authentication (the server interceptor);
* ``token+metrics``: the same plus ``--metrics-port`` (per-call metrics);
* ``mtls``: mutual TLS with certificates made by ``openssl`` (skipped without it);
* ``grpc-raw``: the ceiling of any Python gRPC PS here: a bare grpcio server
  whose one unary method views the request bytes as float64 and adds them to
  one array under a lock (no header, no checks, no exactly-once), pushed to by
  the same client processes with one bare unary call each;
* ``tensorflow`` (when installed, or with ``--tf-python`` naming an interpreter
  that has it): a ``tf.distribute.Server`` PS task, and a worker process whose
  16 threads run ``var.assign_sub(grad)`` on the PS.

``--cases plain,grpc-raw,tensorflow`` runs a subset.

The PS's CPU use during a case (user+system seconds of the process over the
case's seconds, from /proc) is reported as ``ps_cpu``: near 1.0 means one
core's worth of Python under the GIL limits it, far below 1.0 with the cores
idle that something else (the clients, the thread pool) does.  CPU per
acknowledged push is reported for both sides (``ps_cpu_ms_per_push``,
``client_cpu_ms_per_push``: every client process together), since the clients
run on the same cores as the PS.  The
TensorFlow worker stays one process with ``--clients`` threads (its eager
runtime holds one connection per process).  ``PSClient`` never uses shared
memory, so every byte crosses TCP (as ``--shm off`` elsewhere).

Each case checks exactness: the final value must equal the initial value
minus the sum of every acknowledged gradient (reported as ``"exact"``).
Metrics: throughput = acknowledged pushes / seconds; latency p50/p99 of one
push as its client saw it; ratios against ``plain``.  stdout: JSON lines
(BENCHMARKS.md); stderr: a table.  Default: 30 s per case (2 rounds of 15 s);
``--quick``: 3 s per case, under a minute in all.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import emit, percentile, progress, table

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCH = "load"
TOKEN = "load-benchmark-token-0123456789"
SECURE_ENV = (
    "PSFLOW_AUTH_TOKEN",
    "PSFLOW_AUTH_TOKEN_FILE",
    "PSFLOW_TLS_CERT",
    "PSFLOW_TLS_KEY",
    "PSFLOW_TLS_CA",
)


# --- client processes --------------------------------------------------------------
def _client_loop(push, index: int, args, start_at: float, out: dict) -> None:
    """One client: integer gradients until the end time; records acked sum and latencies."""
    rng = np.random.default_rng(args.seed * 1000 + args.index_base + index)
    acked = np.zeros(args.elements, np.float64)
    latencies: list[float] = []
    errors: list[str] = []
    time.sleep(max(0.0, start_at - time.time()))
    stop = start_at + args.seconds
    while time.time() < stop:
        grad = rng.integers(-8, 9, size=args.elements).astype(np.float64)
        t0 = time.perf_counter()
        try:
            push(grad)
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}"[:300])
            if len(errors) > 20:
                break
            continue
        latencies.append(time.perf_counter() - t0)
        acked += grad
    out[index] = (acked, latencies, errors)


def _run_threads(make_push, args) -> dict:
    pushes = [make_push(i) for i in range(args.clients)]
    # every client of every process starts together: say ready, wait for the start time
    print("READY", flush=True)
    line = sys.stdin.readline()
    start_at = float(line) if line.strip() else time.time()
    out: dict = {}
    threads = []
    for i, push in enumerate(pushes):
        threads.append(threading.Thread(target=_client_loop, args=(push, i, args, start_at, out)))
    cpu0 = time.process_time()  # this process's CPU (every thread) while it pushes
    for t in threads:
        t.start()
    for t in threads:
        t.join(args.seconds + 120)
    cpu = time.process_time() - cpu0
    total = sum((r[0] for r in out.values()), np.zeros(args.elements))
    latencies = [x for r in out.values() for x in r[1]]
    errors = [e for r in out.values() for e in r[2]]
    return {
        "sum": total.tolist(),
        "latencies": [round(x, 7) for x in latencies],
        "errors": errors[:20],
        "clients_done": len(out),
        "cpu": cpu,
    }


def _client_psflow(args) -> None:
    """A client process: ``--clients`` threads, each with its own PSClient (security from env)."""
    from psflow.memory import tune_malloc
    from psflow.transport.client import PSClient

    tune_malloc()
    clients = [
        PSClient(args.address, timeout=30, client_id=f"load-{args.index_base + i}")
        for i in range(args.clients)
    ]
    try:
        result = _run_threads(lambda i: lambda g: clients[i].push({"load": g}), args)
    finally:
        for c in clients:
            c.close()
    print(json.dumps(result), flush=True)


_RAW_SERVICE = "bench.BareLoad"


def _serve_raw() -> None:
    """The bare-grpcio reference: a unary method adding float64 bytes into one array.

    What any Python gRPC parameter server has to do per push (one unary call, the
    bytes viewed as an array, one locked add), with none of psflow's checks: the
    ceiling a Python gRPC PS can reach under the same clients on the same cores.
    """
    import concurrent.futures

    import grpc

    total: dict[str, np.ndarray] = {}
    lock = threading.Lock()

    def push(request: bytes, context) -> bytes:
        grad = np.frombuffer(request, np.float64)
        with lock:
            if "v" not in total:
                total["v"] = np.zeros(grad.size)
            total["v"] += grad
        return b""

    def read(request: bytes, context) -> bytes:
        with lock:
            return total["v"].tobytes() if "v" in total else b""

    server = grpc.server(concurrent.futures.ThreadPoolExecutor(32))
    handlers = {
        "Push": grpc.unary_unary_rpc_method_handler(push),
        "Read": grpc.unary_unary_rpc_method_handler(read),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_RAW_SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"READY port={port}", flush=True)
    server.wait_for_termination()


def _client_raw(args) -> None:
    """A client process of the bare reference: one channel per thread, one unary call a push."""
    import grpc

    channels = [grpc.insecure_channel(args.address) for _ in range(args.clients)]
    stubs = [ch.unary_unary(f"/{_RAW_SERVICE}/Push") for ch in channels]
    try:
        result = _run_threads(lambda i: lambda g: stubs[i](g.tobytes(), timeout=30), args)
    finally:
        for ch in channels:
            ch.close()
    print(json.dumps(result), flush=True)


def _serve_tf_ps(cluster_json: str) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    cluster = tf.train.ClusterSpec(json.loads(cluster_json))
    server = tf.distribute.Server(cluster, job_name="ps", task_index=0, protocol="grpc")
    print("READY port=0", flush=True)
    server.join()


def _client_tf(args) -> None:
    """TensorFlow's side: this process is the worker; its threads assign_sub on the PS."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    from tensorflow.python.distribute.cluster_resolver import SimpleClusterResolver

    cluster = json.loads(args.address)
    resolver = SimpleClusterResolver(
        tf.train.ClusterSpec(cluster), task_type="worker", task_id=0, rpc_layer="grpc"
    )
    tf.config.experimental_connect_to_cluster(
        resolver, job_name="worker", task_index=0, make_master_device_default=False
    )
    initial = np.arange(args.elements, dtype=np.float64) * 1000
    with tf.device("/job:ps/task:0"):
        var = tf.Variable(initial)

    def make_push(i):
        def push(g):
            with tf.device("/job:worker/task:0"):
                delta = tf.constant(g)
            with tf.device("/job:ps/task:0"):
                var.assign_sub(delta, read_value=False)  # synchronous remote execution

        return push

    make_push(0)(np.zeros(args.elements))  # warm up the remote function path
    result = _run_threads(make_push, args)
    with tf.device("/job:worker/task:0"):
        result["final"] = tf.identity(var.read_value()).numpy().tolist()
    result["tf_version"] = tf.__version__
    print(json.dumps(result), flush=True)


# --- processes ------------------------------------------------------------------------
def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in SECURE_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.update(extra or {})
    return env


def _start(
    argv: list[str], ready: str, env: dict[str, str], timeout: float = 120.0, python: str = ""
) -> tuple[subprocess.Popen, dict[str, str]]:
    """Starts ``python argv`` and waits (bounded) for its ready line; returns (proc, fields)."""
    from psflow import launch

    return launch.start_process(
        [python or sys.executable, *argv],
        lambda line: (
            dict(f.split("=", 1) for f in line.split() if "=" in f)
            if line.startswith(ready)
            else None
        ),
        env=env,
        stderr=subprocess.DEVNULL,
        timeout=timeout,
        what=f"{ready} line",
    )


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    if proc.stdout:
        proc.stdout.close()


def _run_client(mode: str, address: str, args, env: dict[str, str]) -> dict:
    """Runs the clients (``--processes`` processes for psflow, one for TF); merges results."""
    processes = max(1, min(args.processes, args.clients)) if mode != "tf" else 1
    share = [args.clients // processes + (k < args.clients % processes) for k in range(processes)]
    procs = []
    with contextlib.ExitStack() as stack:
        for k in range(processes):
            argv = [
                __file__, "--client", mode, "--address", address, "--clients", str(share[k]),
                "--seconds", str(args.run_seconds), "--elements", str(args.elements),
                "--seed", str(args.seed), "--index-base", str(sum(share[:k])),
            ]  # fmt: skip
            python = args.tf_python if mode == "tf" else sys.executable
            proc = subprocess.Popen(
                [python, *argv],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            stack.callback(_stop, proc)
            procs.append(proc)
        deadline = time.monotonic() + 180
        for proc in procs:  # every process imported and connected
            line = ""
            while time.monotonic() < deadline:
                ready, _, _ = select.select([proc.stdout], [], [], 1.0)
                if not ready:
                    continue
                line = proc.stdout.readline()
                if line.startswith("READY") or not line:
                    break
            if not line.startswith("READY"):
                raise RuntimeError(f"{mode} client exited before it was ready ({proc.poll()})")
        start_at = f"{time.time() + 0.5}\n"
        for proc in procs:
            proc.stdin.write(start_at)
            proc.stdin.flush()
        results = []
        for proc in procs:
            out, err = proc.communicate(timeout=args.run_seconds + 240)
            lines = out.strip().splitlines()
            if proc.returncode != 0 or not lines:
                raise RuntimeError(f"{mode} client failed ({proc.returncode}): {err[-2000:]}")
            results.append(json.loads(lines[-1]))
    merged = dict(results[0])
    merged["sum"] = np.sum([r["sum"] for r in results], axis=0).tolist()
    for key in ("latencies", "errors"):
        merged[key] = [x for r in results for x in r[key]]
    merged["clients_done"] = sum(r["clients_done"] for r in results)
    merged["client_cpu"] = sum(r["cpu"] for r in results) / args.run_seconds
    return merged


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc; NaN elsewhere)."""
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _make_certs(directory: pathlib.Path) -> dict[str, str] | None:
    if shutil.which("openssl") is None:
        return None
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    (directory / "node.ext").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n"
    )
    commands = [
        ["req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
         "-subj", "/CN=load-ca"],
        ["req", *ec, "-keyout", "node.key", "-out", "node.csr", "-subj", "/CN=node"],
        ["x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
         "-CAcreateserial", "-out", "node.pem", "-days", "1", "-extfile", "node.ext"],
    ]  # fmt: skip
    for command in commands:
        subprocess.run(["openssl", *command], cwd=directory, check=True, capture_output=True)
    return {
        "PSFLOW_TLS_CERT": str(directory / "node.pem"),
        "PSFLOW_TLS_KEY": str(directory / "node.key"),
        "PSFLOW_TLS_CA": str(directory / "ca.pem"),
    }


def _free_ports(n: int) -> list[int]:
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(n):
            s = stack.enter_context(socket.socket())
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
        return ports


# --- one case -------------------------------------------------------------------------
def _psflow_case(case: str, args, certs: dict[str, str] | None) -> dict:
    env_extra: dict[str, str] = {}
    flags = ["--port", "0", "--log-level", "WARNING"]
    if case in ("token", "token+metrics"):
        env_extra["PSFLOW_AUTH_TOKEN"] = TOKEN
    if case == "token+metrics":
        flags += ["--metrics-port", "auto"]
    if case == "mtls":
        env_extra.update(certs or {})
    if case == "plain-grpc":
        env_extra["PSFLOW_DATA_PLANE"] = "off"
    env = _env(env_extra)
    from psflow import launch

    ps, ready = launch.start_role(
        "ps_server", flags, role="ps", env=env, stderr=subprocess.DEVNULL, timeout=120.0
    )
    try:
        from psflow.security.config import SecurityConfig
        from psflow.transport.client import PSClient

        address = f"127.0.0.1:{ready.port}"
        security = SecurityConfig.from_environment(env)
        initial = np.arange(args.elements, dtype=np.float64) * 1000
        with PSClient(address, security=security, timeout=30) as client:
            client.create_variable("load", initial, optimizer={"name": "sgd", "learning_rate": 1})
        cpu0, t0 = _cpu_seconds(ps.pid), time.monotonic()
        result = _run_client("psflow", address, args, env)
        # the clients' start-up wait is in the wall time too: count the pushing seconds only
        result["ps_cpu"] = (_cpu_seconds(ps.pid) - cpu0) / min(
            args.run_seconds, time.monotonic() - t0
        )
        with PSClient(address, security=security, timeout=30) as client:
            final = client.pull("load")
            result["applied"] = client.stats()["pushes_applied"]
        result["exact"] = bool(np.array_equal(final, initial - np.array(result["sum"])))
        result["exact"] &= result["applied"] == len(result["latencies"])
        return result
    finally:
        _stop(ps)


def _raw_case(args) -> dict:
    import grpc

    env = _env()
    server, fields = _start([__file__, "--serve-raw"], "READY", env)
    try:
        address = f"127.0.0.1:{fields['port']}"
        cpu0, t0 = _cpu_seconds(server.pid), time.monotonic()
        result = _run_client("raw", address, args, env)
        result["ps_cpu"] = (_cpu_seconds(server.pid) - cpu0) / min(
            args.run_seconds, time.monotonic() - t0
        )
        with grpc.insecure_channel(address) as channel:
            final = np.frombuffer(channel.unary_unary(f"/{_RAW_SERVICE}/Read")(b"", timeout=30))
    finally:
        _stop(server)
    result["exact"] = bool(np.array_equal(final, np.array(result["sum"])))
    return result


def _tf_case(args) -> dict:
    ports = _free_ports(2)
    cluster = {"ps": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{ports[1]}"]}
    env = _env({"TF_CPP_MIN_LOG_LEVEL": "2"})
    ps, _ = _start(
        [__file__, "--serve-tf", json.dumps(cluster)], "READY", env, python=args.tf_python
    )
    try:
        cpu0, t0 = _cpu_seconds(ps.pid), time.monotonic()
        result = _run_client("tf", json.dumps(cluster), args, env)
        result["ps_cpu"] = (_cpu_seconds(ps.pid) - cpu0) / min(
            args.run_seconds, time.monotonic() - t0
        )
    finally:
        _stop(ps)
    initial = np.arange(args.elements, dtype=np.float64) * 1000
    result["exact"] = bool(np.array_equal(result["final"], initial - np.array(result["sum"])))
    return result


def run(args) -> int:
    """Runs every case ``rounds`` times, alternating; prints JSON lines and a table."""
    import importlib.util

    rounds = args.rounds or (1 if args.quick else 2)
    total_seconds = args.seconds or (3.0 if args.quick else 30.0)
    args.run_seconds = total_seconds / rounds
    psflow_cases = ["plain", "plain-grpc", "token", "token+metrics", "mtls", "grpc-raw"]
    cases = [c for c in psflow_cases if c in args.cases]
    with tempfile.TemporaryDirectory(prefix="psflow-load-") as tmp:
        certs = _make_certs(pathlib.Path(tmp))
        if certs is None and "mtls" in cases:
            cases.remove("mtls")
            emit(BENCH, "mtls", "skipped", 0, "", reason="no openssl to make certificates")
        tf_ok = not args.no_tf and (
            args.tf_python != sys.executable or importlib.util.find_spec("tensorflow") is not None
        )
        if "tensorflow" not in args.cases:
            pass
        elif not tf_ok:
            reason = "--no-tf" if args.no_tf else "tensorflow not installed"
            emit(BENCH, "tensorflow", "skipped", 0, "", reason=reason)
        else:
            cases.append("tensorflow")
        progress(
            f"load: {args.clients} clients x {args.elements} float64, {rounds} round(s) of "
            f"{args.run_seconds:.1f} s per case: {', '.join(cases)}"
        )
        results: dict[str, list[dict]] = {c: [] for c in cases}
        for r in range(rounds):
            for case in cases if r % 2 == 0 else list(reversed(cases)):
                progress(f"  round {r + 1}: {case}")
                try:
                    if case == "tensorflow":
                        res = _tf_case(args)
                    elif case == "grpc-raw":
                        res = _raw_case(args)
                    else:
                        res = _psflow_case(case, args, certs)
                except (RuntimeError, subprocess.TimeoutExpired, OSError) as e:
                    emit(BENCH, case, "skipped", 0, "", reason=f"{type(e).__name__}: {e}"[:300])
                    results.pop(case, None)
                    cases = [c for c in cases if c != case]
                    continue
                results[case].append(res)
    rows, throughput = [], {}
    tf_version = None
    for case, runs in results.items():
        if not runs:
            continue
        latencies = [x for res in runs for x in res["latencies"]]
        pushes = len(latencies)
        seconds = args.run_seconds * len(runs)
        errors = sum(len(res["errors"]) for res in runs)
        exact = all(res["exact"] for res in runs)
        throughput[case] = pushes / seconds
        p50, p99 = percentile(latencies, 50) * 1e3, percentile(latencies, 99) * 1e3
        extra = {"clients": args.clients, "elements": args.elements, "seconds": seconds}
        if case == "tensorflow":
            tf_version = runs[0].get("tf_version")
            extra["tf_version"] = tf_version
        else:
            extra["processes"] = min(args.processes, args.clients)
        extra["ps_cpu"] = round(float(np.median([res["ps_cpu"] for res in runs])), 3)
        # CPU time per acknowledged push on each side (the PS; every client process
        # together): both run on the same cores, so both limit the rate
        extra["ps_cpu_ms_per_push"] = round(extra["ps_cpu"] / throughput[case] * 1e3, 3)
        client_cpu = float(np.median([res["client_cpu"] for res in runs]))
        extra["client_cpu_ms_per_push"] = round(client_cpu / throughput[case] * 1e3, 3)
        emit(BENCH, case, "throughput", round(throughput[case], 1), "pushes/s", n=pushes,
             errors=errors, exact=exact, **extra)  # fmt: skip
        emit(BENCH, case, "latency", round(p50, 3), "ms", p50=round(p50, 3), p99=round(p99, 3),
             n=pushes, **extra)  # fmt: skip
        rows.append([case, round(throughput[case], 1), round(p50, 3), round(p99, 3), pushes,
                     errors, exact, extra["ps_cpu_ms_per_push"],
                     extra["client_cpu_ms_per_push"]])  # fmt: skip
    for case in throughput:
        if case not in ("plain", "tensorflow", "grpc-raw") and "plain" in throughput:
            emit(BENCH, case, "ratio", round(throughput[case] / throughput["plain"], 3), "x",
                 baseline="plain", of="throughput")  # fmt: skip
    for case in ("plain", "plain-grpc"):  # the data plane and gRPC, each against both
        if "tensorflow" in throughput and case in throughput:
            emit(BENCH, case, "ratio", round(throughput[case] / throughput["tensorflow"], 3),
                 "x", baseline="tensorflow", of="throughput", tf_version=tf_version)  # fmt: skip
        if "grpc-raw" in throughput and case in throughput:
            emit(BENCH, case, "ratio", round(throughput[case] / throughput["grpc-raw"], 3), "x",
                 baseline="grpc-raw", of="throughput")  # fmt: skip
    table(["case", "pushes/s", "p50 ms", "p99 ms", "pushes", "errors", "exact", "ps ms/push",
           "client ms/push"], rows)  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark (or one of its client/server subprocesses)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="3 s per case (< 60 s in all)")
    p.add_argument("--seconds", type=float, help="seconds per case (default 30; --quick 3)")
    p.add_argument("--rounds", type=int, help="rounds per case (default 2; --quick 1)")
    p.add_argument("--clients", type=int, default=16, help="concurrent clients")
    p.add_argument("--elements", type=int, default=64, help="float64 values per gradient")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-tf", action="store_true", help="skip the TensorFlow side")
    p.add_argument(
        "--cases",
        type=lambda text: text.split(","),
        default=[
            "plain",
            "plain-grpc",
            "token",
            "token+metrics",
            "mtls",
            "grpc-raw",
            "tensorflow",
        ],
        help="comma-separated cases to run (default: all)",
    )
    p.add_argument(
        "--tf-python",
        default=sys.executable,
        help="the interpreter with TensorFlow for its side (default: this one)",
    )
    p.add_argument("--client", choices=["psflow", "tf", "raw"], help=argparse.SUPPRESS)
    p.add_argument("--serve-raw", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--address", help=argparse.SUPPRESS)
    p.add_argument("--processes", type=int, default=16, help="client processes (psflow)")
    p.add_argument("--serve-tf", metavar="CLUSTER", help=argparse.SUPPRESS)
    p.add_argument("--index-base", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_tf:
        _serve_tf_ps(args.serve_tf)
        return 0
    if args.serve_raw:
        _serve_raw()
        return 0
    if args.client:
        args.seconds = args.seconds or 3.0
        clients = {"psflow": _client_psflow, "tf": _client_tf, "raw": _client_raw}
        clients[args.client](args)
        return 0
    try:
        return run(args)
    except Exception as e:  # could not run at all
        progress(f"load: {type(e).__name__}: {e}")
        return 1


if __name__ == "__main__":
    sys.exit(main())

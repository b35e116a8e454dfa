"""ParameterServerStrategy training throughput: psflow vs TensorFlow, same cluster shape.

Both sides run 2 parameter servers and 2 workers as separate processes on
loopback and train the 784->512->512->10 MLP (ReLU, softmax cross-entropy, SGD
0.1, seeded synthetic data) with TensorFlow's custom-loop pattern: a
per-worker dataset, a ``step_fn`` running ``strategy.run`` with GradientTape
and ``apply_gradients``, scheduled through the ClusterCoordinator. A step is
one closure: one batch of ``batch`` examples on one worker. psflow runs async
and sync (each step then takes one batch from every worker: 2 closures);
TensorFlow has only async.

Also the round trip of a scheduled no-op closure (schedule -> worker ->
fetched result) against a bare grpcio unary round trip, both p50.

Paths: on loopback first (``--shm auto``, the default, lets each PS mirror its
values into shared memory for the workers on its host; ``--shm off`` makes every
byte go over gRPC), then, where the machine allows it (root and ``ip``;
otherwise one ``"metric": "skipped"`` line), across two network namespaces
joined by a veth link (benchmarks/_netns.py): both sides' parameter servers in
one namespace, workers and chief in the other, so every push and pull crosses
the link as between pods on different nodes.  Those cases are prefixed
``veth/``; the closure round trip stays on the chief's side of the link and is
not measured there.  ``--netns off`` skips that leg, ``--netns only`` runs it
alone.

Prints JSON lines (stdout) and a table (stderr); ``--quick`` finishes in about
a minute per leg. Format: shared/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import _cluster
import _netns
from _common import emit, progress, table

BENCH = "pss_train"

MODEL_CODE = """
def make_model(tf):
    return tf.keras.Sequential([
        tf.keras.layers.Dense(512, activation="relu", input_shape=(784,)),
        tf.keras.layers.Dense(512, activation="relu"),
        tf.keras.layers.Dense(10),
    ])

def make_data(np):
    rng = np.random.default_rng(0)
    return rng.normal(size=(4096, 784)).astype("float32"), rng.integers(0, 10, 4096).astype("int64")
"""


def run_psflow(
    cluster: dict,
    batch: int,
    mode: str,
    steps: int,
    timed: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> float:
    """Steps per second of psflow's PS training; ``timed()`` is entered around the timed steps."""
    import numpy as np

    import psflow as pf
    from psflow.distribute.cluster_resolver import ClusterSpec, SimpleClusterResolver

    namespace: dict = {}
    exec(MODEL_CODE, namespace)
    resolver = SimpleClusterResolver(
        ClusterSpec({**cluster, "chief": ["127.0.0.1:1"]}), task_type="chief", task_id=0
    )
    pf.random.set_seed(0)
    strategy = pf.distribute.ParameterServerStrategy(resolver, mode=mode)
    with strategy.scope():
        model = namespace["make_model"](pf)
        optimizer = pf.keras.optimizers.SGD(0.1)
    coordinator = pf.distribute.coordinator.ClusterCoordinator(strategy)
    x, y = namespace["make_data"](np)

    def dataset_fn(ctx):
        ds = pf.data.Dataset.from_tensor_slices((x, y)).shard(
            ctx.num_input_pipelines, ctx.input_pipeline_id
        )
        return ds.repeat().batch(batch)

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    def step_fn(it):
        xb, yb = next(it)

        def replica_fn(xb, yb):
            with pf.GradientTape() as tape:
                logits = model(xb, training=True)
                loss = pf.nn.compute_average_loss(
                    pf.nn.sparse_softmax_cross_entropy_with_logits(yb, logits)
                )
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        return strategy.run(replica_fn, args=(xb, yb))

    for _ in range(10):
        coordinator.schedule(step_fn, args=(iterator,))
    coordinator.join()
    with timed():
        start = time.perf_counter()
        for _ in range(steps):
            coordinator.schedule(step_fn, args=(iterator,))
        coordinator.join()
        rate = steps / (time.perf_counter() - start)
    coordinator.shutdown()
    return rate


def warm_up(cluster: dict) -> None:
    """A short untimed run, then an idle second: one-time costs stay out of the timing.

    Every PS and worker process loads psflow's compiled loops in a background thread
    after its first large array (~0.4 s of CPU each, much of it holding the GIL; four
    processes on two cores take a second or more); timed, the first case of a fresh
    cluster would measure that instead of its training. Batch 256: the workers' arrays
    at batch 64 are under the loops' floor, so only the larger batch starts their load."""
    run_psflow(cluster, 256, "async", 10)
    time.sleep(1.0)


def closure_and_grpc_rtt(
    cluster: dict, procs: _cluster.Processes, n: int
) -> tuple[list[float], list[float]]:
    """Seconds of ``schedule(noop).fetch()`` and of bare grpcio unary round trips, alternated."""
    import grpc

    import psflow as pf
    from psflow.distribute.cluster_resolver import ClusterSpec, SimpleClusterResolver

    resolver = SimpleClusterResolver(
        ClusterSpec({**cluster, "chief": ["127.0.0.1:1"]}), task_type="chief", task_id=0
    )
    strategy = pf.distribute.ParameterServerStrategy(resolver)
    coordinator = pf.distribute.coordinator.ClusterCoordinator(strategy)
    _, line = procs.start([sys.executable, "-c", GRPC_ECHO], "READY")
    channel = grpc.insecure_channel("127.0.0.1:" + line.split("=")[1])
    call = channel.unary_unary("/bench.Echo/Call")

    def noop():
        return 0

    closure, raw = [], []
    for i in range(n + 20):  # A B A B: drift hits both sides
        t = time.perf_counter()
        coordinator.schedule(noop).fetch()
        t1 = time.perf_counter()
        call(b"1234", timeout=10)
        t2 = time.perf_counter()
        if i >= 20:
            closure.append(t1 - t)
            raw.append(t2 - t1)
    coordinator.shutdown()
    channel.close()
    return closure, raw


GRPC_ECHO = """
import concurrent.futures, grpc, sys
echo = grpc.unary_unary_rpc_method_handler(lambda req, ctx: req)
handler = grpc.method_handlers_generic_handler("bench.Echo", {"Call": echo})
server = grpc.server(concurrent.futures.ThreadPoolExecutor(4))
server.add_generic_rpc_handlers((handler,))
port = server.add_insecure_port("127.0.0.1:0")
server.start()
print("READY port=%d" % port, flush=True)
server.wait_for_termination()
"""


TF_CHIEF = (
    MODEL_CODE
    + """
import json, sys, time
import numpy as np
import tensorflow as tf
spec, cases, rtt_n = json.loads(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
    tf.train.ClusterSpec(spec), task_type="chief", task_id=0, rpc_layer="grpc")
strategy = tf.distribute.ParameterServerStrategy(resolver)
coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
x, y = make_data(np)
out = {}
for batch, steps in cases:
    tf.random.set_seed(0)
    with strategy.scope():
        model = make_model(tf)
        optimizer = tf.keras.optimizers.SGD(0.1)
    def dataset_fn(ctx, batch=batch):
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        return ds.repeat().batch(batch)
    @tf.function
    def per_worker_dataset_fn():
        return strategy.distribute_datasets_from_function(dataset_fn)
    iterator = iter(coordinator.create_per_worker_dataset(per_worker_dataset_fn))
    @tf.function
    def step_fn(it):
        def replica_fn(xb, yb):
            with tf.GradientTape() as tape:
                logits = model(xb, training=True)
                loss = tf.nn.compute_average_loss(tf.nn.sparse_softmax_cross_entropy_with_logits(yb, logits))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        xb, yb = next(it)
        return strategy.run(replica_fn, args=(xb, yb))
    for _ in range(10):
        coordinator.schedule(step_fn, args=(iterator,))
    coordinator.join()
    start = time.perf_counter()
    for _ in range(steps):
        coordinator.schedule(step_fn, args=(iterator,))
    coordinator.join()
    out[str(batch)] = steps / (time.perf_counter() - start)
@tf.function
def noop():
    return tf.constant(0)
samples = []
for i in range(rtt_n + 20):
    t = time.perf_counter()
    coordinator.schedule(noop).fetch()
    if i >= 20:
        samples.append(time.perf_counter() - t)
out["rtt"] = samples
print("RESULT " + json.dumps(out), flush=True)
"""
)


def run_tensorflow(
    cases: list[tuple[int, int]], rtt_n: int, net: _netns.VethPair | None = None
) -> dict | None:
    """TensorFlow's PSS on the same cluster shape; None when TensorFlow is not installed."""
    try:
        import importlib.util

        if importlib.util.find_spec("tensorflow") is None:
            return None
    except ImportError:
        return None
    env = {"TF_CPP_MIN_LOG_LEVEL": "3"}
    with _cluster.Processes() as procs:
        try:
            spec = _cluster.tf_cluster(procs, 2, 2, env, net=net)
        except RuntimeError as e:  # a server that did not come up: report, go on
            progress(f"TensorFlow cluster did not start: {e}"[:500])
            return {}
        out = subprocess.run(
            [sys.executable, "-c", TF_CHIEF, json.dumps(spec), json.dumps(cases), str(rtt_n)],
            capture_output=True,
            text=True,
            timeout=900,
            env=_cluster.child_env(env),
            cwd=_cluster.ROOT,
        )
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    progress(f"TensorFlow run failed: {out.stderr[-2000:]}")
    return {}


def run_veth(argv: list[str]) -> int:
    """The same benchmark across a veth link: this script again, inside namespace "b"."""
    reason = _netns.unavailable()
    if reason is not None:
        emit(BENCH, "veth", "skipped", 0, "", reason=f"no network namespaces: {reason}")
        return 0
    _netns.remove_stale()
    with _netns.VethPair() as net:
        progress(f"veth leg: PS in {net.names['a']}, workers and chief in {net.names['b']}")
        cmd = net.exec_in("b", [sys.executable, __file__, *argv, "--netns-child", net.base])
        child = subprocess.Popen(cmd, env=_cluster.child_env(), cwd=_cluster.ROOT)
        try:
            return child.wait(timeout=1800)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(10)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer steps and rounds (< ~1 minute)")
    p.add_argument("--no-tf", action="store_true", help="skip TensorFlow")
    p.add_argument(
        "--shm", choices=["auto", "off"], default="auto", help="the PS's --shm on loopback"
    )
    p.add_argument(
        "--netns",
        choices=["auto", "off", "only"],
        default="auto",
        help="the leg across a veth link between network namespaces (needs root and ip)",
    )
    p.add_argument("--netns-child", help=argparse.SUPPRESS)
    argv = sys.argv[1:]
    args = p.parse_args(argv)
    if args.netns_child:
        return run_leg(args, _netns.VethPair.attach(args.netns_child))
    rc = 0 if args.netns == "only" else run_leg(args, None)
    if args.netns != "off":
        rc = rc or run_veth(argv)
    return rc


def run_leg(args: argparse.Namespace, net: _netns.VethPair | None) -> int:
    """Both sides on one path (loopback, or across ``net``); prints lines and tables."""
    pre = "veth/" if net else ""
    path = {"path": "veth" if net else "loopback", "shm": "off" if net else args.shm}
    steps = 60 if args.quick else 300
    rounds = 1 if args.quick else 3
    rtt_n = 200 if args.quick else 1000
    env = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    results: dict[str, list[float]] = {}
    tf_results: dict[str, list[float]] = {}
    rtt: dict[str, list[float]] = {"psflow": [], "grpc": [], "tensorflow": []}
    tf_available = not args.no_tf
    for r in range(rounds):
        progress(f"round {r + 1}/{rounds}: psflow")
        with _cluster.Processes() as procs:
            cluster = _cluster.psflow_cluster(procs, 2, 2, env, net=net, shm=args.shm)
            warm_up(cluster)
            for mode in ("async", "sync"):
                for batch in (64, 256):
                    rate = run_psflow(cluster, batch, mode, steps)
                    results.setdefault(f"{mode}/batch{batch}", []).append(rate)
                    progress(f"  psflow {mode} batch {batch}: {rate:.1f} steps/s")
            if net is None:
                closure, raw = closure_and_grpc_rtt(cluster, procs, rtt_n)
                rtt["psflow"] += closure
                rtt["grpc"] += raw
        if tf_available:
            progress(f"round {r + 1}/{rounds}: TensorFlow")
            tf_out = run_tensorflow([(64, steps), (256, steps)], rtt_n, net)
            if tf_out is None:
                tf_available = False
                emit(BENCH, "tensorflow", "skipped", 0, "", reason="tensorflow is not installed")
            elif tf_out:
                for batch in (64, 256):
                    tf_results.setdefault(f"async/batch{batch}", []).append(tf_out[str(batch)])
                rtt["tensorflow"] += tf_out["rtt"]
    rows = []
    for case, values in results.items():
        batch = int(case.split("batch")[1])
        med = statistics.median(values)
        # a sync step is one closure per worker (2) applied as one update
        emit(
            BENCH,
            f"{pre}psflow/{case}",
            "throughput",
            med,
            "steps/s",
            examples_per_s=med * batch,
            n=len(values),
            **path,
        )
        tf_med = statistics.median(tf_results[case]) if case in tf_results else None
        if tf_med:
            emit(
                BENCH,
                f"{pre}tensorflow/{case}",
                "throughput",
                tf_med,
                "steps/s",
                examples_per_s=tf_med * batch,
                n=len(tf_results[case]),
                **path,
            )
            emit(
                BENCH,
                pre + case,
                "ratio",
                med / tf_med,
                "x",
                a="psflow",
                b="tensorflow-2-ps",
                **path,
            )
        rows.append(
            [
                pre + case,
                round(med, 1),
                round(tf_med, 1) if tf_med else "-",
                round(med / tf_med, 2) if tf_med else "-",
            ]
        )
    table(["case (closures)", "psflow steps/s", "TF steps/s", "ratio"], rows)
    if net is not None:  # the chief and its workers share a namespace: no round trip here
        return 0
    p50 = {k: statistics.median(v) * 1e3 for k, v in rtt.items() if v}
    for k, v in rtt.items():
        if v:
            v = sorted(v)
            emit(
                BENCH,
                f"rtt/{k}",
                "latency",
                p50[k],
                "ms",
                p50=p50[k],
                p99=v[int(0.99 * (len(v) - 1))] * 1e3,
                n=len(v),
            )
    emit(
        BENCH,
        "rtt",
        "ratio",
        p50["psflow"] / p50["grpc"],
        "x",
        a="psflow-noop-closure",
        b="grpc-raw-unary",
    )
    if "tensorflow" in p50:
        emit(
            BENCH,
            "rtt-tf",
            "ratio",
            p50["tensorflow"] / p50["grpc"],
            "x",
            a="tensorflow-noop-closure",
            b="grpc-raw-unary",
        )
    table(["round trip", "p50 ms"], [[k, round(v, 3)] for k, v in p50.items()])
    return 0


if __name__ == "__main__":
    sys.exit(main())

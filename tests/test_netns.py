"""The cross-host path: a PS and its clients in two network namespaces joined by veth.

Skipped without root or ``ip`` (and, for the faulty-link cases, without a
kernel that has ``tc netem``).  Every namespace a test makes is deleted,
including when the process holding it is killed by a signal.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, child_env

sys.path.insert(0, str(ROOT / "benchmarks"))
import _netns

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(_netns.unavailable() is not None, reason=f"{_netns.unavailable()}"),
]

# Runs in namespace "b": pushes from several threads, each push a fresh id, then
# reads the value back.  SGD with lr 1 on ones: the value must end at 1 - pushes.
CLIENT = """
import json, sys, threading
import numpy as np
from psflow.transport.client import PSClient
address, n, pushes, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
client = PSClient(address, timeout=60, chunk_bytes=1 << 18, stream_threshold=1 << 18)
client.wait_ready(30)
client.create_variable("w", np.ones(n, np.float32), optimizer={"name": "sgd", "learning_rate": 1.0})
errors = []
def run():
    try:
        for _ in range(pushes):
            client.push({"w": np.ones(n, np.float32)})
    except Exception as e:
        errors.append(repr(e))
ts = [threading.Thread(target=run) for _ in range(threads)]
[t.start() for t in ts]
[t.join(120) for t in ts]
value, version = client.pull("w", return_versions=True)
print("RESULT " + json.dumps({"min": float(value.min()), "max": float(value.max()),
      "version": version, "errors": errors, "alive": sum(t.is_alive() for t in ts)}), flush=True)
"""


def _start_ps(net: _netns.VethPair) -> tuple[subprocess.Popen, str]:
    return _start_server(net, "a", "ps_server", "ps", ["--bind", _netns.SERVER_ADDR, "--insecure"])


def _start_server(
    net: _netns.VethPair, side: str, module: str, role: str, args: list[str]
) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        net.exec_in(side, [sys.executable, "-m", module, "--port", "0", *args]),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=child_env(),
        cwd=ROOT,
        text=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(f"PSFLOW_READY {role}"):
            port = dict(f.split("=", 1) for f in line.split() if "=" in f)["port"]
            host = _netns.SERVER_ADDR if side == "a" else "127.0.0.1"
            return proc, f"{host}:{port}"
        if not line and proc.poll() is not None:
            break
    proc.kill()
    proc.wait(10)
    raise RuntimeError(f"{module} in namespace {side} did not start")


def _push_across(net: _netns.VethPair, n: int, pushes: int, threads: int) -> dict:
    ps, address = _start_ps(net)
    try:
        out = subprocess.run(
            net.exec_in(
                "b",
                [sys.executable, "-c", CLIENT, address, str(n), str(pushes), str(threads)],
            ),
            capture_output=True,
            text=True,
            timeout=150,
            env=child_env(),
            cwd=ROOT,
        )
    finally:
        ps.kill()
        ps.wait(10)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise AssertionError(f"client failed: {out.stderr[-2000:]}")


def test_veth_pair_is_removed_on_exit_and_on_sigterm():
    with _netns.VethPair() as net:
        assert net.exists()
    assert not net.exists()
    # a holder killed by SIGTERM still deletes its namespaces
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; sys.path.insert(0, 'benchmarks'); import _netns\n"
            "with _netns.VethPair() as net:\n"
            "    print(net.base, flush=True); time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=child_env(),
    )
    try:
        base = holder.stdout.readline().strip()
        assert base, "the holder did not create its pair"
        assert _netns.VethPair.attach(base).exists()
        holder.send_signal(signal.SIGTERM)
        assert holder.wait(30) == 128 + signal.SIGTERM
        assert not _netns.VethPair.attach(base).exists()
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.wait(10)


def test_pushes_across_the_link_are_each_applied_once():
    # streamed pushes (1 MB in 256 KB chunks) from 3 threads: none lost, none doubled
    with _netns.VethPair() as net:
        result = _push_across(net, 1 << 18, pushes=10, threads=3)
    assert result["errors"] == [] and result["alive"] == 0
    assert result["version"] == 30
    assert result["min"] == result["max"] == 1.0 - 30


@pytest.mark.parametrize("delay_ms, loss", [(10, 1.0)])  # 20 ms round trip, 1% loss
def test_pushes_over_a_slow_lossy_link_are_all_applied(delay_ms, loss):
    if _netns.unavailable(need_tc=True):
        pytest.skip(_netns.unavailable(need_tc=True))
    with _netns.VethPair() as net:
        try:
            net.netem(delay_ms, loss)
        except RuntimeError as e:
            pytest.skip(f"no netem here: {e}")
        start = time.monotonic()
        result = _push_across(net, 1 << 18, pushes=5, threads=2)
        elapsed = time.monotonic() - start
    assert result["errors"] == [] and result["alive"] == 0
    assert result["version"] == 10
    assert result["min"] == result["max"] == 1.0 - 10
    assert elapsed > 10 * 2 * delay_ms / 1000  # the delay was really there


PUSHPULL_ARGS = ["--quick", "--sizes", "1", "--reps", "1", "--no-tf", "--netns", "only"]


def test_pushpull_benchmark_runs_across_the_link_and_cleans_up():
    bench = subprocess.Popen(
        [sys.executable, str(ROOT / "benchmarks" / "pushpull.py"), *PUSHPULL_ARGS],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
        cwd=ROOT,
    )
    try:
        stdout, stderr = bench.communicate(timeout=180)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.communicate(timeout=10)
    out = subprocess.CompletedProcess(bench.args, bench.returncode, stdout, stderr)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    throughput = {d["case"]: d["value"] for d in lines if d["metric"] == "throughput"}
    for case in ("veth/push/1MB", "veth/pull/1MB", "veth/grpc-raw-up/1MB", "veth/push-bf16/1MB"):
        assert throughput[case] > 0, case
    assert all(d["path"] == "veth" for d in lines)
    assert not any(c.startswith("veth/shm-") for c in throughput)  # no shared memory across hosts
    # only the benchmark's own pairs (their names carry its pid): tests running beside this
    # one (pytest-xdist) have pairs of their own up while it runs
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    assert not [n for n in left if n.startswith(f"psfw{bench.pid}t")], left


# The chief, in namespace "b" with its worker: async training whose every push crosses the link.
CHIEF = """
import json, sys
import numpy as np
import psflow as pf
from psflow.distribute.cluster_resolver import ClusterSpec, SimpleClusterResolver
ps, worker, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
resolver = SimpleClusterResolver(
    ClusterSpec({"ps": [ps], "worker": [worker], "chief": ["127.0.0.1:1"]}),
    task_type="chief", task_id=0)
strategy = pf.distribute.ParameterServerStrategy(resolver)
with strategy.scope():
    model = pf.keras.Sequential([pf.keras.layers.Dense(4, activation="tanh", input_shape=(3,)),
                                 pf.keras.layers.Dense(1)])
    optimizer = pf.keras.optimizers.SGD(0.05)
coordinator = pf.distribute.coordinator.ClusterCoordinator(strategy)
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 3)).astype(np.float32)
y = x.sum(axis=1, keepdims=True).astype(np.float32)
dataset = pf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(8)
iterator = iter(coordinator.create_per_worker_dataset(lambda: dataset))
def step(it):
    xb, yb = next(it)
    def replica(xb, yb):
        with pf.GradientTape() as tape:
            loss = pf.reduce_mean(pf.square(model(xb, training=True) - yb))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    return strategy.run(replica, args=(xb, yb))
losses = [coordinator.schedule(step, args=(iterator,)) for _ in range(steps)]
coordinator.join()
first, last = float(losses[0].fetch()), float(losses[-1].fetch())
applied = sum(s["pushes_applied"] for s in strategy.ps_stats())
print("RESULT " + json.dumps({"first": first, "last": last, "applied": applied,
                              "variables": len(model.trainable_variables)}), flush=True)
coordinator.shutdown()
"""


@pytest.mark.parametrize(
    "delay_ms, loss", [(0, 0.0), (10, 1.0)], ids=["clean", "20ms-rtt-1pct-loss"]
)
def test_training_across_the_link_applies_every_step(delay_ms, loss):
    steps = 30
    with _netns.VethPair() as net:
        if delay_ms:
            try:
                net.netem(delay_ms, loss)
            except RuntimeError as e:
                pytest.skip(f"no netem here: {e}")
        ps, ps_address = _start_ps(net)
        worker, worker_address = _start_server(
            net,
            "b",
            "worker",
            "worker",
            ["--task", "worker:0", "--ps", ps_address, "--workers", "1"],
        )
        try:
            out = subprocess.run(
                net.exec_in(
                    "b", [sys.executable, "-c", CHIEF, ps_address, worker_address, str(steps)]
                ),
                capture_output=True,
                text=True,
                timeout=150,
                env=child_env(),
                cwd=ROOT,
            )
        finally:
            for proc in (worker, ps):
                proc.kill()
                proc.wait(10)
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, out.stderr[-2000:]
    result = json.loads(lines[-1][len("RESULT ") :])
    # nothing lost, nothing doubled: one applied push (all variables of the PS) per step
    assert result["applied"] == steps
    assert result["last"] < result["first"]

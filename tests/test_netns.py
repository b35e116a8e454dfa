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
    proc = subprocess.Popen(
        net.exec_in(
            "a",
            [
                sys.executable,
                "-m",
                "ps_server",
                "--port",
                "0",
                "--bind",
                _netns.SERVER_ADDR,
                "--insecure",
                "--log-level",
                "WARNING",
            ],
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=child_env(),
        cwd=ROOT,
        text=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("PSFLOW_READY ps"):
            port = dict(f.split("=", 1) for f in line.split() if "=" in f)["port"]
            return proc, f"{_netns.SERVER_ADDR}:{port}"
        if not line and proc.poll() is not None:
            break
    proc.kill()
    proc.wait(10)
    raise RuntimeError("the PS in the namespace did not start")


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
    before = set(
        subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    )
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "pushpull.py"), *PUSHPULL_ARGS],
        capture_output=True,
        text=True,
        timeout=180,
        env=child_env(),
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    throughput = {d["case"]: d["value"] for d in lines if d["metric"] == "throughput"}
    for case in ("veth/push/1MB", "veth/pull/1MB", "veth/grpc-raw-up/1MB", "veth/push-bf16/1MB"):
        assert throughput[case] > 0, case
    assert all(d["path"] == "veth" for d in lines)
    assert not any(c.startswith("veth/shm-") for c in throughput)  # no shared memory across hosts
    after = set(
        subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    )
    assert not {n for n in after - before if n.startswith("psfw")}

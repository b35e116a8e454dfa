"""Network faults on a real link: one worker in its own network namespace, across a veth.

Namespace ``a`` holds the PS, worker:0 and the chief (a script: this process
cannot reach into the namespaces); namespace ``b`` holds worker:1 alone, so
every byte between worker:1 and the rest crosses the veth link.  Faults act on
that link:

* a partition: worker:1's end of the link goes down for 10 s, then up again
  (sockets stay open; TCP resumes by retransmission);
* 20 ms round trip and 1% loss: ``tc netem`` where the kernel has it; else the
  loss from an nftables rule (``numgen random mod 100 < 1 drop``) and the delay
  from chaos relays (benchmarks/_netfault.py) in namespace ``a`` on worker:1's
  two paths (to the PS, from the chief).

Same counting as tests/test_netfault.py (tests/netfault_scenario.py): the
variable must end at the sum of the closures' increments and the PS must have
applied ``n`` pushes.  Skipped without root or ``ip``; the loss case also without netem and
nft.  The namespaces are deleted whatever happens (benchmarks/_netns.py).
"""

from __future__ import annotations

import concurrent.futures
import json
import pathlib
import statistics
import subprocess
import sys
import time

import pytest

from tests import netfault_scenario as scenario
from tests.conftest import ROOT, child_env, pick_free_port

sys.path.insert(0, str(ROOT / "benchmarks"))
import _netns

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(_netns.unavailable() is not None, reason=f"{_netns.unavailable()}"),
]

HEALTH = {"PSFLOW_HEALTH_GRACE": "2", "PSFLOW_HEALTH_INTERVAL": "0.25"}

# The chief, in namespace "a": trains through tests/netfault_scenario.py and prints its result.
CHIEF = """
import json, sys
sys.path.insert(0, "benchmarks")
import _netns
import psflow as pf
from psflow.distribute.cluster_resolver import ClusterSpec, SimpleClusterResolver
from tests import netfault_scenario as scenario
ps, w0, w1, base, seconds = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5])
resolver = SimpleClusterResolver(
    ClusterSpec({"ps": [ps], "worker": [w0, w1], "chief": ["127.0.0.1:1"]}),
    task_type="chief", task_id=0)
strategy = pf.distribute.ParameterServerStrategy(resolver)
net = _netns.VethPair.attach(base)
if seconds > 0:
    result = scenario.run_fault(
        strategy, lambda: net.set_link("b", False), lambda: net.set_link("b", True), seconds)
else:
    result = scenario.run_steady(strategy, per_worker=40)
print("RESULT " + json.dumps(result), flush=True)
"""


class _Servers:
    """Server processes started in namespaces; every one reaped by :meth:`reap`."""

    def __init__(self, net: _netns.VethPair, log_dir: pathlib.Path) -> None:
        self.net, self.log_dir = net, log_dir
        self.procs: list[subprocess.Popen] = []

    def start(
        self,
        side: str,
        module: str,
        role: str,
        bind: str,
        args: list[str],
        env: dict[str, str] | None = None,
    ) -> str:
        """Starts ``python -m module`` in namespace ``side``; returns ``bind:port`` once ready."""
        log = open(self.log_dir / f"{module}-{side}-{len(self.procs)}.log", "wb")  # noqa: SIM115
        with log:
            proc = subprocess.Popen(
                self.net.exec_in(
                    side, [sys.executable, "-m", module, "--port", "0", "--bind", bind, *args]
                ),
                stdout=subprocess.PIPE,
                stderr=log,
                env=child_env(env),
                cwd=ROOT,
                text=True,
            )
        self.procs.append(proc)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if line.startswith(f"PSFLOW_READY {role}"):
                port = dict(f.split("=", 1) for f in line.split() if "=" in f)["port"]
                return f"{bind}:{port}"
            if not line and proc.poll() is not None:
                break
        raise RuntimeError(f"{module} in namespace {side} did not start")

    def relay(self, side: str, target: str, bind: str, delay_ms: float) -> str:
        """Starts a chaos relay (benchmarks/_netfault.py) in namespace ``side``; its address."""
        proc = subprocess.Popen(
            self.net.exec_in(
                side,
                [sys.executable, str(ROOT / "benchmarks" / "_netfault.py"), "--target", target,
                 "--bind", bind, "--delay-ms", str(delay_ms)],
            ),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=child_env(), cwd=ROOT, text=True,
        )  # fmt: skip
        self.procs.append(proc)
        line = proc.stdout.readline()  # the relay prints its line before anything can block it
        if not line.startswith("RELAY "):
            raise RuntimeError(f"the relay in namespace {side} did not start: {line!r}")
        return line.split()[1]

    def reap(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()


def _train_across(
    net: _netns.VethPair, tmp_path: pathlib.Path, fault_seconds: float, delay_ms: float = 0.0
) -> dict:
    """Trains with worker:1 across the link; ``delay_ms``: one-way delay on its two paths."""
    servers = _Servers(net, tmp_path)
    try:
        data_port = pick_free_port()  # a fresh namespace: free there too
        ps = servers.start(
            "a",
            "ps_server",
            "ps",
            _netns.SERVER_ADDR,
            ["--insecure", "--data-port", str(data_port)],
        )
        # without netem, the delay comes from relays in namespace "a" on worker:1's paths
        # (to the PS's gRPC port and to its data plane, which pushes and pulls take)
        ps_for_w1, w1_env = ps, None
        if delay_ms:
            ps_for_w1 = servers.relay("a", ps, _netns.SERVER_ADDR, delay_ms)
            data = servers.relay(
                "a", f"{_netns.SERVER_ADDR}:{data_port}", _netns.SERVER_ADDR, delay_ms
            )
            w1_env = {"PSFLOW_DATA_PLANE_ROUTES": f"{ps_for_w1}={data}"}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # side by side: seconds each
            w0 = pool.submit(
                servers.start, "a", "worker", "worker", "127.0.0.1",
                ["--task", "worker:0", "--ps", ps, "--workers", "2"],
            )  # fmt: skip
            w1 = pool.submit(
                servers.start, "b", "worker", "worker", _netns.CLIENT_ADDR,
                ["--task", "worker:1", "--insecure",  # an address only the namespaces see
                 "--ps", ps_for_w1, "--workers", "2"], w1_env,
            )  # fmt: skip
        w0, w1 = w0.result(), w1.result()
        if delay_ms:
            w1 = servers.relay("a", w1, "127.0.0.1", delay_ms)
        out = subprocess.run(
            net.exec_in(
                "a", [sys.executable, "-c", CHIEF, ps, w0, w1, net.base, str(fault_seconds)]
            ),
            capture_output=True,
            text=True,
            timeout=120,
            env=child_env(HEALTH),
            cwd=ROOT,
        )
    finally:
        servers.reap()
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, out.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


def test_a_worker_partitioned_for_10s_moves_its_closures_then_rejoins_with_updates_once(
    tmp_path,
):
    with _netns.VethPair() as net:
        result = _train_across(net, tmp_path, fault_seconds=10.0)
    assert not net.exists()
    scenario.check(result)


def test_training_over_a_link_with_20ms_rtt_losing_1pct_of_packets_applies_every_update_once(
    tmp_path,
):
    """The link loses 1% (netem, else nftables); worker:1's paths add 10 ms each way."""
    with _netns.VethPair() as net:
        try:
            net.netem(10, 1.0)
            how, relay_delay = "netem", 0.0
        except (RuntimeError, OSError) as netem_error:  # no netem in the kernel, or no tc
            try:
                net.drop(1)
                how, relay_delay = "nft", 10.0
            except (RuntimeError, OSError) as nft_error:
                pytest.skip(f"no packet loss here: netem: {netem_error}; nftables: {nft_error}")
        result = _train_across(net, tmp_path, fault_seconds=0.0, delay_ms=relay_delay)
        dropped = net.dropped()
    scenario.check(result, moved=False)
    if how == "nft":  # the loss was real: the rule dropped packets of this training
        assert dropped > 0, dropped
    # slower across the link: worker:1's closures wait for round trips worker:0's do not
    durations = {
        task: statistics.median(
            r["end"] - r["start"] for r in result["results"] if r["task"] == task
        )
        for task in ("worker:0", "worker:1")
    }
    assert durations["worker:1"] >= durations["worker:0"] + 0.015, durations

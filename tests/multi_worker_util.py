"""Starts N worker processes of ``multi_worker_scenario.py`` with TF_CONFIG on 127.0.0.1.

Every process is bounded by a timeout and reaped, whatever happens.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from psflow.collective.peer_link import PeerLinks
from psflow.security.config import SecurityConfig
from tests.conftest import ROOT, child_env, pick_free_port

SCENARIO = ROOT / "tests" / "multi_worker_scenario.py"
TOKEN = "multi-worker-test-token-0123456789"


# A peer lost for good mid-call (the signal sent to it), and the typed errors every
# survivor may see: a dead peer is seen at once, a frozen one at the deadline.
LOST_PEER_FAULTS = [
    ("SIGKILL", ("UnavailableError", "DeadlineExceededError")),
    ("SIGSTOP", ("DeadlineExceededError",)),
]


def assert_survivors_name_the_lost_peer(
    codes: list[int | None],
    results: list[dict],
    logs: list[str],
    errors_allowed: tuple[str, ...],
    within: float,
) -> None:
    """Workers 0 and 2 of 3 (worker 1 lost) each ended with exit code 3 and a typed
    error naming ``worker:1`` within ``within`` seconds."""
    for rank in (0, 2):
        assert codes[rank] == 3, logs[rank][-3000:]
        result = results[rank]
        assert result["error"] in errors_allowed, result
        assert "worker:1 at 127.0.0.1:" in result["message"], result
        assert result["seconds"] < within, result


def tf_config(ports: list[int], index: int, chief: bool = False) -> str:
    """TF_CONFIG of process ``index`` on ``ports``: worker ``index`` of a worker-only
    cluster, or with ``chief`` process 0 as the chief and the others workers 0, 1..."""
    addresses = [f"127.0.0.1:{p}" for p in ports]
    if not chief:
        cluster, task = {"worker": addresses}, {"type": "worker", "index": index}
    else:
        cluster = {"chief": addresses[:1], "worker": addresses[1:]}
        task = (
            {"type": "chief", "index": 0} if index == 0 else {"type": "worker", "index": index - 1}
        )
    return json.dumps({"cluster": cluster, "task": task})


def run_processes(
    argvs: list[list[str]],
    envs: list[dict[str, str]],
    logs: list[pathlib.Path],
    *,
    timeout: float,
    wait_for: set[int] | None = None,
) -> tuple[list[int | None], list[int]]:
    """Starts one process per ``argvs`` entry (its extra environment, its log file),
    waits up to ``timeout`` in all for those in ``wait_for`` (default: all), then kills
    and reaps every one still running.

    Returns:
        (exit codes, None for a process that had not exited; the processes' pids).
    """
    procs: list[subprocess.Popen] = []
    try:
        for argv, extra, log in zip(argvs, envs, logs):
            with open(log, "wb") as f:
                procs.append(
                    subprocess.Popen(
                        argv, env=child_env(extra), stdout=f, stderr=subprocess.STDOUT, cwd=ROOT
                    )
                )
        deadline = time.monotonic() + timeout
        codes: list[int | None] = []
        for i, p in enumerate(procs):
            if wait_for is not None and i not in wait_for:
                codes.append(None)
                continue
            try:
                codes.append(p.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    return codes, [p.pid for p in procs]


def run_workers(
    tmp: pathlib.Path,
    mode: str,
    workers: int,
    *,
    devices: int = 1,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    per_worker_env: dict[int, dict[str, str]] | None = None,
    wait_for: set[int] | None = None,
    chief: bool = False,
) -> tuple[list[int | None], list[dict], list[str]]:
    """Runs ``workers`` processes of MODE; returns (exit codes, JSON results, logs).

    Only the ranks in ``wait_for`` (default: all) are waited for; the others are
    killed once those exited (code None: it had not exited).
    """
    ports = [pick_free_port() for _ in range(workers)]
    outs = [tmp / f"{mode}-{i}.json" for i in range(workers)]
    logs = [tmp / f"{mode}-{i}.log" for i in range(workers)]
    envs = [
        {
            "TF_CONFIG": tf_config(ports, i, chief),
            "PSFLOW_NUM_CPU_DEVICES": str(devices),
            "PSFLOW_AUTH_TOKEN": TOKEN,
            "SCENARIO_SEED": str(1 + i),  # worker 0 has the reference's seed
            **(env or {}),
            **((per_worker_env or {}).get(i, {})),
        }
        for i in range(workers)
    ]
    argvs = [[sys.executable, str(SCENARIO), mode, str(out)] for out in outs]
    codes, _ = run_processes(argvs, envs, logs, timeout=timeout, wait_for=wait_for)
    results = [json.loads(o.read_text()) if o.exists() else {} for o in outs]
    return codes, results, [log.read_text(errors="replace") for log in logs]


def run_reference(
    tmp: pathlib.Path, mode: str = "reference", timeout: float = 120.0, env: dict | None = None
) -> dict:
    """The scenario's training with no strategy, in one process."""
    out = tmp / f"{mode}.json"
    env = child_env({"SCENARIO_SEED": "1", **(env or {})})
    env.pop("TF_CONFIG", None)
    subprocess.run(
        [sys.executable, str(SCENARIO), mode, str(out)],
        env=env,
        cwd=ROOT,
        timeout=timeout,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL if os.environ.get("CI") else None,
    )
    return json.loads(out.read_text())


def replay_reference(
    scenario: pathlib.Path, tmp: pathlib.Path, epochs: list, env: dict[str, str] | None = None
) -> dict:
    """Runs ``scenario``'s ``reference`` mode: one process replaying the per-step global
    batches ``epochs`` (example ids) that a group trained on; returns what it wrote."""
    schedule, out = tmp / "schedule.json", tmp / "reference.json"
    schedule.write_text(json.dumps(epochs))
    env = child_env({"SCENARIO_SEED": "1", "SCHEDULE": str(schedule), **(env or {})})
    env.pop("TF_CONFIG", None)
    subprocess.run(
        [sys.executable, str(scenario), "reference", str(out)],
        env=env,
        cwd=ROOT,
        timeout=120,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return json.loads(out.read_text())


def ring_links(n: int, timeout: float = 10.0, generations: Sequence[int] = ()) -> list[PeerLinks]:
    """``n`` ring links on loopback, connected (one thread each in a test; worker ``i``
    at ``generations[i]``, else 0)."""
    listeners = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(4)
        listeners.append(s)
    addresses = [f"127.0.0.1:{s.getsockname()[1]}" for s in listeners]
    security = SecurityConfig(token="r" * 24)
    links = [
        PeerLinks(
            i,
            addresses,
            security,
            listener=listeners[i],
            generation=generations[i] if generations else 0,
        )
        for i in range(n)
    ]
    threads = [threading.Thread(target=lk.connect, args=(timeout,)) for lk in links]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    return links

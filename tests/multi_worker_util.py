"""Starts N worker processes of ``multi_worker_scenario.py`` with TF_CONFIG on 127.0.0.1.

Every process is bounded by a timeout and reaped, whatever happens.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

from tests.conftest import ROOT, child_env, pick_free_port

SCENARIO = ROOT / "tests" / "multi_worker_scenario.py"
TOKEN = "multi-worker-test-token-0123456789"


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
    procs, logs, outs = [], [], []
    try:
        for i in range(workers):
            out = tmp / f"{mode}-{i}.json"
            log = tmp / f"{mode}-{i}.log"
            extra = {
                "TF_CONFIG": tf_config(ports, i, chief),
                "PSFLOW_NUM_CPU_DEVICES": str(devices),
                "PSFLOW_AUTH_TOKEN": TOKEN,
                "SCENARIO_SEED": str(1 + i),  # worker 0 has the reference's seed
                **(env or {}),
                **((per_worker_env or {}).get(i, {})),
            }
            with open(log, "wb") as f:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(SCENARIO), mode, str(out)],
                        env=child_env(extra),
                        stdout=f,
                        stderr=subprocess.STDOUT,
                        cwd=ROOT,
                    )
                )
            outs.append(out)
            logs.append(log)
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

"""Hello, cluster: a tiny chief script that runs unchanged embedded or on a cluster.

It creates a ``ParameterServerStrategy``, a counter variable in its scope, and
schedules a few closures with the ``ClusterCoordinator``; each one adds 1 to the
counter on its parameter server and reports which process ran it.

Run it on a local cluster of separate processes (2 ps, 2 workers, this chief)::

    psflow local --ps 2 --workers 2 examples/cluster_hello.py --steps 6

or alone (embedded: an in-process PS, this process as the only worker)::

    python examples/cluster_hello.py

Every line it prints starts with ``hello``; the results are JSON, e.g.::

    hello chief {"pid": 1234, "task": "chief:0", "cluster": {"ps": [...], ...}}
    hello closure {"step": 0, "pid": 1240, "task": "worker:1", "devices": 1}
    hello counter 6
"""

from __future__ import annotations

import argparse
import json
import os
import time

import psflow as pf


def tf_config_task() -> str | None:
    """``"<type>:<index>"`` of this process from ``TF_CONFIG``, or None without one."""
    task = json.loads(os.environ.get("TF_CONFIG") or "{}").get("task")
    return f"{task['type']}:{task['index']}" if task else None


def main() -> None:
    """Schedules ``--steps`` closures and prints who ran them and the counter."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="closures to schedule")
    parser.add_argument(
        "--work", type=float, default=0.1, help="seconds each closure works (spreads them)"
    )
    args = parser.parse_args()

    cluster = json.loads(os.environ.get("TF_CONFIG") or "{}").get("cluster", {})
    chief = {"pid": os.getpid(), "task": tf_config_task(), "cluster": cluster}
    print("hello chief", json.dumps(chief), flush=True)

    strategy = pf.distribute.ParameterServerStrategy()
    coordinator = pf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        counter = pf.Variable([0], name="hello_counter")

    def visit(step: int) -> dict:
        counter.assign_add([1])
        time.sleep(args.work)
        devices = pf.config.list_logical_devices("GPU") or pf.config.list_logical_devices("CPU")
        return {"step": step, "pid": os.getpid(), "task": tf_config_task(), "devices": len(devices)}

    results = [coordinator.schedule(visit, args=(step,)) for step in range(args.steps)]
    coordinator.join()
    for result in results:
        print("hello closure", json.dumps(result.fetch()), flush=True)
    print("hello counter", int(counter.numpy()[0]), flush=True)


if __name__ == "__main__":
    main()

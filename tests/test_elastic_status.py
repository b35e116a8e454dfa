"""The dashboard's and ``psflow local --status``'s PS list follow a resize of the parameter servers.

Real PS processes answer the probes; the launcher test runs ``psflow local
--ps-max --status`` and ``psflow scale`` as real processes.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request

import pytest

from psflow import errors
from psflow.dashboard.collector import ClusterMonitor
from psflow.dashboard.probe import ClusterProbe
from psflow.dashboard.terminal import status_line
from psflow.distribute.cluster_resolver import write_cluster_file
from psflow.distribute.cluster_resolver.cluster_file import CLUSTER_FILE_ENV
from psflow.observability.events import EventLog
from tests.test_elastic_local import _scale
from tests.test_local_cluster import WAITING_CHIEF, launch  # noqa: F401  (a fixture)

pytestmark = pytest.mark.slow


def test_the_monitor_probes_the_ps_tasks_the_view_lists_now(start_ps):
    servers = [start_ps("--task", f"ps:{i}") for i in range(3)]
    addresses = [s.address for s in servers]
    listed = {"n": 2, "broken": False}

    def view():
        if listed["broken"]:
            raise errors.InvalidArgumentError("cluster file half written")
        return addresses[: listed["n"]]

    monitor = ClusterMonitor(ClusterProbe({"ps": addresses[:2]}), EventLog(), ps_view=view)
    try:
        monitor.probe_once()
        doc = monitor.snapshot()
        assert [(p["task"], p["state"]) for p in doc["ps"]] == [("ps:0", "up"), ("ps:1", "up")]
        first_seen = doc["ps"][0]["last_seen"]

        listed["n"] = 3  # scaled up: the new task is probed from the next round on
        monitor.probe_once()
        doc = monitor.snapshot()
        assert [p["task"] for p in doc["ps"]] == ["ps:0", "ps:1", "ps:2"]
        assert [p["address"] for p in doc["ps"]] == addresses
        assert all(p["state"] == "up" for p in doc["ps"])
        assert doc["ps"][0]["last_seen"] > first_seen  # a kept task keeps its history
        assert "ps:2 up" in status_line(doc)

        listed["broken"] = True  # a view that cannot be read keeps the last one
        monitor.probe_once()
        assert [p["task"] for p in monitor.snapshot()["ps"]] == ["ps:0", "ps:1", "ps:2"]

        listed.update(n=1, broken=False)  # scaled down: the dropped tasks are not shown as lost
        servers[2].stop()
        monitor.probe_once()
        monitor.probe_once()
        doc = monitor.snapshot()
        assert [(p["task"], p["state"]) for p in doc["ps"]] == [("ps:0", "up")]
        assert "ps:1" not in status_line(doc) and "ps:2" not in status_line(doc)
        assert not [e for e in doc["events"] if e["kind"] == "ps_lost"]
    finally:
        monitor.close()


def _ps_listed(dashboard, want: list[str], timeout: float = 20.0) -> list[dict]:
    """Polls the page's document until its PS tasks are ``want``, each up; returns them."""
    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(dashboard.url + "api/cluster", timeout=5) as reply:
            ps = json.loads(reply.read())["ps"]
        if [p["task"] for p in ps] == want and all(p["state"] == "up" for p in ps):
            return ps
        assert time.monotonic() < deadline, ps
        time.sleep(0.1)


def test_the_chiefs_dashboard_follows_the_cluster_file(start_ps, tmp_path):
    from chief.__main__ import _start_dashboard

    servers = [start_ps("--task", f"ps:{i}") for i in range(2)]
    path = str(tmp_path / "cluster.json")
    cluster = {"ps": [servers[0].address], "worker": [], "chief": ["127.0.0.1:1"]}
    write_cluster_file(path, cluster)
    environ = {
        "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "chief", "index": 0}}),
        CLUSTER_FILE_ENV: path,
    }
    dashboard = _start_dashboard(0, "127.0.0.1", environ)
    assert dashboard is not None
    try:
        _ps_listed(dashboard, ["ps:0"])
        write_cluster_file(path, {**cluster, "ps": [s.address for s in servers]})  # scaled up
        ps = _ps_listed(dashboard, ["ps:0", "ps:1"])
        assert [p["address"] for p in ps] == [s.address for s in servers]
        write_cluster_file(path, cluster)  # and down again
        _ps_listed(dashboard, ["ps:0"])
    finally:
        dashboard.close()


def _status_after(launcher, mark: int, pattern: str, timeout: float = 30.0) -> str:
    """The first ``[local] status:`` line after ``mark`` that matches ``pattern``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in launcher.output[mark:].splitlines():
            if line.startswith("[local] status:") and re.search(pattern, line):
                return line
        launcher._read(0.2)
    raise AssertionError(f"no status line matching {pattern!r}:\n{launcher.output[mark:]}")


def test_local_status_lists_the_ps_tasks_after_psflow_scale(launch, tmp_path):  # noqa: F811
    chief = tmp_path / "chief.py"
    chief.write_text(WAITING_CHIEF)
    release = tmp_path / "release"
    cdir = tmp_path / "control"
    launcher = launch(
        "--ps-max", "3", "--num-ps", "2", "--workers", "1", "--cluster-dir", str(cdir),
        "--drain-timeout", "2", "--status", "--status-interval", "0.3", str(chief), str(release),
    )  # fmt: skip
    launcher.wait_for(r"^\[chief\] CHIEF_UP", timeout=90)
    line = _status_after(launcher, 0, r"ps:1 up")
    assert "ps:2" not in line  # the reserved slot is not a task yet

    mark = len(launcher.output)
    up = _scale("--ps", "3", "--cluster-dir", str(cdir))
    assert up.returncode == 0, up.stderr + launcher.output[mark:]  # how ps:2 ended, if it did
    line = _status_after(launcher, mark, r"ps:2 up")
    assert re.search(r"ps:0 up .*\| ps:1 up .*\| ps:2 up .*\| worker:0", line), line

    # this chief watches nothing, so ps:2 is not drained; the view drops it all the same
    mark = len(launcher.output)
    down = _scale("--ps", "2", "--cluster-dir", str(cdir))
    assert down.returncode == 1, down.stdout + down.stderr
    assert len(json.loads((cdir / "cluster.json").read_text())["cluster"]["ps"]) == 2
    line = _status_after(launcher, mark, r"ps:1 up [^|]*\| worker:0")
    assert "ps:2" not in line

    release.write_text("")
    assert launcher.finish(timeout=60) == 0, launcher.output

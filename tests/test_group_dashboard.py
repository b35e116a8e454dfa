"""The dashboard of a multi-worker group: membership, each change, how each process ended.

``psflow local --mode multi-worker --elastic --dashboard`` serves the page
from the launcher (a group has no chief): it asks every worker's door for
the group's view.  Real processes on 127.0.0.1: three elastic workers, one
SIGKILLs itself at step 5; the page shows generation 0 with three members,
then generation 1 without the dead one, its ``killed`` state with the
signal, and the final state once the survivors are done.  Also the door's
``view`` answer itself, to a wrong token and to a right one.
"""

from __future__ import annotations

import json
import pathlib
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import jsonschema
import pytest

import psflow as pf
from psflow.collective import door as door_lib
from psflow.collective.membership import ask_view
from psflow.dashboard.group import GroupMonitor
from psflow.observability.events import EventLog
from psflow.security.config import SecurityConfig
from tests.conftest import ROOT, child_env, pick_free_port

SCHEMA = json.loads(
    (pathlib.Path(__file__).parent / "schemas" / "cluster_api.schema.json").read_text()
)
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)


def _api(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url + "/api/cluster", timeout=5) as reply:
            document = json.loads(reply.read())
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None
    VALIDATOR.validate(document)
    return document


def test_the_page_shows_each_membership_change_and_how_the_lost_worker_ended(tmp_path):
    launcher = subprocess.Popen(
        [
            sys.executable, "-m", "chief.local", "--mode", "multi-worker", "--workers", "3",
            "--elastic", "--dashboard", "0", "--dashboard-linger", "60",
            str(ROOT / "examples" / "multi_worker_elastic.py"),
            "--kill-rank", "1", "--kill-step", "5", "--step-sleep", "0.2",
        ],
        env=child_env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        url, lines = None, []
        deadline = time.monotonic() + 60
        while url is None and time.monotonic() < deadline:
            line = launcher.stderr.readline()
            lines.append(line)
            found = re.search(r"dashboard at (http://127\.0\.0\.1:\d+)", line)
            url = found.group(1) if found else None
        assert url is not None, "".join(lines)
        generations, final = set(), None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            document = _api(url)
            if document is not None:
                if document["membership"]["generation"] is not None:
                    generations.add(document["membership"]["generation"])
                if document["job"] is not None and document["job"]["finished"]:
                    final = document
                    break
            time.sleep(0.2)
        assert final is not None, "the page never said the job finished"
        assert final["membership"] == {
            "generation": 1,
            "members": ["worker:0", "worker:2"],
            "changes": 1,
        }
        assert 1 in generations
        changes = [e for e in final["events"] if e["kind"] == "membership_changed"]
        assert [c["data"]["generation"] for c in changes] == [0, 1]
        assert changes[0]["data"]["members"] == ["worker:0", "worker:1", "worker:2"]
        assert changes[1]["data"]["left"] == ["worker:1"] and changes[1]["data"]["joined"] == []
        states = {w["task"]: w for w in final["workers"]}
        assert states["worker:1"]["state"] == "killed"
        assert states["worker:1"]["exit"]["signal"] == "SIGKILL"
        assert states["worker:0"]["state"] == states["worker:2"]["state"] == "exited"
        assert final["job"]["exit_codes"] == {"worker:0": 0, "worker:1": 137, "worker:2": 0}
        # the launcher saw each end: no "lost" guess on top of it
        assert not [e for e in final["events"] if e["kind"] == "worker_lost"]
        launcher.send_signal(signal.SIGINT)  # ends the linger
        assert launcher.wait(30) == 0
    finally:
        if launcher.poll() is None:
            launcher.kill()
        launcher.wait()
        launcher.stdout.close()
        launcher.stderr.close()


def test_a_door_answers_its_view_to_the_token_only():
    security = SecurityConfig(token="t" * 20)
    address = f"127.0.0.1:{pick_free_port()}"
    door = door_lib.Door(address, security, "worker:0")
    try:
        door.set_generation(2, (0, 3), (address, "127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"))
        view = ask_view(address, security, timeout=5)
        assert (view.generation, view.members, view.addresses[0]) == (2, (0, 3), address)
        with pytest.raises(pf.errors.UnauthenticatedError):
            ask_view(address, SecurityConfig(token="w" * 20), timeout=5)
    finally:
        door.close()
    with pytest.raises((pf.errors.UnavailableError, pf.errors.DeadlineExceededError)):
        ask_view(address, security, timeout=1)  # nothing there now: typed, bounded


def test_a_monitor_of_doors_that_never_answer_shows_unknown_workers_and_no_group():
    security = SecurityConfig(token="t" * 20)
    addresses = [f"127.0.0.1:{pick_free_port()}" for _ in range(2)]
    monitor = GroupMonitor(addresses, security, EventLog(), timeout=0.5)
    try:
        monitor.probe_once()
        document = monitor.snapshot()
        VALIDATOR.validate(document)
        assert document["membership"] == {"generation": None, "members": [], "changes": 0}
        assert [w["state"] for w in document["workers"]] == ["unknown", "unknown"]
        assert document["events"] == []
    finally:
        monitor.close()

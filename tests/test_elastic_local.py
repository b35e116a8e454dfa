"""``psflow local --ps-max`` and ``psflow scale``: the launcher's side of elastic parameter servers.

Real launcher, ps, worker and chief processes on 127.0.0.1 (the launcher helper
of ``tests/test_local_cluster.py`` reaps them all); ``psflow scale`` runs as a
real process too.  Training through a resize is in ``test_elastic_local_fit.py``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from chief.local import LocalClusterConfig
from chief.script import Target
from psflow.distribute.cluster_resolver import (
    ClusterFileResolver,
    TaskNotFoundError,
    read_cluster_file,
    write_cluster_file,
)
from psflow.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError
from tests.conftest import ROOT, child_env
from tests.test_local_cluster import WAITING_CHIEF, _env, launch  # noqa: F401  (a fixture)

CLUSTER = {"ps": ["127.0.0.1:5000"], "worker": ["127.0.0.1:5001"], "chief": ["127.0.0.1:5002"]}


def _scale(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "psflow", "scale", *args],
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=ROOT,
        timeout=timeout,
    )


# -- the cluster file ---------------------------------------------------------------------
def test_cluster_file_resolver_sees_a_rewrite_only_when_refreshed(tmp_path):
    path = str(tmp_path / "cluster.json")
    write_cluster_file(path, CLUSTER)
    resolver = ClusterFileResolver(path, task_type="chief", task_id=0)
    grown = {**CLUSTER, "ps": [*CLUSTER["ps"], "127.0.0.1:5003"]}
    write_cluster_file(path, grown)
    assert resolver.cluster_spec().num_tasks("ps") == 1  # a snapshot until refreshed
    assert resolver.refresh().num_tasks("ps") == 2
    assert resolver.cluster_spec().task_address("ps", 1) == "127.0.0.1:5003"
    assert resolver.version == 1
    assert resolver.refresh().num_tasks("ps") == 2 and resolver.version == 1  # same view
    assert os.listdir(tmp_path) == ["cluster.json"]  # no temporary file left behind


def test_a_broken_cluster_file_keeps_the_previous_view(tmp_path):
    path = tmp_path / "cluster.json"
    write_cluster_file(str(path), CLUSTER)
    resolver = ClusterFileResolver(str(path))
    path.write_text('{"cluster": {"ps": "not-a-list"')
    with pytest.raises(InvalidArgumentError, match=r"cluster\.json"):
        resolver.refresh()
    path.unlink()
    with pytest.raises(NotFoundError, match=r"cluster\.json"):
        resolver.refresh()
    assert resolver.cluster_spec().as_dict() == CLUSTER and resolver.version == 0


def test_cluster_file_errors_are_typed_and_write_nothing_bad(tmp_path):
    path = str(tmp_path / "cluster.json")
    with pytest.raises(InvalidArgumentError, match="duplicate address 'a:1'"):
        write_cluster_file(path, {"ps": ["a:1", "a:1"]})  # two tasks, one address
    assert not os.path.exists(path)
    with pytest.raises(NotFoundError, match="cannot be read"):
        ClusterFileResolver(path)
    (tmp_path / "task.json").write_text(json.dumps({"cluster": CLUSTER, "task": {"type": "ps"}}))
    with pytest.raises(InvalidArgumentError, match="task"):
        read_cluster_file(str(tmp_path / "task.json"))
    write_cluster_file(path, CLUSTER)
    with pytest.raises(TaskNotFoundError):
        ClusterFileResolver(path, task_type="ps", task_id=3)
    with pytest.raises(NotFoundError, match="PSFLOW_CLUSTER_FILE"):
        ClusterFileResolver.from_environment({})
    chief = json.dumps({"task": {"type": "chief", "index": 0}})
    resolver = ClusterFileResolver.from_environment(
        {"PSFLOW_CLUSTER_FILE": path, "TF_CONFIG": chief}
    )
    assert (resolver.task_type, resolver.task_id) == ("chief", 0)


def test_ps_max_is_validated_against_the_ps_count(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("")
    target = Target(path=str(script), module=None)
    with pytest.raises(InvalidArgumentError, match="ps_max 1 is below num_ps 2"):
        LocalClusterConfig(num_ps=2, num_workers=1, target=target, ps_max=1)
    with pytest.raises(InvalidArgumentError, match=r"cluster_dir .* needs ps_max"):
        LocalClusterConfig(num_ps=2, num_workers=1, target=target, cluster_dir=str(tmp_path))
    config = LocalClusterConfig(num_ps=1, num_workers=2, target=target, ps_max=3)
    assert (config.ps_slots, config.num_tasks) == (3, 6)


# -- psflow scale against a running launcher ----------------------------------------------
def test_scale_without_a_running_cluster_exits_2_naming_the_directory(tmp_path):
    result = _scale("--ps", "2", "--cluster-dir", str(tmp_path / "none"))
    assert result.returncode == 2
    assert "no running local cluster" in result.stderr and str(tmp_path) in result.stderr
    (tmp_path / "state.json").write_text(
        json.dumps({"pid": 2**22 + 7, "ps_max": 3, "num_ps": 1, "cluster_file": "x"})
    )
    stale = _scale("--ps", "2", "--cluster-dir", str(tmp_path))
    assert stale.returncode == 2 and "has exited" in stale.stderr


@pytest.mark.slow
def test_scale_up_starts_a_ps_bad_input_changes_nothing_and_an_undrained_ps_is_reported(
    launch,  # noqa: F811
    tmp_path,
):
    chief = tmp_path / "chief.py"
    chief.write_text(WAITING_CHIEF)
    release = tmp_path / "release"
    cdir = tmp_path / "control"
    launcher = launch(
        "--ps-max", "3", "--num-ps", "2", "--workers", "1", "--cluster-dir", str(cdir),
        "--drain-timeout", "3", str(chief), str(release),
    )  # fmt: skip
    launcher.wait_for(r"^\[chief\] CHIEF_UP", timeout=90)
    view = cdir / "cluster.json"
    assert len(json.loads(view.read_text())["cluster"]["ps"]) == 2
    before = (view.read_bytes(), (cdir / "state.json").read_bytes())

    for bad, needle in (("0", "at least 1"), ("4", "above the cluster's --ps-max 3")):
        result = _scale("--ps", bad, "--cluster-dir", str(cdir))
        assert result.returncode == 2 and needle in result.stderr, result.stderr
    assert (view.read_bytes(), (cdir / "state.json").read_bytes()) == before
    assert "scale:" not in launcher.output  # nothing was asked of the launcher

    up = _scale("--ps", "3", "--cluster-dir", str(cdir))
    assert up.returncode == 0, up.stderr
    assert "started ps:2" in up.stdout
    first_pid = re.search(r"ps:2 \(pid (\d+)\)", up.stdout).group(0)
    ps = json.loads(view.read_text())["cluster"]["ps"]
    assert len(ps) == 3
    launcher.wait_for(rf"^\[ps:2\] PSFLOW_READY ps port={ps[2].rpartition(':')[2]} ")
    assert json.loads((cdir / "state.json").read_text())["num_ps"] == 3
    assert _scale("--ps", "3", "--cluster-dir", str(cdir)).stdout.strip().endswith("already 3 PS")

    # This chief watches nothing: the view drops ps:2 but nobody drains it.
    down = _scale("--ps", "2", "--cluster-dir", str(cdir))
    assert down.returncode == 1 and "ps:2 still running" in down.stderr, down.stderr
    assert len(json.loads(view.read_text())["cluster"]["ps"]) == 2
    again = _scale("--ps", "3", "--cluster-dir", str(cdir))  # the undrained ps:2 is listed again
    assert again.returncode == 0 and first_pid in again.stdout, again.stdout + again.stderr
    assert len(re.findall(r"PSFLOW_READY ps port=\d+ task=ps:2 ", launcher.output)) == 1

    release.write_text("")
    assert launcher.finish(timeout=60) == 0
    assert not cdir.exists()  # the launcher cleaned its control directory up
    assert re.search(r"stopped: .*ps:2=0", launcher.output)


TRAIN = str(ROOT / "examples" / "elastic_train.py")


@pytest.mark.slow
def test_training_goes_2_3_1_ps_and_the_drained_ones_exit_0_unrestarted(launch, tmp_path):  # noqa: F811
    stop = tmp_path / "stop"
    cdir = tmp_path / "control"
    launcher = launch(
        "--ps-max", "3", "--ps", "2", "--workers", "2", "--cluster-dir", str(cdir),
        "--restart", "on-failure", "--drain-timeout", "60",
        TRAIN, "--seconds", "120", "--stop-file", str(stop), "--watch-interval", "0.2",
    )  # fmt: skip
    launcher.wait_for(r"^\[chief\] elastic_train step", timeout=90)

    up = _scale("--ps", "3", "--cluster-dir", str(cdir))
    assert up.returncode == 0, up.stderr
    launcher.wait_for(r"resized PS 2 -> 3: moved \d+ shards, [\d.]+ MB, pause [\d.]+ s")
    launcher.wait_for(r"^\[chief\] elastic_train step \d+ loss [\d.]+ ps 3$")  # trains on 3

    down = _scale("--ps", "1", "--cluster-dir", str(cdir))  # answers once both exited
    assert down.returncode == 0, down.stderr
    assert "drained 2 PS; the view lists 1 PS" in down.stdout
    launcher.wait_for(r"resized PS 3 -> 1: moved \d+ shards")
    launcher.wait_for(r"^\[chief\] elastic_train step \d+ loss [\d.]+ ps 1$")  # trains on 1
    stop.write_text("")
    assert launcher.finish(timeout=90) == 0, launcher.output
    out = launcher.output

    assert re.search(r"^\[chief\] elastic_train done: \d+ steps, .* 2 resizes$", out, re.M)
    for name in ("ps:1", "ps:2"):
        assert re.search(rf"^\[{name}\] PSFLOW_DRAINED task={name} ", out, re.M), name
        assert f"{name} drained: exited 0 (PSFLOW_DRAINED); not restarting it" in out
        assert len(re.findall(rf"PSFLOW_READY ps port=\d+ task={name} ", out)) == 1  # once
    assert "restarting it" not in out.replace("not restarting it", "")
    assert not re.search(r"ps:\d exited with status", out)  # nothing counted as a failure
    stopped = re.search(r"stopped: (.*)$", out, re.M).group(1)
    assert {"ps:0=0", "ps:1=0", "ps:2=0", "chief=0"} <= set(stopped.split(", "))


# A chief that resizes by itself (no psflow scale): 3 -> 1, then reads its values back.
SELF_RESIZING_CHIEF = """
import json, time
import numpy as np
import psflow as pf
from psflow.distribute.cluster_resolver import ClusterFileResolver

resolver = ClusterFileResolver.from_environment()
strategy = pf.distribute.ParameterServerStrategy(resolver)
with strategy.scope():
    vs = [pf.Variable(np.full(4, i, "float32"), name=f"v{i}") for i in range(6)]
report = strategy.resize_parameter_servers(1, timeout=60)
deadline = time.monotonic() + 30
while resolver.refresh().num_tasks("ps") != 1 and time.monotonic() < deadline:
    time.sleep(0.1)
print("CHIEF_RESIZED", json.dumps({
    "old": report.old_num_ps, "new": report.new_num_ps,
    "view": resolver.cluster_spec().num_tasks("ps"),
    "values": [v.numpy().tolist() for v in vs]}), flush=True)
"""


@pytest.mark.slow
def test_a_chief_resizing_by_itself_shrinks_the_view_and_nothing_restarts(launch, tmp_path):  # noqa: F811
    chief = tmp_path / "chief.py"
    chief.write_text(SELF_RESIZING_CHIEF)
    cdir = tmp_path / "control"
    launcher = launch(
        "--ps-max", "3", "--ps", "3", "--workers", "1", "--cluster-dir", str(cdir),
        "--restart", "on-failure", str(chief),
    )  # fmt: skip
    assert launcher.finish(timeout=120) == 0, launcher.output
    out = launcher.output
    result = json.loads(re.search(r"^\[chief\] CHIEF_RESIZED (\{.*\})$", out, re.M).group(1))
    assert (result["old"], result["new"], result["view"]) == (3, 1, 1)
    assert result["values"] == [[float(i)] * 4 for i in range(6)]  # moved, unchanged
    for name in ("ps:1", "ps:2"):
        assert f"{name} drained: exited 0 (PSFLOW_DRAINED); not restarting it" in out
    assert "restarting it at" not in out and not re.search(r"ps:\d exited with status", out)


def test_a_control_directory_in_use_is_refused_and_requests_come_in_order(tmp_path):
    from chief.control import ControlDir, LauncherState

    control = ControlDir(str(tmp_path / "c"))
    control.create()
    other = LauncherState(pid=os.getppid(), ps_max=3, num_ps=1, cluster_file="x")  # alive
    control.write_state(other)
    with pytest.raises(FailedPreconditionError, match=f"running launcher \\(pid {os.getppid()}\\)"):
        control.create()
    control.put_request("b-second", 2)
    os.utime(control.file("requests/b-second.json"), (1, 2))  # older: taken first
    control.put_request("a-first", 3)
    (tmp_path / "c" / "requests" / "c-bad.json").write_text("{oops")
    os.utime(control.file("requests/c-bad.json"), (5, 5))
    assert control.next_request() == ("b-second", 2)
    assert control.next_request() == ("c-bad", None)  # malformed: no count (answered as bad)
    assert control.next_request() == ("a-first", 3)
    assert control.next_request() is None
    control.remove()
    assert not (tmp_path / "c").exists()


def test_scale_without_an_answer_exits_1_and_leaves_the_request_queued(tmp_path):
    from chief.control import ControlDir, LauncherState

    control = ControlDir(str(tmp_path))
    control.create()  # a "launcher" that is alive (this test's parent) but never answers
    control.write_state(LauncherState(os.getppid(), ps_max=3, num_ps=1, cluster_file="x"))
    result = _scale("--ps", "2", "--cluster-dir", str(tmp_path), "--timeout", "0.5")
    assert result.returncode == 1 and "did not answer within 0.5s" in result.stderr
    queued = control.next_request()
    assert queued is not None and queued[1] == 2  # the launcher may still act on it
    bad = _scale("--ps", "2", "--cluster-dir", str(tmp_path), "--timeout", "0")
    assert bad.returncode == 2 and "--timeout" in bad.stderr


@pytest.mark.parametrize("order", [(1, 2), (2, 1)])
def test_a_self_resize_shrinks_the_view_only_once_every_dropped_slot_exited(tmp_path, order):
    # The chief of a self-resize waits for the view to list its count; if ps:1 exits before
    # ps:2, the view must still list ps:2 until it exits too (else the chief ends first).
    import time

    from chief.control import ControlDir
    from chief.elastic_ps import PSScaler
    from chief.supervisor import RoleProcess

    control = ControlDir(str(tmp_path / "c"))
    control.create()
    cluster = {**CLUSTER, "ps": [f"127.0.0.1:{5010 + i}" for i in range(3)]}
    roles = {}
    for i in range(3):
        proc = subprocess.Popen([sys.executable, "-c", "print('PSFLOW_DRAINED task=x')"])
        roles[i] = RoleProcess(f"ps:{i}", proc, time.monotonic())
    scaler = PSScaler(
        control, cluster, 3, start_ps=lambda i: roles[i], ps_roles=lambda: list(roles.values()),
        is_ready=lambda r: True, ready_timeout=5,
    )  # fmt: skip
    scaler.publish()
    views = []
    for index in order:
        role = roles[index]
        role.returncode = role.proc.wait(timeout=30)
        scaler.on_line(role, "PSFLOW_DRAINED task=x", from_stdout=True)
        assert scaler.claims_exit(role)  # a drained exit: no restart, no failure
        views.append(read_cluster_file(control.cluster_file).num_tasks("ps"))
    assert views == ([3, 1] if order == (1, 2) else [2, 1])
    assert scaler.num_ps == 1
    roles[0].proc.wait(timeout=30)
    control.remove()

"""``psflow local``: real ps, worker and chief processes on 127.0.0.1, started, watched, reaped.

Every launcher runs as a real process; each test bounds its waits and, whatever
happens, kills the launcher and every role pid it saw (``_Launcher.reap``).
Liveness is read from ``/proc`` (zombies count as gone).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import time

import pytest

from chief.local import (
    LocalClusterConfig,
    cluster_dict,
    gpu_ids,
    pick_ports,
    plan_roles,
    worker_device_env,
)
from chief.local import (
    main as local_main,
)
from chief.script import Target
from psflow.errors import InvalidArgumentError, UnavailableError
from tests.conftest import ROOT, child_env, free_port_range, pid_alive, wait_gone

HELLO = str(ROOT / "examples" / "cluster_hello.py")
READY = re.compile(r"^\[(?P<role>\S+)\] PSFLOW_READY (?P<type>\w+) port=(?P<port>\d+) "
                   r"task=(?P<task>\S+) pid=(?P<pid>\d+)(?: \w+=\S+)*$", re.M)  # fmt: skip

# A chief that reports itself, then waits (bounded) for a release file.
WAITING_CHIEF = """
import json, os, pathlib, sys, time
task = json.loads(os.environ["TF_CONFIG"])["task"]
release = pathlib.Path(sys.argv[1])
deadline = time.monotonic() + 60
try:
    print("CHIEF_UP", json.dumps({"pid": os.getpid(), "task": task}), flush=True)
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
finally:
    print("CHIEF_FINALLY", flush=True)
sys.exit(0 if release.exists() else 9)
"""

# Injected into every Python process of a run (sitecustomize): worker:1 dies or hangs at start.
FAULTY_WORKER = """
import json, os, time
_task = (json.loads(os.environ.get("TF_CONFIG") or "{}").get("task") or {})
if _task.get("type") == "worker" and _task.get("index") == 1:
    if os.environ.get("PSFLOW_TEST_FAULT") == "exit":
        os._exit(3)
    time.sleep(60)
"""


def _env(extra: dict[str, str] | None = None, pythonpath_first: str | None = None) -> dict:
    env = child_env(extra)
    env.pop("TF_CONFIG", None)
    env.pop("PSFLOW_NUM_CPU_DEVICES", None)
    if pythonpath_first:
        env["PYTHONPATH"] = os.pathsep.join([pythonpath_first, env["PYTHONPATH"]])
    return env


def _launcher_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "chief.local", *args]


class _Launcher:
    """A launcher process whose merged output is read incrementally, with bounded waits."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            _launcher_argv(*args),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=ROOT,
        )
        self.output = ""
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.proc.stdout, selectors.EVENT_READ)
        self._eof = False

    def _read(self, timeout: float) -> None:
        if self._eof:
            time.sleep(min(timeout, 0.05))
            return
        if self._selector.select(timeout):
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                self._eof = True
            self.output += chunk.decode(errors="replace")

    def wait_for(self, pattern: str, timeout: float = 60.0) -> re.Match:
        """Reads until ``pattern`` (a regex, multiline) appears in the output."""
        deadline = time.monotonic() + timeout
        while True:
            match = re.search(pattern, self.output, re.M)
            if match:
                return match
            left = deadline - time.monotonic()
            if left <= 0 or (self._eof and self.proc.poll() is not None):
                raise AssertionError(f"{pattern!r} not in the output:\n{self.output}")
            self._read(min(left, 0.2))

    def finish(self, timeout: float = 60.0) -> int:
        """Reads to EOF and returns the launcher's exit status."""
        deadline = time.monotonic() + timeout
        while not self._eof and time.monotonic() < deadline:
            self._read(0.2)
        return self.proc.wait(max(deadline - time.monotonic(), 1.0))

    def role_pids(self) -> dict[str, int]:
        """``{role: pid}`` from the ready lines and the chief's own report so far."""
        pids = {m["role"]: int(m["pid"]) for m in READY.finditer(self.output)}
        for m in re.finditer(r"^\[chief\] (?:CHIEF_UP|hello chief) (\{.*\})$", self.output, re.M):
            pids["chief"] = json.loads(m.group(1))["pid"]
        return pids

    def reap(self) -> None:
        """Kills the launcher and every role it reported; closes the pipe."""
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        for pid in self.role_pids().values():
            if pid_alive(pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        self._selector.close()
        self.proc.stdout.close()


@pytest.fixture
def launch():
    """Factory: ``launch(*args, env=...)`` -> a running :class:`_Launcher`; all reaped at the end."""
    started: list[_Launcher] = []

    def start(*args: str, env: dict[str, str] | None = None) -> _Launcher:
        launcher = _Launcher(list(args), env or _env())
        started.append(launcher)
        return launcher

    try:
        yield start
    finally:
        for launcher in started:
            launcher.reap()


# -- the whole thing ----------------------------------------------------------------------
@pytest.mark.slow
def test_hello_runs_five_processes_with_their_tf_config_roles_and_leaves_none(tmp_path):
    result = subprocess.run(
        _launcher_argv(
            "--ps", "2", "--workers", "2", "--devices-per-worker", "2", HELLO, "--steps", "8"
        ),
        capture_output=True,
        text=True,
        env=_env(),
        cwd=ROOT,
        timeout=120,
    )
    out, err = result.stdout, result.stderr
    assert result.returncode == 0, out + err

    # The chief ran with the chief's TF_CONFIG, whose cluster lists 2 ps, 2 workers, 1 chief.
    chief = json.loads(re.search(r"^\[chief\] hello chief (\{.*\})$", out, re.M).group(1))
    assert chief["task"] == "chief:0"
    cluster = chief["cluster"]
    assert {job: len(tasks) for job, tasks in cluster.items()} == {"ps": 2, "worker": 2, "chief": 1}
    addresses = [a for tasks in cluster.values() for a in tasks]
    assert len(set(addresses)) == 5 and all(a.startswith("127.0.0.1:") for a in addresses)

    # Each ps and worker announced the task and the port its TF_CONFIG gave it.
    ready = {m["role"]: m for m in READY.finditer(out)}
    assert sorted(ready) == ["ps:0", "ps:1", "worker:0", "worker:1"]
    for role, m in ready.items():
        job, index = role.split(":")
        assert m["task"] == role and m["type"] == job
        assert f"127.0.0.1:{m['port']}" == cluster[job][int(index)]

    # Closures ran in the worker processes (both of them), which saw K=2 logical devices.
    closures = [json.loads(m) for m in re.findall(r"^\[chief\] hello closure (\{.*\})$", out, re.M)]
    assert sorted(c["step"] for c in closures) == list(range(8))
    worker_pids = {f"worker:{i}": int(ready[f"worker:{i}"]["pid"]) for i in range(2)}
    assert {c["task"] for c in closures} == {"worker:0", "worker:1"}
    for c in closures:
        assert c["pid"] == worker_pids[c["task"]] and c["devices"] == 2
    assert re.search(r"^\[chief\] hello counter 8$", out, re.M)

    # Five distinct processes; stdout and stderr went to their own streams, prefixed.
    pids = {*(int(m["pid"]) for m in ready.values()), chief["pid"]}
    assert len(pids) == 5
    assert "[local] INFO all 2 ps and 2 workers ready" in err
    assert re.search(r"^\[ps:1\] .*ps_server", err, re.M)
    assert "PSFLOW_READY" not in err and "[local]" not in out
    assert "stopped: ps:0=0, ps:1=0, worker:0=0, worker:1=0, chief=0" in err
    assert wait_gone(pids, timeout=5) == []


@pytest.mark.slow
def test_chief_killed_with_sigkill_tears_the_cluster_down(launch, tmp_path):
    script = tmp_path / "chief.py"
    script.write_text(WAITING_CHIEF)
    base = free_port_range(3)
    run = launch("--ps", "1", "--workers", "1", "--port-base", str(base), str(script),
                 str(tmp_path / "never"))  # fmt: skip
    up = run.wait_for(r"^\[chief\] CHIEF_UP (\{.*\})$")
    assert json.loads(up.group(1))["task"] == {"type": "chief", "index": 0}
    pids = run.role_pids()
    assert sorted(pids) == ["chief", "ps:0", "worker:0"]
    assert run.wait_for(r"task=ps:0 pid")  # ports from --port-base, in order ps, worker, chief
    assert f"port={base} task=ps:0" in run.output and f"port={base + 1} task=worker:0" in run.output

    os.kill(pids["chief"], signal.SIGKILL)
    assert run.finish(timeout=60) == 128 + signal.SIGKILL
    assert "chief exited with status 137; stopping the cluster" in run.output
    assert wait_gone(pids.values(), timeout=5) == []


@pytest.mark.slow
def test_sigint_to_launcher_stops_chief_gracefully_then_everything(launch, tmp_path):
    script = tmp_path / "chief.py"
    script.write_text(WAITING_CHIEF)
    run = launch("--ps", "1", "--workers", "1", str(script), str(tmp_path / "never"))
    run.wait_for(r"^\[chief\] CHIEF_UP")
    pids = run.role_pids()

    run.proc.send_signal(signal.SIGINT)
    assert run.finish(timeout=60) == 128 + signal.SIGINT
    assert "received SIGINT: stopping the cluster" in run.output
    assert "[chief] CHIEF_FINALLY" in run.output  # SIGTERM reached the program: finally ran
    assert re.search(r"stopped: ps:0=0, worker:0=0, chief=143$", run.output, re.M)
    assert wait_gone(pids.values(), timeout=5) == []


@pytest.mark.slow
def test_roles_die_with_a_sigkilled_launcher(launch, tmp_path):
    script = tmp_path / "chief.py"
    script.write_text(WAITING_CHIEF)
    run = launch("--ps", "1", "--workers", "1", str(script), str(tmp_path / "never"))
    run.wait_for(r"^\[chief\] CHIEF_UP")
    pids = run.role_pids()
    assert all(pid_alive(p) for p in pids.values())

    run.proc.kill()  # no teardown: the kernel's parent-death signal must do it
    run.proc.wait(10)
    assert wait_gone(pids.values(), timeout=10) == []


@pytest.mark.slow
def test_worker_death_is_reported_and_the_chief_keeps_running(launch, tmp_path):
    script = tmp_path / "chief.py"
    script.write_text(WAITING_CHIEF)
    release = tmp_path / "release"
    run = launch("--ps", "1", "--workers", "2", str(script), str(release))
    run.wait_for(r"^\[chief\] CHIEF_UP")
    pids = run.role_pids()

    os.kill(pids["worker:1"], signal.SIGKILL)
    run.wait_for(r"worker:1 exited with status 137 while the chief runs; the chief keeps running")
    assert pid_alive(pids["chief"]) and pid_alive(pids["worker:0"])
    release.touch()
    assert run.finish(timeout=60) == 0
    assert re.search(r"stopped: ps:0=0, worker:0=0, worker:1=137, chief=0$", run.output, re.M)
    assert wait_gone(pids.values(), timeout=5) == []


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("exit", r"worker:1 exited with status 3 before the chief started"),
        ("hang", r"worker:1 not ready within 2\.0s \(no PSFLOW_READY line\)"),
    ],
)
def test_a_role_failing_to_start_is_named_and_everything_is_torn_down(
    launch, tmp_path, fault, message
):
    (tmp_path / "sitecustomize.py").write_text(FAULTY_WORKER)
    env = _env({"PSFLOW_TEST_FAULT": fault}, pythonpath_first=str(tmp_path))
    run = launch("--ps", "1", "--workers", "2", "--ready-timeout", "2", HELLO, env=env)
    assert run.finish(timeout=60) == 1
    assert re.search(message, run.output), run.output
    assert "[chief]" not in run.output
    started = re.findall(r"\[(\S+)\] PSFLOW_READY \S+ port=\d+ task=\S+ pid=(\d+)", run.output)
    assert {role for role, _ in started} <= {"ps:0", "worker:0"}
    assert wait_gone([int(pid) for _, pid in started], timeout=5) == []
    # SIGTERM before a server installed its handler kills it: 143.
    worker1 = "3" if fault == "exit" else "143"
    stopped = rf"stopped: ps:0=(0|143), worker:0=(0|143), worker:1={worker1}$"
    assert re.search(stopped, run.output, re.M), run.output


# -- pieces -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--ps", "0", "--workers", "1", HELLO], "num_ps 0 must be between 1 and 256"),
        (["--ps", "1", "--workers", "1", "missing.py"], "script 'missing.py' does not exist"),
        (["--ps", "1", "--workers", "1"], "no script (or -m MODULE) to run"),
        (["--ps", "1", "--workers", "1", "--host", "10.0.0.1", HELLO], "host '10.0.0.1'"),
        (["--ps", "1", "--workers", "1", "--port-base", "65534", HELLO], "port_base 65534"),
    ],
)
def test_usage_errors_exit_2_before_anything_starts(capsys, args, needle):
    assert local_main(args) == 2
    captured = capsys.readouterr()
    assert needle in captured.err
    assert "PSFLOW_READY" not in captured.out and "[local] INFO cluster" not in captured.err


def test_usage_error_of_the_launcher_process():
    result = subprocess.run(
        _launcher_argv("--ps", "1", "--workers", "1", "missing.py"),
        capture_output=True,
        text=True,
        env=_env(),
        cwd=ROOT,
        timeout=60,
    )
    assert result.returncode == 2
    assert "script 'missing.py' does not exist" in result.stderr


def test_port_base_in_use_is_named_and_nothing_starts():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(UnavailableError, match=f"port {port} on 127.0.0.1 is not free"):
            pick_ports(1, "127.0.0.1", port)


def test_pick_ports_gives_distinct_free_ports():
    from chief.local import ephemeral_ports

    ports = pick_ports(6)
    assert len(set(ports)) == 6
    # below the range outgoing connections take their local port from: a reserved slot
    # cannot be taken meanwhile by some connection's local end
    assert all(10000 <= p < ephemeral_ports()[0] for p in ports), ports
    for port in ports:  # each is bindable now
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))


def test_plan_gives_each_role_its_own_task_in_one_cluster():
    config = LocalClusterConfig(2, 3, Target(HELLO, None, ("--steps", "1")), devices_per_worker=4)
    roles = plan_roles(config, [7000, 7001, 7002, 7003, 7004, 7005], gpus=[])
    assert [r.name for r in roles] == ["ps:0", "ps:1", "worker:0", "worker:1", "worker:2", "chief"]
    cluster = cluster_dict(2, 3, "127.0.0.1", [7000, 7001, 7002, 7003, 7004, 7005])
    for role in roles:
        tf_config = json.loads(role.env["TF_CONFIG"])
        assert tf_config["cluster"] == cluster
        assert tf_config["task"] == {"type": role.task_type, "index": role.index}
        assert role.address == cluster[role.task_type][role.index]
        assert role.env.get("PSFLOW_NUM_CPU_DEVICES") == (
            "4" if role.task_type == "worker" else None
        )
    assert roles[0].argv[1:] == ("-m", "ps_server", "--bind", "127.0.0.1")
    assert roles[2].argv[1:] == ("-m", "worker", "--bind", "127.0.0.1")
    assert roles[-1].argv[1:] == ("-m", "chief", HELLO, "--steps", "1")


def test_devices_per_worker_splits_gpus_when_there_are_some():
    assert worker_device_env(2, 2, ["0", "1", "2", "3"]) == [
        {"CUDA_VISIBLE_DEVICES": "0,1"},
        {"CUDA_VISIBLE_DEVICES": "2,3"},
    ]
    assert worker_device_env(None, 2, ["0"]) == [{}, {}]
    with pytest.raises(InvalidArgumentError, match="needs 4 GPUs; this machine has 3"):
        worker_device_env(2, 2, ["4", "5", "6"])


def test_gpu_ids_follow_cuda_visible_devices_only_with_cupy():
    ids = gpu_ids({"CUDA_VISIBLE_DEVICES": "3, 5"})
    try:
        import cupy  # noqa: F401
    except ImportError:
        assert ids == []
    else:
        assert ids == ["3", "5"]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"num_ps": 1, "num_workers": 300}, "num_workers 300 must be between 1 and 256"),
        ({"num_ps": True, "num_workers": 1}, "num_ps True must be an integer"),
        ({"num_ps": 1, "num_workers": 1, "devices_per_worker": 0}, "devices_per_worker 0"),
        ({"num_ps": 1, "num_workers": 1, "host": "0.0.0.0"}, "host '0.0.0.0'"),
        ({"num_ps": 1, "num_workers": 1, "ready_timeout": 0}, "ready_timeout 0"),
        ({"num_ps": 1, "num_workers": 1, "grace": -1}, "grace -1"),
    ],
)
def test_config_rejects_bad_values_by_name(kwargs, needle):
    with pytest.raises(InvalidArgumentError, match=re.escape(needle)):
        LocalClusterConfig(target=Target(HELLO, None), **kwargs)

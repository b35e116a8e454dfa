"""``python -m chief``: the user's program as ``__main__``, the chief-task check, exit codes.

Exit codes are checked on real ``python -m chief`` processes (what Kubeflow
sees); the argument splitting and the ``TF_CONFIG`` check also in-process.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from chief.__main__ import check_chief_task, run_chief
from chief.pdeathsig import EXIT_PARENT_GONE, wrap
from chief.script import Target, split_command
from psflow.distribute.cluster_resolver import TaskNotFoundError
from psflow.errors import InvalidArgumentError
from psflow.exit_codes import ExitCode, is_retryable
from tests.conftest import ROOT, child_env, pid_alive, wait_gone

PROGRAM = """
import json, os, sys
import psflow.errors
print("RAN", json.dumps({"argv": sys.argv, "name": __name__, "path0": sys.path[0]}), flush=True)
what = sys.argv[1] if len(sys.argv) > 1 else "ok"
if what == "value":
    raise ValueError("learning rate -1 is negative")
if what == "unavailable":
    raise psflow.errors.UnavailableError("ps:0 is gone", task="ps:0")
if what == "deadline":
    raise psflow.errors.DeadlineExceededError("push took too long", task="ps:1")
if what == "exit":
    sys.exit(int(sys.argv[2]))
if what == "exit-text":
    sys.exit("giving up: no data")
"""

CLUSTER = {"chief": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"], "worker": ["127.0.0.1:3"]}


def _tf_config(task_type: str | None = "chief", index: int = 0, cluster=None) -> str:
    config: dict = {"cluster": CLUSTER if cluster is None else cluster}
    if task_type is not None:
        config["task"] = {"type": task_type, "index": index}
    return json.dumps(config)


def _env(tf_config: str | None = None) -> dict[str, str]:
    env = child_env()
    env.pop("TF_CONFIG", None)
    if tf_config is not None:
        env["TF_CONFIG"] = tf_config
    return env


def _chief(*args: str, tf_config: str | None = None, timeout: float = 60):
    return subprocess.run(
        [sys.executable, "-m", "chief", *args],
        capture_output=True,
        text=True,
        env=_env(tf_config),
        cwd=ROOT,
        timeout=timeout,
    )


@pytest.fixture
def program(tmp_path):
    path = tmp_path / "program.py"
    path.write_text(PROGRAM)
    return str(path)


# -- exit codes ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "status", "stderr"),
    [
        ((), 0, None),
        (("value",), 1, r"ValueError: learning rate -1 is negative"),
        (("unavailable",), 138, r"UnavailableError: ps:0 is gone \(task ps:0\)"),
    ],
)
def test_exit_status_of_the_chief_process_follows_the_program(program, args, status, stderr):
    result = _chief(program, *args)
    assert result.returncode == status, result.stderr
    ran = json.loads(re.search(r"^RAN (\{.*\})$", result.stdout, re.M).group(1))
    assert ran["argv"] == [program, *args] and ran["name"] == "__main__"
    assert ran["path0"] == os.path.dirname(program)
    if stderr:
        assert re.search(stderr, result.stderr), result.stderr
        # The user's traceback, without the launcher's frames; then the verdict.
        assert 'program.py", line' in result.stderr
        assert "chief/__main__.py" not in result.stderr and "runpy" not in result.stderr
        kind = "retryable" if status == 138 else "not retryable"
        assert f"exit {status} ({kind})" in result.stderr
        assert is_retryable(status) == (status == ExitCode.RETRYABLE)


@pytest.mark.parametrize(
    ("args", "status", "stderr"),
    [
        (("deadline",), 138, "DeadlineExceededError: push took too long"),
        (("exit", "7"), 7, ""),
        (("exit", "0"), 0, ""),
        (("exit-text",), 1, "giving up: no data"),
    ],
)
def test_exit_status_in_process(program, capsys, args, status, stderr):
    argv, path = sys.argv[:], sys.path[:]
    assert run_chief(Target(program, None, args), environ={}) == status
    assert (sys.argv, sys.path) == (argv, path)  # restored
    captured = capsys.readouterr()
    assert captured.out.startswith("RAN ") and stderr in captured.err


def test_runs_as_the_chief_of_a_cluster_and_as_a_module(tmp_path):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(PROGRAM)
    result = subprocess.run(
        [sys.executable, "-m", "chief", "--log-level", "debug", "-m", "mypkg.train", "exit", "0"],
        capture_output=True,
        text=True,
        env=_env(_tf_config("chief")),
        cwd=tmp_path,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    ran = json.loads(re.search(r"^RAN (\{.*\})$", result.stdout, re.M).group(1))
    assert ran["argv"][1:] == ["exit", "0"] and ran["argv"][0].endswith("train.py")
    assert ran["name"] == "__main__"
    assert "running -m mypkg.train exit 0 as chief:0" in result.stderr


def test_a_tf_config_naming_another_task_exits_2_without_running(program):
    result = _chief(program, tf_config=_tf_config("worker"))
    assert result.returncode == ExitCode.USAGE_ERROR, result.stderr
    assert "names this task worker:0, not the chief; start worker tasks" in result.stderr
    assert "RAN" not in result.stdout  # nothing ran


@pytest.mark.parametrize(
    ("tf_config", "needle"),
    [
        (_tf_config("ps"), "start ps tasks with `python -m ps_server`"),
        (_tf_config(None), "TF_CONFIG has a cluster but no 'task'"),
        ('{"cluster": ', "TF_CONFIG is not valid JSON"),
        (_tf_config("chief", cluster={"chief": ["h:1"], "ps": ["h:2"]}), "at least one 'worker'"),
        (_tf_config("chief", 1), "task index 1 is out of range for job 'chief'"),
    ],
)
def test_a_tf_config_that_does_not_name_this_task_chief_exits_2(
    program, capsys, caplog, tf_config, needle
):
    assert run_chief(Target(program, None), environ={"TF_CONFIG": tf_config}) == 2
    assert needle in caplog.text
    assert "RAN" not in capsys.readouterr().out  # nothing ran


def test_sigterm_raises_in_the_program_so_finally_runs_and_exits_143(tmp_path):
    script = tmp_path / "slow.py"
    script.write_text(
        "import time\n"
        "try:\n"
        "    print('UP', flush=True)\n"  # inside the try: a signal right after it hits it
        "    time.sleep(60)\n"
        "except Exception:\n"
        "    print('SWALLOWED', flush=True)\n"  # a Terminated is no Exception
        "finally:\n"
        "    print('FINALLY', flush=True)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "chief", str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        cwd=ROOT,
    )
    try:
        assert proc.stdout.readline().strip() == "UP"  # bounded by the script's own sleep
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "FINALLY" in out and "SWALLOWED" not in out
    assert "stopped by SIGTERM" in err


def test_usage_errors_exit_2():
    result = _chief()
    assert result.returncode == 2 and "no script (or -m MODULE) to run" in result.stderr
    result = _chief("does-not-exist.py")
    assert result.returncode == 2 and "script 'does-not-exist.py' does not exist" in result.stderr


# -- in-process pieces --------------------------------------------------------------------
def test_check_chief_task():
    assert check_chief_task({}) is None
    assert check_chief_task({"TF_CONFIG": _tf_config("chief")}) == "chief:0"
    assert check_chief_task({"TF_CONFIG": _tf_config("master")}) == "chief:0"  # TF 1.x's name
    with pytest.raises(InvalidArgumentError, match=r"evaluator:0, not the chief$"):
        check_chief_task({"TF_CONFIG": _tf_config("evaluator")})
    with pytest.raises(TaskNotFoundError, match="'chief' is not a job"):
        check_chief_task(
            {"TF_CONFIG": _tf_config("chief", cluster={"ps": ["a:1"], "worker": ["b:1"]})}
        )


@pytest.mark.parametrize(
    ("argv", "own", "target"),
    [
        (["s.py"], [], Target("s.py", None, ())),
        (["--log-level", "INFO", "s.py", "--log-level", "x"], ["--log-level", "INFO"],
         Target("s.py", None, ("--log-level", "x"))),
        (["--log-level=INFO", "s.py"], ["--log-level=INFO"], Target("s.py", None, ())),
        (["-m", "pkg.mod", "-m", "x"], [], Target(None, "pkg.mod", ("-m", "x"))),
        (["-mpkg", "a"], [], Target(None, "pkg", ("a",))),
        (["--", "-odd.py", "a"], [], Target("-odd.py", None, ("a",))),
    ],
)  # fmt: skip
def test_split_command_stops_at_the_program(argv, own, target):
    assert split_command(argv, {"--log-level"}) == (own, target)


@pytest.mark.parametrize("argv", [[], ["--log-level", "INFO"], ["-m"], ["--"]])
def test_split_command_without_a_program_is_an_error(argv):
    with pytest.raises(InvalidArgumentError):
        split_command(argv, {"--log-level"})


# -- parent-death signal ------------------------------------------------------------------
def test_pdeathsig_child_dies_with_its_parent():
    # A parent that starts `sleep` through chief.pdeathsig, reports the pid, then waits.
    parent_code = (
        "import subprocess, sys, time\n"
        "from chief.pdeathsig import wrap\n"
        "p = subprocess.Popen(wrap(['/bin/sleep', '60']))\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code],
        stdout=subprocess.PIPE,
        text=True,
        env=_env(),
        cwd=ROOT,
    )
    child = None
    try:
        child = int(parent.stdout.readline())
        deadline = time.monotonic() + 10  # the wrapper execs into sleep: same pid
        while time.monotonic() < deadline and b"sleep" not in _cmdline(child):
            time.sleep(0.02)
        assert pid_alive(child)
        parent.kill()
        parent.wait(10)
        assert wait_gone([child], timeout=10) == []
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)
        if child is not None and pid_alive(child):
            os.kill(child, signal.SIGKILL)
        parent.stdout.close()


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def test_pdeathsig_refuses_to_start_when_the_parent_is_already_gone():
    # PID 1 is never this test's pid: the wrapper must see a different parent and stop.
    result = subprocess.run(
        wrap(["/bin/echo", "started"], parent_pid=1),
        capture_output=True,
        text=True,
        env=_env(),
        cwd=ROOT,
        timeout=30,
    )
    assert result.returncode == EXIT_PARENT_GONE
    assert "parent 1 is gone" in result.stderr and "started" not in result.stdout


# -- docstring examples -------------------------------------------------------------------
@pytest.mark.parametrize(
    "name",
    [
        "chief.script",
        "chief.local",
        "chief.pdeathsig",
        "chief.supervisor",
        "chief.restart",
        "chief.liveness",
        "psflow.cli",
    ],
)
def test_docstring_examples(name):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0

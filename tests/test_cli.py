"""The ``psflow`` command: exec'd entrypoints, ``cluster`` and ``health``.

``cluster`` and ``health`` run in-process through ``psflow.cli.main`` (the same
code as the console script) and once each as a real process; the exec'd
commands only as real processes (they replace the process that runs them).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from psflow.cli import check_address, describe_cluster, entrypoint_argv, main
from psflow.errors import InvalidArgumentError
from psflow.transport.service import SERVICE as PS_SERVICE
from tests.conftest import ROOT, child_env, pick_free_port, wait_gone

CLUSTER = {
    "chief": ["c0:2222"],
    "ps": ["p0:2222", "p1:2222"],
    "worker": ["w0:2222", "w1:2222"],
}


def _psflow(*args: str, env: dict[str, str] | None = None, timeout: float = 60):
    """Runs the ``psflow`` console script's code in a fresh interpreter."""
    code = "import sys; from psflow.cli import main; sys.exit(main())"
    base = child_env(env)
    if env is None or "TF_CONFIG" not in env:
        base.pop("TF_CONFIG", None)
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        env=base,
        cwd=ROOT,
        timeout=timeout,
    )


# -- cluster ------------------------------------------------------------------------------
def test_cluster_prints_the_spec_and_this_tasks_role(capsys):
    tf_config = json.dumps({"cluster": CLUSTER, "task": {"type": "worker", "index": 1}})
    assert main(["cluster"], environ={"TF_CONFIG": tf_config}) == 0
    info = json.loads(capsys.readouterr().out)
    assert info == {
        "cluster": CLUSTER,
        "task": {"type": "worker", "index": 1},
        "role": "worker:1",
        "address": "w1:2222",
        "embedded": False,
        "num_tasks": {"chief": 1, "ps": 2, "worker": 2},
    }


def test_cluster_without_tf_config_is_embedded(capsys):
    assert main(["cluster"], environ={}) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["embedded"] is True and info["cluster"] == {} and info["role"] is None


def test_cluster_reads_tf_config_from_the_option_and_from_a_file(capsys, tmp_path):
    text = json.dumps({"cluster": CLUSTER, "task": {"type": "master", "index": 0}})
    assert main(["cluster", "--tf-config", text], environ={}) == 0
    assert json.loads(capsys.readouterr().out)["role"] == "chief:0"  # TF 1.x's master
    path = tmp_path / "tf_config.json"
    path.write_text(json.dumps({"cluster": CLUSTER, "task": {"type": "ps", "index": 1}}))
    assert main(["cluster", "--tf-config", f"@{path}"], environ={"TF_CONFIG": "junk"}) == 0
    assert json.loads(capsys.readouterr().out)["address"] == "p1:2222"


def test_cluster_sparse_jobs_keep_their_indices(capsys):
    text = json.dumps(
        {
            "sparseCluster": {"ps": ["p0:1"], "worker": {"3": "w3:1"}},
            "task": {"type": "worker", "index": 3},
        }
    )
    assert main(["cluster", "--tf-config", text], environ={}) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["cluster"]["worker"] == {"3": "w3:1"} and info["address"] == "w3:1"


@pytest.mark.parametrize(
    ("tf_config", "needle"),
    [
        ('{"cluster": {"ps": ["a:1"]', "TF_CONFIG is not valid JSON"),
        ('{"cluster": {"ps": ["a:1"], "worker": ["b:1"]}, "task": {"type": "worker", "index": "x"}}',
         "TF_CONFIG['task']['index'] 'x' must be a non-negative integer"),
        ('{"cluster": {"ps": ["a:1"], "worker": ["b:1"]}, "task": {"type": "worker", "index": 4}}',
         "task index 4 is out of range for job 'worker'"),
        ('{"cluster": {"ps": ["a:1"]}}', "needs at least one 'worker' task"),
        ('{"cluster": {"ps": ["a:1"], "worker": ["a:1"]}}', "duplicate address 'a:1'"),
        ('{"cluster": {"ps": ["a:1"], "worker": ["b:1"], "trainer": ["c:1"]}}',
         "job 'trainer' is not allowed"),
        ('{"cluster": {"ps": "a:1", "worker": ["b:1"]}}', "the tasks of job 'ps' must be a list"),
        ('{"cluster": {"ps": ["a:1"], "worker": ["b:1"]}, "task": {"type": "worker"}}',
         "has a 'type' but no 'index'"),
    ],
)  # fmt: skip
def test_cluster_errors_name_the_bad_key_and_exit_2(capsys, tf_config, needle):
    assert main(["cluster"], environ={"TF_CONFIG": tf_config}) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert needle in captured.err


def test_cluster_no_ps_check_accepts_other_clusters(capsys):
    text = json.dumps({"cluster": {"trainer": ["t:1"]}, "task": {"type": "trainer", "index": 0}})
    assert main(["cluster", "--no-ps-check", "--tf-config", text], environ={}) == 0
    assert json.loads(capsys.readouterr().out)["role"] == "trainer:0"


def test_cluster_as_a_process_reads_the_environment():
    tf_config = json.dumps({"cluster": CLUSTER, "task": {"type": "ps", "index": 0}})
    result = _psflow("cluster", env={"TF_CONFIG": tf_config})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["role"] == "ps:0"
    bad = _psflow("cluster", env={"TF_CONFIG": '{"task": {"type": "ps", "index": 0}}'})
    assert bad.returncode == 2 and "task ps:0 cannot be in it" in bad.stderr


def test_describe_cluster_is_what_cluster_prints():
    text = json.dumps({"cluster": CLUSTER, "task": {"type": "chief", "index": 0}})
    assert describe_cluster(text)["address"] == "c0:2222"
    assert describe_cluster(None)["embedded"] is True


# -- health -------------------------------------------------------------------------------
def test_health_of_a_live_ps_is_serving(start_ps, capsys):
    ps = start_ps()
    assert main(["health", ps.address]) == 0
    assert capsys.readouterr().out == "SERVING\n"
    assert main(["health", ps.address, "--service", PS_SERVICE, "--timeout", "5"]) == 0
    assert capsys.readouterr().out == "SERVING\n"
    assert main(["health", ps.address, "--service", "no.such.Service"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "SERVICE_UNKNOWN\n" and "no.such.Service" in captured.err

    result = _psflow("health", ps.address)  # the exit code a healthcheck sees
    assert (result.returncode, result.stdout) == (0, "SERVING\n")

    assert ps.stop(signal.SIGTERM) == 0
    assert main(["health", ps.address, "--timeout", "2"]) == 1
    assert capsys.readouterr().out == "UNAVAILABLE\n"


def test_health_of_a_dead_port_fails_fast_with_1(capsys):
    port = pick_free_port()
    start = time.monotonic()
    assert main(["health", f"127.0.0.1:{port}", "--timeout", "3"]) == 1
    assert time.monotonic() - start < 3.5
    captured = capsys.readouterr()
    assert captured.out == "UNAVAILABLE\n" and f"127.0.0.1:{port}" in captured.err


def test_health_wait_is_bounded_by_the_timeout(capsys):
    port = pick_free_port()
    start = time.monotonic()
    assert main(["health", f"127.0.0.1:{port}", "--timeout", "1", "--wait"]) == 1
    assert 0.9 < time.monotonic() - start < 5
    assert capsys.readouterr().out == "DEADLINE_EXCEEDED\n"


@pytest.mark.parametrize("address", ["localhost", "host:", ":80", "host:99999", "::1:80", "h:x"])
def test_health_rejects_a_bad_address_with_2(capsys, address):
    assert main(["health", address]) == 2
    assert repr(address) in capsys.readouterr().err
    with pytest.raises(InvalidArgumentError, match=r"HOST\]?:PORT"):
        check_address(address)


def test_health_accepts_host_port_and_bracketed_ipv6():
    for address in ("127.0.0.1:80", "ps-0.svc:2222", "[::1]:80"):
        assert check_address(address) == address


def test_health_rejects_a_bad_timeout(capsys):
    assert main(["health", "127.0.0.1:1", "--timeout", "0"]) == 2
    assert "timeout 0.0 must be > 0" in capsys.readouterr().err


# -- exec'd entrypoints -------------------------------------------------------------------
def test_psflow_ps_is_python_m_ps_server(tmp_path):
    code = "import sys; from psflow.cli import main; sys.exit(main())"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "ps", "--port", "0", "--task", "ps:3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=child_env(),
        cwd=ROOT,
    )
    try:
        line = proc.stdout.readline()  # bounded: the server prints it or exits
        assert line.startswith("PSFLOW_READY ps port=") and "task=ps:3" in line
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        assert int(fields["pid"]) == proc.pid  # exec: the same process, no wrapper
        port = int(fields["port"])
        assert main(["health", f"127.0.0.1:{port}"]) == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()
    assert wait_gone([proc.pid], timeout=5) == []


def test_psflow_chief_passes_arguments_and_exit_codes_through(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import sys\nprint(sys.argv[1:])\nraise ConnectionAbortedError('x')\n")
    result = _psflow("chief", str(script), "--flag", "v")
    assert result.returncode == 1, result.stderr  # a plain error: not retryable
    assert result.stdout == "['--flag', 'v']\n"
    script.write_text("import psflow.errors as e\nraise e.AbortedError('step 3 applied')\n")
    assert _psflow("chief", str(script)).returncode == 138


def test_psflow_local_and_worker_pass_usage_errors_through():
    local = _psflow("local", "--ps", "1", "--workers", "0", "x.py")
    assert local.returncode == 2 and "psflow local" in local.stderr
    worker = _psflow("worker", "--port", "0")  # no --ps and no TF_CONFIG
    assert worker.returncode == 2 and "give --port and --ps" in worker.stderr


def test_entrypoint_argv_and_unknown_commands():
    assert entrypoint_argv("local", ["--ps", "1"]) == [
        sys.executable,
        "-m",
        "chief.local",
        "--ps",
        "1",
    ]
    with pytest.raises(InvalidArgumentError, match="unknown command 'evaluator'"):
        entrypoint_argv("evaluator", [])
    with pytest.raises(SystemExit) as exit_info:
        main(["evaluator"])
    assert exit_info.value.code == 2


def test_psflow_never_imports_the_process_packages():
    code = (
        "import sys, json\n"
        "import psflow, psflow.cli, psflow.distribute\n"
        "psflow.cli.describe_cluster(None)\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=child_env(), cwd=ROOT,
        timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert not {"ps_server", "worker", "chief", "cupy"} & set(json.loads(result.stdout))

"""The BLAS thread budget of every process psflow starts (psflow/thread_budget.py, chief/thread_plan.py).

The policy and the precedence are pure functions, tested by tables. The real
processes (``psflow local``, ``python -m ps_server|worker|chief``) report the
count their BLAS runs with, read with threadpoolctl inside each of them; the
reference is the plan computed here from the same cores.
"""

from __future__ import annotations

import doctest
import importlib
import json
import re
import subprocess
import sys

import pytest

from chief.local import LocalClusterConfig
from chief.script import Target
from chief.thread_plan import plan_threads
from psflow.errors import InvalidArgumentError
from psflow.launch import start_role
from psflow.thread_budget import (
    LIBRARY_THREAD_VARIABLES,
    ThreadBudget,
    available_cores,
    parse_threads,
    resolve_budget,
    share_cores,
)
from tests.conftest import ROOT, child_env, wait_gone

READY = re.compile(r"^\[(?P<role>\S+)\] PSFLOW_READY .* blas_threads=(?P<n>\S+)", re.M)
# The chief's program: the BLAS threads it runs with, read inside the process.
CHIEF_SCRIPT = """
import json, numpy, os, threadpoolctl
pools = [p["num_threads"] for p in threadpoolctl.threadpool_info() if p["user_api"] == "blas"]
print("CHIEF_BLAS", json.dumps({"pid": os.getpid(), "threads": pools}), flush=True)
"""


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """A child environment without any thread variable of the caller's."""
    env = child_env()
    for name in (*LIBRARY_THREAD_VARIABLES, "PSFLOW_BLAS_THREADS", "TF_CONFIG"):
        env.pop(name, None)
    env.update(extra or {})
    return env


@pytest.mark.parametrize("name", ["psflow.thread_budget", "chief.thread_plan"])
def test_docstring_examples(name) -> None:
    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0 and result.failed == 0


# -- the policy ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("cores", "num_ps", "num_compute", "expected"),
    [
        (2, 1, 2, (1, 1)),  # this host: psflow local --ps 1 --workers 1
        (2, 0, 2, (1, 1)),  # two trainers on two cores: one thread each
        (1, 1, 1, (1, 1)),  # never below one thread
        (8, 1, 3, (1, 2)),  # 7 cores left for 2 workers and the chief
        (16, 2, 3, (1, 4)),  # each PS keeps a core, the rest is split evenly
        (4, 8, 2, (1, 2)),  # more PS than cores: no core set aside for them
        (64, 0, 1, (1, 64)),  # a lone worker gets every core
    ],
)
def test_share_cores_gives_ps_one_thread_and_splits_the_rest(
    cores, num_ps, num_compute, expected
) -> None:
    assert share_cores(cores, num_ps, num_compute) == expected


def test_share_cores_rejects_a_negative_count() -> None:
    with pytest.raises(InvalidArgumentError, match="-1 ps"):
        share_cores(4, -1, 2)


@pytest.mark.parametrize(
    ("cpu_max", "expected"),
    [
        ("max 100000\n", None),  # no quota: the affinity
        ("100000 100000\n", 1),
        ("50000 100000\n", 1),  # half a core: still one thread
        ("250000 100000\n", 2),  # rounded down
        ("garbage\n", None),
    ],
)
def test_available_cores_is_capped_by_a_cgroup_quota(tmp_path, cpu_max, expected) -> None:
    path = tmp_path / "cpu.max"
    path.write_text(cpu_max)
    affinity = available_cores(str(tmp_path / "absent"))
    want = affinity if expected is None else min(affinity, expected)
    assert available_cores(str(path)) == want


# -- precedence ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("role", "environ", "expected"),
    [
        ("worker", {}, ThreadBudget(6, "auto", 6)),
        ("chief", {}, ThreadBudget(6, "auto", 6)),
        ("ps", {}, ThreadBudget(1, "auto", 6)),
        ("worker", {"PSFLOW_BLAS_THREADS": "auto"}, ThreadBudget(6, "auto", 6)),
        ("worker", {"PSFLOW_BLAS_THREADS": "0"}, ThreadBudget(6, "auto", 6)),
        ("ps", {"PSFLOW_BLAS_THREADS": "3"}, ThreadBudget(3, "PSFLOW_BLAS_THREADS", 6)),
        (
            "worker",
            {"PSFLOW_BLAS_THREADS": "3", "OPENBLAS_NUM_THREADS": "1"},
            ThreadBudget(1, "OPENBLAS_NUM_THREADS", 6),
        ),
        ("worker", {"OMP_NUM_THREADS": "4,2"}, ThreadBudget(4, "OMP_NUM_THREADS", 6)),
        ("worker", {"MKL_NUM_THREADS": "2"}, ThreadBudget(2, "MKL_NUM_THREADS", 6)),
        ("worker", {"OPENBLAS_NUM_THREADS": " "}, ThreadBudget(6, "auto", 6)),  # blank: unset
    ],
)
def test_resolve_budget_precedence(role, environ, expected) -> None:
    assert resolve_budget(role, environ, cores=6) == expected


@pytest.mark.parametrize(
    ("environ", "named"),
    [
        ({"PSFLOW_BLAS_THREADS": "many"}, "PSFLOW_BLAS_THREADS 'many'"),
        ({"PSFLOW_BLAS_THREADS": "-2"}, "PSFLOW_BLAS_THREADS '-2'"),
        ({"PSFLOW_BLAS_THREADS": "1.5"}, "PSFLOW_BLAS_THREADS '1.5'"),
        ({"PSFLOW_BLAS_THREADS": "99999"}, "PSFLOW_BLAS_THREADS '99999'"),
        ({"OPENBLAS_NUM_THREADS": "two"}, "OPENBLAS_NUM_THREADS='two'"),
        ({"OMP_NUM_THREADS": "x,2"}, "OMP_NUM_THREADS='x,2'"),
    ],
)
def test_resolve_budget_names_a_bad_value(environ, named) -> None:
    with pytest.raises(InvalidArgumentError, match=re.escape(named)):
        resolve_budget("worker", environ, cores=2)


def test_parse_threads_takes_counts_and_auto() -> None:
    assert [parse_threads(v, "X") for v in ("1", "16", " 4 ", "0", "auto", "AUTO", "")] == [
        1,
        16,
        4,
        None,
        None,
        None,
        None,
    ]


@pytest.mark.parametrize(
    ("threads", "environ", "expected", "source"),
    [
        (None, {}, {"ps": 1, "worker": 3, "chief": 3}, "auto"),  # 8 cores, 2 PS slots
        (2, {}, {"ps": 2, "worker": 2, "chief": 2}, "--threads-per-process"),
        (None, {"PSFLOW_BLAS_THREADS": "5"}, dict.fromkeys(("ps", "worker", "chief"), 5),
         "PSFLOW_BLAS_THREADS"),
        (2, {"PSFLOW_BLAS_THREADS": "5"}, dict.fromkeys(("ps", "worker", "chief"), 2),
         "--threads-per-process"),
        (2, {"OPENBLAS_NUM_THREADS": "1"}, dict.fromkeys(("ps", "worker", "chief"), 1),
         "OPENBLAS_NUM_THREADS"),
    ],
)  # fmt: skip
def test_plan_threads_precedence(threads, environ, expected, source) -> None:
    plan = plan_threads(2, 1, threads, environ, cores=8)
    assert (dict(plan.threads), plan.source) == (expected, source)
    assert plan.processes == 4
    if plan.inherited:  # the roles read the user's variable themselves
        assert plan.env("worker") == {}
    else:
        assert plan.env("worker") == {"PSFLOW_BLAS_THREADS": str(expected["worker"])}


def test_plan_threads_names_a_bad_environment_value() -> None:
    with pytest.raises(InvalidArgumentError, match="PSFLOW_BLAS_THREADS 'lots'"):
        plan_threads(1, 1, None, {"PSFLOW_BLAS_THREADS": "lots"}, cores=2)


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_local_config_rejects_a_bad_thread_count(tmp_path, bad) -> None:
    script = tmp_path / "s.py"
    script.write_text("")
    with pytest.raises(InvalidArgumentError, match=re.escape(f"threads_per_process {bad!r}")):
        LocalClusterConfig(1, 1, Target(str(script), ()), threads_per_process=bad)


# -- real processes -----------------------------------------------------------------------
def _local(tmp_path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    script = tmp_path / "chief.py"
    script.write_text(CHIEF_SCRIPT)
    return subprocess.run(
        [sys.executable, "-m", "chief.local", "--ps", "1", "--workers", "1", *args, str(script)],
        capture_output=True,
        text=True,
        env=env or _env(),
        cwd=ROOT,
        timeout=120,
    )


def _reported(run: subprocess.CompletedProcess) -> tuple[dict[str, int], list[int], int]:
    """Each ps/worker's ready-line count, the chief's BLAS pools, and the chief's pid."""
    ready = {m["role"]: int(m["n"]) for m in READY.finditer(run.stdout)}
    chief = json.loads(re.search(r"^\[chief\] CHIEF_BLAS (\{.*\})$", run.stdout, re.M).group(1))
    return ready, chief["threads"], chief["pid"]


@pytest.mark.slow
def test_psflow_local_gives_each_role_its_budget(tmp_path) -> None:
    run = _local(tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    plan = plan_threads(1, 1, None, {}, cores=available_cores())
    ready, chief, pid = _reported(run)
    assert ready == {"ps:0": plan.threads["ps"], "worker:0": plan.threads["worker"]}
    assert chief == [plan.threads["chief"]]
    assert f"[local] INFO BLAS threads per process: {plan.describe()}" in run.stderr
    assert wait_gone([pid], timeout=5) == []


@pytest.mark.slow
def test_psflow_local_threads_per_process_sets_every_role(tmp_path) -> None:
    # 3: above this host's 2 cores, so not what OpenBLAS would pick by itself here.
    run = _local(tmp_path, "--threads-per-process", "3")
    assert run.returncode == 0, run.stdout + run.stderr
    ready, chief, _ = _reported(run)
    assert ready == {"ps:0": 3, "worker:0": 3} and chief == [3]
    assert "ps 3, worker 3, chief 3 (from --threads-per-process" in run.stderr


@pytest.mark.slow
def test_psflow_local_respects_and_reports_a_users_openblas_threads(tmp_path) -> None:
    run = _local(tmp_path, "--threads-per-process", "2", env=_env({"OPENBLAS_NUM_THREADS": "1"}))
    assert run.returncode == 0, run.stdout + run.stderr
    ready, chief, _ = _reported(run)
    assert ready == {"ps:0": 1, "worker:0": 1} and chief == [1]
    assert "(from OPENBLAS_NUM_THREADS:" in run.stderr
    assert "OPENBLAS_NUM_THREADS in the environment wins over --threads-per-process 2" in run.stderr
    assert re.search(r"^\[worker:0\] .*blas_threads=1 \(OPENBLAS_NUM_THREADS=1;", run.stderr, re.M)


@pytest.mark.parametrize(
    ("args", "env", "named"),
    [
        (["--threads-per-process", "-3"], {}, "--threads-per-process '-3'"),
        (["--threads-per-process", "many"], {}, "--threads-per-process 'many'"),
        ([], {"PSFLOW_BLAS_THREADS": "x"}, "PSFLOW_BLAS_THREADS 'x'"),
        ([], {"OMP_NUM_THREADS": "lots"}, "OMP_NUM_THREADS='lots'"),
    ],
)
def test_psflow_local_bad_thread_value_is_a_usage_error_before_any_start(
    tmp_path, args, env, named
) -> None:
    run = _local(tmp_path, *args, env=_env(env))
    assert run.returncode == 2, run.stdout + run.stderr
    assert named in run.stderr
    assert "PSFLOW_READY" not in run.stdout and "CHIEF_BLAS" not in run.stdout


@pytest.mark.parametrize(
    ("module", "args", "env", "expected"),
    [
        ("ps_server", [], {}, 1),  # a lone PS: one thread
        ("worker", ["--ps", "127.0.0.1:1"], {}, available_cores()),  # its container's cores
        ("ps_server", [], {"PSFLOW_BLAS_THREADS": "3"}, 3),
        ("worker", ["--ps", "127.0.0.1:1"], {"OMP_NUM_THREADS": "1"}, 1),
    ],
)
def test_entrypoint_started_alone_reports_its_budget(module, args, env, expected) -> None:
    proc, ready = start_role(
        module, ["--port", "0", *args], env=_env(env), stderr=subprocess.DEVNULL, timeout=60
    )
    try:
        assert ready.fields["blas_threads"] == str(expected)
    finally:
        proc.kill()
        proc.wait(10)
        proc.stdout.close()


@pytest.mark.parametrize("module", ["ps_server", "worker", "chief"])
def test_entrypoint_names_a_bad_budget_and_exits_2(tmp_path, module) -> None:
    script = tmp_path / "chief.py"
    script.write_text(CHIEF_SCRIPT)
    args = {"ps_server": ["--port", "0"], "worker": ["--port", "0", "--ps", "127.0.0.1:1"]}
    run = subprocess.run(
        [sys.executable, "-m", module, *args.get(module, [str(script)])],
        capture_output=True,
        text=True,
        env=_env({"PSFLOW_BLAS_THREADS": "-4"}),
        cwd=ROOT,
        timeout=60,
    )
    assert run.returncode == 2, run.stdout + run.stderr
    assert "PSFLOW_BLAS_THREADS '-4'" in run.stderr
    assert "PSFLOW_READY" not in run.stdout and "CHIEF_BLAS" not in run.stdout

"""validate_ps_cluster, task strings, the resolver registry, GPU probes and exit codes."""

from __future__ import annotations

import re

import pytest

from psflow.distribute.cluster_resolver import (
    RESOLVERS,
    ClusterSpec,
    SimpleClusterResolver,
    TaskNotFoundError,
    TFConfigClusterResolver,
    accelerators,
    make_resolver,
    parse_task_string,
    task_string,
    validate_ps_cluster,
    visible_gpu_count,
)
from psflow.errors import (
    AbortedError,
    CancelledError,
    DeadlineExceededError,
    InternalError,
    InvalidArgumentError,
    PSUnavailableError,
    UnavailableError,
    WorkerUnavailableError,
)
from psflow.exit_codes import ExitCode, exit_code_for, is_retryable

GOOD = {"chief": ["c:1"], "ps": ["p0:1", "p1:1"], "worker": ["w0:1", "w1:1"]}


# -- validate_ps_cluster ------------------------------------------------------------


def test_valid_ps_clusters_pass():
    validate_ps_cluster(ClusterSpec(GOOD))
    validate_ps_cluster(GOOD)
    validate_ps_cluster({"ps": ["p:1"], "worker": ["w:1"]})
    validate_ps_cluster({**GOOD, "evaluator": ["e:1"]}, task_type="evaluator", task_id=0)
    validate_ps_cluster(GOOD, task_type="worker", task_id=1)
    validate_ps_cluster(GOOD, task_type="evaluator", task_id=0)  # evaluator outside the cluster


@pytest.mark.parametrize(
    ("cluster", "message"),
    [
        ({}, "empty"),
        ({"worker": ["w:1"]}, "at least one 'ps' task"),
        ({"ps": [], "worker": ["w:1"]}, "at least one 'ps' task"),
        ({"ps": ["p:1"], "chief": ["c:1"]}, "at least one 'worker' task"),
        (
            {**GOOD, "chief": ["c0:1", "c1:1"]},
            "at most one 'chief' task, found 2: ['c0:1', 'c1:1']",
        ),
        ({**GOOD, "evaluator": ["e0:1", "e1:1"]}, "at most one 'evaluator' task, found 2"),
        ({**GOOD, "master": ["m:1"]}, "job 'master' is not allowed"),
        ({**GOOD, "worker": ["w0:1", "p1:1"]}, "duplicate address 'p1:1': tasks ps:1 and worker:1"),
    ],
)
def test_invalid_ps_clusters_are_named(cluster, message):
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        validate_ps_cluster(ClusterSpec(cluster))


def test_validate_ps_cluster_checks_the_task():
    with pytest.raises(TaskNotFoundError, match=r"task index 2 is out of range for job 'worker'"):
        validate_ps_cluster(GOOD, task_type="worker", task_id=2)
    with pytest.raises(TaskNotFoundError, match=r"'trainer'"):
        validate_ps_cluster(GOOD, task_type="trainer", task_id=0)
    with pytest.raises(InvalidArgumentError, match=r"'ps' given without a task id"):
        validate_ps_cluster(GOOD, task_type="ps")


def test_validate_ps_cluster_rejects_non_specs():
    with pytest.raises(InvalidArgumentError, match=r"\['p:1'\]"):
        validate_ps_cluster(["p:1"])


# -- task strings ------------------------------------------------------------------


def test_task_string_round_trip():
    assert task_string("ps", 0) == "ps:0"
    assert task_string("worker", 12) == "worker:12"
    assert parse_task_string("worker:12") == ("worker", 12)
    assert parse_task_string(task_string("chief", 0)) == ("chief", 0)


@pytest.mark.parametrize(
    ("task_type", "task_id", "named"),
    [("", 0, "''"), ("a:b", 0, "'a:b'"), (None, 0, "None"), ("ps", -1, "-1"), ("ps", "x", "'x'")],
)
def test_task_string_errors_name_the_value(task_type, task_id, named):
    with pytest.raises(InvalidArgumentError, match=re.escape(named)):
        task_string(task_type, task_id)


@pytest.mark.parametrize("text", ["ps", "ps:0:1", ":0", "ps:x", "ps:-1", 3])
def test_parse_task_string_errors_name_the_value(text):
    with pytest.raises(
        InvalidArgumentError, match=re.escape(repr(text)) if text != "ps:-1" else "'-1'"
    ):
        parse_task_string(text)


# -- registry ----------------------------------------------------------------------


def test_make_resolver_by_name():
    r = make_resolver("tfconfig", environ={})
    assert isinstance(r, TFConfigClusterResolver)
    s = make_resolver("simple", cluster_spec={"ps": ["p:1"]})
    assert isinstance(s, SimpleClusterResolver)
    assert set(RESOLVERS) == {"tfconfig", "slurm", "kubernetes", "simple"}


def test_make_resolver_unknown_name_lists_choices():
    with pytest.raises(
        InvalidArgumentError, match=r"'mpi'.*\['kubernetes', 'simple', 'slurm', 'tfconfig'\]"
    ):
        make_resolver("mpi")
    with pytest.raises(TypeError):
        RESOLVERS["mine"] = SimpleClusterResolver


# -- GPU probes ---------------------------------------------------------------------


def test_visible_gpu_count_reads_cuda_visible_devices():
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "0,1,3"}) == 3
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": ""}) == 0
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "GPU-1f2e, GPU-aa"}) == 2


def test_visible_gpu_count_without_variable_never_fails(monkeypatch, tmp_path):
    monkeypatch.setattr(accelerators, "_NVIDIA_PROC_GPUS", str(tmp_path / "absent"))
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    assert visible_gpu_count({}) == 0
    gpus = tmp_path / "gpus"
    gpus.mkdir()
    (gpus / "0000:17:00.0").mkdir()
    (gpus / "0000:65:00.0").mkdir()
    monkeypatch.setattr(accelerators, "_NVIDIA_PROC_GPUS", str(gpus))
    assert visible_gpu_count({}) == 2


def test_visible_gpu_count_parses_nvidia_smi(monkeypatch, tmp_path):
    monkeypatch.setattr(accelerators, "_NVIDIA_PROC_GPUS", str(tmp_path / "absent"))
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\necho 'GPU 0: H200 (UUID: GPU-a)'\necho 'GPU 1: H200 (UUID: GPU-b)'\n"
    )
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert visible_gpu_count({}) == 2
    smi.write_text("#!/bin/sh\nexit 3\n")
    assert visible_gpu_count({}) == 0


def test_cupy_gpu_count_never_fails():
    count = accelerators.cupy_gpu_count()
    assert isinstance(count, int) and count >= 0


# -- exit codes ----------------------------------------------------------------------


def test_exit_code_values_follow_kubeflow():
    assert ExitCode.OK == 0
    assert ExitCode.USER_ERROR == 1
    assert ExitCode.RETRYABLE == 138
    assert not is_retryable(ExitCode.OK)
    assert not is_retryable(ExitCode.USER_ERROR)
    assert not is_retryable(ExitCode.USAGE_ERROR)
    assert is_retryable(ExitCode.RETRYABLE)
    assert not is_retryable(127)
    assert is_retryable(128)
    assert is_retryable(137)  # SIGKILL, e.g. the OOM killer
    assert is_retryable(-9)  # subprocess's code for the same
    assert is_retryable(-15)


@pytest.mark.parametrize(
    "error",
    [
        UnavailableError("ps:0 unreachable"),
        PSUnavailableError("ps:0 lost"),
        WorkerUnavailableError("worker:1 lost"),
        DeadlineExceededError("push timed out"),
        AbortedError("step already applied"),
    ],
)
def test_transient_errors_exit_retryable(error):
    assert exit_code_for(error) is ExitCode.RETRYABLE


@pytest.mark.parametrize(
    "error",
    [
        InvalidArgumentError("bad shape"),
        CancelledError("cancelled"),
        InternalError("bug"),
        ValueError("plain"),
        ConnectionError("not a psflow error"),
        KeyboardInterrupt(),
    ],
)
def test_other_errors_exit_user_error(error):
    assert exit_code_for(error) is ExitCode.USER_ERROR

"""Starting a role and reading its ready line (psflow.launch), with real processes."""

from __future__ import annotations

import doctest
import subprocess

import pytest

from psflow import errors, launch
from tests.conftest import ROOT, child_env


def test_launch_doctests():
    result = doctest.testmod(launch)
    assert result.failed == 0 and result.attempted > 0


@pytest.mark.parametrize(
    "line",
    ["PSFLOW_READY", "PSFLOW_READY ps", "PSFLOW_READY ps port=x task=ps:0", "ready ps port=1"],
)
def test_malformed_ready_lines_are_not_ready(line):
    assert launch.parse_ready(line) is None


def test_a_ready_line_round_trips_through_its_format():
    line = launch.READY_FORMAT.format(role="worker", port=4242, task="worker:3", pid=7)
    ready = launch.parse_ready(line + " metrics_port=9100\n")
    assert (ready.role, ready.port, ready.task) == ("worker", 4242, "worker:3")
    assert ready.fields["pid"] == "7" and ready.fields["metrics_port"] == "9100"


@pytest.mark.slow
def test_start_role_returns_a_ready_ps_and_its_port():
    proc, ready = launch.start_role(
        "ps_server", ["--port", "0"], role="ps", env=child_env(), cwd=ROOT,
        stderr=subprocess.DEVNULL, timeout=60,
    )  # fmt: skip
    try:
        assert ready.role == "ps" and ready.port > 0 and ready.fields["pid"] == str(proc.pid)
    finally:
        proc.kill()
        proc.wait(10)
        proc.stdout.close()


@pytest.mark.slow
def test_a_role_that_exits_before_ready_is_a_typed_error():
    with pytest.raises(errors.FailedPreconditionError, match="exited with status 2"):
        launch.start_role(
            "ps_server", ["--port", "not-a-port"], env=child_env(), cwd=ROOT,
            stderr=subprocess.DEVNULL, timeout=60,
        )  # fmt: skip


@pytest.mark.slow
def test_a_role_not_ready_in_time_is_a_typed_error_naming_the_wait():
    with pytest.raises(errors.DeadlineExceededError, match=r"not ready within 0\.05s"):
        launch.start_role(
            "ps_server", ["--port", "0"], env=child_env(), cwd=ROOT,
            stderr=subprocess.DEVNULL, timeout=0.05,
        )  # fmt: skip

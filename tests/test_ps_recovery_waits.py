"""Waits for a lost parameter server end, on time, and say what they wait for.

Real PS processes on loopback: one killed for good, one frozen with SIGSTOP
(it accepts connections and answers nothing), and a chief process whose PS
dies mid-fit under ``BackupAndRestore`` with no one to restart it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from psflow import errors
from psflow.distribute.ps.grpc_connection import GrpcPSConnection
from psflow.distribute.ps.recovery import Progress, RecoveryConfig
from psflow.distribute.ps.session import PSSession
from psflow.exit_codes import ExitCode
from tests.conftest import ROOT, child_env

SLACK = 3.0
"""Seconds a wait may overrun its limit on a loaded 2-core machine (process and thread wake-ups)."""


# -- configuration -------------------------------------------------------------------------


def test_recovery_config_defaults_are_finite_and_read_from_the_environment():
    default = RecoveryConfig.from_environ({})
    assert default == RecoveryConfig(300.0, 5.0, 5.0)
    cfg = RecoveryConfig.from_environ(
        {
            "PSFLOW_PS_RECOVERY_TIMEOUT": "12.5",
            "PSFLOW_PS_PROBE_TIMEOUT": "1",
            "PSFLOW_WAIT_PROGRESS_INTERVAL": "2",
        }
    )
    assert (cfg.ps_timeout, cfg.probe_timeout, cfg.progress_every) == (12.5, 1.0, 2.0)


@pytest.mark.parametrize("raw", ["soon", "0", "-3", "inf", "nan"])
def test_recovery_config_rejects_a_bad_value_naming_the_variable(raw):
    with pytest.raises(errors.InvalidArgumentError) as info:
        RecoveryConfig.from_environ({"PSFLOW_PS_RECOVERY_TIMEOUT": raw})
    assert "PSFLOW_PS_RECOVERY_TIMEOUT" in str(info.value) and repr(raw) in str(info.value)


def test_recovery_config_rejects_an_infinite_or_non_positive_field_by_name():
    with pytest.raises(errors.InvalidArgumentError, match="probe_timeout"):
        RecoveryConfig(probe_timeout=0)
    with pytest.raises(errors.InvalidArgumentError, match="ps_timeout"):
        RecoveryConfig(ps_timeout=float("inf"))


def test_progress_logs_at_once_then_at_most_every_interval(caplog):
    now = [100.0]
    progress = Progress("waiting for ps:3", 60, 5, logging.getLogger("t"), clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="t"):
        for _ in range(11):  # 0, 1, ... 10 s
            progress.tick("UnavailableError: connection refused")
            now[0] += 1.0
    assert progress.lines == 3  # at 0, 5 and 10 s
    assert all("waiting for ps:3" in r.getMessage() for r in caplog.records)
    assert "5s of 60s (UnavailableError: connection refused)" in caplog.records[1].getMessage()


# -- real parameter servers ----------------------------------------------------------------


def _session(cluster) -> PSSession:
    return PSSession(
        [GrpcPSConnection(p.address, task=f"ps:{i}") for i, p in enumerate(cluster.ps)]
    )


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["killed", "frozen"])
def test_wait_ready_gives_up_on_time_naming_a_lost_ps_and_logs_what_it_waits_for(
    start_cluster, caplog, fault
):
    cluster = start_cluster(num_ps=2, num_workers=0)
    session = _session(cluster)
    try:
        session.wait_ready(10.0)  # both answer: returns at once
        victim = cluster.ps[1].proc
        os.kill(victim.pid, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        timeout = 4.0
        t0 = time.monotonic()
        with (
            caplog.at_level(logging.WARNING, logger="psflow.distribute"),
            pytest.raises(errors.PSUnavailableError) as info,
        ):
            # a probe deadline longer than the wait: the wait's own deadline must win
            session.wait_ready(timeout, probe_timeout=30.0, progress_every=1.0)
        took = time.monotonic() - t0
        assert timeout - 0.2 <= took <= timeout + SLACK, took
        assert info.value.task == "ps:1" and "ps:1" in str(info.value)
        lines = [r.getMessage() for r in caplog.records if "waits for" in r.getMessage()]
        assert lines and all("ps:1" in line for line in lines), lines
        if fault == "frozen":
            os.kill(victim.pid, signal.SIGCONT)
            session.wait_ready(30.0, probe_timeout=5.0)  # thawed: it answers again
    finally:
        if cluster.ps[1].proc.poll() is None:
            os.kill(cluster.ps[1].proc.pid, signal.SIGCONT)
        session.close()


@pytest.mark.slow
def test_wait_ready_returns_when_a_killed_ps_is_restarted_in_its_slot(start_cluster, caplog):
    cluster = start_cluster(num_ps=1, num_workers=0)
    session = _session(cluster)
    try:
        os.kill(cluster.ps[0].proc.pid, signal.SIGKILL)
        cluster.ps[0].proc.wait(10)
        restarter = threading.Timer(1.5, lambda: cluster.restart_ps(0))
        restarter.start()
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="psflow.distribute"):
            # probes shorter than the outage: the first fails for sure, and says so
            session.wait_ready(60.0, probe_timeout=0.5, progress_every=1.0)
        restarter.join(30)
        assert time.monotonic() - t0 < 45
        messages = [r.getMessage() for r in caplog.records]
        assert any("ps:0 answers again" in m for m in messages), messages
    finally:
        session.close()


CHIEF_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    import psflow as pf
    from psflow.distribute.cluster_resolver import ClusterSpec, SimpleClusterResolver

    ps, worker, backup = sys.argv[1].split(","), sys.argv[2].split(","), sys.argv[3]
    spec = ClusterSpec({"ps": ps, "worker": worker, "chief": ["127.0.0.1:1"]})
    strategy = pf.distribute.ParameterServerStrategy(
        SimpleClusterResolver(spec, task_type="chief", task_id=0))
    with strategy.scope():
        model = pf.keras.Sequential([pf.keras.layers.Dense(4, input_shape=(6,)),
                                     pf.keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 6)).astype("float32"); y = x.sum(axis=1, keepdims=True)

    class Announce(pf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 3:
                print("STEP3", flush=True)
            time.sleep(0.02)

    model.fit(x, y, batch_size=16, epochs=50, verbose=0,
              callbacks=[pf.keras.callbacks.BackupAndRestore(backup), Announce()])
    print("DONE", flush=True)
    """
)


@pytest.mark.slow
def test_chief_exits_retryable_within_the_recovery_timeout_when_a_ps_never_returns(
    start_cluster, tmp_path
):
    cluster = start_cluster(num_ps=2, num_workers=1)
    script = tmp_path / "chief.py"
    script.write_text(CHIEF_SCRIPT)
    timeout = 5.0
    env = child_env({"PSFLOW_PS_RECOVERY_TIMEOUT": str(timeout)})
    args = [
        sys.executable,
        "-m",
        "chief",
        str(script),
        ",".join(p.address for p in cluster.ps),
        cluster.workers[0].address,
        str(tmp_path / "backup"),
    ]
    chief = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT
    )
    err_lines: list[tuple[float, str]] = []  # (arrival, line): when the chief said what
    reader = threading.Thread(
        target=lambda: err_lines.extend((time.monotonic(), line) for line in chief.stderr),
        daemon=True,
    )
    reader.start()
    try:
        line = ""
        deadline = time.monotonic() + 90
        while "STEP3" not in line and time.monotonic() < deadline:
            line = chief.stdout.readline()
            if not line and chief.poll() is not None:
                break
        assert "STEP3" in line, "".join(text for _, text in err_lines)[-3000:]
        os.kill(cluster.ps[1].proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        out = chief.stdout.read()  # until the chief exits
        chief.wait(timeout + 60)
        exited_at = time.monotonic()
    finally:
        if chief.poll() is None:
            chief.kill()
            chief.wait(30)
        reader.join(30)
    err = "".join(text for _, text in err_lines)
    assert chief.returncode == int(ExitCode.RETRYABLE), err[-3000:]
    # the wait starts with this line, and keeps its limit; noticing the loss (a closure's
    # push to the dead task failing) comes before it
    started = [t for t, text in err_lines if "parameter server ps:1 was lost" in text]
    assert started and "waiting up to 5s" in err, err[-3000:]
    assert exited_at - started[0] <= timeout + SLACK, (exited_at - started[0], err[-3000:])
    assert "waits for parameter server ps:1" in err, err[-3000:]  # its progress lines
    assert exited_at - killed_at <= timeout + 20, exited_at - killed_at
    assert "PSUnavailableError" in err and "ps:1 did not come back within 5s" in err, err[-3000:]
    assert "PSFLOW_PS_RECOVERY_TIMEOUT" in err, err[-3000:]
    assert "DONE" not in out


@pytest.mark.slow
def test_a_push_held_at_a_sync_barrier_says_so_and_gives_up_typed_on_time(start_cluster, caplog):
    import numpy as np

    import psflow as pf
    from psflow.distribute.ps.session import SyncConfig
    from psflow.distribute.ps.values import PSVariable

    cluster = start_cluster(num_ps=1, num_workers=0)
    timeout = 3.0
    session = PSSession(
        [GrpcPSConnection(cluster.ps[0].address, task="ps:0")],
        SyncConfig("sync", num_workers=2, timeout=timeout, progress_every=1.0),
        task="worker:0",
    )
    try:
        var = PSVariable(session, "barrier/w", "w", 0, (3,), "float32", True)
        session.create([var], [np.zeros(3, np.float32)])
        t0 = time.monotonic()
        with (
            caplog.at_level(logging.WARNING, logger="psflow.distribute"),
            pytest.raises(errors.DeadlineExceededError) as info,
            session.step(step=1),
        ):  # the other worker never pushes its gradient of step 1
            session.apply_optimizer(
                pf.keras.optimizers.SGD(0.1), [(np.ones(3, np.float32), var)], step=1
            )
        took = time.monotonic() - t0
        assert timeout - 0.2 <= took <= timeout + SLACK, took
        assert info.value.task == "ps:0"
        lines = [r.getMessage() for r in caplog.records if "barrier" in r.getMessage()]
        assert lines, [r.getMessage() for r in caplog.records]
        assert "worker:0 waits at the barrier of sync step 1 on ps:0 for 2 workers" in lines[0]
        ((value, _),) = session.connections[0].pull(["barrier/w"])
        np.testing.assert_array_equal(value, np.zeros(3, np.float32))  # nothing applied
    finally:
        session.close()


def test_sync_config_rejects_an_unbounded_barrier_wait():
    from psflow.distribute.ps.session import SyncConfig

    for bad in (0, -1, float("inf")):
        with pytest.raises(errors.InvalidArgumentError, match="sync timeout"):
            SyncConfig("sync", num_workers=2, timeout=bad)


def test_docstring_examples():
    import doctest

    from psflow.distribute.ps import recovery

    result = doctest.testmod(recovery)
    assert result.attempted > 0 and result.failed == 0

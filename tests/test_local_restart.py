"""``psflow local --restart on-failure``: roles that die are started again in their slot.

Real launchers, real roles on 127.0.0.1: a PS and then a worker are SIGKILLed
mid-fit and nobody intervenes; the run must complete every epoch with a loss
close to an undisturbed run, and the restarted PS must be read through its
shared-memory mirrors again.  Chief restarts follow the exit code's class.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from chief.local import main as local_main
from chief.restart import RestartBook, RestartMode, RestartPolicy
from psflow.errors import InvalidArgumentError
from psflow.transport import shm
from tests.conftest import ROOT, wait_gone
from tests.test_local_cluster import _env, _Launcher

EPOCHS = 8

TRAIN = f"""
import json, sys, time
import numpy as np
import psflow as pf

backup = sys.argv[1]
strategy = pf.distribute.ParameterServerStrategy()
rng = np.random.default_rng(0)
x = rng.normal(size=(512, 6)).astype("float32")
y = (x @ rng.normal(size=(6, 1)) + 0.1 * rng.normal(size=(512, 1))).astype("float32")
with strategy.scope():
    model = pf.keras.Sequential([pf.keras.layers.Dense(
        1, input_shape=(6,), kernel_initializer=pf.keras.initializers.GlorotUniform(seed=1))])
    model.compile(optimizer=pf.keras.optimizers.SGD(0.1), loss="mse")

class Announce(pf.keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        print("EPOCH", epoch, flush=True)
    def on_train_batch_end(self, batch, logs=None):
        if batch == 4:
            print("MID", self.epoch, flush=True)  # the test kills here: mid-epoch
        time.sleep(0.03)  # an epoch lasts long enough to be interrupted in the middle

history = model.fit(x, y, batch_size=32, epochs={EPOCHS}, verbose=0, shuffle=False,
                    callbacks=[pf.keras.callbacks.BackupAndRestore(backup), Announce()])
stats = strategy.ps_stats()
print("RESULT", json.dumps({{"loss": history.history["loss"],
                             "pulls": [int(s["pulls"]) for s in stats]}}), flush=True)
"""


@pytest.fixture
def launch():
    """Factory: ``launch(*args)`` -> a running launcher; every one is reaped at the end."""
    started: list[_Launcher] = []

    def start(*args: str) -> _Launcher:
        launcher = _Launcher(list(args), _env())
        started.append(launcher)
        return launcher

    try:
        yield start
    finally:
        for launcher in started:
            launcher.reap()


def _result(text: str) -> dict:
    match = re.search(r"^(?:\[chief\] )?RESULT (\{.*\})$", text, re.M)
    assert match, text[-4000:]
    return json.loads(match.group(1))


def _wait_after(run: _Launcher, start: int, pattern: str, timeout: float = 90.0) -> int:
    """Reads until ``pattern`` appears after offset ``start``; returns the end of the match."""
    deadline = time.monotonic() + timeout
    while True:
        match = re.compile(pattern, re.M).search(run.output, start)
        if match:
            return match.end()
        assert time.monotonic() < deadline and run.proc.poll() is None, (
            f"{pattern!r} not in the output after offset {start}:\n{run.output[-6000:]}"
        )
        run._read(0.2)


# -- the policy ---------------------------------------------------------------------------


def test_restart_policy_rejects_bad_values_by_name():
    with pytest.raises(InvalidArgumentError, match="max_restarts -1"):
        RestartPolicy(RestartMode.ON_FAILURE, max_restarts=-1)
    with pytest.raises(InvalidArgumentError, match=r"'sometimes'.*never, on-failure"):
        RestartMode.parse("sometimes")


def test_restart_book_restarts_failures_only_up_to_the_cap_with_growing_delays():
    book = RestartBook(RestartPolicy(RestartMode.ON_FAILURE, max_restarts=3, max_delay=1.5))
    assert [book.next_delay("ps:0", 137, is_chief=False) for _ in range(4)] == [
        0.5,
        1.0,
        1.5,
        None,
    ]
    assert book.next_delay("worker:0", 1, is_chief=False) == 0.5  # any failure of a server
    assert book.next_delay("chief", 1, is_chief=True) is None  # permanent: would fail again
    assert book.next_delay("chief", 138, is_chief=True) == 0.5  # retryable
    assert book.used("ps:0") == 3 and book.used("chief") == 1
    never = RestartBook(RestartPolicy())
    assert never.next_delay("ps:0", 137, is_chief=False) is None  # the default: as before


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--restart", "sometimes"], "restart mode 'sometimes' is not one of: never, on-failure"),
        (["--restart", "on-failure", "--max-restarts", "-2"], "max_restarts -2"),
    ],
)
def test_bad_restart_options_exit_2_before_anything_starts(capsys, args, needle):
    assert local_main(["--ps", "1", "--workers", "1", *args, "x.py"]) == 2
    assert needle in capsys.readouterr().err


# -- real clusters ------------------------------------------------------------------------

FLAKY_CHIEF = """
import pathlib, sys
marker = pathlib.Path(sys.argv[1])
runs = int(marker.read_text()) + 1 if marker.exists() else 1
marker.write_text(str(runs))
print("CHIEF_RUN", runs, flush=True)
sys.exit(int(sys.argv[2]) if runs == 1 else 0)
"""


@pytest.mark.slow
@pytest.mark.parametrize("first_status, restarted", [(138, True), (1, False)])
def test_chief_is_restarted_after_a_retryable_exit_only(launch, tmp_path, first_status, restarted):
    script = tmp_path / "chief.py"
    script.write_text(FLAKY_CHIEF)
    marker = tmp_path / "runs"
    run = launch("--restart", "on-failure", "--ps", "1", "--workers", "1",
                 str(script), str(marker), str(first_status))  # fmt: skip
    status = run.finish(timeout=90)
    if restarted:
        assert status == 0, run.output[-3000:]
        assert marker.read_text() == "2"
        assert "chief exited with status 138; restarting it" in run.output
    else:
        assert status == first_status, run.output[-3000:]
        assert marker.read_text() == "1" and "restarting" not in run.output


@pytest.mark.slow
def test_a_role_that_keeps_dying_is_restarted_up_to_the_cap_then_reported(launch, tmp_path):
    script = tmp_path / "chief.py"
    release = tmp_path / "release"
    script.write_text(
        "import pathlib, sys, time\n"
        "deadline = time.monotonic() + 90\n"
        "while not pathlib.Path(sys.argv[1]).exists() and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
    )
    run = launch("--restart", "on-failure", "--max-restarts", "1", "--ps", "1", "--workers",
                 "1", str(script), str(release))  # fmt: skip
    end = _wait_after(run, 0, r"starting the chief")
    for attempt in range(2):  # kill the worker, then its replacement
        pid = run.role_pids()["worker:0"]
        os.kill(pid, signal.SIGKILL)
        assert wait_gone([pid], timeout=10) == []
        if attempt == 0:
            end = _wait_after(run, end, r"worker:0 is back at")
    _wait_after(run, end, r"worker:0 exited with status 137 and was restarted 1 times already")
    release.touch()
    assert run.finish(timeout=60) == 0, run.output[-3000:]
    assert run.output.count("restarting it at") == 1
    stopped = re.search(r"stopped: (.*)$", run.output, re.M).group(1).split(", ")
    assert sorted(stopped) == ["chief=0", "ps:0=0", "worker:0=137", "worker:0=137"], stopped


@pytest.mark.slow
def test_killed_ps_then_worker_recover_without_a_human_and_training_completes(launch, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    # the undisturbed run: the same program, embedded (one process, nothing to lose)
    reference = subprocess.run(
        [sys.executable, "-m", "chief", str(script), str(tmp_path / "ref-backup")],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=ROOT,
        timeout=120,
    )
    assert reference.returncode == 0, reference.stderr[-3000:]
    ref_loss = _result(reference.stdout)["loss"]

    run = launch("--restart", "on-failure", "--ps", "2", "--workers", "2", str(script),
                 str(tmp_path / "backup"))  # fmt: skip
    end = _wait_after(run, 0, r"^\[chief\] MID 2$")
    ps1 = run.role_pids()["ps:1"]
    os.kill(ps1, signal.SIGKILL)
    end = _wait_after(run, end, r"ps:1 is back at 127\.0\.0\.1:\d+")
    end = _wait_after(run, end, r"^\[chief\] MID 5$")  # resumed from the backup, then on
    # mid-epoch, not at its start: a worker lost while its epoch iterator is being
    # created hangs the coordinator (see the report of this change)
    worker1 = run.role_pids()["worker:1"]
    os.kill(worker1, signal.SIGKILL)
    # the survivor may finish the run before the restarted worker is back: the restart
    # is what the launcher owes, the worker's return is the coordinator's business
    end = _wait_after(run, end, r"worker:1 exited with status 137; restarting it")
    assert run.finish(timeout=120) == 0, run.output[-5000:]

    out = run.output
    assert "ps:1 exited with status 137; restarting it" in out
    assert "worker:1 exited with status 137; restarting it" in out
    assert "parameter server ps:1 was lost" in out  # the chief rolled back to its backup
    result = _result(out)
    losses = result["loss"]
    assert len(losses) == EPOCHS == len(ref_loss)
    assert abs(losses[-1] - ref_loss[-1]) <= 0.05 * ref_loss[-1], (losses, ref_loss)
    if shm.enabled():
        # every role is on this host: after its restart ps:1 is read through its mirrors
        # again (each step would otherwise pull it over gRPC: 2 workers x dozens of steps)
        assert result["pulls"][1] <= 8, result
    assert wait_gone(run.role_pids().values(), timeout=10) == []


@pytest.mark.slow
def test_a_frozen_ps_fails_its_health_checks_and_is_restarted_in_its_slot(launch, tmp_path):
    script = tmp_path / "chief.py"
    release = tmp_path / "release"
    script.write_text(
        "import pathlib, sys, time\n"
        "deadline = time.monotonic() + 90\n"
        "while not pathlib.Path(sys.argv[1]).exists() and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
    )
    grace = 3.0
    run = launch("--restart", "on-failure", "--health-grace", str(grace), "--ps", "1",
                 "--workers", "1", str(script), str(release))  # fmt: skip
    end = _wait_after(run, 0, r"starting the chief")
    ps0 = run.role_pids()["ps:0"]
    port = re.search(r"PSFLOW_READY ps port=(\d+) task=ps:0", run.output).group(1)
    os.kill(ps0, signal.SIGSTOP)  # alive, but answers nothing: nothing exits by itself
    frozen_at = time.monotonic()
    try:
        end = _wait_after(run, end, r"ps:0 has not answered health checks for [\d.]+s", 60)
        noticed = time.monotonic() - frozen_at
        end = _wait_after(run, end, rf"ps:0 is back at 127\.0\.0\.1:{port} \(pid \d+", 60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(ps0, signal.SIGCONT)
    # counted from its last answer, up to one probe interval (grace / 3) before the freeze
    assert grace * 2 / 3 <= noticed <= grace + 10, noticed
    assert wait_gone([ps0], timeout=10) == []
    assert run.role_pids()["ps:0"] != ps0
    release.touch()
    assert run.finish(timeout=60) == 0, run.output[-3000:]
    assert "ps:0 exited with status 137; restarting it" in run.output

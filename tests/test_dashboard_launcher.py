"""The dashboard under ``psflow local``: exit statuses from the launcher, the final page, the loss.

``psflow local --dashboard`` shares a directory with its chief
(``psflow.dashboard.job_status``): a worker SIGKILLed for good shows as
``killed`` with its exit status and signal, with the ``--restart on-failure``
hint while restarts are off; when the chief exits, the launcher keeps serving
the job's final state on the same port. Real processes on 127.0.0.1 throughout.
The per-batch loss is compared with the same SGD steps done in NumPy.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import jsonschema
import numpy as np
import pytest

from chief.local import LocalClusterConfig
from chief.script import Target
from psflow.dashboard.app import start_dashboard
from psflow.dashboard.job_status import FinalDocument, JobStatus, RoleStatus, write_json
from psflow.errors import InvalidArgumentError
from tests.conftest import ROOT, child_env, pick_free_port

SCHEMA = json.loads(
    (pathlib.Path(__file__).parent / "schemas" / "cluster_api.schema.json").read_text()
)
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)

# A chief that trains until the test drops a flag file, then exits 0.
JOB = """
import os, sys, time
import numpy as np
import psflow as tf

flag = sys.argv[1]
x = np.random.default_rng(0).normal(size=(256, 3)).astype("float32")
y = x @ np.array([[1.0], [-2.0], [0.5]], "float32")
strategy = tf.distribute.ParameterServerStrategy()
with strategy.scope():
    model = tf.keras.Sequential([tf.keras.layers.Dense(1)])
    model.compile(optimizer=tf.keras.optimizers.SGD(0.01), loss="mse")
deadline = time.monotonic() + 150
while not os.path.exists(flag) and time.monotonic() < deadline:
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
print("job done", flush=True)
"""


def api(url: str) -> dict | None:
    """The schema-checked document at ``url``, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url + "api/cluster", timeout=5) as reply:
            doc = json.load(reply)
    except (OSError, ValueError):
        return None
    VALIDATOR.validate(doc)
    return doc


def wait_api(url, predicate, timeout, launcher, log) -> dict:
    deadline = time.monotonic() + timeout
    doc = None
    while time.monotonic() < deadline:
        doc = api(url)
        if doc is not None and predicate(doc):
            return doc
        assert launcher.poll() is None, f"psflow local exited early:\n{log.read_text()[-4000:]}"
        time.sleep(0.2)
    raise AssertionError(
        f"not reached in {timeout}s; last {str(doc)[:1500]}\n{log.read_text()[-3000:]}"
    )


def by_task(doc: dict) -> dict[str, dict]:
    return {t["task"]: t for t in doc["ps"] + doc["workers"]}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_killed_worker_hint_and_final_state_served_after_the_chief_exits(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    flag = tmp_path / "flag"
    port = pick_free_port()
    url = f"http://127.0.0.1:{port}/"
    log = tmp_path / "local.log"
    argv = [
        sys.executable, "-m", "chief.local", "--ps", "1", "--workers", "2", "--grace", "5",
        "--dashboard", str(port), "--dashboard-linger", "120", str(script), str(flag),
    ]  # fmt: skip
    with open(log, "w") as out:
        launcher = subprocess.Popen(
            argv, env=child_env(), stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
            start_new_session=True,
        )  # fmt: skip
    try:
        doc = wait_api(
            url,
            lambda d: (
                d["training"]["global_step"] > 0
                and all(w["state"] == "running" for w in d["workers"])
            ),
            120,
            launcher,
            log,
        )
        assert doc["job"] == {"restart": "never", "finished": False, "exit_codes": {}, "hint": None}
        assert all(t["exit"] is None for t in by_task(doc).values())

        # SIGKILL worker:1 for good: the launcher's exit status reaches the page.
        os.kill(by_task(doc)["worker:1"]["pid"], signal.SIGKILL)
        doc = wait_api(
            url, lambda d: by_task(d)["worker:1"]["state"] == "killed", 60, launcher, log
        )
        exit_ = by_task(doc)["worker:1"]["exit"]
        assert (exit_["status"], exit_["signal"]) == (137, "SIGKILL")
        assert exit_["description"] == "killed by SIGKILL (exit 137)"
        assert doc["job"]["exit_codes"] == {"worker:1": 137}
        assert "--restart on-failure" in doc["job"]["hint"] and "worker:1" in doc["job"]["hint"]
        assert by_task(doc)["worker:0"]["state"] in ("running", "ready")
        exited = [e for e in doc["events"] if e["kind"] == "task_exited"]
        assert [(e["task"], e["data"]["status"]) for e in exited] == [("worker:1", 137)]

        # The chief exits: the launcher stops the rest and keeps serving the last state.
        flag.write_text("")
        doc = wait_api(url, lambda d: d["job"]["finished"], 90, launcher, log)
        assert doc["job"]["exit_codes"] == {"chief": 0, "ps:0": 0, "worker:0": 0, "worker:1": 137}
        assert doc["training"]["state"] == "finished" and doc["training"]["global_step"] > 0
        states = {t: v["state"] for t, v in by_task(doc).items()}
        assert states == {"ps:0": "exited", "worker:0": "exited", "worker:1": "killed"}
        assert "--restart on-failure" in doc["job"]["hint"]  # still said on the final page
        with urllib.request.urlopen(url, timeout=5) as page:
            assert page.status == 200 and b'id="job"' in page.read()
        assert launcher.poll() is None  # lingering, as asked
        assert "shows its final state for 120 s" in log.read_text()
        # A signal ends the wait; the launcher's status is still the chief's.
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(30) == 0, log.read_text()[-3000:]
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(url, timeout=2)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(10)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_without_linger_the_launcher_exits_with_the_chief(tmp_path):
    # Not a terminal, no --dashboard-linger: psflow local exits as before, and removes its directory.
    script = tmp_path / "job.py"
    script.write_text(JOB)
    flag = tmp_path / "flag"
    flag.write_text("")  # the chief ends at once
    argv = [
        sys.executable, "-m", "chief.local", "--ps", "1", "--workers", "1", "--grace", "5",
        "--dashboard", str(script), str(flag),
    ]  # fmt: skip
    env = child_env({"TMPDIR": str(tmp_path)})
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=100, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "job done" in out.stdout and "shows its final state" not in out.stderr
    assert not list(tmp_path.glob("psflow-local-dashboard-*"))


def test_dashboard_linger_must_be_non_negative():
    target = Target(("job.py",), ())
    with pytest.raises(InvalidArgumentError, match="-1"):
        LocalClusterConfig(1, 1, target, dashboard_port=0, dashboard_linger=-1)
    with pytest.raises(InvalidArgumentError, match="nan"):
        LocalClusterConfig(1, 1, target, dashboard_port=0, dashboard_linger=float("nan"))


def test_a_garbled_role_file_leaves_the_page_as_without_a_launcher(tmp_path):
    assert JobStatus.from_json({"roles": {"worker:0": {"running": "?"}}}) is None
    assert JobStatus.from_json(["not", "an", "object"]) is None
    (tmp_path / "roles.json").write_text("{half a file")
    with start_dashboard({}, port=0, launcher_dir=str(tmp_path)) as dash:
        dash.monitor.probe_once()
        doc = dash.monitor.snapshot()
    VALIDATOR.validate(doc)
    assert doc["job"] is None
    # The chief left its final document behind for the launcher.
    final = json.loads((tmp_path / "dashboard.json").read_text())
    VALIDATOR.validate(final)


def test_final_document_without_the_chiefs_document_still_reports_exits(tmp_path):
    # A chief killed before its dashboard wrote anything: the launcher's word alone.
    roles = {
        "ps:0": RoleStatus("ps:0", 10, False, 0),
        "worker:0": RoleStatus("worker:0", 11, False, 143),
        "chief": RoleStatus("chief", 12, False, 137),
    }
    write_json(
        str(tmp_path / "roles.json"), JobStatus("on-failure", roles, finished=True).to_json()
    )
    doc = FinalDocument(str(tmp_path)).snapshot()
    VALIDATOR.validate(doc)
    assert doc["job"]["finished"] is True and doc["job"]["hint"] is None  # restarts were on
    assert doc["job"]["exit_codes"] == {"chief": 137, "ps:0": 0, "worker:0": 143}


def test_restarts_off_hint_names_only_failed_tasks():
    roles = {
        "ps:0": RoleStatus("ps:0", 1, True),
        "worker:0": RoleStatus("worker:0", 2, False, 0),  # drained or stopped: no failure
        "worker:1": RoleStatus("worker:1", 3, False, 1),
    }
    hint = JobStatus("never", roles).hint()
    assert hint.startswith("worker:1 exited with status 1 and restarts are off")
    assert JobStatus("on-failure", roles).hint() is None
    assert JobStatus("never", {"worker:0": roles["worker:0"]}).hint() is None


def test_loss_per_step_is_each_batchs_own_loss():
    # Reference: the same plain SGD on the same linear model, batch by batch, in NumPy.
    import psflow as pf

    pf.random.set_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 3)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5]], np.float32) + 0.3).astype(np.float32)
    lr, batch, epochs = 0.05, 16, 3
    with start_dashboard({}, port=0) as dash:
        model = pf.keras.Sequential([pf.keras.layers.Dense(1)])
        model.compile(optimizer=pf.keras.optimizers.SGD(lr), loss="mse")
        model.build((None, 3))
        w, b = (np.asarray(v, np.float64) for v in model.get_weights())
        history = model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
        doc = dash.monitor.snapshot()
    expected = []
    for _ in range(epochs):
        for i in range(0, len(x), batch):
            xb, yb = x[i : i + batch].astype(np.float64), y[i : i + batch].astype(np.float64)
            err = xb @ w + b - yb
            expected.append(float(np.mean(err**2)))
            w = w - lr * 2 * xb.T @ err / len(xb)
            b = b - lr * 2 * err.mean(axis=0)
    steps = doc["training"]["steps"]
    np.testing.assert_allclose([p["batch_loss"] for p in steps], expected, rtol=2e-4)
    # The running mean is still there, and is what Keras reports for the epoch.
    np.testing.assert_allclose(
        [p["loss"] for p in steps if p["step"] % 4 == 0], history.history["loss"], rtol=1e-5
    )

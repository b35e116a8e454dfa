"""The dashboard's JSON API against real PS and worker processes, and its access rules.

Every live document is validated against ``tests/schemas/cluster_api.schema.json``;
task states are driven by killing and restarting real processes; the training
series is compared with what ``Model.fit``'s History recorded.
"""

from __future__ import annotations

import json
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

from psflow.dashboard.app import start_dashboard
from psflow.dashboard.collector import ClusterMonitor
from psflow.dashboard.probe import ClusterProbe
from psflow.dashboard.server import DashboardServer
from psflow.errors import FailedPreconditionError, InvalidArgumentError
from psflow.observability.events import EventKind, EventLog
from psflow.security.config import SecurityConfig
from tests.conftest import child_env, pick_free_port

SCHEMA = json.loads(
    (pathlib.Path(__file__).parent / "schemas" / "cluster_api.schema.json").read_text()
)
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes, dict]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, reply.read(), dict(reply.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


def document(url: str) -> dict:
    status, body, headers = get(url + "api/cluster")
    assert status == 200 and headers["Content-Type"] == "application/json"
    doc = json.loads(body)
    VALIDATOR.validate(doc)
    return doc


def wait_for(url: str, predicate, timeout: float = 30.0) -> dict:
    """Polls the API until ``predicate(doc)``; every document seen is schema-checked."""
    deadline = time.monotonic() + timeout
    doc = document(url)
    while not predicate(doc):
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s; last document: {doc}")
        time.sleep(0.1)
        doc = document(url)
    return doc


def by_task(doc: dict, job: str) -> dict[str, dict]:
    return {t["task"]: t for t in doc["ps" if job == "ps" else "workers"]}


def test_schema_is_a_valid_draft_2020_12_schema():
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


@pytest.mark.slow
def test_api_tracks_lost_and_replaced_tasks(start_cluster):
    cluster = start_cluster(2, 2)
    with start_dashboard(cluster.spec(), port=0, interval=0.2) as dash:
        doc = wait_for(
            dash.url,
            lambda d: (
                all(p["state"] == "up" for p in d["ps"])
                and all(w["state"] == "ready" for w in d["workers"])
            ),
        )
        assert [p["task"] for p in doc["ps"]] == ["ps:0", "ps:1"]
        workers = by_task(doc, "worker")
        assert workers["worker:1"]["pid"] == cluster.workers[1].proc.pid
        assert doc["training"]["state"] == "idle"

        # A worker killed for good is lost, and says so once on the timeline.
        cluster.workers[1].proc.send_signal(signal.SIGKILL)
        doc = wait_for(dash.url, lambda d: by_task(d, "worker")["worker:1"]["state"] == "lost")
        assert by_task(doc, "worker")["worker:0"]["state"] == "ready"
        assert by_task(doc, "worker")["worker:1"]["error"]
        time.sleep(0.5)  # more failed rounds must not repeat the event
        lost = [e for e in document(dash.url)["events"] if e["kind"] == "worker_lost"]
        assert [e["task"] for e in lost] == ["worker:1"]
        # The message quotes the probe's error whole (it names the address), not cut inside it.
        error = " ".join(lost[0]["data"]["error"].split())
        assert len(error) <= 300 and lost[0]["message"] == f"worker:1 lost: {error}"

        # Another process in the slot: replaced, one restart, its new pid.
        new = cluster.restart_worker(1)
        doc = wait_for(dash.url, lambda d: by_task(d, "worker")["worker:1"]["state"] == "replaced")
        w1 = by_task(doc, "worker")["worker:1"]
        assert (w1["restarts"], w1["pid"]) == (1, new.proc.pid)
        assert "worker_replaced" in [e["kind"] for e in doc["events"]]

        # A PS that dies and comes back empty: lost, then up again holding nothing.
        cluster.ps[1].proc.send_signal(signal.SIGKILL)
        wait_for(dash.url, lambda d: by_task(d, "ps")["ps:1"]["state"] == "lost")
        cluster.restart_ps(1)
        doc = wait_for(dash.url, lambda d: by_task(d, "ps")["ps:1"]["state"] == "up")
        kinds = [(e["kind"], e["task"]) for e in doc["events"]]
        assert ("ps_lost", "ps:1") in kinds and ("ps_back", "ps:1") in kinds
        assert by_task(doc, "ps")["ps:1"]["variables"] == 0


@pytest.mark.slow
def test_ps_counters_and_rates_match_the_pushes_made(start_cluster):
    from psflow.transport.client import PSClient

    cluster = start_cluster(1, 1)
    client = PSClient(cluster.ps[0].address, "ps:0", timeout=30)
    client.create_variable("w", np.zeros(1000, np.float32))
    client.configure_optimizer(["w"], {"name": "sgd", "learning_rate": 0.1})
    with start_dashboard(cluster.spec(), port=0, interval=0.2) as dash:
        wait_for(dash.url, lambda d: d["ps"][0]["state"] == "up")
        for _ in range(5):
            client.push({"w": np.ones(1000, np.float32)})
        doc = wait_for(dash.url, lambda d: d["ps"][0]["pushes_applied"] == 5)
        ps0 = doc["ps"][0]
        reference = client.stats()  # the same RPC, asked directly
        assert ps0["variables"] == reference["num_variables"] == 1
        assert ps0["variable_bytes"] == reference["variable_bytes"] == 4000
        assert ps0["bytes_in"] == reference["bytes_in"]
        assert sum(b["count"] for b in ps0["staleness_histogram"]) == sum(
            reference["staleness_histogram"].values()
        )
        # no more pushes: the rate falls to zero within a round or two
        doc = wait_for(dash.url, lambda d: d["ps"][0]["pushes_per_second"] == 0.0)
    client.close()


def test_table_rows_by_tier_and_hit_rate_match_the_tables_stats(start_ps, tmp_path):
    from psflow.ps.dynamic_table import TableConfig
    from psflow.transport.embedding_client import EmbeddingClient

    ps = start_ps("--table-memory-rows", "16", "--table-dir", str(tmp_path / "tier"))
    with EmbeddingClient([ps.address], timeout=30) as tables:
        tables.create_table(TableConfig("users", dim=4))
        for start in range(0, 200, 50):  # 200 rows against a budget of 16: most go to disk
            tables.lookup("users", np.arange(start, start + 50, dtype=np.int64))
        tables.lookup("users", np.arange(0, 50, dtype=np.int64))  # back from disk
        with start_dashboard({"ps": [ps.address]}, port=0, interval=0.2) as dash:
            doc = wait_for(dash.url, lambda d: d["ps"][0]["tables"] != [])
            reference = tables.stats()[0]["users"]  # the same RPC, asked directly
        shown = doc["ps"][0]["tables"][0]
        assert shown["table"] == "users" and shown["rows"] == reference.rows == 200
        assert shown["disk_rows"] == reference.disk_rows > 0
        # the last lookup's rows wait in memory for its push (over the budget until then)
        assert shown["memory_rows"] == reference.memory_rows
        assert shown["memory_rows"] + shown["disk_rows"] == 200
        assert shown["hit_rate"] == pytest.approx(reference.hit_rate) and shown["hit_rate"] < 1
        assert shown["disk_bytes_read"] == reference.disk_bytes_read > 0


def test_a_table_without_a_tier_shows_every_row_in_memory(start_ps):
    from psflow.ps.dynamic_table import TableConfig
    from psflow.transport.embedding_client import EmbeddingClient

    ps = start_ps()
    with EmbeddingClient([ps.address], timeout=30) as tables:
        tables.create_table(TableConfig("items", dim=2))
        tables.lookup("items", np.arange(10, dtype=np.int64))
        with start_dashboard({"ps": [ps.address]}, port=0, interval=0.2) as dash:
            doc = wait_for(dash.url, lambda d: d["ps"][0]["tables"] != [])
    shown = doc["ps"][0]["tables"][0]
    assert (shown["rows"], shown["memory_rows"], shown["disk_rows"]) == (10, 10, 0)
    assert shown["hit_rate"] == 1.0 and shown["disk_bytes"] == 0


def test_fit_progress_is_what_history_recorded():
    import psflow as pf

    pf.random.set_seed(0)
    x = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
    y = x @ np.array([[1.0], [-2.0], [0.5]], np.float32)
    with start_dashboard({}, port=0) as dash:
        model = pf.keras.Sequential([pf.keras.layers.Dense(1)])
        model.compile(optimizer=pf.keras.optimizers.SGD(0.05), loss="mse")
        history = model.fit(x, y, batch_size=16, epochs=3, verbose=0)
        doc = document(dash.url)
    t = doc["training"]
    assert (t["state"], t["epoch"], t["epochs"], t["steps_per_epoch"]) == ("finished", 3, 3, 4)
    assert t["global_step"] == 12 and [p["step"] for p in t["steps"]] == list(range(1, 13))
    np.testing.assert_allclose([e["loss"] for e in t["epoch_logs"]], history.history["loss"])
    # the running loss at each epoch's last step is that epoch's loss
    last_steps = [p["loss"] for p in t["steps"] if p["step"] % 4 == 0]
    np.testing.assert_allclose(last_steps, history.history["loss"], rtol=1e-6)
    kinds = [e["kind"] for e in doc["events"]]
    assert kinds == ["training_started", "epoch_end", "epoch_end", "epoch_end", "training_ended"]


def test_page_and_static_files_are_served_from_the_package():
    with start_dashboard({}, port=0) as dash:
        status, body, headers = get(dash.url)
        assert status == 200 and headers["Content-Type"].startswith("text/html")
        for src in (b"/static/chart.js", b"/static/dashboard.js", b"/static/dashboard.css"):
            assert src in body
            code, script, _ = get(dash.url + src.decode()[1:])
            assert code == 200 and len(script) > 100
        assert b"http" not in get(dash.url + "static/dashboard.js")[1].split(b"\n", 3)[3]
        assert get(dash.url + "static/../server.py")[0] == 404
        assert get(dash.url + "nope")[0] == 404


def test_token_guards_the_dashboard_when_required():
    token = "t" * 32
    monitor = ClusterMonitor(ClusterProbe({}), EventLog())
    security = SecurityConfig(token=token)
    server = DashboardServer(monitor, "127.0.0.1", 0, security=security, require_token=True)
    try:
        url = server.url + "api/cluster"
        assert get(url)[0] == 401
        assert get(url, {"Authorization": "Bearer wrong"})[0] == 401
        assert get(url, {"Authorization": f"Bearer {token}"})[0] == 200
        status, _, headers = get(server.url + f"?token={token}")
        assert status == 200
        cookie = headers["Set-Cookie"].split(";")[0]
        assert "HttpOnly" in headers["Set-Cookie"]
        assert get(url, {"Cookie": cookie})[0] == 200
    finally:
        server.close()
        monitor.close()


def test_dashboard_refuses_bad_configuration():
    monitor = ClusterMonitor(ClusterProbe({}), EventLog())
    try:
        with pytest.raises(FailedPreconditionError, match=r"0\.0\.0\.0"):
            DashboardServer(monitor, "0.0.0.0", 0)  # refused before anything is bound
        with pytest.raises(FailedPreconditionError, match="token"):
            DashboardServer(monitor, "127.0.0.1", 0, require_token=True)
    finally:
        monitor.close()
    with pytest.raises(InvalidArgumentError, match="interval"):
        ClusterMonitor(ClusterProbe({}), EventLog(), interval=0)
    with pytest.raises(InvalidArgumentError, match="'ps'"):
        ClusterProbe({"ps": "127.0.0.1:1"})
    with pytest.raises(InvalidArgumentError, match="EventKind"):
        EventLog().record("worker_lost", "worker:0", "x")  # type: ignore[arg-type]
    assert EventLog().count(EventKind.WORKER_LOST) == 0


def test_chief_exits_2_when_the_dashboard_port_is_taken(tmp_path):
    import socket

    script = tmp_path / "noop.py"
    script.write_text("print('ran')\n")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "chief", "--dashboard-port", str(port), str(script)],
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 2
    assert "cannot start the dashboard" in proc.stderr and "ran" not in proc.stdout


def test_chief_serves_the_dashboard_while_the_script_runs(tmp_path):
    port = pick_free_port()
    script = tmp_path / "probe.py"
    script.write_text(
        "import json, urllib.request\n"
        f"doc = json.load(urllib.request.urlopen('http://127.0.0.1:{port}/api/cluster', "
        "timeout=10))\n"
        "print('version', doc['version'], 'workers', len(doc['workers']))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "chief", "--dashboard-port", str(port), str(script)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "version 1 workers 0" in proc.stdout
    assert f"dashboard at http://127.0.0.1:{port}/" in proc.stderr


def test_checkpoints_written_appear_on_the_timeline(tmp_path):
    import psflow as pf

    with start_dashboard({}, port=0) as dash:
        v = pf.Variable(np.arange(3, dtype=np.float32))
        manager = pf.train.CheckpointManager(pf.train.Checkpoint(v=v), str(tmp_path), max_to_keep=2)
        paths = [manager.save() for _ in range(2)]
        events = document(dash.url)["events"]
    written = [e for e in events if e["kind"] == "checkpoint_written"]
    assert [e["message"] for e in written] == [f"checkpoint {p}" for p in paths]


def test_without_a_dashboard_publishing_records_nothing():
    from psflow.observability import events, progress

    assert events.installed() is None and progress.installed() is None
    events.publish(EventKind.WORKER_LOST, "worker:0", "nobody listens")  # a no-op
    with start_dashboard({}, port=0) as dash:
        assert events.installed() is dash.monitor.events
    assert events.installed() is None and progress.installed() is None  # restored on close


@pytest.mark.parametrize(
    ("argv", "port"),
    [
        (["--dashboard", "run.py", "7"], 0),
        (["--dashboard", "8080", "run.py", "7"], 8080),
        (["--dashboard=8080", "run.py", "7"], 8080),
        (["--ps", "1", "run.py", "--dashboard", "7"], None),  # the script's own option
    ],
)
def test_local_dashboard_option_forms(argv, port):
    from chief import local

    parser = local._parser()
    options = local._value_options(parser)
    own, target = local.split_command(local._join_dashboard_port(argv, options), options)
    assert target.path == "run.py" and target.args[-1] == "7"
    args = parser.parse_args(["--ps", "1", "--workers", "1", *own])
    assert args.dashboard == port


def test_local_plans_the_dashboard_on_the_chief_only(tmp_path):
    from chief import local

    script = tmp_path / "run.py"
    script.write_text("pass\n")
    config = local.LocalClusterConfig(
        1, 1, local.Target(str(script), None, ()), dashboard_port=8123
    )
    roles = local.plan_roles(config, [5000, 5001, 5002])
    chief = [r for r in roles if r.task_type == "chief"][0]
    assert chief.argv[3:5] == ("--dashboard-port", "8123")
    assert all("--dashboard-port" not in r.argv for r in roles if r is not chief)


@pytest.mark.parametrize("port", [70000, -1])
def test_local_rejects_a_bad_dashboard_port(tmp_path, capsys, port):
    from chief import local

    script = tmp_path / "run.py"
    script.write_text("pass\n")
    status = local.main(["--ps", "1", "--workers", "1", f"--dashboard={port}", str(script)])
    assert status == 2
    assert f"dashboard port {port} must be an integer in 0..65535" in capsys.readouterr().err


@pytest.mark.parametrize(
    "module",
    [
        "psflow.observability.events",
        "psflow.observability.progress",
        "psflow.dashboard.server",
        "psflow.dashboard.app",
        "psflow.dashboard.terminal",
        "psflow.dashboard.job_status",
        "chief.local",
    ],
)
def test_docstring_examples(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_chief_refuses_a_dashboard_beyond_loopback_without_a_token(tmp_path):
    script = tmp_path / "noop.py"
    script.write_text("print('ran')\n")
    env = {
        k: v for k, v in child_env().items() if not k.startswith(("PSFLOW_AUTH_", "PSFLOW_TLS_"))
    }
    proc = subprocess.run(
        [sys.executable, "-m", "chief", "--dashboard-port", "0", "--dashboard-bind", "0.0.0.0",
         str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "refusing to serve on '0.0.0.0' without authentication" in proc.stderr
    assert "ran" not in proc.stdout


@pytest.mark.slow
def test_timeline_of_a_fit_that_loses_and_restores_a_ps(start_cluster, tmp_path):
    import os
    import threading

    import psflow as pf

    cluster = start_cluster(2, 1)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(384, 6)).astype(np.float32)
    y = (x @ rng.normal(size=(6, 1))).astype(np.float32)

    class KillPS(pf.keras.callbacks.Callback):
        steps = 0

        def on_train_batch_end(self, batch, logs=None):
            KillPS.steps += 1
            if KillPS.steps == 18:  # in the second of three 12-step epochs
                os.kill(cluster.ps[1].proc.pid, signal.SIGKILL)
                threading.Timer(0.5, lambda: cluster.restart_ps(1)).start()

    with start_dashboard(cluster.spec(), port=0, interval=0.2) as dash:
        strategy = pf.distribute.ParameterServerStrategy(cluster.resolver())
        with strategy.scope():
            model = pf.keras.Sequential([pf.keras.layers.Dense(1, input_shape=(6,))])
            model.compile(optimizer=pf.keras.optimizers.SGD(0.02), loss="mse")
        backup = pf.keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
        history = model.fit(x, y, batch_size=32, epochs=3, verbose=0, callbacks=[backup, KillPS()])
        doc = wait_for(dash.url, lambda d: by_task(d, "ps")["ps:1"]["state"] == "up")
    kinds = [(e["kind"], e["task"]) for e in doc["events"]]
    assert ("ps_restored", "ps:1") in kinds, kinds
    assert kinds.count(("checkpoint_written", "chief")) >= 2, kinds  # one backup per epoch
    assert kinds[0] == ("training_started", "chief")
    # the chief's last event ends training; the collector may see ps:1 back (its own
    # probe, every 0.2 s) only after a fast fit has ended, so "ps_back" may come later
    chief_events = [kind for kind, task in kinds if task == "chief"]
    assert chief_events[-1] == "training_ended", kinds
    t = doc["training"]
    assert t["state"] == "finished" and len(t["epoch_logs"]) == 3
    np.testing.assert_allclose([e["loss"] for e in t["epoch_logs"]], history.history["loss"])

"""Metrics and structured logs: the registry's format, then live servers scraped over HTTP.

The live tests send a known amount of traffic and check that each counter
moved by exactly that much.
"""

from __future__ import annotations

import doctest
import importlib
import io
import json
import logging
import time
import urllib.error
import urllib.request

import cloudpickle
import numpy as np
import pytest

from psflow.distribute.coordinator.workers import GrpcWorker
from psflow.errors import InvalidArgumentError, UnauthenticatedError
from psflow.observability.http import MetricsServer
from psflow.observability.logs import (
    JsonFormatter,
    LogFormat,
    configure_logging,
    current_context,
    log_context,
    set_log_context,
)
from psflow.observability.metrics import Registry, parse_exposition
from psflow.proto import worker_pb2
from psflow.security.config import SecurityConfig
from psflow.transport.client import PSClient
from tests.conftest import start_server


# -- the registry -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "module",
    [
        "psflow.observability.metrics",
        "psflow.observability.http",
        "psflow.observability.logs",
        "psflow.observability.flags",
        "psflow.http_server",
    ],
)
def test_observability_doctests(module):
    result = doctest.testmod(importlib.import_module(module))
    assert result.failed == 0 and result.attempted > 0


def test_exposition_format_and_round_trip():
    reg = Registry()
    c = reg.counter("t_requests_total", "Requests.\nSecond line.", ["path"])
    c.labels(path='a"b\\c\nd').inc(3)
    c.labels(path="plain").inc()
    g = reg.gauge("t_temperature", "A gauge.")
    g.inc(5)
    g.inc(-7.5)
    h = reg.histogram("t_seconds", "Latency.", ["op"], buckets=[0.1, 1.0])
    for v in (0.05, 0.1, 0.5, 2.0):
        h.labels(op="x").observe(v)
    text = reg.exposition()
    assert (
        "# HELP t_requests_total Requests. Second line.\n# TYPE t_requests_total counter\n" in text
    )
    assert 't_requests_total{path="a\\"b\\\\c\\nd"} 3.0\n' in text
    samples = parse_exposition(text)
    assert samples[("t_requests_total", (("path", 'a"b\\c\nd'),))] == 3
    assert samples[("t_temperature", ())] == -2.5
    buckets = [
        samples[("t_seconds_bucket", (("le", le), ("op", "x")))] for le in ("0.1", "1.0", "+Inf")
    ]
    assert buckets == [2, 3, 4]  # cumulative; 0.1 falls in le="0.1"
    assert samples[("t_seconds_count", (("op", "x"),))] == 4
    assert samples[("t_seconds_sum", (("op", "x"),))] == pytest.approx(2.65)


def test_registry_rejects_misuse_and_caps_series():
    reg = Registry(max_series=3)
    c = reg.counter("t_total", "c", ["k"])
    with pytest.raises(InvalidArgumentError, match="registered twice"):
        reg.counter("t_total", "again")
    with pytest.raises(InvalidArgumentError, match="invalid metric"):
        reg.gauge("bad-name", "x")
    with pytest.raises(InvalidArgumentError, match="cannot decrease"):
        reg.counter("u_total", "u").inc(-1)
    with pytest.raises(InvalidArgumentError, match="needs labels"):
        c.labels(other="x")
    for i in range(10):
        c.labels(k=str(i)).inc()
    samples = parse_exposition(reg.exposition())
    series = {labels: v for (name, labels), v in samples.items() if name == "t_total"}
    assert len(series) == 4 and series[(("k", "other"),)] == 7  # 3 kept, the rest pooled


def test_registry_reports_process_metrics_and_sets_gauge_maxima():
    reg = Registry()
    step = reg.gauge("t_step", "Highest step.")
    for v in (3, 9, 4):
        step.labels().set_max(v)
    samples = parse_exposition(reg.exposition())
    assert samples[("t_step", ())] == 9  # never lowered by a late, smaller step
    # prometheus-client's process collector (Linux /proc): CPU and memory of this process
    assert samples[("process_resident_memory_bytes", ())] > 0
    assert ("process_cpu_seconds_total", ()) in samples


def test_metrics_http_server_serves_only_metrics():
    reg = Registry()
    reg.counter("t_hits_total", "Hits.").inc(2)
    server = MetricsServer(reg, "127.0.0.1", 0)
    try:
        base = f"http://127.0.0.1:{server.port}"
        with urllib.request.urlopen(base + "/metrics", timeout=10) as reply:
            assert reply.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            assert parse_exposition(reply.read().decode())[("t_hits_total", ())] == 2
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(base + "/other", timeout=10)
        assert info.value.code == 404
    finally:
        server.close()


def test_json_log_lines_carry_role_task_step_and_request():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter("worker", "worker:3"))
    logger = logging.getLogger("test.metrics.json")
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    try:
        with log_context(step=12, request_id="sess/c4"):
            try:
                raise ValueError("boom")
            except ValueError:
                logger.exception("closure failed", extra={"closure": "f"})
        logger.info("outside")
    finally:
        logger.removeHandler(handler)
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["role"] == "worker" and first["task"] == "worker:3"
    assert (first["step"], first["request_id"], first["closure"]) == (12, "sess/c4", "f")
    assert first["level"] == "ERROR" and "ValueError: boom" in first["exception"]
    assert first["time"].endswith("Z")
    assert (second["step"], second["request_id"]) == (None, None)
    with pytest.raises(InvalidArgumentError, match="'yaml' is not one of"):
        LogFormat.parse("yaml")


def test_fields_set_inside_a_call_do_not_leak_to_the_next_one():
    """A push learns its step late (``set_log_context``); the call's block must undo it,
    or the next connection-level warning on that thread carries a stale ``step=``."""
    with log_context(request_id="ps:0/1"):
        set_log_context(step=7, request_id="client:3")
        assert current_context() == {"step": 7, "request_id": "client:3"}
    assert current_context() == {"step": None, "request_id": None}
    with log_context(step=2):  # an outer step stays for an inner block that sets none
        with log_context(request_id="r"):
            assert current_context() == {"step": 2, "request_id": "r"}
        assert current_context() == {"step": 2, "request_id": None}
    with pytest.raises(InvalidArgumentError, match="unknown log level"):
        configure_logging("ps", "ps:0", "LOUD", "text", stream=io.StringIO())


# -- a live PS -------------------------------------------------------------------------------
def _fields(server) -> dict[str, str]:
    return dict(f.split("=", 1) for f in server.ready_line.split() if "=" in f)


def scrape(server) -> dict:
    url = f"http://127.0.0.1:{_fields(server)['metrics_port']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        return parse_exposition(reply.read().decode())


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_ps_metrics_move_with_the_traffic(start_ps):
    ps = start_ps("--metrics-port", "auto", "--task", "ps:4", "--log-format", "json",
                  "--log-level", "DEBUG")  # fmt: skip
    t = {"task": "ps:4"}
    before = scrape(ps)
    assert value(before, "psflow_ps_variables", **t) == 0
    start = time.time()
    with PSClient(ps.address, task="ps:4", timeout=30, client_id="metrics-client") as client:
        client.create_variable(
            "m", np.zeros(1000, np.float32), optimizer={"name": "sgd", "learning_rate": 1.0}
        )
        for _ in range(5):
            version = client.pull("m", return_versions=True)[1]
            client.push({"m": np.ones(1000, np.float32)}, base_versions={"m": version})
        client.push({"m": np.ones(1000, np.float32)}, step=7, num_required=1, wait_applied=True)
        with pytest.raises(InvalidArgumentError):
            client.push({"m": np.ones(999, np.float32)}, push_id=("bad-client", 1))
    after = scrape(ps)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **t, **labels) - value(before, name, **t, **labels)

    assert moved("psflow_ps_push_bytes_total", variable="m") == 6 * 4000
    assert moved("psflow_ps_push_seconds_count", variable="m") == 6
    assert moved("psflow_ps_pull_bytes_total", variable="m") == 5 * 4000
    assert moved("psflow_ps_pull_seconds_count", variable="m") == 5
    assert moved("psflow_ps_rpcs_total", method="Push", code="OK") == 6
    assert moved("psflow_ps_rpcs_total", method="Push", code="INVALID_ARGUMENT") == 1
    assert moved("psflow_ps_rpc_seconds_count", method="Push") == 7
    assert moved("psflow_ps_rejected_total", reason="invalid_argument") == 1
    assert moved("psflow_ps_updates_applied_total", variable="m") == 5  # the async ones
    assert moved("psflow_ps_pushes_applied_total") == 6
    assert moved("psflow_ps_sync_steps_applied_total") == 1
    assert moved("psflow_ps_staleness_count") == 5
    assert value(after, "psflow_ps_staleness_bucket", le="0.0", **t) == 5  # pull, then push
    assert value(after, "psflow_ps_step", **t) == 7
    assert value(after, "psflow_ps_variables", **t) == 1
    assert value(after, "psflow_ps_variable_bytes", **t) == 4000
    seen = value(
        after, "psflow_ps_client_last_push_timestamp_seconds", client="metrics-client", **t
    )
    assert start - 1 <= seen <= time.time() + 1
    # a rejected push leaves no series behind (client ids are the caller's to invent)
    assert not any(
        dict(labels).get("client") == "bad-client"
        for name, labels in after
        if name == "psflow_ps_client_last_push_timestamp_seconds"
    )
    # JSON logs: the rejected push is logged with its push id as the request id
    records = [json.loads(x) for x in ps.log_tail(400).splitlines() if x.startswith("{")]
    rejected = [r for r in records if "Push rejected" in r["message"]]
    assert rejected and rejected[0]["request_id"] == "bad-client:1"
    assert (rejected[0]["role"], rejected[0]["task"]) == ("ps", "ps:4")


def test_unauthenticated_calls_are_counted(tmp_path):
    token = "metrics-token-0123456789"
    ps = start_server(
        "ps_server",
        ["--port", "0", "--metrics-port", "auto"],
        "PSFLOW_READY ps",
        log_dir=tmp_path,
        env={"PSFLOW_AUTH_TOKEN": token},
    )
    try:
        with PSClient(ps.address, security=SecurityConfig(), timeout=10) as client:
            for _ in range(3):
                with pytest.raises(UnauthenticatedError):
                    client.list_variables()
        samples = scrape(ps)
        assert (
            value(samples, "psflow_ps_rejected_total", task="ps:0", reason="unauthenticated") == 3
        )
        assert value(samples, "psflow_ps_rpcs_total", task="ps:0", method="ListVariables",
                     code="OK") == 0  # fmt: skip
    finally:
        ps.reap()


# -- a live worker ---------------------------------------------------------------------------
def test_worker_metrics_move_with_the_closures(start_ps, tmp_path):
    ps = start_ps()
    worker = start_server(
        "worker",
        ["--port", "0", "--ps", ps.address, "--workers", "1", "--task", "worker:2",
         "--metrics-port", "auto"],
        "PSFLOW_READY worker",
        log_dir=tmp_path,
    )  # fmt: skip
    client = GrpcWorker(2, worker.address)
    try:
        t = {"task": "worker:2"}
        before = scrape(worker)
        start = time.time()

        def run(fn, step, closure_id):
            request = worker_pb2.RunClosureRequest(
                session_id="metrics", closure_id=closure_id,
                function_key=f"once-{closure_id}" if closure_id > 1 else "kept",  # kept: a session
                function=cloudpickle.dumps(fn), step=step,
            )  # fmt: skip
            return client._call(client._stub.RunClosure, request, 30)

        for i in range(3):
            assert cloudpickle.loads(run(lambda: 7, 4 + i, i + 1).result) == 7
        assert run(lambda: 1 / 0, 9, 10).error.type == "ZeroDivisionError"
        after = scrape(worker)

        def moved(name: str, **labels: str) -> float:
            return value(after, name, **t, **labels) - value(before, name, **t, **labels)

        assert moved("psflow_worker_closures_total", outcome="ok") == 3
        assert moved("psflow_worker_closures_total", outcome="error") == 1
        assert moved("psflow_worker_closure_seconds_count") == 4
        assert moved("psflow_worker_rpcs_total", method="RunClosure", code="OK") == 4
        assert moved("psflow_worker_closure_bytes_total") > 0
        assert value(after, "psflow_worker_step", **t) == 9
        assert value(after, "psflow_worker_sessions", **t) == 1
        last = value(after, "psflow_worker_last_closure_timestamp_seconds", **t)
        assert start - 1 <= last <= time.time() + 1
    finally:
        client.close()
        worker.reap()

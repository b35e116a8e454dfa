"""A live PS against hostile requests outside the wire layer (issue 21).

Each test sends what an attacker sent — values that overflow, paths that are
files, JSON that nests 100,000 deep, names of a megabyte, a sync step that
never fills, client ids by the hundred — and checks that the answer is a
typed status (never UNKNOWN or INTERNAL), that a control variable is bit for
bit unchanged, and that the server keeps serving.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request

import grpc
import numpy as np
import pytest

from psflow.observability.metrics import parse_exposition
from psflow.proto import ps_pb2
from psflow.transport import framing
from psflow.transport.client import PSClient
from psflow.transport.service import method_path

CONTROL = np.arange(6, dtype=np.float32) / 3
BAD = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}


@pytest.fixture(scope="module")
def ps(start_ps_module):
    server = start_ps_module(
        "--max-tensor-bytes", str(1 << 20), "--max-sync-contributors", "4",
        "--metrics-port", "auto", "--shm", "off",
    )  # fmt: skip
    with PSClient(server.address, timeout=30) as client:
        client.create_variable("control", CONTROL, optimizer={"name": "sgd"})
    return server


def _call(address: str, method: str, payload, *, timeout: float | None = 10.0):
    """Sends raw bytes (or messages, for a stream); returns ``(code, details)``."""
    with grpc.insecure_channel(address) as channel:
        try:
            if method.endswith("Stream") and method != "PullStream":
                messages = payload if isinstance(payload, list) else [payload]
                channel.stream_unary(method_path(method))(iter(messages), timeout=timeout)
            else:
                channel.unary_unary(method_path(method))(payload, timeout=timeout)
        except grpc.RpcError as e:
            return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def _unchanged(server) -> None:
    with PSClient(server.address, timeout=30) as client:
        assert client.health() == "SERVING"
        assert client.pull("control").tobytes() == CONTROL.tobytes()


def _create(name: str, shape, optimizer_json: str = "", payload: bytes = b"") -> bytes:
    spec = ps_pb2.VariableSpec(name=name, trainable=True, optimizer_json=optimizer_json)
    spec.spec.dtype, spec.spec.shape[:] = 2, shape
    header = ps_pb2.WriteHeader(op=ps_pb2.WRITE_OP_CREATE, variables=[spec])
    return framing.encode_message(header.SerializeToString(), [payload])


def _push(client_id: str, seq: int, *, name="control", step=None, num_required=0, wait=False):
    header = ps_pb2.PushHeader(items=[ps_pb2.PushItem(name=name, base_version=-1)])
    header.id.client_id, header.id.sequence = client_id, seq
    header.items[0].values.dtype, header.items[0].values.shape[:] = 2, [6]
    if step is not None:
        header.step, header.num_required, header.wait_applied = step, num_required, wait
    return framing.encode_message(header.SerializeToString(), [np.zeros(6, np.float32).tobytes()])


def _scrape(server) -> tuple[str, dict]:
    fields = dict(f.split("=", 1) for f in server.ready_line.split() if "=" in f)
    url = f"http://127.0.0.1:{fields['metrics_port']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return text, parse_exposition(text)


@pytest.mark.slow
@pytest.mark.parametrize("shape", [[0, 2**63 - 1], [2**62, 0], [0, 1 << 40, 1 << 40]])
def test_an_empty_shape_with_a_huge_dimension_is_refused(ps, shape):
    for method in ("Write", "WriteStream"):
        code, details = _call(ps.address, method, _create("empty", shape))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert "even though the tensor is empty" in details
    code, details = _call(ps.address, "Push", _push("c", 1, name="control"))  # control works
    assert code == grpc.StatusCode.OK, details
    with PSClient(ps.address, timeout=30) as client:
        assert "empty" not in [v.name for v in client.list_variables()]
        client.assign("control", CONTROL)
    _unchanged(ps)


HOSTILE_OPTIMIZERS = [
    '{"name": "sgd", "learning_rate": 1' + "0" * 400 + "}",
    '{"name": "sgd", "momentum": -1' + "0" * 400 + "}",
    '{"name": "adam", "epsilon": 1' + "0" * 5000 + "}",  # beyond Python's int-from-text limit
    "[" * 100_000 + "]" * 100_000,
    '{"name": "sgd", "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
    '{"name": "sgd", "learning_rate": 1e999}',
]


@pytest.mark.slow
@pytest.mark.parametrize("text", HOSTILE_OPTIMIZERS, ids=range(len(HOSTILE_OPTIMIZERS)))
def test_hostile_optimizer_json_is_invalid_argument(ps, text):
    payload = np.zeros(2, np.float32).tobytes()
    for method in ("Write", "WriteStream"):
        code, details = _call(ps.address, method, _create("opt", [2], text, payload))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert len(details) < 5000
    request = ps_pb2.ConfigureOptimizerRequest(names=["control"], optimizer_json=text)
    code, details = _call(ps.address, "ConfigureOptimizer", request.SerializeToString())
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    with PSClient(ps.address, timeout=30) as client:
        assert "opt" not in [v.name for v in client.list_variables()]
        (info,) = [v for v in client.list_variables() if v.name == "control"]
        assert info.optimizer["learning_rate"] == 0.01  # sgd's default
    _unchanged(ps)


@pytest.mark.slow
def test_a_sync_push_waiting_without_a_client_deadline_completes(ps):
    with PSClient(ps.address, timeout=30) as client:
        before = client.stats()["bytes_in"]
    with grpc.insecure_channel(ps.address) as channel:
        push = channel.unary_unary(method_path("Push"))
        waiting = push.future(_push("a", 1, step=0, num_required=2, wait=True))  # no deadline
        try:
            with PSClient(ps.address, timeout=30) as client:  # "a" is in and waiting
                deadline = time.monotonic() + 20
                while client.stats()["bytes_in"] == before and not waiting.done():
                    assert time.monotonic() < deadline, "the first contribution never arrived"
                    time.sleep(0.05)
            push(_push("b", 1, step=0, num_required=2), timeout=30)
            assert ps_pb2.PushResponse.FromString(waiting.result(timeout=30)).applied
        finally:
            waiting.cancel()
    _unchanged(ps)  # zero gradients: the value is as it was


@pytest.mark.slow
def test_a_sync_step_is_bounded_by_the_contributor_limit(ps):
    for n in (2**31 - 1, 5):
        code, details = _call(ps.address, "Push", _push("big", 1, step=50, num_required=n))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
        assert "--max-sync-contributors=4" in details
    with PSClient(ps.address, timeout=30) as client:
        assert client.stats()["rejected"].get("too_many_contributors", 0) >= 2
    _unchanged(ps)


def _ps_with_tf_config(start_ps, workers: int):
    cluster = {"ps": ["127.0.0.1:1"], "worker": [f"127.0.0.1:{2 + i}" for i in range(workers)]}
    tf_config = json.dumps({"cluster": cluster, "task": {"type": "ps", "index": 0}})
    return start_ps("--shm", "off", env={"TF_CONFIG": tf_config})


@pytest.mark.slow
def test_the_contributor_limit_defaults_to_the_cluster_worker_count(start_ps):
    server = _ps_with_tf_config(start_ps, 3)
    with PSClient(server.address, timeout=30) as client:
        client.create_variable("control", CONTROL, optimizer={"name": "sgd"})
    code, details = _call(server.address, "Push", _push("w", 1, step=0, num_required=4))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-sync-contributors=3" in details
    for i in range(3):
        code, details = _call(server.address, "Push", _push(f"w{i}", 1, step=0, num_required=3))
        assert code == grpc.StatusCode.OK, details
    _unchanged(server)


@pytest.mark.slow
def test_bad_checkpoint_paths_are_typed_errors_and_change_nothing(ps, tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    cases = {
        "nul": (str(tmp_path / "a\0b"), grpc.StatusCode.INVALID_ARGUMENT),
        "file": (str(a_file), grpc.StatusCode.FAILED_PRECONDITION),
        "below a file": (str(a_file / "sub"), grpc.StatusCode.FAILED_PRECONDITION),
        "long": (str(tmp_path / ("n" * 5000)), grpc.StatusCode.INVALID_ARGUMENT),
        "long part": (str(tmp_path / ("n" * 300) / "x"), grpc.StatusCode.INVALID_ARGUMENT),
    }
    for label, (directory, code) in cases.items():
        got, details = _call(
            ps.address, "Save", ps_pb2.SaveRequest(directory=directory, step=9).SerializeToString()
        )
        assert got == code, (label, details)
        restore_code = grpc.StatusCode.NOT_FOUND if label == "below a file" else code
        got, details = _call(
            ps.address, "Restore", ps_pb2.RestoreRequest(directory=directory).SerializeToString()
        )
        assert got in (restore_code, code), (label, details)  # fmt: skip
    for prefix in ("../up", "a/b", ".", "p" * 300, "x\0y"):
        request = ps_pb2.SaveRequest(directory=str(tmp_path / "ok"), prefix=prefix)
        got, details = _call(ps.address, "Save", request.SerializeToString())
        assert got == grpc.StatusCode.INVALID_ARGUMENT, (prefix, details)
    missing = ps_pb2.RestoreRequest(directory=str(tmp_path / "missing" / "sub"))
    assert _call(ps.address, "Restore", missing.SerializeToString())[0] == (
        grpc.StatusCode.NOT_FOUND
    )
    assert not os.path.exists(tmp_path / "up")
    _unchanged(ps)


def _tamper(path, **fields) -> None:
    with open(path) as f:
        manifest = json.load(f)
    manifest.update(fields)
    with open(path, "w") as f:
        json.dump(manifest, f)


@pytest.mark.slow
def test_a_malformed_manifest_is_data_loss_and_changes_nothing(ps, tmp_path):
    save = ps_pb2.SaveRequest(directory=str(tmp_path), prefix="shard", step=3)
    assert _call(ps.address, "Save", save.SerializeToString())[0] == grpc.StatusCode.OK
    manifest = tmp_path / "shard.manifest.json"
    original = manifest.read_text()
    entry = json.loads(original)["variables"][0]
    big = json.loads('{"name": "sgd", "learning_rate": 1' + "0" * 400 + "}")
    tampered = [
        {"tensor_file": "."},
        {"tensor_file": ".."},
        {"tensor_file": "/etc/passwd"},
        {"step": "abc"},
        {"step": 1.5},
        {"variables": [{**entry, "optimizer": big}]},
        {"variables": [{**entry, "optimizer": {"name": "nope"}}]},
        {"variables": [{**entry, "shape": ["a"]}]},
        {"variables": [{**entry, "slots": {"momentum": 7}}]},
    ]
    for fields in tampered:
        manifest.write_text(original)
        _tamper(manifest, **fields)
        request = ps_pb2.RestoreRequest(directory=str(tmp_path), prefix="shard")
        code, details = _call(ps.address, "Restore", request.SerializeToString())
        assert code == grpc.StatusCode.DATA_LOSS, (fields, details)
    manifest.write_text('{"format": "psflow.shard.v1", "x": ' + "[" * 100_000 + "]" * 100_000)
    request = ps_pb2.RestoreRequest(directory=str(tmp_path), prefix="shard")
    code, details = _call(ps.address, "Restore", request.SerializeToString())
    assert code == grpc.StatusCode.DATA_LOSS, details
    request = ps_pb2.RestoreRequest(directory=str(tmp_path), names=["control"])
    code, details = _call(ps.address, "Restore", request.SerializeToString())
    assert code == grpc.StatusCode.DATA_LOSS, details
    _unchanged(ps)


@pytest.mark.slow
def test_long_names_are_refused_and_quoted_short(ps):
    huge = "n" * (1 << 20)
    code, details = _call(ps.address, "Write", _create(huge, [2], "", b"\0" * 8))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "above the limit of 1024" in details
    assert len(details) < 1000
    long = "m" * 20_000  # unknown: NOT_FOUND, quoted short enough for the status metadata
    code, details = _call(ps.address, "Pull", ps_pb2.PullRequest(
        items=[ps_pb2.PullItem(name=long)]).SerializeToString())  # fmt: skip
    assert code == grpc.StatusCode.NOT_FOUND and "(20000 chars)" in details, details
    code, details = _call(ps.address, "Push", _push("c", 1, name=long))
    assert code == grpc.StatusCode.NOT_FOUND, details
    code, details = _call(ps.address, "Push", _push("i" * 5000, 1))  # a client id as long
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    ok = "k" * 1024
    with PSClient(ps.address, timeout=30) as client:
        client.create_variable(ok, np.zeros(1, np.float32))
        assert ok in [v.name for v in client.list_variables()]
    _unchanged(ps)


@pytest.mark.slow
def test_client_ids_leave_bounded_metrics(ps):
    from psflow.observability.services import MAX_CLIENT_SERIES

    before = len(_scrape(ps)[0])
    for i in range(50):  # rejected: no series at all
        _call(ps.address, "Push", _push(f"{i}-" + "r" * 65_536, 1))
    with grpc.insecure_channel(ps.address) as channel:
        push = channel.unary_unary(method_path("Push"))
        for i in range(MAX_CLIENT_SERIES + 60):  # accepted, long ids: a bounded set, cut short
            push(_push(f"{i}-" + "a" * 1000, 1), timeout=10)
    text, samples = _scrape(ps)
    series = [labels for name, labels in samples
              if name == "psflow_ps_client_last_push_timestamp_seconds"]  # fmt: skip
    assert len(series) == MAX_CLIENT_SERIES
    assert all(len(dict(labels)["client"]) <= 128 for labels in series)
    assert "rrrr" not in text
    assert len(text) - before < 150_000, len(text)
    _unchanged(ps)


@pytest.mark.slow
def test_no_call_here_ended_unknown_or_internal(ps):
    """Runs last in this module: every call above got a typed status."""
    _, samples = _scrape(ps)
    codes = {dict(labels)["code"] for name, labels in samples if name == "psflow_ps_rpcs_total"}
    assert not codes & {"UNKNOWN", "INTERNAL"}, codes
    assert "Traceback" not in ps.log_tail(2000)

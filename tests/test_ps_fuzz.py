"""Hypothesis-generated requests against a live PS: typed errors, never a state change.

Each example is one Push or Write request built from random (often invalid)
parts: names, dtype codes, shapes, sparse indices, payload lengths.  The server
must either apply it or answer INVALID_ARGUMENT / NOT_FOUND / RESOURCE_EXHAUSTED /
FAILED_PRECONDITION with a message, and after a rejection every variable must
be bit for bit what it was.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from psflow.proto import ps_pb2
from psflow.transport import framing
from psflow.transport.client import PSClient
from psflow.transport.service import method_path

VARS = {"w": ((4, 3), np.float32), "b": ((3,), np.float32), "n": ((2,), np.int64)}
REJECT = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,  # a shape above --max-tensor-bytes
    grpc.StatusCode.ABORTED,  # a contribution to a sync step an earlier example applied
    grpc.StatusCode.ALREADY_EXISTS,  # a create conflicting with an earlier example's variable
}


@pytest.fixture(scope="module")
def fuzz_target(start_ps_module):
    server = start_ps_module("--max-tensor-bytes", str(1 << 24))
    with PSClient(server.address, timeout=30) as client:
        client.create_variables(
            {k: np.ones(s, d) for k, (s, d) in VARS.items() if k != "n"},
            optimizer={"name": "adam"},
        )
        client.create_variable("n", np.ones(2, np.int64), trainable=False)
    return server


names = st.sampled_from(["w", "b", "n", "missing", ""])
dtype_codes = st.sampled_from([0, 1, 2, 3, 6, 7, 9, 42])
shapes = st.lists(st.integers(-2, 6), max_size=3) | st.just([1 << 40]) | st.just([4, 3])


def _random_item(draw):
    shape = draw(shapes)
    code = draw(dtype_codes)
    sparse = draw(st.booleans())
    item = ps_pb2.PushItem(name=draw(names), sparse=sparse, base_version=draw(st.integers(-1, 5)))
    item.values.dtype = code
    item.values.shape.extend(shape)
    payload = b""
    itemsize = {1: 2, 2: 4, 3: 8, 6: 4, 7: 8, 9: 1}.get(code, 4)
    count = int(np.prod([max(d, 0) for d in shape] or [1])) if shape != [1 << 40] else 1
    nbytes = count * itemsize + draw(st.sampled_from([0, 0, 0, -1, 1, 4]))
    if sparse and shape and 0 <= shape[0] <= 16:
        rows = draw(st.lists(st.integers(-1, 5), min_size=shape[0], max_size=shape[0]))
        payload += np.array(rows, "<i8").tobytes()
    payload += draw(st.binary(min_size=max(nbytes, 0), max_size=max(nbytes, 0)))
    return item, payload


def _plausible_item(draw):
    """A well-formed gradient for w or b, sometimes with one thing wrong."""
    name = draw(st.sampled_from(["w", "b"]))
    shape, _ = VARS[name]
    sparse = draw(st.booleans())
    floats = st.floats(-10, 10, width=32)
    rows = draw(st.lists(st.integers(0, shape[0] - 1), max_size=4)) if sparse else []
    vshape = (len(rows), *shape[1:]) if sparse else shape
    values = np.array(
        draw(st.lists(floats, min_size=int(np.prod(vshape)), max_size=int(np.prod(vshape)))),
        np.float32,
    )
    flaw = draw(st.sampled_from([None] * 6 + ["row", "bytes", "name", "dtype"]))
    if flaw == "row" and sparse:
        rows = [*rows, shape[0]]
        vshape = (len(rows), *shape[1:])
        values = np.ones(int(np.prod(vshape)), np.float32)
    item = ps_pb2.PushItem(name="missing" if flaw == "name" else name, sparse=sparse)
    item.values.dtype = 3 if flaw == "dtype" else 2
    item.values.shape.extend(vshape)
    payload = (np.array(rows, "<i8").tobytes() if sparse else b"") + values.tobytes()
    if flaw == "dtype":
        payload += values.tobytes()
    if flaw == "bytes":
        payload = payload[:-1]
    return item, payload


@st.composite
def push_requests(draw):
    items, payload = [], b""
    for _ in range(draw(st.sampled_from([1, 1, 2, 2, 3, 0]))):
        item, data = draw(st.sampled_from([_plausible_item, _plausible_item, _random_item]))(draw)
        items.append(item)
        payload += data
    header = ps_pb2.PushHeader(items=items)
    header.id.client_id = draw(st.sampled_from(["fuzz"] * 9 + [""]))
    header.id.sequence = draw(st.integers(0, 10**6))
    if draw(st.integers(0, 4)) == 0:
        header.step = draw(st.integers(-1, 3))
        header.num_required = draw(st.integers(-1, 2))
    return framing.encode_message(header.SerializeToString(), [payload])


@st.composite
def write_requests(draw):
    op = draw(st.sampled_from([0, 1, 2, 3, 4, 9]))
    shape = draw(shapes)
    code = draw(dtype_codes)
    spec = ps_pb2.VariableSpec(name=draw(names), trainable=draw(st.booleans()))
    spec.spec.dtype = code
    spec.spec.shape.extend(shape)
    spec.optimizer_json = draw(st.sampled_from(["", '{"name": "sgd"}', "{bad", '{"name": "x"}']))
    header = ps_pb2.WriteHeader(op=op, variables=[spec])
    data = draw(st.binary(max_size=64))
    return framing.encode_message(header.SerializeToString(), [data])


def _state(client):
    return {k: client.pull(k).tobytes() for k in VARS}, {
        v.name: v.version for v in client.list_variables()
    }


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    request=st.one_of(
        push_requests().map(lambda r: ("Push", r)), write_requests().map(lambda r: ("Write", r))
    )
)
def test_random_requests_are_applied_or_rejected_without_change(fuzz_target, request):
    method, raw = request
    with (
        PSClient(fuzz_target.address, timeout=30) as client,
        grpc.insecure_channel(fuzz_target.address) as channel,
    ):
        before = _state(client)
        try:
            channel.unary_unary(method_path(method))(raw, timeout=30)
            event(f"{method}: OK")
        except grpc.RpcError as e:
            event(f"{method}: {e.code().name} {e.details()[:40]}")
            assert e.code() in REJECT, (e.code(), e.details())
            assert e.details()
            after = _state(client)
            # A Write that created a new variable is allowed only on success.
            assert after[0] == before[0], e.details()
            assert {k: after[1][k] for k in before[1]} == before[1]
            assert set(after[1]) == set(before[1])

"""A live worker against hostile closures and session ids (issue 21).

A closure's own failure is a reply, whatever the exception does: a ``__str__``
that raises, a message with a lone surrogate, a psflow error whose ``code``
is a bare int, ``sys.exit()``, ``KeyboardInterrupt``.  Sessions are bounded:
only sessions that hold something are kept, at most ``--max-sessions``, each
for at most ``--session-ttl`` seconds unused, with ids of at most 1 KB.
"""

from __future__ import annotations

import time

import cloudpickle
import grpc
import pytest

from psflow.errors import Code
from psflow.proto import worker_pb2
from tests.conftest import start_server

MAX_SESSIONS = 4
SESSION_TTL = 4.0


@pytest.fixture(scope="module")
def worker(start_ps_module, tmp_path_factory):
    ps = start_ps_module()
    server = start_server(
        "worker",
        ["--port", "0", "--ps", ps.address, "--workers", "1",
         "--max-sessions", str(MAX_SESSIONS), "--session-ttl", str(SESSION_TTL),
         "--metrics-port", "auto"],
        "PSFLOW_READY worker",
        log_dir=tmp_path_factory.mktemp("worker"),
    )  # fmt: skip
    try:
        yield server
    finally:
        server.reap()


def _call(address: str, method: str, request, reply_cls, timeout: float = 30.0):
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(
            f"/psflow.v1.Worker/{method}",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=reply_cls.FromString,
        )
        return call(request, timeout=timeout)


def _run(address: str, fn, session_id: str = "s", key: str = "once-f"):
    request = worker_pb2.RunClosureRequest(
        session_id=session_id, closure_id=1, function_key=key,
        function=cloudpickle.dumps(fn) if fn is not None else b"",
    )  # fmt: skip
    return _call(address, "RunClosure", request, worker_pb2.RunClosureResponse)


def _sessions(address: str) -> list[str]:
    reply = _call(address, "GetStatus", worker_pb2.GetStatusRequest(), worker_pb2.GetStatusResponse)
    return list(reply.session_ids)


def _hostile_closures():
    import sys

    from psflow import errors

    class Unprintable(Exception):
        def __str__(self):
            raise RuntimeError("no str for you")

    def bad_str():
        raise Unprintable()

    def surrogate():
        raise ValueError("lone \ud800 surrogate")

    def int_code():
        e = errors.InvalidArgumentError("int code")
        e.code = 3
        raise e

    def junk_code():
        e = errors.InvalidArgumentError("junk code")
        e.code = "abc"
        raise e

    def exits():
        sys.exit(3)

    def interrupts():
        raise KeyboardInterrupt

    return {
        "bad_str": (bad_str, "Unprintable", Code.UNKNOWN),
        "surrogate": (surrogate, "ValueError", Code.UNKNOWN),
        "int_code": (int_code, "InvalidArgumentError", Code.INVALID_ARGUMENT),
        "junk_code": (junk_code, "InvalidArgumentError", Code.UNKNOWN),
        "exits": (exits, "SystemExit", Code.UNKNOWN),
        "interrupts": (interrupts, "KeyboardInterrupt", Code.UNKNOWN),
    }


@pytest.mark.slow
@pytest.mark.parametrize("case", list(_hostile_closures()))
def test_a_misbehaving_closure_exception_is_an_error_reply(worker, case):
    fn, type_name, code = _hostile_closures()[case]
    start = time.monotonic()
    reply = _run(worker.address, fn)
    assert time.monotonic() - start < 20  # a reply, not the caller's deadline
    assert reply.HasField("error"), reply
    assert reply.error.type == type_name
    assert reply.error.code == code
    if case == "surrogate":
        assert "\\ud800" in reply.error.message
    assert worker.proc.poll() is None
    assert cloudpickle.loads(_run(worker.address, lambda: "alive").result) == "alive"


@pytest.mark.slow
def test_sessions_are_kept_only_when_they_hold_something_and_are_bounded(worker):
    for i in range(30):  # nothing kept: once- functions, a missing function
        assert _run(worker.address, lambda: 1, session_id=f"empty-{i}-" + "x" * 1000).result
        assert _run(worker.address, None, session_id=f"missing-{i}", key="k").function_missing
    assert _sessions(worker.address) == []
    long = "y" * (1 << 20)
    with pytest.raises(grpc.RpcError) as info:
        _run(worker.address, lambda: 1, session_id=long)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "limit of 1024" in info.value.details() and len(info.value.details()) < 1000
    for i in range(10):  # each keeps a function: only the last MAX_SESSIONS stay
        assert _run(worker.address, lambda: 2, session_id=f"kept-{i}", key="k").result
    assert _sessions(worker.address) == [f"kept-{i}" for i in range(10 - MAX_SESSIONS, 10)]
    # a dropped session's coordinator is told to send its function again
    assert _run(worker.address, None, session_id="kept-0", key="k").function_missing
    assert _run(worker.address, None, session_id="kept-9", key="k").result
    deadline = time.monotonic() + SESSION_TTL * 4
    while _sessions(worker.address):  # unused for --session-ttl: dropped
        assert time.monotonic() < deadline, _sessions(worker.address)
        time.sleep(0.2)


def _sync_of_this_worker():
    from psflow.distribute.ps import session

    sync = session.current().sync
    return sync.mode, sync.num_workers, sync.timeout


def _run_with(address: str, fn, training):
    request = worker_pb2.RunClosureRequest(
        session_id="training", closure_id=1, function_key="once-mode",
        function=cloudpickle.dumps(fn), training=training,
    )  # fmt: skip
    if training is None:
        request.ClearField("training")
    return _call(address, "RunClosure", request, worker_pb2.RunClosureResponse)


def test_the_training_mode_travels_with_the_closure_and_stays(worker):
    mode = worker_pb2.TrainingMode(mode="sync", num_workers=3, sync_timeout=42.0)
    reply = _run_with(worker.address, _sync_of_this_worker, mode)
    assert not reply.HasField("error"), reply.error
    assert cloudpickle.loads(reply.result) == ("sync", 3, 42.0)
    # a closure without a mode (an older chief) leaves the worker's as it is
    reply = _run_with(worker.address, _sync_of_this_worker, None)
    assert cloudpickle.loads(reply.result) == ("sync", 3, 42.0)
    back = worker_pb2.TrainingMode(mode="async", num_workers=1, sync_timeout=300.0)
    assert cloudpickle.loads(_run_with(worker.address, _sync_of_this_worker, back).result) == (
        "async", 1, 300.0,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("training", "quoted"),
    [
        (worker_pb2.TrainingMode(mode="eventually", num_workers=1, sync_timeout=5), "eventually"),
        (worker_pb2.TrainingMode(mode="sync", num_workers=0, sync_timeout=5), "num_workers"),
        (worker_pb2.TrainingMode(mode="sync", num_workers=2, sync_timeout=0), "timeout 0.0"),
        (
            worker_pb2.TrainingMode(
                mode="async", num_workers=1, sync_timeout=5, compression="int3"
            ),
            "int3",
        ),
    ],
)
def test_a_bad_training_mode_is_refused_and_changes_nothing(worker, training, quoted):
    before = cloudpickle.loads(_run_with(worker.address, _sync_of_this_worker, None).result)
    with pytest.raises(grpc.RpcError) as info:
        _run_with(worker.address, _sync_of_this_worker, training)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert quoted in info.value.details()
    after = cloudpickle.loads(_run_with(worker.address, _sync_of_this_worker, None).result)
    assert after == before

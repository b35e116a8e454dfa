"""Closures from the chief to a worker over the worker's data plane (real processes).

A worker serves ``RunClosure`` on a raw TCP data plane beside gRPC and
announces it in ``GetStatus``; the chief sends closures there.  The same
closures give the same results and the same typed errors as over gRPC; a
worker killed mid-closure is a lost worker (its closure runs elsewhere); a
wrong token is refused with a typed error; a plane that cannot be used sends
the closures back to gRPC with one log line; SIGTERM lets the running
closure finish as gRPC's drain does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time

import cloudpickle
import pytest

import psflow as pf
from psflow import errors, settings
from psflow.distribute.coordinator import closure as closure_lib
from psflow.distribute.coordinator.remote_value import RemoteValue
from psflow.distribute.coordinator.workers import Closure, GrpcWorker
from psflow.proto import worker_pb2
from psflow.security.config import SecurityConfig
from psflow.transport.dataplane import DataPlaneClient, frames
from tests.conftest import pick_free_port, start_server
from tests.test_auth import BAD_CLIENTS, GOOD, TOKEN
from tests.test_auth_tls import pki, tls, tls_cluster  # noqa: F401  (fixtures)
from tests.test_dataplane_ps import _closed, _hello, _read_frame
from tests.test_metrics import scrape, value


def _data_address(server) -> str:
    """The data plane a worker named in its ready line."""
    fields = dict(f.split("=", 1) for f in server.ready_line.split() if "=" in f)
    return f"127.0.0.1:{fields['data_port']}"


@pytest.fixture
def start_worker(tmp_path):
    """Factory: ``start_worker(ps, *flags, env=None)`` -> a ready worker, reaped after the test."""
    started = []

    def start(ps, *args: str, env: dict[str, str] | None = None):
        worker = start_server(
            "worker",
            ["--port", "0", "--ps", ps.address, "--workers", "1", *args],
            "PSFLOW_READY worker",
            log_dir=tmp_path,
            env=env,
        )
        started.append(worker)
        return worker

    try:
        yield start
    finally:
        for worker in started:
            worker.reap()


class _Runner:
    """Runs functions on one :class:`GrpcWorker` as the coordinator does (one session)."""

    def __init__(self, worker: GrpcWorker) -> None:
        self.worker = worker
        self.functions = closure_lib.FunctionCache()
        self._ids = iter(range(1, 1 << 30))

    def __call__(self, fn, *args, timeout: float | None = 60.0):
        cid = next(self._ids)
        return self.worker.run(
            "s", Closure(cid, fn, args, {}, RemoteValue(cid)), self.functions, timeout
        )


def _double(x):
    return {"twice": [x, x], "pid": os.getpid()}


def _raise_key():
    raise KeyError("missing-feature-17")


def _raise_psflow():
    raise pf.errors.InvalidArgumentError("bad closure input 23")


def _nap(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def _each_element_once_per_worker(taken: list[tuple[int, int]]) -> bool:
    """Whether each worker's own iterator handed out 0, 1, 2... once each."""
    by_worker: dict[int, list[int]] = {}
    for pid, element in taken:
        by_worker.setdefault(pid, []).append(element)
    return all(sorted(got) == list(range(len(got))) for got in by_worker.values())


def test_the_switch_is_on_by_default_and_off_names():
    assert settings.ProcessSettings.from_environment({}).closure_plane
    for off in ("0", "off", "false", "no"):
        env = {settings.ENV_CLOSURE_PLANE: off}
        assert not settings.ProcessSettings.from_environment(env).closure_plane


@pytest.mark.parametrize(
    "flags", [["--data-port", "-1"], ["--data-port", "70000"], ["--data-advertise", "nohost"]]
)
def test_a_worker_refuses_a_bad_data_plane_flag_naming_it(flags, capsys):
    from worker.__main__ import main

    assert main(["--port", "0", "--ps", "127.0.0.1:1", *flags]) == 2
    assert flags[0] in capsys.readouterr().err


@pytest.mark.slow
def test_closures_over_the_data_plane_give_what_grpc_gives(start_cluster, monkeypatch):
    """The same closures through a coordinator, the plane on then off: the same values, the
    same typed errors, a per-worker iterator read once per element."""
    cluster = start_cluster(num_ps=1, num_workers=2)
    outcomes = {}
    for plane in ("on", "off"):
        monkeypatch.setenv(settings.ENV_CLOSURE_PLANE, plane)
        strategy = pf.distribute.ParameterServerStrategy(cluster.resolver())
        with strategy.scope():
            v = pf.Variable([1.0, 2.0], name=f"v-{plane}")
        coordinator = pf.distribute.coordinator.ClusterCoordinator(strategy)
        iterator = iter(coordinator.create_per_worker_dataset(lambda: pf.data.Dataset.range(40)))

        def read(v=v):
            return v.numpy().tolist()

        def take(it):
            return os.getpid(), int(next(it))

        values = [coordinator.schedule(_double, args=(i,)) for i in range(20)]
        reads = [coordinator.schedule(read) for _ in range(4)]
        taken = [coordinator.schedule(take, args=(iterator,)) for _ in range(40)]
        coordinator.join()
        raised = []
        for boom in (_raise_key, _raise_psflow):
            coordinator.schedule(boom)
            with pytest.raises(Exception) as info:
                coordinator.join()
            raised.append((type(info.value), info.value.args))
        workers = [s.worker for s in coordinator._states]
        addresses = [w.data_plane_address for w in workers]
        if plane == "on":
            assert addresses == [_data_address(w) for w in cluster.workers]
        else:
            assert addresses == [None, None]
        outcomes[plane] = (
            [v.fetch()["twice"] for v in values],
            [r.fetch() for r in reads],
            _each_element_once_per_worker([t.fetch() for t in taken]),
            raised,
            {v.fetch()["pid"] for v in values} == {w.proc.pid for w in cluster.workers},
        )
        coordinator.shutdown()
    assert outcomes["on"] == outcomes["off"]
    assert outcomes["on"][2] is True
    assert outcomes["on"][3] == [
        (KeyError, ("missing-feature-17",)),
        (pf.errors.InvalidArgumentError, ("bad closure input 23",)),
    ]


@pytest.mark.slow
def test_a_worker_killed_mid_closure_is_lost_and_its_closures_finish_elsewhere(start_cluster):
    cluster = start_cluster(num_ps=1, num_workers=2)
    strategy = pf.distribute.ParameterServerStrategy(cluster.resolver())
    coordinator = pf.distribute.coordinator.ClusterCoordinator(strategy)
    warm = [coordinator.schedule(_nap, args=(0.01,)) for _ in range(8)]
    coordinator.join()
    assert {w.fetch() for w in warm} == {w.proc.pid for w in cluster.workers}
    victim = coordinator._states[1].worker
    assert victim.data_plane_address == _data_address(cluster.workers[1])
    values = [coordinator.schedule(_nap, args=(0.2,)) for _ in range(20)]
    deadline = time.monotonic() + 30
    while not coordinator._states[1].running:  # a closure in flight on worker:1's plane
        assert time.monotonic() < deadline, "worker:1 got no closure"
        time.sleep(0.01)
    os.kill(cluster.workers[1].proc.pid, signal.SIGKILL)
    coordinator.join(timeout=60)
    pids = [v.fetch() for v in values]
    assert len(pids) == 20 and cluster.workers[0].proc.pid in pids
    assert coordinator.counters()["workers_up"] == 1
    coordinator.shutdown()


@pytest.mark.slow
def test_a_worker_killed_during_a_closure_and_for_good_raises_worker_unavailable(
    start_ps, tmp_path, start_worker
):
    worker = start_worker(start_ps())
    client = GrpcWorker(0, worker.address)
    run = _Runner(client)
    try:
        assert run(_double, 3)["twice"] == [3, 3]
        assert client.data_plane_address == _data_address(worker)
        failure: list[BaseException] = []

        def long_closure():
            try:
                run(_nap, 60.0)
            except BaseException as e:
                failure.append(e)

        thread = threading.Thread(target=long_closure)
        thread.start()
        time.sleep(1.0)  # sent, and running on the worker
        os.kill(worker.proc.pid, signal.SIGKILL)
        thread.join(20)
        assert not thread.is_alive(), "the closure on a killed worker did not fail"
        assert isinstance(failure[0], errors.WorkerUnavailableError), failure
        assert failure[0].task == "worker:0"
        worker.proc.wait(10)
        start = time.monotonic()
        for _ in range(2):  # gone for good: every closure is a lost worker's, at once
            with pytest.raises(errors.WorkerUnavailableError, match="worker:0"):
                run(_double, 1)
        assert time.monotonic() - start < 10
    finally:
        client.close()


@pytest.mark.slow
def test_the_data_plane_refuses_a_wrong_token_with_a_typed_error(
    start_ps, tmp_path, caplog, start_worker
):
    env = {"PSFLOW_AUTH_TOKEN": TOKEN}
    ps = start_ps(env=env)
    worker = start_worker(ps, env=env)
    for security in BAD_CLIENTS.values():
        plane = DataPlaneClient(_data_address(worker), security, task="worker:0")
        with plane, pytest.raises(errors.UnauthenticatedError, match="token"):
            plane.connect(10)
        client = GrpcWorker(0, worker.address, security=security)
        try:  # asked over gRPC first: refused there, typed, not a lost worker
            with pytest.raises(errors.UnauthenticatedError):
                _Runner(client)(_double, 1)
        finally:
            client.close()
    # a plane refusing what gRPC accepted (it asked with other credentials): gRPC, one line
    good = GrpcWorker(0, worker.address, security=GOOD)
    from psflow.distribute.coordinator.closure_plane import ClosurePlane

    plane = ClosurePlane(
        worker.address, "worker:0", BAD_CLIENTS["wrong-token"], good.status, enabled=True
    )
    request = worker_pb2.RunClosureRequest(
        session_id="s", closure_id=1, function_key="once-f", function=cloudpickle.dumps(int)
    )
    try:
        with caplog.at_level(logging.WARNING, logger="psflow.transport.core"):
            assert plane.run(request, 10) is None and plane.run(request, 10) is None
        lines = [r for r in caplog.records if "cannot be used" in r.getMessage()]
        assert len(lines) == 1 and "its closures go over gRPC" in lines[0].getMessage()
        assert _Runner(good)(_double, 2)["twice"] == [2, 2]
        assert good.data_plane_address == _data_address(worker)
        assert good.status().closures_run == 1  # nothing ran for the refused clients
    finally:
        plane.close()
        good.close()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["unreachable", "unimplemented", "switched_off"])
def test_a_plane_that_cannot_run_closures_leaves_them_to_grpc_with_one_log_line(
    start_ps, tmp_path, caplog, monkeypatch, how, start_worker
):
    ps = start_ps()
    if how == "unreachable":  # announced where nothing listens
        worker = start_worker(ps, "--data-advertise", f"127.0.0.1:{pick_free_port()}")
        expected = "cannot be used"
    elif how == "unimplemented":  # announced at a plane that serves no RunClosure: the PS's
        data_port = ps.ready_line.split("data_port=")[1].split()[0]
        worker = start_worker(ps, "--data-advertise", f"127.0.0.1:{data_port}")
        expected = "runs no closures"
    else:
        worker = start_worker(ps, env={settings.ENV_CLOSURE_PLANE: "off"})
        assert "data_port=" not in worker.ready_line
        expected = None
    client = GrpcWorker(0, worker.address)
    try:
        with caplog.at_level(logging.WARNING):
            results = [_Runner(client)(_double, i)["twice"] for i in range(5)]
        assert results == [[i, i] for i in range(5)]
        assert client.data_plane_address is None
        lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        if expected is None:
            assert lines == []
        else:
            assert len(lines) == 1 and expected in lines[0], lines
        assert client.status().closures_run == 5
    finally:
        client.close()


@pytest.mark.slow
def test_closures_over_a_mutual_tls_data_plane(tls_cluster, pki):  # noqa: F811
    _, worker = tls_cluster
    client = GrpcWorker(0, worker.address, security=tls(pki))
    try:
        assert _Runner(client)(_double, 4)["twice"] == [4, 4]
        assert client.data_plane_address == _data_address(worker)
    finally:
        client.close()
    for security in (tls(pki, cert="rogue"), SecurityConfig()):
        plane = DataPlaneClient(_data_address(worker), security, task="worker:0")
        with plane, pytest.raises((errors.UnauthenticatedError, errors.UnavailableError)):
            plane.connect(10)


@pytest.mark.slow
def test_sigterm_lets_the_running_closure_finish_and_refuses_new_ones(
    start_ps, tmp_path, start_worker
):
    worker = start_worker(start_ps(), "--grace", "20")
    client = GrpcWorker(0, worker.address)
    run = _Runner(client)
    try:
        run(_double, 0)
        assert client.data_plane_address is not None
        done: list = []
        thread = threading.Thread(target=lambda: done.append(run(_nap, 2.0)))
        thread.start()
        time.sleep(0.5)
        worker.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(errors.WorkerUnavailableError):  # refused: the chief moves it
            run(_double, 1)
        thread.join(30)
        assert done == [worker.proc.pid]
        assert worker.proc.wait(30) == 0
    finally:
        client.close()


@pytest.mark.slow
def test_sigterm_drains_both_transports_within_one_grace(start_ps, tmp_path, start_worker):
    """Closures running on the plane and on gRPC at once share one grace: the plane's
    drain gets what gRPC's left, not a grace of its own after it; and the process then
    exits (``serving.exit_process``) instead of waiting for the closures to return."""
    grace = 5.0
    worker = start_worker(start_ps(), "--grace", str(grace))
    plane, grpc_only = (
        GrpcWorker(0, worker.address),
        GrpcWorker(0, worker.address, data_plane=False),
    )
    runners = [_Runner(plane), _Runner(grpc_only)]
    threads = []
    try:
        for run in runners:
            run(_double, 0)
        assert plane.data_plane_address is not None and grpc_only.data_plane_address is None
        for run in runners:  # each outlives the grace; how they end does not matter here
            thread = threading.Thread(target=_swallow, args=(run, _nap, 60.0), daemon=True)
            thread.start()
            threads.append(thread)
        time.sleep(1.0)
        signalled = time.monotonic()
        worker.proc.send_signal(signal.SIGTERM)
        assert worker.proc.wait(30) == 0
        # one grace, the exit's 2 s linger, slack: two graces would be >= 12 s, and waiting
        # for the closures 60 s
        assert time.monotonic() - signalled < grace + 4.5
        assert "not waiting for" in worker.log_tail()
    finally:
        plane.close()
        grpc_only.close()
        for thread in threads:
            thread.join(30)


def _swallow(run, fn, *args) -> None:
    with contextlib.suppress(Exception):
        run(fn, *args, timeout=40.0)


@pytest.mark.slow
def test_the_plane_keeps_the_closure_limits_and_the_metrics(start_ps, tmp_path, start_worker):
    worker = start_worker(start_ps(), "--max-closure-bytes", "10000", "--metrics-port", "auto")
    client = GrpcWorker(0, worker.address)
    run = _Runner(client)
    try:
        before = scrape(worker)
        assert run(_double, 1)["twice"] == [1, 1]
        assert client.data_plane_address is not None
        with pytest.raises(errors.ResourceExhaustedError, match="--max-closure-bytes=10000"):
            run(len, b"x" * 12_000)  # refused by the servicer, on the plane
        # above the plane's payload limit: sent over gRPC, whose own limit refuses it
        with pytest.raises(errors.ResourceExhaustedError, match="larger than max"):
            run(len, b"x" * (3 << 20))
        with pytest.raises(KeyError):
            run(_raise_key)
        t = {"task": "worker:0"}

        def moved(name: str, **labels: str) -> float:
            return value(after, name, **t, **labels) - value(before, name, **t, **labels)

        # the plane sends a call's reply from inside the call, before the call is counted:
        # the last one's count may come a moment after its reply (a loaded machine shows it)
        deadline = time.monotonic() + 10
        after = scrape(worker)
        while (
            moved("psflow_worker_rpcs_total", method="RunClosure", code="OK") < 2
            and time.monotonic() < deadline
        ):
            time.sleep(0.05)
            after = scrape(worker)
        assert moved("psflow_worker_rpcs_total", method="RunClosure", code="OK") == 2
        assert (
            moved("psflow_worker_rpcs_total", method="RunClosure", code="RESOURCE_EXHAUSTED") == 1
        )
        assert moved("psflow_worker_closures_total", outcome="ok") == 1
        assert moved("psflow_worker_closures_total", outcome="error") == 1
        assert client.data_plane_address is not None  # still on the plane
    finally:
        client.close()


@pytest.mark.slow
def test_a_malformed_closure_on_the_plane_is_an_invalid_argument_and_harms_nothing(
    start_ps, tmp_path, start_worker
):
    worker = start_worker(start_ps())
    with DataPlaneClient(_data_address(worker), SecurityConfig(), task="worker:0") as plane:
        for payload, match in (
            (b"\xff\xfe not a protobuf", "malformed RunClosureRequest"),
            (worker_pb2.RunClosureRequest(function_key="f").SerializeToString(), "session_id"),
        ):
            with pytest.raises(errors.InvalidArgumentError, match=match):
                plane.call("RunClosure", b"", (payload,), 10)
        good = worker_pb2.RunClosureRequest(
            session_id="s", closure_id=1, function_key="once-f", function=cloudpickle.dumps(int)
        )
        _, reply = plane.call("RunClosure", b"", (good.SerializeToString(),), 10)
        assert cloudpickle.loads(worker_pb2.RunClosureResponse.FromString(reply).result) == 0


@pytest.mark.slow
def test_hostile_bytes_on_the_workers_data_port_before_and_after_the_hello_run_nothing(
    start_ps, tmp_path, start_worker
):
    worker = start_worker(start_ps(), env={"PSFLOW_AUTH_TOKEN": TOKEN})
    host, port = _data_address(worker).rsplit(":", 1)
    closure = worker_pb2.RunClosureRequest(
        session_id="s", closure_id=1, function_key="f", function=cloudpickle.dumps(int)
    ).SerializeToString()
    run_closure = frames.pack(
        frames.Kind.REQUEST, method=frames.method_id("RunClosure"), payload_len=len(closure)
    )
    # before the hello: bytes that are no frame, a request instead of a hello, a hello
    # announcing a header past every limit, a wrong token: each connection is closed
    for hostile in (
        b"GET / HTTP/1.1\r\n\r\n" + b"x" * 64,
        run_closure + closure,
        frames.pack(frames.Kind.HELLO, header_len=1 << 30),
    ):
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(hostile)
            assert _closed(sock)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        _hello(sock, "not-the-token-not-the-token-0000")
        assert _read_frame(sock)[0].kind is frames.Kind.ERROR
        assert _closed(sock)
    # after it: an unknown method is UNIMPLEMENTED and the connection lives; a payload
    # past every limit closes it before anything is read
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        _hello(sock, TOKEN)
        assert _read_frame(sock)[0].kind is frames.Kind.WELCOME
        sock.sendall(frames.pack(frames.Kind.REQUEST, method=frames.method_id("Shutdown")))
        head, body = _read_frame(sock)
        assert head.kind is frames.Kind.ERROR and b"UNIMPLEMENTED" in body
        sock.sendall(
            frames.pack(
                frames.Kind.REQUEST, method=frames.method_id("RunClosure"), payload_len=1 << 50
            )
        )
        assert _closed(sock)
    client = GrpcWorker(0, worker.address, security=SecurityConfig(token=TOKEN))
    try:
        assert client.status().closures_run == 0  # nothing hostile ran
    finally:
        client.close()
    with DataPlaneClient(
        _data_address(worker), SecurityConfig(token=TOKEN), task="worker:0"
    ) as plane:  # and it still serves
        _, reply = plane.call("RunClosure", b"", (closure,), 10)
        assert cloudpickle.loads(worker_pb2.RunClosureResponse.FromString(reply).result) == 0

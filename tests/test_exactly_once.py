"""Exactly-once writes on a real cluster: the caller's request id reaches the PS process.

A closure re-run after its worker died carries the same closure-derived ids as
its first run; the PS must answer the repeat from its record, for ``assign_add``
and metric flushes (writes) as for gradient pushes.
"""

from __future__ import annotations

import os
import pathlib
import socket
import threading
import time

import numpy as np
import pytest

import psflow as pf
from psflow import errors
from psflow.distribute.ps.connection import Grad, VarSpec
from psflow.distribute.ps.grpc_connection import GrpcPSConnection
from psflow.ps.push_types import PushContext

pytestmark = pytest.mark.slow


@pytest.fixture
def connection(start_ps):
    ps = start_ps()
    conn = GrpcPSConnection(ps.address, task="ps:0", timeout=30.0)
    try:
        yield conn
    finally:
        conn.close()


def _value(conn: GrpcPSConnection, name: str) -> np.ndarray:
    ((value, _version),) = conn.pull([name])
    return np.asarray(value)


def test_write_with_a_repeated_request_id_is_applied_once_by_the_ps_process(connection):
    connection.create([VarSpec("n", np.dtype("float64"), (3,), False)], [np.zeros(3)])
    one = np.ones(3)
    first = connection.write("assign_add", ["n"], [one], request_id=("closure-7/ps0", 1))
    again = connection.write("assign_add", ["n"], [one], request_id=("closure-7/ps0", 1))
    assert again == first  # answered from the PS's record
    np.testing.assert_array_equal(_value(connection, "n"), one)
    # a different id is a different write: it applies (the record is per id, not per value)
    connection.write("assign_add", ["n"], [one], request_id=("closure-7/ps0", 2))
    connection.write("assign_sub", ["n"], [one * 0.5], request_id=("closure-8/ps0", 1))
    connection.write("assign_sub", ["n"], [one * 0.5], request_id=("closure-8/ps0", 1))
    np.testing.assert_array_equal(_value(connection, "n"), one * 1.5)


def test_write_without_a_request_id_still_applies_every_call(connection):
    connection.create([VarSpec("m", np.dtype("int64"), (), False)], [np.zeros((), np.int64)])
    for _ in range(3):
        connection.write("assign_add", ["m"], [np.ones((), np.int64)])
    assert int(_value(connection, "m")) == 3


def test_push_with_a_repeated_push_id_is_applied_once_by_the_ps_process(connection):
    connection.create([VarSpec("w", np.dtype("float32"), (4,), True)], [np.ones(4, np.float32)])
    connection.configure_optimizer(["w"], {"name": "sgd", "learning_rate": 0.5})
    grad = [Grad("w", np.ones(4, np.float32))]
    first = connection.push(grad, PushContext(("closure-3/ps0", 1)))
    again = connection.push(grad, PushContext(("closure-3/ps0", 1)))
    assert first.applied and not first.duplicate
    assert again.duplicate and again.versions == first.versions
    np.testing.assert_allclose(_value(connection, "w"), np.full(4, 0.5, np.float32))


class _LossyRelay:
    """A loopback TCP relay to a server that can drop everything the server sends back.

    With replies dropped, a request still reaches the server and is applied, but
    its caller never hears back: the reply is lost and the caller's deadline passes.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.dropping = threading.Event()
        self._stop = threading.Event()
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._spawn(self._accept)

    def _spawn(self, fn, *args) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True)
        self._threads.append(t)
        t.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            server = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            self._sockets += [client, server]
            self._spawn(self._pipe, client, server, False)
            self._spawn(self._pipe, server, client, True)

    def _pipe(self, src: socket.socket, dst: socket.socket, is_reply: bool) -> None:
        src.settimeout(0.2)
        while not self._stop.is_set():
            try:
                data = src.recv(1 << 16)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                return
            if is_reply and self.dropping.is_set():
                continue  # the reply is lost on its way back
            try:
                dst.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        self._stop.set()
        for sock in [self._listener, *self._sockets]:
            sock.close()
        for t in self._threads:
            t.join(timeout=5)


def test_write_whose_reply_was_lost_is_applied_once_when_sent_again_with_its_id(start_ps):
    ps = start_ps()
    relay = _LossyRelay(ps.port)
    direct = GrpcPSConnection(ps.address, task="ps:0", timeout=30.0)
    lossy = GrpcPSConnection(relay.address, task="ps:0", timeout=2.0)
    again = GrpcPSConnection(relay.address, task="ps:0", timeout=30.0)
    try:
        direct.create([VarSpec("lost", np.dtype("float64"), (2,), False)], [np.zeros(2)])
        assert lossy.list_variables()  # the relayed channel is up before replies are dropped
        relay.dropping.set()
        request_id = ("closure-42/ps0", 1)
        with pytest.raises(errors.DeadlineExceededError):
            lossy.write("assign_add", ["lost"], [np.ones(2)], request_id=request_id)
        deadline = time.monotonic() + 20
        while not _value(direct, "lost").any() and time.monotonic() < deadline:
            time.sleep(0.05)
        np.testing.assert_array_equal(_value(direct, "lost"), [1.0, 1.0])  # it was applied
        relay.dropping.clear()
        # the closure runs again (another worker): same id, the PS answers from its record
        again.write("assign_add", ["lost"], [np.ones(2)], request_id=request_id)
        np.testing.assert_array_equal(_value(direct, "lost"), [1.0, 1.0])
    finally:
        for conn in (direct, lossy, again):
            conn.close()
        relay.close()


def _die_once(marker: str) -> None:
    """Kills this worker process the first time (after its writes reached the PS)."""
    path = pathlib.Path(marker)
    if not path.exists():
        path.write_text("died once")
        os._exit(17)  # like a crash: no reply ever leaves this worker


def test_rerun_closure_whose_writes_reached_the_ps_counts_its_metric_assign_add_and_push_once(
    start_cluster, tmp_path
):
    cluster = start_cluster(num_ps=1, num_workers=2)
    strategy = pf.distribute.ParameterServerStrategy(cluster.resolver())
    coordinator = pf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        counter = pf.Variable(0.0, trainable=False, name="counter")
        weight = pf.Variable([0.0, 0.0], name="weight")
        seen = pf.keras.metrics.Sum(name="seen")
        mean = pf.keras.metrics.Mean(name="mean")
        optimizer = pf.keras.optimizers.SGD(1.0)
    marker = str(tmp_path / "died")

    def step(x: float) -> float:
        counter.assign_add(1.0)
        optimizer.apply_gradients([(pf.constant([x, 1.0]), weight)])  # a push
        seen.update_state(x)
        mean.update_state(x)
        result = float(seen.result())  # flushes the metric's state to the PS now
        mean.result()
        if x == 5.0:
            _die_once(marker)  # the writes above are on the PS; their replies are lost
        return result

    for x in (1.0, 2.0, 5.0):
        coordinator.schedule(step, args=(x,))
    coordinator.join()
    assert pathlib.Path(marker).exists()  # the crash happened: the closure ran twice
    # three closures, one of them run twice: each counted once
    got = (float(seen.result()), float(mean.result()), float(counter.numpy()))
    assert got == pytest.approx((8.0, 8.0 / 3.0, 3.0))
    # the re-run's gradient push carried its first run's id too: applied once
    np.testing.assert_allclose(weight.numpy(), [-8.0, -3.0])


def test_push_context_id_is_honoured_by_the_in_process_backend_too():
    from psflow.distribute.ps.inprocess import InProcessPSConnection

    conn = InProcessPSConnection()
    conn.create([VarSpec("w", np.dtype("float32"), (4,), True)], [np.ones(4, np.float32)])
    conn.configure_optimizer(["w"], {"name": "sgd", "learning_rate": 0.5})
    grad = [Grad("w", np.ones(4, np.float32))]
    first = conn.push(grad, PushContext(("closure-3/ps0", 1)))
    again = conn.push(grad, PushContext(("closure-3/ps0", 1)))
    other = conn.push(grad, PushContext(("closure-3/ps0", 2)))
    assert first.applied and again.duplicate and not other.duplicate
    np.testing.assert_allclose(conn.pull(["w"])[0][0], np.zeros(4, np.float32))

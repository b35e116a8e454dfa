"""The PS process lifecycle: health, SIGTERM drain, crash + restore, a 1 GB variable."""

from __future__ import annotations

import queue
import signal
import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from psflow.errors import DeadlineExceededError, UnavailableError
from psflow.proto import ps_pb2
from psflow.ps.checkpoint import restore_shard, save_shard
from psflow.ps.store import VariableMeta, VariableStore
from psflow.transport import framing
from psflow.transport.client import PSClient
from psflow.transport.service import method_path
from psflow.update_rules import rule_from_config

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING


class HealthWatch:
    """Collects the statuses of a health Watch stream in a thread."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        stub = health_pb2_grpc.HealthStub(self.channel)
        self.call = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=60)
        self.statuses: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for reply in self.call:
                self.statuses.put(reply.status)
        except grpc.RpcError:
            pass

    def next(self, timeout: float = 30.0) -> int:
        return self.statuses.get(timeout=timeout)

    def close(self) -> None:
        self.call.cancel()
        self.thread.join(10)
        self.channel.close()


def test_health_is_not_serving_until_restored_then_serving(start_ps, tmp_path):
    # A checkpoint big enough that restoring it (with its checksums) takes a while.
    store = VariableStore(task="ps:0")
    big = np.random.default_rng(0).standard_normal(24 << 20).astype(np.float32)  # 96 MB
    store.create([VariableMeta("big", big.dtype, big.shape)], [big])
    save_shard(store, str(tmp_path), "ps-0", step=3)
    del store
    server = start_ps("--restore", str(tmp_path))
    watch = HealthWatch(server.address)
    try:
        assert watch.next() == NOT_SERVING
        assert watch.next() == SERVING
        with PSClient(server.address) as client:
            assert client.pull("big").tobytes() == big.tobytes()
    finally:
        watch.close()


def _slow_push(address: str, name: str, grad: np.ndarray, sent: threading.Event, out: dict):
    header = ps_pb2.PushHeader(items=[ps_pb2.PushItem(name=name, base_version=-1)])
    header.id.client_id, header.id.sequence = "slow", 1
    header.items[0].values.dtype = 2
    header.items[0].values.shape.append(grad.size)
    data = grad.tobytes()
    pieces = [data[i : i + 400] for i in range(0, len(data), 400)]

    def messages():
        yield framing.encode_message(header.SerializeToString(), [pieces[0]])
        for i, piece in enumerate(pieces[1:], start=1):
            if i == 3:
                # gRPC asks for a message once it has written the one before, so the
                # call is on the wire by now (setting this at the first message races
                # the SIGTERM against the call's arrival on a loaded machine)
                sent.set()
            time.sleep(0.15)  # a slow client: the call stays in flight for ~1.5 s
            yield framing.encode_message(None, [piece])

    try:
        with grpc.insecure_channel(address) as channel:
            reply = channel.stream_unary(method_path("PushStream"))(messages(), timeout=60)
        out["reply"] = ps_pb2.PushResponse.FromString(reply)
    except grpc.RpcError as e:
        out["error"] = e


@pytest.mark.slow
def test_sigterm_drains_in_flight_calls_then_checkpoints(start_ps, tmp_path):
    server = start_ps("--grace", "30", "--checkpoint-dir", str(tmp_path))
    grad = np.arange(1000, dtype=np.float32)
    with PSClient(server.address) as client:
        client.create_variable("w", np.zeros(1000, np.float32), optimizer={"name": "sgd"})
    watch = HealthWatch(server.address)
    try:
        assert watch.next() == SERVING
        sent, out = threading.Event(), {}
        pusher = threading.Thread(target=_slow_push, args=(server.address, "w", grad, sent, out))
        pusher.start()
        assert sent.wait(30)
        server.proc.send_signal(signal.SIGTERM)
        assert watch.next() == NOT_SERVING
        watch.close()
        late = PSClient(server.address, timeout=2.0)
        with late, pytest.raises((UnavailableError, DeadlineExceededError), match="ps:0"):
            late.pull("w")  # new calls are refused while draining
        pusher.join(60)
        assert "error" not in out, out.get("error")
        assert out["reply"].applied
        assert server.proc.wait(60) == 0, server.log_tail()
    finally:
        watch.close()
    restored = VariableStore()
    restore_shard(restored, str(tmp_path), "ps-0")
    np.testing.assert_array_equal(restored.pull(["w"])[0].value, -0.01 * grad)


@pytest.mark.slow
def test_save_kill9_restart_restore_is_bit_exact(start_ps, tmp_path):
    rng = np.random.default_rng(7)
    cfg = {"name": "adam", "learning_rate": 0.01}
    rule = rule_from_config(cfg)
    init = {"w": rng.standard_normal((30, 20)).astype(np.float32), "b": np.zeros(20, np.float32)}
    local = {k: v.copy() for k, v in init.items()}
    slots = {k: rule.init_slots(v) for k, v in init.items()}
    server = start_ps()
    with PSClient(server.address) as client:
        client.create_variables(init)
        client.create_variable("steps", np.zeros((), np.int64), trainable=False)
        client.configure_optimizer(["w", "b"], cfg)
        for step in range(1, 4):
            grads = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in init.items()}
            client.push(grads)
            client.assign_add("steps", np.ones((), np.int64))
            for k in init:
                rule.apply_dense(local[k], grads[k], slots[k], step)
        client.save(str(tmp_path), step=3)
        before = client.list_variables()
    server.stop(signal.SIGKILL)
    server2 = start_ps("--restore", str(tmp_path))
    with PSClient(server2.address) as client:
        client.wait_ready(30)
        assert client.list_variables() == before
        assert client.pull("steps") == 3
        for k in init:
            assert client.pull(k).tobytes() == local[k].tobytes()
        # Slots came back too: one more step matches the local optimizer exactly.
        grads = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in init.items()}
        client.push(grads)
        for k in init:
            rule.apply_dense(local[k], grads[k], slots[k], 4)
            assert client.pull(k).tobytes() == local[k].tobytes()


def _vm_hwm_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


@pytest.mark.slow
def test_one_gigabyte_variable_streams_both_ways(start_ps):
    n = (1 << 30) // 4
    server = start_ps()
    value = np.arange(n, dtype=np.float32)
    with PSClient(server.address, timeout=300) as client:
        start = time.monotonic()
        client.create_variable("huge", value, optimizer={"name": "sgd", "learning_rate": 0.5})
        del value
        got = client.pull("huge")
        assert got[0] == 0 and got[-1] == n - 1 and got[n // 2] == n // 2
        got[:] = 2.0  # reuse the buffer as the gradient: w -= 0.5 * 2
        client.push({"huge": got})
        client.pull("huge", out=[got])
        expected_tail = np.arange(n, dtype=np.float32)[-1000:] - np.float32(1)
        np.testing.assert_array_equal(got[-1000:], expected_tail)
        assert got[0] == -1
        elapsed = time.monotonic() - start
    # The server held the variable and one received gradient, not many copies.
    hwm = _vm_hwm_bytes(server.proc.pid)
    assert hwm < 2.6 * (1 << 30), f"server peak memory {hwm / 2**30:.2f} GiB"
    assert elapsed < 240, f"1 GB create + pull + push + pull took {elapsed:.0f}s"

"""The PS's lean path for small pushes still checks everything, every time.

The servicer remembers (dtype, shape) specs that passed its checks and the store
remembers well-formed client ids; these tests make sure that what is remembered
is only ever what passed, so a bad push that follows good ones is refused with
a typed status, changes nothing, and is counted.
"""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest

from psflow.errors import InvalidArgumentError, ResourceExhaustedError
from psflow.proto import ps_pb2
from psflow.transport import codec, framing
from psflow.transport.client import PSClient
from psflow.transport.service import method_path

pytestmark = pytest.mark.slow


def _push_message(name: str, dtype, shape, payload: bytes, client_id: str, seq: int) -> bytes:
    header = ps_pb2.PushHeader()
    header.id.client_id, header.id.sequence = client_id, seq
    header.items.add(name=name, values=codec.spec_to_proto(np.dtype(dtype), shape))
    return framing.encode_message(header.SerializeToString(), [payload])


def _raw_push(address: str, message: bytes) -> grpc.RpcError | None:
    with grpc.insecure_channel(address) as channel:
        stub = channel.unary_unary(method_path("Push"))
        try:
            stub(message, timeout=30)
        except grpc.RpcError as e:
            return e
    return None


def test_push_with_a_remembered_spec_but_short_payload_is_refused(start_ps):
    ps = start_ps()
    with PSClient(ps.address, timeout=30) as client:
        client.create_variable("w", np.zeros(512), optimizer={"name": "sgd", "learning_rate": 1})
        client.push({"w": np.ones(512)})  # the spec float64[512] is now known good
        before = client.stats()
        for payload in (bytes(4095), bytes(4104), b""):
            e = _raw_push(ps.address, _push_message("w", "float64", (512,), payload, "raw", 1))
            assert e is not None and e.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "4096" in e.details()
        np.testing.assert_array_equal(client.pull("w"), -np.ones(512))
        assert client.stats()["pushes_applied"] == before["pushes_applied"]


def test_a_spec_over_the_limit_is_refused_every_time(start_ps):
    ps = start_ps("--max-tensor-bytes", "8192")
    with PSClient(ps.address, timeout=30) as client:
        client.create_variable("w", np.zeros(8), optimizer={"name": "sgd", "learning_rate": 1})
        for _ in range(3):  # a refused spec is never remembered as good
            with pytest.raises(ResourceExhaustedError, match="2048"):
                client.push({"w": np.ones(2048)})
        client.push({"w": np.ones(8)})
        np.testing.assert_array_equal(client.pull("w"), -np.ones(8))


def test_a_bad_client_id_is_refused_after_good_ones(start_ps):
    ps = start_ps()
    with PSClient(ps.address, timeout=30) as client:
        client.create_variable("w", np.zeros(4), optimizer={"name": "sgd", "learning_rate": 1})
        client.push({"w": np.ones(4)}, push_id=("good", 1))
        long_id = "x" * 2000
        for seq in (1, 2):  # refused every time, never remembered
            with pytest.raises(InvalidArgumentError, match="client id"):
                client.push({"w": np.ones(4)}, push_id=(long_id, seq))
        np.testing.assert_array_equal(client.pull("w"), -np.ones(4))


def test_many_distinct_shapes_are_each_checked(start_ps):
    """More specs than the PS remembers: every push is still validated against its variable."""
    ps = start_ps()
    with PSClient(ps.address, timeout=30) as client:
        client.create_variable("w", np.zeros(3), optimizer={"name": "sgd", "learning_rate": 1})
        codes = set()
        with grpc.insecure_channel(ps.address) as channel:
            stub = channel.unary_unary(method_path("Push"))
            for n in range(4, 1100):  # wrong shapes, distinct specs, past the cache bound
                try:
                    stub(_push_message("w", "float64", (n,), bytes(8 * n), "s", n), timeout=30)
                except grpc.RpcError as e:
                    codes.add(e.code())
                else:
                    codes.add(grpc.StatusCode.OK)
        assert codes == {grpc.StatusCode.INVALID_ARGUMENT}
        with pytest.raises(InvalidArgumentError, match="shape"):
            client.push({"w": np.ones(5)})
        client.push({"w": np.ones(3)})
        np.testing.assert_array_equal(client.pull("w"), -np.ones(3))
        assert client.stats()["pushes_applied"] == 1


def test_concurrent_small_pushes_sum_exactly(start_ps):
    """Eight clients pushing integer gradients at once: the PS's value is the exact sum."""
    ps = start_ps()
    n, pushes, threads = 512, 40, 8
    with PSClient(ps.address, timeout=30) as client:
        client.create_variable("w", np.zeros(n), optimizer={"name": "sgd", "learning_rate": 1})
        sums = [np.zeros(n) for _ in range(threads)]
        failures: list[BaseException] = []

        def run(k: int) -> None:
            rng = np.random.default_rng(k)
            try:
                with PSClient(ps.address, timeout=30, client_id=f"c{k}") as own:
                    for _ in range(pushes):
                        g = rng.integers(-8, 9, size=n).astype(np.float64)
                        own.push({"w": g})
                        sums[k] += g
            except BaseException as e:  # reported below, not lost in the thread
                failures.append(e)

        workers = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
        for t in workers:
            t.start()
        for t in workers:
            t.join(120)
        assert not failures and not any(t.is_alive() for t in workers)
        np.testing.assert_array_equal(client.pull("w"), -sum(sums))
        assert client.stats()["pushes_applied"] == pushes * threads

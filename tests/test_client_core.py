"""The client core (psflow.transport.started / core): one started-call type, one
fan-out failure rule, one retry policy, against real PS processes."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import numpy as np
import pytest

from psflow.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
)
from psflow.ps.dynamic_table import TableConfig
from psflow.transport.client import PSClient, RetryPolicy
from psflow.transport.embedding_client import EmbeddingClient
from psflow.transport.started import Started, fan_out, gather
from tests.conftest import pick_free_port

DIM = 4


# -- the started call ---------------------------------------------------------------------
def test_a_started_call_is_read_once_and_a_cancelled_one_never():
    calls = []
    started = Started(lambda: calls.append(1) or 7, what="Probe")
    assert started.result() == 7
    with pytest.raises(InvalidArgumentError, match="Probe was read or given up"):
        started.result()
    assert calls == [1]  # never made twice
    cancelled = []
    given_up = Started(lambda: 1, lambda: cancelled.append(1))
    given_up.cancel()
    given_up.cancel()  # idempotent: the hook runs once
    assert cancelled == [1]
    with pytest.raises(InvalidArgumentError, match="read or given up"):
        given_up.result()


def test_gather_gives_the_named_errors_as_values_and_raises_the_others():
    def failing(error):
        return Started(lambda: (_ for _ in ()).throw(error))

    got = gather({0: failing(NotFoundError("gone")), 1: Started.done(3)}, NotFoundError)
    assert isinstance(got[0], NotFoundError) and got[1] == 3
    with pytest.raises(UnavailableError):  # only the named errors are values
        gather({0: failing(UnavailableError("x"))}, NotFoundError)


def test_fan_out_sends_the_started_calls_first_and_runs_the_rest_on_the_pool():
    order = []

    def start(key):
        order.append(("sent", key))
        return Started.done(key) if key != "b" else None  # "b" cannot start: made instead

    def work(key):
        return lambda: order.append(("made", key, threading.current_thread().name)) or key

    keys = ["a", "b", "c", "d"]
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pooled") as pool:
        calls = fan_out({"a": lambda: start("a"), "b": lambda: start("b")},
                        {k: work(k) for k in keys}, pool)  # fmt: skip
        assert gather(calls) == {k: k for k in keys}
    assert order[:2] == [("sent", "a"), ("sent", "b")]
    made = {k: thread for _, k, thread in order[2:]}
    assert made["b"] == threading.current_thread().name  # the first of the rest: inline
    assert made["c"].startswith("pooled") and made["d"].startswith("pooled")
    with pytest.raises(NotFoundError):  # a start that raises lets the sent ones finish
        fan_out({"a": lambda: Started.done(1), "b": lambda: (_ for _ in ()).throw(
            NotFoundError("b"))}, {}, None)  # fmt: skip


def test_a_pooled_call_not_begun_is_cancelled_on_its_pool():
    gate = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        busy = pool.submit(gate.wait, 10)
        waiting = Started.pooled(pool.submit(lambda: "never"))
        waiting.cancel()
        gate.set()
        assert busy.result() is True
    with pytest.raises(InvalidArgumentError, match="read or given up"):
        waiting.result()


def test_gather_reads_every_call_then_raises_the_first_error_in_order():
    read = []

    def call(key, error=None):
        def run():
            read.append(key)
            if error is not None:
                raise error
            return key

        return Started(run)

    first, second = NotFoundError("first"), UnavailableError("second")
    with pytest.raises(NotFoundError, match="first"):
        gather({0: call(0), 1: call(1, first), 2: call(2, second), 3: call(3)})
    assert read == [0, 1, 2, 3]  # none given up: every outcome is settled
    assert gather({5: call(5), 4: call(4)}) == {5: 5, 4: 4}


# -- against a real PS -------------------------------------------------------------------
def test_a_started_push_at_a_barrier_times_out_within_its_deadline(start_ps):
    server = start_ps()
    with PSClient(server.address, task="ps:0") as client:
        client.create_variable("w", np.zeros(8, np.float32))
        client.configure_optimizer(["w"], {"name": "sgd", "learning_rate": 1.0})
        client.pull("w")  # asks for the data plane: pushes start on it from now on
        begun = time.monotonic()
        started = client.start_push(
            {"w": np.ones(8, np.float32)}, step=0, num_required=2, wait_applied=True, timeout=1.5
        )
        assert started is not None
        with pytest.raises(DeadlineExceededError):
            started.result()  # the second contribution never comes
        assert time.monotonic() - begun < 10.0
        with pytest.raises(InvalidArgumentError, match="read or given up"):
            started.result()
        # a cancelled one frees its connection: the client goes on serving
        held = client.start_push(
            {"w": np.ones(8, np.float32)}, step=1, num_required=2, wait_applied=True, timeout=30
        )
        held.cancel()
        assert client.pull("w").shape == (8,)


def test_a_call_made_while_the_ps_is_down_succeeds_once_it_is_back(start_ps):
    port = pick_free_port()
    address = f"127.0.0.1:{port}"
    with PSClient(address, task="ps:0", retry=RetryPolicy(max_attempts=200)) as client:
        out: dict = {}

        def call() -> None:
            try:
                out["names"] = client.list_variables(timeout=60)
            except Exception as e:  # kept for the assertion below
                out["error"] = e

        caller = threading.Thread(target=call)
        caller.start()
        time.sleep(0.5)  # a few attempts fail (UNAVAILABLE) and are retried
        assert caller.is_alive()
        start_ps("--port", str(port))
        caller.join(60)
        assert not caller.is_alive()
        assert out == {"names": []}


def test_retries_end_with_the_typed_error_naming_task_and_address():
    address = f"127.0.0.1:{pick_free_port()}"  # nothing listens there
    policy = RetryPolicy(max_attempts=3, initial_backoff=0.01)
    with PSClient(address, task="ps:7", retry=policy) as client:
        begun = time.monotonic()
        with pytest.raises(UnavailableError, match=f"ps:7 at {address}") as caught:
            client.pull("w", timeout=30)
        assert caught.value.task == "ps:7"
        assert time.monotonic() - begun < 20.0  # three attempts, not the whole deadline


def test_a_table_fan_out_lets_every_shard_finish_before_it_raises(start_ps):
    servers = [start_ps(), start_ps()]
    client = EmbeddingClient([s.address for s in servers], timeout=10)
    try:
        config = TableConfig("t", DIM, optimizer={"name": "sgd", "learning_rate": 1.0})
        client.create_table(config)
        ids = np.arange(64, dtype=np.int64)
        before = client.lookup("t", ids)
        servers[1].stop()
        with pytest.raises(UnavailableError) as caught:
            client.push("t", ids, np.ones((64, DIM), np.float32))
        assert caught.value.task == "ps:1"  # the task that failed, not a cancellation
        # the other shard's push was read to its end before the error: applied, once
        on_0 = EmbeddingClient([servers[0].address], timeout=10)
        try:
            from psflow.ps.key_index import shard_of

            mine = ids[shard_of(ids, 2) == 0]
            got = on_0.call(0, "GetTableStats", _stats_request())
            assert {t.table: t.rows for t in got.tables}["t"] >= mine.size
            rows = _rows(on_0, mine)
            assert np.allclose(rows, before[shard_of(ids, 2) == 0] - 1.0)
        finally:
            on_0.close()
    finally:
        client.close()


def _stats_request():
    from psflow.proto import embedding_pb2

    return embedding_pb2.GetTableStatsRequest()


def _rows(client: EmbeddingClient, ids: np.ndarray) -> np.ndarray:
    """Rows of ``ids`` read from a one-task client (its shard 0 holds them all)."""
    from psflow.proto import embedding_pb2
    from psflow.wire import codec

    request = embedding_pb2.LookupRequest(table="t", ids=codec.encode_tensor(ids), read_only=True)
    return codec.decode_tensor(client.call(0, "Lookup", request).rows)

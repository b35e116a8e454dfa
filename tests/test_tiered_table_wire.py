"""The disk tier over gRPC: real PS processes on loopback started with
``--table-memory-rows``, against an in-process all-in-memory DynamicTable.

A PS whose table is many times its memory budget reads and updates the same
bits; killed with SIGKILL mid-training it restarts from its checkpoint with
what the checkpoint held (its old store is scratch and is wiped); its rows
move from both tiers on a live resize.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
import urllib.request

import numpy as np
import pytest

from psflow import errors
from psflow.distribute.ps.table_moves import move_tables
from psflow.observability.metrics import parse_exposition
from psflow.ps.dynamic_table import DynamicTable, TableConfig
from psflow.ps.hot_rows import HotRowPolicy
from psflow.ps.key_index import shard_of
from psflow.transport.client import PSClient
from psflow.transport.embedding_client import EmbeddingClient

pytestmark = pytest.mark.slow

DIM = 8
BUDGET = 32


def _traffic(seed: int, steps: int, batch: int = 64):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        ids = (rng.zipf(1.1, size=batch).astype(np.int64) * 2654435761) % (2**62)
        yield ids, rng.standard_normal((batch, DIM)).astype(np.float32)


def _tiered(start_ps, tmp_path, i: int, *extra: str):
    return start_ps(
        "--task",
        f"ps:{i}",
        "--table-memory-rows",
        str(BUDGET),
        "--table-dir",
        str(tmp_path / "tier"),
        *extra,
    )


def test_a_tiered_ps_equals_an_in_memory_table_and_survives_kill_9(start_ps, tmp_path):
    config = TableConfig("emb", DIM, seed=5, optimizer={"name": "adagrad", "learning_rate": 0.1})
    reference = DynamicTable(config)
    servers = [_tiered(start_ps, tmp_path, i, "--metrics-port", "auto") for i in range(2)]
    with EmbeddingClient([s.address for s in servers], timeout=30) as client:
        client.create_table(config)
        for ids, grads in _traffic(0, 40):
            assert client.lookup("emb", ids).tobytes() == reference.lookup(ids).tobytes()
            client.push("emb", ids, grads)
            reference.apply_gradients(ids, grads)
        every = np.sort(reference.export_state()["ids"])
        stats = client.stats()
        assert sum(s["emb"].rows for s in stats) == every.size >= 10 * 2 * BUDGET
        assert all(s["emb"].disk_rows > 0 and s["emb"].memory_rows <= BUDGET + 64 for s in stats)
        assert all(s["emb"].disk_bytes_read > 0 for s in stats)
        # operators see both tiers in Prometheus
        samples = _scrape(servers[0])
        key = (("table", "emb"), ("task", "ps:0"))
        memory = samples[("psflow_ps_table_rows", (*key, ("tier", "memory")))]
        disk = samples[("psflow_ps_table_rows", (*key, ("tier", "disk")))]
        assert memory <= BUDGET + 64 and memory + disk == stats[0]["emb"].rows
        assert samples[("psflow_ps_table_hits_total", (*key, ("tier", "disk")))] > 0
        read = ("psflow_ps_table_disk_io_bytes_total", (("direction", "read"), *key))
        assert samples[read] > 0
        # one request for every row: it may pass the budget by its own rows, no more
        assert client.lookup("emb", every).tobytes() == reference.lookup(every).tobytes()
        client.save(str(tmp_path / "ckpt"))
        saved = reference.peek(every)
        for ids, grads in _traffic(1, 10):  # lost on the killed task
            client.lookup("emb", ids)
            client.push("emb", ids, grads)
        servers[1].stop(signal.SIGKILL)
        _tiered(
            start_ps,
            tmp_path,
            1,
            "--port",
            str(servers[1].port),
            "--restore",
            str(tmp_path / "ckpt"),
        )
        with PSClient(servers[1].address, timeout=30) as ps:
            ps.wait_ready(30)
        on_1 = shard_of(every, 2) == 1
        after = client.lookup("emb", every[on_1], training=False)
        assert after.tobytes() == saved[on_1].tobytes()


def _scrape(server) -> dict:
    fields = dict(f.split("=", 1) for f in server.ready_line.split() if "=" in f)
    url = f"http://127.0.0.1:{fields['metrics_port']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        return parse_exposition(reply.read().decode())


def test_a_ps_killed_mid_checkpoint_and_mid_write_restarts_from_a_whole_checkpoint(
    start_ps, tmp_path
):
    """SIGKILL while the tier writes and while an incremental checkpoint is being
    written to the same directory: the restarted PS holds the last committed
    checkpoint exactly (the earlier or the later one), and its store is new."""
    config = TableConfig("emb", DIM, seed=4, optimizer={"name": "adagrad", "learning_rate": 0.1})
    reference = DynamicTable(config)
    ckpt = str(tmp_path / "ckpt")
    servers = [_tiered(start_ps, tmp_path, i) for i in range(2)]
    with EmbeddingClient([s.address for s in servers], timeout=30) as client:
        client.create_table(config)
        for ids, grads in _traffic(5, 60, batch=256):
            client.lookup("emb", ids)
            reference.lookup(ids)
            client.push("emb", ids, grads)
            reference.apply_gradients(ids, grads)
        client.save(ckpt)
        every = np.sort(reference.export_state()["ids"])
        first = reference.peek(every)
        for ids, grads in _traffic(6, 20, batch=256):
            client.lookup("emb", ids)
            reference.lookup(ids)
            client.push("emb", ids, grads)
            reference.apply_gradients(ids, grads)
        every_later = np.sort(reference.export_state()["ids"])
        second = reference.peek(every_later)
        # the second save races the kill; a push stream keeps the writer busy too
        saver = threading.Thread(target=lambda: _ignore(lambda: client.save(ckpt)))
        saver.start()
        time.sleep(0.05)
        servers[1].stop(signal.SIGKILL)
        saver.join(60)
        assert not saver.is_alive()
        _tiered(start_ps, tmp_path, 1, "--port", str(servers[1].port), "--restore", ckpt)
        with PSClient(servers[1].address, timeout=30) as ps:
            ps.wait_ready(30)
        on_1 = shard_of(every, 2) == 1
        later_1 = shard_of(every_later, 2) == 1
        stats = client.stats()[1]["emb"]
        got = client.lookup("emb", every_later[later_1], training=False)
        if stats.rows == int(later_1.sum()) and got.tobytes() == second[later_1].tobytes():
            pass  # the second checkpoint committed before the kill
        else:
            assert stats.rows == int(on_1.sum())
            got = client.lookup("emb", every[on_1], training=False)
            assert got.tobytes() == first[on_1].tobytes()
        # the killed process's store was scratch: the restarted one made its own
        left = [p for p in (tmp_path / "tier").iterdir() if p.name.startswith("ps_1")]
        assert len(left) == 1, left


def _ignore(call) -> None:
    with contextlib.suppress(errors.OpError):  # the PS was killed under it
        call()


def test_the_hot_row_cache_serves_a_tiered_table_exactly_and_cuts_pulled_bytes(start_ps, tmp_path):
    servers = [_tiered(start_ps, tmp_path, i) for i in range(2)]
    addresses = [s.address for s in servers]
    config = TableConfig("emb", DIM, optimizer={"name": "sgd", "learning_rate": 0.1})
    reference = DynamicTable(config)
    with (
        EmbeddingClient(addresses, timeout=30) as plain,
        EmbeddingClient(addresses, timeout=30, hot_rows=HotRowPolicy(16, 1)) as exact,
        EmbeddingClient(addresses, timeout=30, hot_rows=HotRowPolicy(16, 5)) as lazy,
    ):
        plain.create_table(config)
        for ids, grads in _traffic(9, 30, batch=256):
            want = reference.lookup(ids)
            assert plain.lookup("emb", ids).tobytes() == want.tobytes()
            assert exact.lookup("emb", ids).tobytes() == want.tobytes()
            lazy.lookup("emb", ids)
            plain.push("emb", ids, grads)
            reference.apply_gradients(ids, grads)
        assert lazy.bytes.pulled < plain.bytes.pulled, (lazy.bytes, plain.bytes)
        assert sum(s["emb"].disk_rows for s in plain.stats()) > 0


def test_rows_move_from_both_tiers_on_a_live_resize(start_ps, tmp_path):
    config = TableConfig("emb", DIM, seed=2, optimizer={"name": "sgd", "learning_rate": 0.5})
    reference = DynamicTable(config)
    servers = [_tiered(start_ps, tmp_path, i) for i in range(2)]
    with EmbeddingClient([s.address for s in servers], timeout=30) as client:
        client.create_table(config)
        for ids, grads in _traffic(3, 30):
            client.lookup("emb", ids)
            reference.lookup(ids)
            client.push("emb", ids, grads)
            reference.apply_gradients(ids, grads)
        every = np.sort(reference.export_state()["ids"])
        servers.append(_tiered(start_ps, tmp_path, 2))
        assert move_tables(client, [s.address for s in servers]) == every.size
        stats = client.stats()
        assert [s["emb"].rows for s in stats] == [
            int((shard_of(every, 3) == i).sum()) for i in range(3)
        ]
        assert all(s["emb"].memory_rows <= BUDGET for s in stats)
        assert client.lookup("emb", every).tobytes() == reference.lookup(every).tobytes()
        for ids, grads in _traffic(4, 5):  # and training goes on, the same bits
            client.push("emb", ids, grads)
            reference.apply_gradients(ids, grads)
        assert client.lookup("emb", every).tobytes() == reference.lookup(every).tobytes()

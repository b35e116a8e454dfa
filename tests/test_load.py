"""Load: 16 concurrent clients push integer-valued gradients to one variable on a live PS.

The PS requires a token and records metrics (the hardened configuration).
Every push that was acknowledged is applied exactly once: with SGD at
learning rate 1 the final value is the initial one minus the exact sum of
all acknowledged gradients (integers in float64: no rounding), and the PS
counted exactly as many applied pushes.  No client sees an error.
"""

from __future__ import annotations

import threading
import time
import urllib.request

import numpy as np
import pytest

from psflow.observability.metrics import parse_exposition
from psflow.security.config import SecurityConfig
from psflow.transport.client import PSClient

CLIENTS = 16
SECONDS = 4.0
SHAPE = (64,)
TOKEN = "load-token-0123456789abcdef"


def _client_loop(address, index, stop_at, results, errors):
    security = SecurityConfig(token=TOKEN)
    rng = np.random.default_rng(1000 + index)
    acked = np.zeros(SHAPE, np.float64)
    count = 0
    try:
        with PSClient(address, security=security, timeout=30, client_id=f"load-{index}") as c:
            while time.monotonic() < stop_at:
                grad = rng.integers(-8, 9, size=SHAPE).astype(np.float64)
                reply = c.push({"load": grad})
                assert reply.applied and not reply.duplicate
                acked += grad
                count += 1
    except Exception as e:  # reported by the test, with the client's index
        errors.append(f"client {index}: {type(e).__name__}: {e}")
    results[index] = (acked, count)


@pytest.mark.slow
def test_sixteen_clients_push_exactly_once(start_ps):
    ps = start_ps("--metrics-port", "auto", "--log-level", "WARNING",
                  env={"PSFLOW_AUTH_TOKEN": TOKEN})  # fmt: skip
    initial = np.arange(SHAPE[0], dtype=np.float64) * 1000
    security = SecurityConfig(token=TOKEN)
    with PSClient(ps.address, security=security, timeout=30) as client:
        client.create_variable("load", initial, optimizer={"name": "sgd", "learning_rate": 1.0})
    results: dict[int, tuple[np.ndarray, int]] = {}
    errors: list[str] = []
    stop_at = time.monotonic() + SECONDS
    threads = [
        threading.Thread(target=_client_loop, args=(ps.address, i, stop_at, results, errors))
        for i in range(CLIENTS)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(SECONDS + 60)
    assert not any(t.is_alive() for t in threads), "a client hung"
    assert errors == []
    assert sorted(results) == list(range(CLIENTS))
    total = sum(r[0] for r in results.values())
    pushes = sum(r[1] for r in results.values())
    assert all(r[1] > 0 for r in results.values()), "a client never got a push through"
    with PSClient(ps.address, security=security, timeout=30) as client:
        final = client.pull("load")
        stats = client.stats()
    np.testing.assert_array_equal(final, initial - total)
    assert stats["pushes_applied"] == pushes and stats["pushes_duplicate"] == 0
    fields = dict(f.split("=", 1) for f in ps.ready_line.split() if "=" in f)
    url = f"http://127.0.0.1:{fields['metrics_port']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        samples = parse_exposition(reply.read().decode())
    labels = (("task", "ps:0"), ("variable", "load"))
    assert samples[("psflow_ps_updates_applied_total", labels)] == pushes
    assert samples[("psflow_ps_push_bytes_total", labels)] == pushes * SHAPE[0] * 8
    clients = {
        dict(lbl)["client"]
        for (name, lbl) in samples
        if name == "psflow_ps_client_last_push_timestamp_seconds"
    }
    assert clients == {f"load-{i}" for i in range(CLIENTS)}

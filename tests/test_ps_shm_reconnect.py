"""A PS restarted in its slot is read through its shared-memory mirrors again, not over gRPC.

Real PS processes on loopback; the PS's own ``pulls`` counter (Pull RPCs
served) tells which path the reads took.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from psflow import errors
from psflow.distribute.ps.connection import VarSpec
from psflow.distribute.ps.grpc_connection import GrpcPSConnection
from psflow.transport import shm

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not shm.enabled(), reason="no shared memory on this machine"),
]

SPEC = VarSpec("w", np.dtype(np.float32), (4, 3), True)


def _pulls(conn: GrpcPSConnection) -> int:
    return int(conn.stats()["pulls"])


def test_pulls_go_through_shared_memory_again_after_the_ps_restarts_empty(start_cluster):
    cluster = start_cluster(num_ps=1, num_workers=0)
    conn = GrpcPSConnection(cluster.ps[0].address, task="ps:0", timeout=20.0)
    try:
        first = np.arange(12, dtype=np.float32).reshape(4, 3)
        conn.create([SPEC], [first])
        for _ in range(5):
            ((value, _),) = conn.pull(["w"])
        np.testing.assert_array_equal(value, first)
        # same host: every read came from the mirror, but the first (over gRPC, which
        # woke the lazy mirror: a PS copies values in only for readers that ask)
        assert _pulls(conn) == 1

        os.kill(cluster.ps[0].proc.pid, signal.SIGKILL)
        cluster.ps[0].proc.wait(10)
        cluster.restart_ps(0)  # same port, no variables: as before a restore
        deadline = time.monotonic() + 30
        while True:  # a pull of a variable the new PS does not hold yet
            try:
                conn.pull(["w"])
            except errors.NotFoundError:
                break
            except errors.UnavailableError:
                assert time.monotonic() < deadline, "the restarted PS never answered"
                time.sleep(0.2)
            else:
                pytest.fail("the restarted PS served a variable it never received")

        second = first * 2  # what the restore brings back
        conn.create([SPEC], [second])
        before = _pulls(conn)
        for _ in range(20):
            ((value, _),) = conn.pull(["w"])
        np.testing.assert_array_equal(value, second)
        # one pull over gRPC wakes the restored variable's new (lazy) mirror
        assert _pulls(conn) == before + 1, "reads of the restored variable went over gRPC"
    finally:
        conn.close()

"""The benchmarks' process helper (``benchmarks/_cluster.py``) leaves no shared memory behind."""

from __future__ import annotations

import os
import pathlib
import sys

import numpy as np
import pytest

from psflow.distribute.ps.connection import VarSpec
from psflow.distribute.ps.grpc_connection import GrpcPSConnection
from psflow.transport import shm

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
import _cluster  # from benchmarks/, put on the path above

pytestmark = pytest.mark.skipif(
    not shm.enabled(), reason="no shared memory on this host (its fast path is off)"
)


def _segments_of(pid: int) -> list[str]:
    return [n for n in os.listdir(shm.SHM_DIR) if n.startswith(f"psflow-{pid}-")]


def test_a_killed_ps_leaves_no_segment_after_close():
    """A PS that served a pull from its mirror holds a segment under /dev/shm; the
    helper kills it (SIGKILL: it cannot clean up), and ``close`` must remove it."""
    procs = _cluster.Processes()
    try:
        spec = _cluster.psflow_cluster(procs, 1, 0, shm="auto")
        pid = procs.procs[0].pid
        client = GrpcPSConnection(spec["ps"][0])
        try:
            value = np.arange(1024, dtype=np.float32)
            client.create([VarSpec("w", value.dtype, value.shape, True)], [value])
            ((pulled, _),) = client.pull(["w"])
            np.testing.assert_array_equal(pulled, value)
            assert client._mirrors["w"] is not None  # the value came through the mirror
        finally:
            client.close()
        assert _segments_of(pid), "the PS made no segment: this test would prove nothing"
    finally:
        procs.close()
    assert procs.procs == []
    assert _segments_of(pid) == []

"""What the chief says when a network fault leaves it no worker to use.

The cluster is tests/test_netfault.py's: a PS and two workers, every path
through its own chaos relay, so a fault on one worker's path to the PS leaves
the chief's own paths (to the PS, to each worker) intact.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import psflow as pf
from tests.test_netfault import relayed_cluster, sgd_training  # noqa: F401  (the fixture)


@pytest.mark.slow
def test_every_worker_cut_off_from_the_ps_fails_naming_each_path_and_that_the_chief_reaches_it(
    relayed_cluster,  # noqa: F811
    monkeypatch,
):
    cluster = relayed_cluster(ps_timeout=1.5)
    monkeypatch.setenv("PSFLOW_WORKER_UNAVAILABLE_TIMEOUT", "3")
    v, coordinator, step = sgd_training(cluster, "cut_paths_v")
    for worker in (0, 1):
        cluster.fault(worker, "cut", only_to_ps=True)
    start = time.monotonic()
    with pytest.raises(pf.errors.WorkerUnavailableError) as raised:
        while time.monotonic() - start < 30:
            coordinator.schedule(step)
            time.sleep(0.05)
        coordinator.join(timeout=30)
    elapsed = time.monotonic() - start
    message = str(raised.value)
    # what happened, not "no worker reachable": each worker's PS path, and the chief's
    assert "worker:0 cannot reach ps:0" in message, message
    assert "worker:1 cannot reach ps:0" in message, message
    assert "the chief reaches ps:0" in message, message
    assert "No worker reachable" not in message, message
    assert elapsed < 30, elapsed  # the unavailable timeout (3 s), not an endless re-queue loop
    # true: the chief still reads the PS, whose value is whole steps of -1 (none applied twice)
    value = v.numpy()
    assert value[0] <= -4 and np.all(value == value[0]) and value[0] == int(value[0]), value

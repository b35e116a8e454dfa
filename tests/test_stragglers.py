"""A late closure is re-run on an idle worker and the first result wins (real processes)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

import psflow as pf
from psflow.distribute.coordinator.stragglers import StepTimes

pytestmark = pytest.mark.slow


def _slow_the_first_time(marker: str, seconds: float = 8.0) -> str:
    from psflow.distribute.ps import session as session_lib

    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
        time.sleep(seconds)  # the first attempt stalls; a re-run finds the marker
    except FileExistsError:
        pass
    return session_lib.current().task


def test_a_late_closure_is_re_run_elsewhere_and_applied_once(start_cluster, monkeypatch, tmp_path):
    monkeypatch.setenv("PSFLOW_STRAGGLER_MIN_SECONDS", "0.5")
    cluster = start_cluster(num_ps=1, num_workers=2)
    strategy = pf.distribute.ParameterServerStrategy(cluster.resolver())
    coordinator = pf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        total = pf.Variable(np.zeros((), np.float32), trainable=False, name="total")

    def add_one():
        total.assign_add(np.float32(1.0))

    for _ in range(20):  # the recent closure times the threshold derives from
        coordinator.schedule(add_one)
    coordinator.join()
    marker = str(tmp_path / "first")

    def late():
        total.assign_add(np.float32(1.0))
        return _slow_the_first_time(marker)

    start = time.monotonic()
    value = coordinator.schedule(late)
    winner = value.fetch(timeout=30)
    elapsed = time.monotonic() - start
    assert elapsed < 6.0, elapsed  # did not wait for the stalled first attempt
    assert coordinator.counters()["speculative_runs"] == 1
    assert winner.startswith("worker:")
    coordinator.join(timeout=30)
    time.sleep(8.0 - elapsed + 1.0)  # the stalled attempt ends and pushes: deduplicated
    assert float(total.numpy()) == 21.0

    # a closure reading a per-worker iterator is not re-run while it runs: a second run
    # would consume another element of another worker's iterator
    iterator = iter(coordinator.create_per_worker_dataset(lambda: pf.data.Dataset.range(100)))

    def late_reader(it):
        return int(next(it)), _slow_the_first_time(marker + "-it", 3.0)

    element, _ = coordinator.schedule(late_reader, args=(iterator,)).fetch(timeout=30)
    assert element == 0
    assert coordinator.counters()["speculative_runs"] == 1


def test_threshold_follows_recent_closure_times():
    times = StepTimes(factor=3.0, min_seconds=0.1, window=50, min_samples=5)
    assert times.threshold() is None  # too early to tell
    for _ in range(50):
        times.record(0.2)
    assert times.threshold() == pytest.approx(0.6)
    assert StepTimes(factor=0.0, min_seconds=0.1).threshold() is None  # off

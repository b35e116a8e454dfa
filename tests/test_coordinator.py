"""ClusterCoordinator semantics: scheduling, results, errors, per-worker resources."""

from __future__ import annotations

import numpy as np
import pytest

import psflow as pf


@pytest.fixture
def embedded():
    strategy = pf.distribute.ParameterServerStrategy()
    coordinator = pf.distribute.coordinator.ClusterCoordinator(strategy)
    try:
        yield strategy, coordinator
    finally:
        coordinator.shutdown()


def test_schedule_rejects_a_non_callable(embedded):
    _, coordinator = embedded
    with pytest.raises(TypeError, match=r"callable.*int"):
        coordinator.schedule(42)


def test_schedule_rejects_bad_args(embedded):
    _, coordinator = embedded
    with pytest.raises(TypeError, match="args"):
        coordinator.schedule(lambda x: x, args=5)


def test_a_second_coordinator_is_the_first(embedded):
    strategy, coordinator = embedded
    assert pf.distribute.coordinator.ClusterCoordinator(strategy) is coordinator


def test_coordinator_needs_a_parameter_server_strategy():
    with pytest.raises(TypeError, match="ParameterServerStrategy"):
        pf.distribute.coordinator.ClusterCoordinator(pf.distribute.MirroredStrategy())


def test_ten_thousand_closures_are_each_fetched_exactly_once(embedded):
    strategy, coordinator = embedded
    with strategy.scope():
        counter = pf.Variable(0, name="counter")
    calls = []

    def work(i):
        calls.append(i)
        return i * 2

    values = [coordinator.schedule(work, args=(i,)) for i in range(10_000)]
    coordinator.join()
    assert sorted(calls) == list(range(10_000))
    assert [v.fetch() for v in values] == [2 * i for i in range(10_000)]
    assert int(counter.numpy()) == 0


def test_first_error_surfaces_once_at_join_and_cancels_the_rest(embedded):
    _, coordinator = embedded

    def boom():
        raise ValueError("bad closure input 17")

    first = coordinator.schedule(boom)
    rest = []
    # raised once: by join, or by a schedule call if it failed first (TF's semantics too)
    with pytest.raises(ValueError, match="bad closure input 17"):
        for _ in range(50):
            rest.append(coordinator.schedule(lambda: 1))
        coordinator.join()
    with pytest.raises(ValueError):
        first.fetch()
    done_or_cancelled = [v for v in rest if v.done()]
    assert len(done_or_cancelled) == len(rest)
    coordinator.join()  # the error was raised once: join is clean now
    assert coordinator.schedule(lambda: 7).fetch() == 7


def test_fetch_maps_structures(embedded):
    _, coordinator = embedded
    values = {"a": coordinator.schedule(lambda: pf.constant([1, 2])), "b": 3}
    out = coordinator.fetch(values)
    np.testing.assert_array_equal(out["a"], [1, 2])
    assert out["b"] == 3


def test_per_worker_dataset_and_iterator(embedded):
    _, coordinator = embedded

    def dataset_fn(ctx):
        return pf.data.Dataset.range(10).shard(ctx.num_input_pipelines, ctx.input_pipeline_id)

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    got = [coordinator.schedule(lambda it: int(next(it)), args=(iterator,)) for _ in range(10)]
    assert [g.fetch() for g in got] == list(range(10))
    with pytest.raises(TypeError, match="scheduled function"):
        next(iterator)


@pytest.mark.slow
def test_closure_error_on_a_remote_worker_names_the_worker(start_cluster):
    cluster = start_cluster(num_ps=1, num_workers=2)
    strategy = pf.distribute.ParameterServerStrategy(cluster.resolver())
    coordinator = pf.distribute.coordinator.ClusterCoordinator(strategy)

    def boom():
        raise KeyError("missing-feature")

    coordinator.schedule(boom)
    with pytest.raises(KeyError) as info:
        coordinator.join()
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "worker:" in notes and "missing-feature" in notes


@pytest.mark.slow
def test_closures_spread_over_remote_workers(start_cluster):
    cluster = start_cluster(num_ps=1, num_workers=2)
    strategy = pf.distribute.ParameterServerStrategy(cluster.resolver())
    coordinator = pf.distribute.coordinator.ClusterCoordinator(strategy)

    def pid():
        import os
        import time

        time.sleep(0.02)
        return os.getpid()

    values = [coordinator.schedule(pid) for _ in range(40)]
    pids = {v.fetch() for v in values}
    assert pids == {w.proc.pid for w in cluster.workers}


@pytest.mark.slow
def test_closures_scheduled_together_run_on_idle_workers_side_by_side(start_cluster):
    """A worker's second closure in flight never takes work another idle worker could
    run: two closures scheduled together on two idle workers run at once, one each."""
    cluster = start_cluster(num_ps=1, num_workers=2)
    strategy = pf.distribute.ParameterServerStrategy(cluster.resolver())
    coordinator = pf.distribute.coordinator.ClusterCoordinator(strategy)
    assert len(_dispatchers(coordinator)) == 4  # two in flight per worker

    def nap():
        import os
        import time

        began = time.monotonic()  # the system's clock: the same in every process here
        time.sleep(0.5)
        return os.getpid(), began, time.monotonic()

    coordinator.schedule(nap)
    coordinator.join()  # both workers warm and idle
    for _ in range(4):  # one worker taking both closures showed in about half the rounds
        values = [coordinator.schedule(nap), coordinator.schedule(nap)]
        coordinator.join()
        (pid_a, began_a, ended_a), (pid_b, began_b, ended_b) = (v.fetch() for v in values)
        assert {pid_a, pid_b} == {w.proc.pid for w in cluster.workers}
        # at once: each began before the other ended (their own clocks, not this test's
        # wall time, which a loaded machine stretches with dispatch and replies)
        assert began_a < ended_b and began_b < ended_a, (began_a, ended_a, began_b, ended_b)


def _dispatchers(coordinator) -> list[str]:
    return sorted(t.name for t in coordinator._threads if t.name.startswith("coordinator-"))


@pytest.mark.slow
def test_async_keeps_two_closures_in_flight_per_remote_worker(start_cluster):
    """The second is queued on the worker, which still runs one at a time: a per-worker
    iterator hands out every element exactly once."""
    cluster = start_cluster(num_ps=1, num_workers=1)
    strategy = pf.distribute.ParameterServerStrategy(cluster.resolver())
    coordinator = pf.distribute.coordinator.ClusterCoordinator(strategy)
    assert _dispatchers(coordinator) == ["coordinator-worker:0", "coordinator-worker:0-1"]
    iterator = iter(coordinator.create_per_worker_dataset(lambda: pf.data.Dataset.range(200)))

    def take(it):
        return int(next(it))

    values = [coordinator.schedule(take, args=(iterator,)) for _ in range(200)]
    coordinator.join()
    assert sorted(v.fetch() for v in values) == list(range(200))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "bounded"])
def test_step_counting_modes_keep_one_closure_in_flight(start_cluster, mode):
    cluster = start_cluster(num_ps=1, num_workers=1)
    kwargs = {"staleness": 1} if mode == "bounded" else {}
    strategy = pf.distribute.ParameterServerStrategy(cluster.resolver(), mode=mode, **kwargs)
    coordinator = pf.distribute.coordinator.ClusterCoordinator(strategy)
    assert _dispatchers(coordinator) == ["coordinator-worker:0"]


def test_the_chief_as_its_own_worker_runs_one_closure_at_a_time(embedded):
    _, coordinator = embedded
    assert _dispatchers(coordinator) == ["coordinator-worker:0"]


@pytest.mark.slow
def test_closures_in_flight_is_configurable(start_cluster, monkeypatch):
    cluster = start_cluster(num_ps=1, num_workers=1)
    monkeypatch.setenv("PSFLOW_CLOSURES_IN_FLIGHT", "zero")
    with pytest.raises(pf.errors.InvalidArgumentError, match="PSFLOW_CLOSURES_IN_FLIGHT"):
        pf.distribute.coordinator.ClusterCoordinator(
            pf.distribute.ParameterServerStrategy(cluster.resolver())
        )
    monkeypatch.setenv("PSFLOW_CLOSURES_IN_FLIGHT", "1")
    coordinator = pf.distribute.coordinator.ClusterCoordinator(
        pf.distribute.ParameterServerStrategy(cluster.resolver())
    )
    assert _dispatchers(coordinator) == ["coordinator-worker:0"]

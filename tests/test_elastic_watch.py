"""``ClusterWatch``: one resize per change of the resolver's PS count, never below 1.

The watched resolver is a real :class:`ClusterFileResolver` whose file the test
rewrites (as ``psflow local --ps-max`` does); the resized target is a real
embedded ``ParameterServerStrategy`` (in-process parameter servers, which
resize like remote ones), whose variables must come through every resize
unchanged (compared with the NumPy values they were created from).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

import psflow as pf
from psflow.distribute.cluster_resolver import ClusterFileResolver, write_cluster_file
from psflow.distribute.coordinator.elastic_watch import ClusterWatch, describe_resize
from psflow.errors import FailedPreconditionError, InvalidArgumentError


def _view(num_ps: int) -> dict[str, list[str]]:
    return {
        "ps": [f"127.0.0.1:{6000 + i}" for i in range(num_ps)],
        "worker": ["127.0.0.1:5999"],
        "chief": ["127.0.0.1:5998"],
    }


@pytest.fixture
def setup(tmp_path):
    """An embedded strategy with three variables, and a cluster file listing 1 PS."""
    path = str(tmp_path / "cluster.json")
    write_cluster_file(path, _view(1))
    resolver = ClusterFileResolver(path, task_type="chief", task_id=0)
    strategy = pf.distribute.ParameterServerStrategy()
    rng = np.random.default_rng(3)
    values = {f"w{i}": rng.normal(size=(64, 32)).astype("float32") for i in range(3)}
    with strategy.scope():
        variables = {name: pf.Variable(v, name=name) for name, v in values.items()}
    return path, resolver, strategy, values, variables


def _check_values(variables, values) -> None:
    for name, v in variables.items():
        np.testing.assert_array_equal(v.numpy(), values[name])


def test_each_change_of_the_count_resizes_once_and_values_survive(setup, caplog):
    path, resolver, strategy, values, variables = setup
    watch = ClusterWatch(strategy, resolver, interval=0.05)
    assert watch.poll() is None  # unchanged: nothing to do
    caplog.set_level(logging.INFO, logger="psflow.coordinator.elastic")
    counts = [3, 3, 2, 2, 2, 1, 3]
    for n in counts:
        write_cluster_file(path, _view(n))
        watch.poll()
        watch.poll()  # a second look at the same view resizes nothing
        assert watch.num_ps == n
        assert len(strategy.placement().addresses) == n
        _check_values(variables, values)
    reports = watch.reports
    changes = [(a, b) for a, b in zip([1, *counts], counts) if a != b]
    assert [(r.old_num_ps, r.new_num_ps) for r in reports] == changes
    assert all(r.version_after > r.version_before for r in reports)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resized PS")]
    assert lines == [describe_resize(r) for r in reports]
    assert "resized PS 1 -> 3: moved " in lines[0] and " MB, pause " in lines[0]


def test_a_view_without_ps_is_ignored_and_a_bad_file_keeps_the_count(setup, tmp_path):
    path, resolver, strategy, values, variables = setup
    watch = ClusterWatch(strategy, resolver)
    write_cluster_file(path, {"worker": ["127.0.0.1:5999"], "chief": ["127.0.0.1:5998"]})
    assert watch.poll() is None and watch.num_ps == 1  # never below 1
    (tmp_path / "cluster.json").write_text("{not json")
    assert watch.poll() is None and watch.num_ps == 1
    assert watch.reports == [] and len(strategy.placement().addresses) == 1
    _check_values(variables, values)


def test_a_failing_resize_is_retried_after_a_back_off_and_counted(setup):
    path, resolver, strategy, values, variables = setup
    strategy._session.refuse_resize("a test's reason")  # every resize raises, typed
    watch = ClusterWatch(strategy, resolver, interval=0.05, max_backoff=0.2)
    write_cluster_file(path, _view(2))
    assert watch.poll() is None and watch.failures == 1
    assert watch.poll() is None and watch.failures == 1  # backing off: not tried again yet
    deadline = time.monotonic() + 10
    while watch.failures < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
        watch.poll()
    assert watch.failures == 2 and watch.num_ps == 1 and watch.reports == []
    _check_values(variables, values)


def test_the_thread_resizes_by_itself_and_stops(setup):
    path, resolver, strategy, values, variables = setup
    seen = []
    with ClusterWatch(strategy, resolver, interval=0.02, on_resize=seen.append) as watch:
        write_cluster_file(path, _view(2))
        deadline = time.monotonic() + 20
        while not seen and time.monotonic() < deadline:
            time.sleep(0.02)
        with pytest.raises(FailedPreconditionError, match="started already"):
            watch.start()
    assert [r.new_num_ps for r in seen] == [2] and watch.num_ps == 2
    _check_values(variables, values)


def test_step_boundary_polls_at_most_once_per_interval(setup):
    path, resolver, strategy, _, _ = setup
    watch = ClusterWatch(strategy, resolver, interval=30.0)
    assert watch.at_step_boundary() is None  # the first poll: the view is unchanged
    write_cluster_file(path, _view(2))
    assert watch.at_step_boundary() is None and watch.num_ps == 1  # within the interval
    assert watch.poll().new_num_ps == 2


def test_bad_arguments_are_named(setup):
    _, resolver, strategy, _, _ = setup
    with pytest.raises(InvalidArgumentError, match="cannot resize"):
        ClusterWatch(object(), resolver)
    with pytest.raises(InvalidArgumentError, match="interval 0"):
        ClusterWatch(strategy, resolver, interval=0)
    embedded = ClusterWatch(strategy)  # its resolver (no TF_CONFIG) lists no ps task
    assert embedded.poll() is None and embedded.num_ps == 1

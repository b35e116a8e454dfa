"""MirroredStrategy failures: bounded, typed, naming the culprit, and the strategy stays usable.

Faults are parameters: a replica that never reaches a collective, one that is
late, one that raises before, inside or after the others' collectives. Every
case runs with a small ``timeout_seconds`` and checks how long ``run`` took.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import psflow as pf
from psflow import errors
from psflow.collective import CommunicationOptions
from tests.test_mirrored_training import logical_cpus

TIMEOUT = 0.5  # timeout_seconds of the strategies under test
SLACK = 5.0  # how much later than expected a failure may surface on a loaded machine
REPLICAS = 3


@pytest.fixture
def strategy() -> Iterator[Any]:
    with logical_cpus(REPLICAS):
        yield pf.distribute.MirroredStrategy(
            communication_options=CommunicationOptions(timeout_seconds=TIMEOUT)
        )


def replica_id() -> int:
    return int(pf.distribute.get_replica_context().replica_id_in_sync_group)


def all_reduce_one() -> Any:
    return pf.distribute.get_replica_context().all_reduce("SUM", pf.constant(1.0))


def merge_identity() -> Any:
    return pf.distribute.get_replica_context().merge_call(lambda s: 1)


def assert_usable(strategy: Any) -> None:
    """The next step after a failure works: collectives line up again."""
    for _ in range(2):
        total = strategy.run(all_reduce_one)
        assert [float(v) for v in strategy.experimental_local_results(total)] == [3.0] * REPLICAS
        assert strategy.run(merge_identity) == 1  # the same object from every replica


def run_timed(strategy: Any, fn: Callable[[], Any]) -> tuple[BaseException, float]:
    start = time.monotonic()
    with pytest.raises(BaseException) as info:
        strategy.run(fn)
    return info.value, time.monotonic() - start


@pytest.mark.parametrize(
    "collective", [all_reduce_one, merge_identity], ids=["all_reduce", "merge_call"]
)
def test_replica_that_skips_a_collective_fails_the_others_naming_it(
    strategy: Any, collective: Callable[[], Any]
) -> None:
    def step() -> Any:
        if replica_id() == 1:
            return None  # never reaches the collective
        return collective()

    error, elapsed = run_timed(strategy, step)
    assert isinstance(error, errors.DeadlineExceededError), repr(error)
    assert "[1]" in str(error) and "did not arrive" in str(error)
    assert TIMEOUT * 0.9 <= elapsed < TIMEOUT + SLACK
    assert_usable(strategy)


def test_late_replica_is_named_and_run_returns_when_it_is_done(strategy: Any) -> None:
    def step() -> Any:
        if replica_id() == 2:
            time.sleep(TIMEOUT * 3)
        return all_reduce_one()

    error, elapsed = run_timed(strategy, step)
    assert isinstance(error, errors.DeadlineExceededError), repr(error)
    assert "[2]" in str(error)
    assert TIMEOUT * 3 <= elapsed < TIMEOUT * 3 + SLACK
    assert_usable(strategy)


class ReplicaFault(Exception):
    """The fault injected into one replica."""


FAULTS = {
    # the faulty replica fails while the others wait for it in all_reduce
    "while_others_wait_in_all_reduce": (0.0, 0.0, all_reduce_one),
    # the others reach all_reduce only after the fault (they find it closed)
    "before_others_reach_all_reduce": (0.0, 0.3, all_reduce_one),
    # the faulty replica fails while the others wait for it in merge_call
    "while_others_wait_in_merge_call": (0.0, 0.0, merge_identity),
    # the fault happens after a first, successful collective
    "after_a_collective": (None, 0.0, all_reduce_one),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_replica_error_is_raised_by_run_promptly(fault: str) -> None:
    fail_delay, others_delay, collective = FAULTS[fault]
    with logical_cpus(REPLICAS):
        # a long timeout: run must not wait for it to notice the failure
        s = pf.distribute.MirroredStrategy(
            communication_options=CommunicationOptions(timeout_seconds=60)
        )

        def step() -> Any:
            if fail_delay is None:  # one good collective first
                all_reduce_one()
            if replica_id() == 1:
                time.sleep(fail_delay or 0.0)
                raise ReplicaFault("replica 1 broke")
            time.sleep(others_delay)
            return collective()

        error, elapsed = run_timed(s, step)
        assert isinstance(error, ReplicaFault), repr(error)  # not CancelledError
        assert elapsed < 10.0
        assert_usable(s)


def test_failing_optimizer_update_on_one_replica_fails_run(strategy: Any) -> None:
    def constraint(w: Any) -> Any:
        if pf.backend.current_device().index == 2:
            raise ReplicaFault("constraint failed on replica 2")
        return w

    with strategy.scope():
        v = pf.Variable([1.0, 2.0], constraint=constraint)
        opt = pf.keras.optimizers.SGD(0.5)

    def step() -> None:
        opt.apply_gradients([(pf.constant([1.0, 1.0]), v)])

    with pytest.raises(ReplicaFault, match="replica 2"):
        strategy.run(step)
    assert_usable(strategy)


def test_slow_merge_function_is_not_a_timeout(strategy: Any) -> None:
    # the timeout bounds the wait for replicas to arrive, not the merge function's work
    def step() -> Any:
        ctx = pf.distribute.get_replica_context()
        return ctx.merge_call(lambda s: time.sleep(TIMEOUT * 2) or 7)

    assert strategy.run(step) == 7


def test_training_continues_after_a_failed_step(strategy: Any) -> None:
    with strategy.scope():
        v = pf.Variable([0.0, 0.0])
        opt = pf.keras.optimizers.SGD(1.0)

    def step(fail: bool) -> None:
        if fail and replica_id() == 0:
            raise ReplicaFault("bad batch")
        with pf.GradientTape() as tape:
            loss = pf.reduce_sum(v * pf.constant([1.0, 2.0]))
        opt.apply_gradients(zip(tape.gradient(loss, [v]), [v]))

    strategy.run(step, args=(False,))
    with pytest.raises(ReplicaFault):
        strategy.run(step, args=(True,))
    strategy.run(step, args=(False,))
    # two good steps, each with the gradient summed over 3 replicas; copies identical
    for copy in v.values:
        np.testing.assert_allclose(np.asarray(copy._value), [-6.0, -12.0])


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), "1s", True])
def test_communication_options_reject_bad_timeouts(bad: Any) -> None:
    with pytest.raises(errors.InvalidArgumentError, match=repr(bad).replace("(", r"\(")):
        CommunicationOptions(timeout_seconds=bad)

"""Collective calls from replica threads: results, rendezvous, timeouts, failures."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from psflow import errors
from psflow.collective import (
    CommunicationOptions,
    Communicator,
    ReduceOp,
    ReductionToOneDevice,
    RingAllReduce,
)
from psflow.collective.session import Session
from tests.test_collective_ring import (
    assert_identical_everywhere,
    assert_matches_sum,
    expected_ring_bytes,
    make_inputs,
)

JOIN_TIMEOUT = 30.0


def run_replicas(n, fn, ranks=None):
    """Runs fn(rank) on one thread per rank; returns (results, errors), never hangs."""
    ranks = list(range(n)) if ranks is None else ranks
    results, errs = {}, {}

    def body(rank):
        try:
            results[rank] = fn(rank)
        except BaseException as exc:
            errs[rank] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a replica thread hung"
    return results, errs


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("ops_cls", [RingAllReduce, ReductionToOneDevice])
@pytest.mark.parametrize("threshold", [0, 1 << 30], ids=["own-share", "leader-does-all"])
def test_collective_all_reduce_equals_batch_call(n, ops_cls, threshold):
    shapes = [(1000,), (7,), (3, 4), (0,), (2**16 + 3,)]
    dtypes = [np.float32, np.float64, np.int32, np.float32, np.float32]
    xs = make_inputs(n, shapes, dtypes, seed=n)
    ops = ops_cls(
        subchunk_bytes=16 << 10,
        parallel_threshold_bytes=threshold,
        replica_parallel_threshold_bytes=threshold,
    )
    comm = Communicator(n, ops, CommunicationOptions(timeout_seconds=20))
    for _ in range(2):  # the communicator is reusable call after call
        results, errs = run_replicas(n, lambda r: comm.all_reduce(r, xs[r]))
        assert not errs
        ordered = [results[r] for r in range(n)]
        for i in range(len(shapes)):
            assert_matches_sum(ordered[0][i], xs, i)
        assert_identical_everywhere(ordered)
    batch = ops.all_reduce(xs)
    for r in range(n):
        for a, b in zip(batch[r], ordered[r], strict=True):
            assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("n", [2, 3, 4])
def test_collective_ring_counts_bytes_per_rank(n):
    size = 12345
    xs = make_inputs(n, [(size,)], [np.float64])
    comm = Communicator(n, RingAllReduce(replica_parallel_threshold_bytes=0, subchunk_bytes=4096))
    _, errs = run_replicas(n, lambda r: comm.all_reduce(r, xs[r], ReduceOp.MEAN))
    assert not errs
    assert comm.bytes_sent == expected_ring_bytes(n, [size], 8)
    comm.reset_bytes_sent()
    assert comm.bytes_sent == [0] * n


def test_collective_in_place():
    n = 3
    xs = make_inputs(n, [(30000,), (5,)], [np.float32, np.float32], seed=4)
    want = RingAllReduce().all_reduce(xs)
    comm = Communicator(n, RingAllReduce(replica_parallel_threshold_bytes=0, subchunk_bytes=8192))
    results, errs = run_replicas(n, lambda r: comm.all_reduce(r, xs[r], out=xs[r]))
    assert not errs
    for r in range(n):
        for i in range(2):
            assert results[r][i] is xs[r][i]
            assert xs[r][i].tobytes() == want[r][i].tobytes()


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_collective_all_gather(axis):
    n = 3
    rng = np.random.default_rng(1)
    parts = [rng.standard_normal((r + 1, 4) if axis == 0 else (2, r + 2)) for r in range(n)]
    comm = Communicator(n)
    results, errs = run_replicas(n, lambda r: comm.all_gather(r, parts[r], axis=axis))
    assert not errs
    want = np.concatenate(parts, axis=axis)
    for r in range(n):
        np.testing.assert_array_equal(results[r], want)
        assert not any(np.shares_memory(results[r], p) for p in parts)


def test_collective_broadcast():
    n = 4
    src = [np.arange(10.0), np.ones((2, 3), np.int32)]
    comm = Communicator(n)
    results, errs = run_replicas(
        n, lambda r: comm.broadcast(r, src if r == 2 else None, source_rank=2)
    )
    assert not errs
    for r in range(n):
        for a, b in zip(results[r], src, strict=True):
            np.testing.assert_array_equal(a, b)
            assert not np.shares_memory(a, b)


def test_missing_rank_times_out_naming_it_and_the_communicator_stays_usable():
    n, timeout = 3, 0.5
    comm = Communicator(n, options=CommunicationOptions(timeout_seconds=timeout))
    xs = make_inputs(n, [(100,)], [np.float32])
    t0 = time.monotonic()
    _, errs = run_replicas(n, lambda r: comm.all_reduce(r, xs[r]), ranks=[0, 1])
    elapsed = time.monotonic() - t0
    assert set(errs) == {0, 1}
    for e in errs.values():
        assert isinstance(e, errors.DeadlineExceededError)
        assert "[2]" in str(e)
    assert elapsed < timeout + 2.0
    # The late rank gets the same failure at once, not a new wait.
    t0 = time.monotonic()
    with pytest.raises(errors.DeadlineExceededError, match=r"\[2\]"):
        comm.all_reduce(2, xs[2])
    assert time.monotonic() - t0 < 0.2
    # The next collective of every rank works.
    results, errs = run_replicas(n, lambda r: comm.all_reduce(r, xs[r]))
    assert not errs
    assert_matches_sum(results[0][0], xs, 0)
    assert comm._collectives == {}


def test_two_missing_ranks_are_both_named():
    comm = Communicator(4, options=CommunicationOptions(timeout_seconds=0.3))
    _, errs = run_replicas(4, lambda r: comm.all_gather(r, np.ones(2)), ranks=[1, 3])
    assert set(errs) == {1, 3}
    assert all("[0, 2]" in str(e) for e in errs.values())


def test_bad_op_on_one_rank_fails_every_rank_fast():
    n = 3
    comm = Communicator(n, options=CommunicationOptions(timeout_seconds=10))
    xs = make_inputs(n, [(10,)], [np.float32])
    t0 = time.monotonic()
    _, errs = run_replicas(n, lambda r: comm.all_reduce(r, xs[r], "MAX" if r == 1 else "SUM"))
    assert time.monotonic() - t0 < 5
    assert set(errs) == {0, 1, 2}
    for e in errs.values():
        assert isinstance(e, errors.InvalidArgumentError)
        assert "rank 1" in str(e) and "'MAX'" in str(e)


def test_inconsistent_shapes_across_ranks_fail_every_rank():
    comm = Communicator(2)
    arrays = [[np.ones(3)], [np.ones(4)]]
    _, errs = run_replicas(2, lambda r: comm.all_reduce(r, arrays[r]))
    assert set(errs) == {0, 1}
    assert all(
        isinstance(e, errors.InvalidArgumentError) and "(4,)" in str(e) for e in errs.values()
    )


def test_ranks_calling_different_collectives_fail():
    comm = Communicator(2, options=CommunicationOptions(timeout_seconds=5))

    def call(r):
        if r == 0:
            return comm.all_reduce(r, [np.ones(2)])
        return comm.all_gather(r, np.ones(2))

    _, errs = run_replicas(2, call)
    assert set(errs) == {0, 1}
    assert all("all_gather" in str(e) and "all_reduce" in str(e) for e in errs.values())


def test_disagreeing_mean_and_sum_fail():
    comm = Communicator(2)
    _, errs = run_replicas(2, lambda r: comm.all_reduce(r, [np.ones(2)], ["sum", "mean"][r]))
    assert set(errs) == {0, 1}
    assert all("SUM" in str(e) and "MEAN" in str(e) for e in errs.values())


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0,), "num_replicas"),
        (("2",), "num_replicas"),
        ((2, "nope"), "registered: nccl, reduce_to_one, ring"),
        ((2, None, {"timeout_seconds": 1}), "CommunicationOptions"),
    ],
)
def test_bad_communicator_arguments(args, match):
    with pytest.raises((errors.InvalidArgumentError, errors.NotFoundError), match=match):
        Communicator(*args)


def test_bad_rank_is_named():
    comm = Communicator(2)
    with pytest.raises(errors.InvalidArgumentError, match="rank 5"):
        comm.all_reduce(5, [np.ones(1)])


def test_closed_communicator_cancels_waiters_and_refuses_calls():
    comm = Communicator(2, options=CommunicationOptions(timeout_seconds=20))
    box = {}

    def waiter():
        try:
            comm.all_reduce(0, [np.ones(2)])
        except errors.OpError as exc:
            box["err"] = exc

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    time.sleep(0.1)
    comm.close()
    t.join(5)
    assert not t.is_alive()
    assert isinstance(box["err"], errors.CancelledError)
    with pytest.raises(errors.FailedPreconditionError):
        comm.all_reduce(1, [np.ones(2)])


# -- the session's waits: timeouts and failures wake everybody -----------------------------
def test_session_wait_times_out_naming_the_stuck_rank():
    s = Session(3, timeout=0.2)
    t0 = time.monotonic()
    with pytest.raises(errors.DeadlineExceededError, match="rank 2"):
        s.wait(0, 2, 0)
    assert time.monotonic() - t0 < 2
    with pytest.raises(errors.DeadlineExceededError, match="rank 2"):
        s.wait(1, 0, 5)  # the collective has failed: other waits fail at once


def test_session_failure_wakes_waiters():
    s = Session(2, timeout=20)
    box = {}

    def waiter():
        try:
            s.wait(0, 1, 3)
        except errors.OpError as exc:
            box["err"] = exc

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    time.sleep(0.05)
    s.fail(1, RuntimeError("device lost"))
    t.join(5)
    assert not t.is_alive()
    assert isinstance(box["err"], errors.AbortedError)
    assert "rank 1" in str(box["err"]) and "device lost" in str(box["err"])


def test_session_progress_releases_waiters_in_order():
    s = Session(2, timeout=5)
    seen = []

    def waiter():
        for u in range(5):
            s.wait(1, 0, u)
            seen.append(u)

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    for _ in range(5):
        time.sleep(0.01)
        s.mark(0)
    t.join(5)
    assert seen == [0, 1, 2, 3, 4]


def test_many_collectives_in_a_row_with_uneven_arrival():
    n, calls = 4, 12
    xs = make_inputs(n, [(20000,), (3,)], [np.float32, np.float64], seed=8)
    want = RingAllReduce().all_reduce(xs)
    comm = Communicator(
        n,
        RingAllReduce(replica_parallel_threshold_bytes=0, subchunk_bytes=4096),
        CommunicationOptions(timeout_seconds=20),
    )
    rngs = [np.random.default_rng(r) for r in range(n)]

    def replica(r):
        got = []
        for _ in range(calls):
            time.sleep(float(rngs[r].uniform(0, 0.003)))
            got.append(comm.all_reduce(r, xs[r]))
        return got

    results, errs = run_replicas(n, replica)
    assert not errs
    for r in range(n):
        for got in results[r]:
            for a, b in zip(got, want[r], strict=True):
                assert a.tobytes() == b.tobytes()
    assert comm._collectives == {}

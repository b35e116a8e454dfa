"""The fused reduce-scatter and update: sums against NumPy, coverage, bytes, bad input."""

from __future__ import annotations

import numpy as np
import pytest

from psflow import errors, update_rules
from psflow.collective import Communicator, RingAllReduce, reduce_update
from tests.test_collective_communicator import run_replicas
from tests.test_collective_ring import make_inputs

SHAPES = [(1000,), (7,), (3, 4), (0,), (2**16 + 3,), (1,)]
DTYPES = [np.float32, np.float64, np.float32, np.float32, np.float32, np.float64]


def run_fused(n, xs, threshold):
    """Each replica adds the summed ranges into every copy (zeros to start); returns
    the copies, how often each element was updated, and the communicator."""
    ops = RingAllReduce(replica_parallel_threshold_bytes=threshold)
    comm = Communicator(n, ops)
    copies = [[np.zeros_like(a) for a in row] for row in xs]
    hits = [np.zeros(a.size, np.int64) for a in xs[0]]

    def body(rank):
        def update(k, lo, hi, summed):
            hits[k][lo:hi] += 1
            for row in copies:
                row[k].reshape(-1)[lo:hi] += summed

        comm.reduce_and_update(rank, xs[rank], update)

    _, errs = run_replicas(n, body)
    assert not errs, errs
    return copies, hits, comm


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("threshold", [0, 1 << 30], ids=["own-share", "leader-does-all"])
def test_every_copy_gets_the_float64_sum_once_per_element(n, threshold, monkeypatch):
    monkeypatch.setattr(reduce_update, "SUB_CHUNK_BYTES", 16 << 10)  # several units per rank
    xs = make_inputs(n, SHAPES, DTYPES, seed=n)
    copies, hits, _ = run_fused(n, xs, threshold)
    for k, h in enumerate(hits):
        assert (h == 1).all(), f"tensor {k}: elements updated {set(h.tolist())} times"
    for k, dtype in enumerate(DTYPES):
        want = np.sum([row[k].astype(np.float64) for row in xs], axis=0)
        tol = 1e-5 if dtype == np.float32 else 1e-12
        np.testing.assert_allclose(copies[0][k], want, rtol=tol, atol=tol)
        for row in copies[1:]:  # bitwise the same on every copy
            np.testing.assert_array_equal(row[k], copies[0][k])


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_each_replica_sends_its_share_as_the_ring_does(n):
    xs = make_inputs(n, [(4096 * n,)], [np.float32], seed=1)
    _, _, comm = run_fused(n, xs, threshold=0)
    size = xs[0][0].nbytes
    assert comm.bytes_sent == [2 * (n - 1) * size // n] * n


def test_mismatched_replicas_fail_on_every_rank_naming_them():
    xs = [[np.ones(4, np.float32)], [np.ones(5, np.float32)]]
    comm = Communicator(2)
    _, errs = run_replicas(2, lambda r: comm.reduce_and_update(r, xs[r], lambda *a: None))
    assert set(errs) == {0, 1}
    for e in errs.values():
        assert isinstance(e, errors.InvalidArgumentError)
        assert "replica 1's array 0" in str(e)


def test_non_numpy_arrays_are_refused():
    comm = Communicator(1)
    with pytest.raises(errors.InvalidArgumentError, match="NumPy arrays"):
        comm.reduce_and_update(0, [[1.0, 2.0]], lambda *a: None)


@pytest.mark.parametrize(
    "rule",
    [
        update_rules.SGD(learning_rate=0.1),
        update_rules.SGD(learning_rate=0.1, momentum=0.9, nesterov=True),
        update_rules.Adam(learning_rate=0.01),
    ],
    ids=["sgd", "nesterov", "adam"],
)
def test_applying_to_copies_equals_applying_to_each(rule):
    rng = np.random.default_rng(0)
    w = rng.standard_normal(1000).astype(np.float32)
    g = rng.standard_normal(1000).astype(np.float32)
    ref = w.copy()
    ref_slots = rule.init_slots(ref)
    rule.apply_dense(ref, g, ref_slots, step=3)
    copies = [w.copy(), w.copy()]
    slots = [rule.init_slots(c) for c in copies]
    rule.apply_dense_to_copies(copies, g.copy(), slots, step=3)
    for c, s in zip(copies, slots):
        np.testing.assert_array_equal(c, ref)
        for name in ref_slots:
            np.testing.assert_array_equal(s[name], ref_slots[name])


def test_applying_to_copies_checks_shapes():
    rule = update_rules.SGD(learning_rate=0.1)
    with pytest.raises(errors.InvalidArgumentError, match="does not match"):
        rule.apply_dense_to_copies([np.zeros(3, np.float32)], np.zeros(4, np.float32), [{}], step=1)


@pytest.mark.parametrize("threshold", [0, 1 << 30], ids=["own-share", "leader-does-all"])
def test_a_failing_update_fails_every_rank_without_hanging(threshold):
    comm = Communicator(2, RingAllReduce(replica_parallel_threshold_bytes=threshold))
    xs = make_inputs(2, [(64,)], [np.float32], seed=2)

    def body(rank):
        def update(k, lo, hi, summed):
            if rank == 1:
                raise ValueError("update of rank 1 broke")

        comm.reduce_and_update(rank, xs[rank], update)

    _, errs = run_replicas(2, body)
    assert set(errs) == {0, 1}
    messages = [str(e) for e in errs.values()]
    assert any(isinstance(e, ValueError) for e in errs.values()), messages
    assert all("rank 1 broke" in m for m in messages), messages
    # the communicator stays usable: the next collective works on both ranks
    seen = [0, 0]

    def again(rank):
        def update(k, lo, hi, summed):
            seen[rank] += hi - lo

        comm.reduce_and_update(rank, xs[rank], update)

    _, errs = run_replicas(2, again)
    assert not errs, errs
    assert sum(seen) == 64


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_products_as_factors_are_summed_by_whole_rows_against_numpy(n, monkeypatch):
    """A replica's gradient given as its factors (``left.T @ right``): each rank multiplies
    out its rows of every replica's product; every copy gets the float64 sum, once, and
    ranges never split a row (beside plain arrays, whose ranges are not rows)."""
    from psflow.framework.product_gradient import ProductGradient

    monkeypatch.setattr(reduce_update, "SUB_CHUNK_BYTES", 4 << 10)  # several rows per unit
    rng = np.random.default_rng(n)
    factors = [
        (rng.standard_normal((5, 37), np.float32), rng.standard_normal((5, 24), np.float32))
        for _ in range(n)
    ]
    plain = [rng.standard_normal(101).astype(np.float32) for _ in range(n)]
    xs = [[plain[q], ProductGradient(*factors[q])] for q in range(n)]
    comm = Communicator(n, RingAllReduce(replica_parallel_threshold_bytes=0))
    copies = [[np.zeros(101, np.float32), np.zeros((37, 24), np.float32)] for _ in range(n)]
    hits = [np.zeros(101, np.int64), np.zeros(37 * 24, np.int64)]
    pieces: list[tuple[int, int]] = []

    def body(rank):
        def update(k, lo, hi, summed):
            hits[k][lo:hi] += 1
            if k == 1:
                pieces.append((lo, hi))
            for row in copies:
                row[k].reshape(-1)[lo:hi] += summed

        comm.reduce_and_update(rank, xs[rank], update)

    _, errs = run_replicas(n, body)
    assert not errs, errs
    assert all((h == 1).all() for h in hits)
    assert all(lo % 24 == 0 and hi % 24 == 0 for lo, hi in pieces)
    want = sum(a.astype(np.float64).T @ b.astype(np.float64) for a, b in factors)
    np.testing.assert_allclose(copies[0][1], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(copies[0][0], np.sum(plain, axis=0), rtol=1e-6, atol=1e-6)
    for row in copies[1:]:
        np.testing.assert_array_equal(row[1], copies[0][1])


def test_a_product_beside_another_replicas_array_is_multiplied_out_first():
    """A replica with no gradient for a weight passes zeros where the others pass factors:
    the factors are multiplied out, and the sum is the others' product."""
    from psflow.framework.product_gradient import ProductGradient

    rng = np.random.default_rng(3)
    left, right = rng.standard_normal((4, 6), np.float32), rng.standard_normal((4, 5), np.float32)
    xs = [[ProductGradient(left, right)], [np.zeros((6, 5), np.float32)]]
    comm = Communicator(2)
    got = np.zeros(30, np.float32)

    def body(rank):
        def update(k, lo, hi, summed):
            got[lo:hi] = summed

        comm.reduce_and_update(rank, xs[rank], update)

    _, errs = run_replicas(2, body)
    assert not errs, errs
    np.testing.assert_allclose(got.reshape(6, 5), left.T @ right, rtol=1e-6)


def test_factors_that_are_not_numpy_or_disagree_in_dtype_are_refused():
    from psflow.framework.product_gradient import ProductGradient

    comm = Communicator(1)
    bad = ProductGradient(np.ones((2, 3), np.float32), np.ones((2, 4), np.float64))
    with pytest.raises(errors.InvalidArgumentError, match="NumPy arrays"):
        comm.reduce_and_update(0, [bad], lambda *a: None)

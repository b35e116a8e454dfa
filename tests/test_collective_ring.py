"""Ring all-reduce and reduction-to-one-device against a float64 NumPy sum."""

from __future__ import annotations

import numpy as np
import pytest

from psflow import errors
from psflow.collective import (
    CommunicationOptions,
    ReduceOp,
    ReductionToOneDevice,
    RingAllReduce,
)
from psflow.collective.layout import split_sizes

REPLICAS = [1, 2, 3, 4, 8]
SIZES = [0, 1, 7, 1000, 2**20 + 3]


def make_inputs(n_replicas, shapes, dtypes, seed=0):
    """Per-replica lists of random arrays (never all zeros)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_replicas):
        row = []
        for shape, dtype in zip(shapes, dtypes, strict=True):
            dtype = np.dtype(dtype)
            if dtype.kind in "iu":
                info = np.iinfo(dtype)
                lo, hi = max(info.min, -1000), min(info.max, 1000)
                row.append(rng.integers(lo, hi, size=shape, dtype=dtype))
            elif dtype in (np.float32, np.float64):
                row.append(rng.standard_normal(shape, dtype=dtype))
            else:
                row.append(rng.standard_normal(shape).astype(dtype))
        out.append(row)
    return out


def reference(per_replica, i, op=ReduceOp.SUM):
    """Tensor i's sum in float64 (integers: exact int64, wrapped to the dtype)."""
    xs = [row[i] for row in per_replica]
    dtype = xs[0].dtype
    if dtype.kind in "iu":
        return np.sum([x.astype(np.int64) for x in xs], axis=0).astype(dtype)
    total = xs[0].astype(np.float64)
    for x in xs[1:]:
        total += x
    return total / len(xs) if op is ReduceOp.MEAN else total


def assert_matches_sum(result, per_replica, i, op=ReduceOp.SUM):
    """Within the rounding of N-1 additions in the array's dtype (exact for integers)."""
    ref = reference(per_replica, i, op)
    xs = [row[i] for row in per_replica]
    assert result.shape == xs[0].shape and result.dtype == xs[0].dtype
    if xs[0].dtype.kind in "iu":
        np.testing.assert_array_equal(result, ref)
        return
    n = len(xs)
    eps = np.finfo(xs[0].dtype).eps
    magnitude = np.abs(xs[0].astype(np.float64))
    for x in xs[1:]:
        magnitude += np.abs(x)
    if op is ReduceOp.MEAN:
        magnitude /= n
    bound = n * eps * magnitude + np.finfo(xs[0].dtype).tiny
    ref -= result
    assert np.all(np.abs(ref) <= bound), f"max error {np.abs(ref).max()} over bound"


def assert_identical_everywhere(results):
    for r in range(1, len(results)):
        for a, b in zip(results[0], results[r], strict=True):
            assert a.tobytes() == b.tobytes()


def expected_ring_bytes(n, sizes_by_pack, itemsize):
    """Bytes rank r sends: per pack, 2*S minus chunks r+1 and r+2 (array_split sizes)."""
    sent = [0] * n
    for size in sizes_by_pack:
        chunks = split_sizes(size, n)
        for r in range(n):
            sent[r] += (2 * size - chunks[(r + 1) % n] - chunks[(r + 2) % n]) * itemsize
    return sent


@pytest.mark.parametrize("n", REPLICAS)
@pytest.mark.parametrize("size", SIZES)
def test_ring_equals_float64_sum(n, size):
    xs = make_inputs(n, [(size,)], [np.float32], seed=size + n)
    ops = RingAllReduce()
    results = ops.all_reduce(xs)
    assert len(results) == n
    for r in range(n):
        assert_matches_sum(results[r][0], xs, 0)
    assert_identical_everywhere(results)
    assert ops.bytes_sent == expected_ring_bytes(n, [size], 4)


@pytest.mark.parametrize("n", REPLICAS)
def test_ring_bytes_sent_is_two_n_minus_one_over_n_of_the_buffer(n):
    size = 840 * 1024  # divisible by every N tested: exactly 2(N-1)/N * S
    xs = make_inputs(n, [(size,)], [np.float32])
    ops = RingAllReduce(subchunk_bytes=64 << 10)
    ops.all_reduce(xs)
    assert ops.bytes_sent == [2 * (n - 1) * size * 4 // n] * n
    ops.reset_bytes_sent()
    assert ops.bytes_sent == [0] * n


def test_ring_counts_uneven_chunks_exactly():
    n, size = 4, 1001  # chunks 251, 250, 250, 250
    ops = RingAllReduce()
    ops.all_reduce(make_inputs(n, [(size,)], [np.float64]))
    assert ops.bytes_sent == expected_ring_bytes(n, [size], 8)
    assert ops.bytes_sent[0] != ops.bytes_sent[2]


@pytest.mark.slow
def test_ring_64mb_on_four_replicas():
    n, size = 4, 16 * 2**20
    xs = make_inputs(n, [(size,)], [np.float32], seed=64)
    ops = RingAllReduce()
    results = ops.all_reduce(xs)
    assert_matches_sum(results[0][0], xs, 0)
    assert_identical_everywhere(results)
    assert ops.bytes_sent == [2 * (n - 1) * size * 4 // n] * n


@pytest.mark.parametrize("n", [2, 3, 8])
def test_mixed_dtypes_packed_in_one_call(n):
    shapes = [(3, 5), (7,), (100,), (), (2, 2, 2), (40000,), (1,)]
    dtypes = [np.float32, np.float64, np.int32, np.float32, np.int32, np.float64, np.float32]
    xs = make_inputs(n, shapes, dtypes, seed=3)
    ops = RingAllReduce()
    results = ops.all_reduce(xs)
    for r in range(n):
        for i in range(len(shapes)):
            assert_matches_sum(results[r][i], xs, i)
    assert_identical_everywhere(results)
    per_dtype = {}
    for s, d in zip(shapes, dtypes, strict=True):
        per_dtype[np.dtype(d)] = per_dtype.get(np.dtype(d), 0) + int(np.prod(s))
    want = [0] * n
    for d, total in per_dtype.items():
        for r, b in enumerate(expected_ring_bytes(n, [total], d.itemsize)):
            want[r] += b
    assert ops.bytes_sent == want


@pytest.mark.parametrize("n", [2, 3, 4])
def test_small_bytes_per_pack_makes_several_packs(n):
    shapes = [(1000,), (37,), (2500,)]
    dtypes = [np.float32, np.float64, np.float32]
    xs = make_inputs(n, shapes, dtypes, seed=5)
    ops = RingAllReduce(subchunk_bytes=256)
    opts = CommunicationOptions(bytes_per_pack=1024)
    results = ops.all_reduce(xs, options=opts)
    layout = ops.layout_for(xs, 1024)
    assert len(layout.packs) == 14 + 1  # float32: 3500 * 4 B / 1 KiB; float64: one
    for r in range(n):
        for i in range(3):
            assert_matches_sum(results[r][i], xs, i)
    assert_identical_everywhere(results)
    want = [0] * n
    for itemsize, total in ((4, 3500), (8, 37)):
        per = 1024 // itemsize
        packs = [min(per, total - p) for p in range(0, total, per)]
        for r, b in enumerate(expected_ring_bytes(n, packs, itemsize)):
            want[r] += b
    assert ops.bytes_sent == want


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.complex64])
@pytest.mark.parametrize("n", [2, 3])
def test_float_dtypes_sum_and_mean(dtype, n):
    xs = make_inputs(n, [(513,), (4, 4)], [dtype, dtype], seed=7)
    if np.dtype(dtype).kind == "c":
        xs = [[x + 1j * x[::-1].reshape(x.shape) for x in row] for row in xs]
    ops = RingAllReduce()
    for op in (ReduceOp.SUM, ReduceOp.MEAN):
        results = ops.all_reduce(xs, op)
        for i in range(2):
            if np.dtype(dtype).kind == "c":
                tot = np.sum([row[i].astype(np.complex128) for row in xs], axis=0)
                ref = tot / n if op is ReduceOp.MEAN else tot
                np.testing.assert_allclose(results[0][i], ref, rtol=1e-5, atol=1e-5)
            else:
                assert_matches_sum(results[0][i], xs, i, op)
        assert_identical_everywhere(results)


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int32, np.int64, np.uint64])
def test_integer_sums_are_exact_with_wraparound(dtype):
    n = 4
    info = np.iinfo(dtype)
    rng = np.random.default_rng(11)
    hi = min(int(info.max), 2**40)
    xs = [[rng.integers(0, hi, size=999, dtype=dtype)] for _ in range(n)]
    results = RingAllReduce().all_reduce(xs)
    want = xs[0][0].copy()
    for row in xs[1:]:
        want += row[0]  # NumPy's modular arithmetic, like the ring's
    for r in range(n):
        np.testing.assert_array_equal(results[r][0], want)


def test_integer_mean_is_refused_naming_the_dtype():
    xs = [[np.arange(4, dtype=np.int32)], [np.arange(4, dtype=np.int32)]]
    with pytest.raises(errors.InvalidArgumentError, match="int32"):
        RingAllReduce().all_reduce(xs, "mean")


@pytest.mark.parametrize("n", [1, 2, 3])
def test_results_never_alias_inputs(n):
    xs = make_inputs(n, [(10,), (300,)], [np.float32, np.float32])
    results = RingAllReduce().all_reduce(xs)
    for r in range(n):
        for i in range(2):
            for q in range(n):
                assert not np.shares_memory(results[r][i], xs[q][i])
    if n == 1:
        np.testing.assert_array_equal(results[0][0], xs[0][0])


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("ops_cls", [RingAllReduce, ReductionToOneDevice])
def test_in_place_and_out_arrays(n, ops_cls):
    # Big tensors are reduced where they lie; the small ones go through a staging copy.
    shapes = [(20000,), (3,), (5, 2), (9000,)]
    dtypes = [np.float32] * 4
    xs = make_inputs(n, shapes, dtypes, seed=21)
    originals = [[x.copy() for x in row] for row in xs]
    ops = ops_cls(subchunk_bytes=4096)
    expected = ops.all_reduce(xs)
    outs = [[np.empty_like(x) for x in row] for row in xs]
    got = ops.all_reduce(xs, out=outs)
    for r in range(n):
        for i in range(4):
            assert got[r][i] is outs[r][i]
            assert got[r][i].tobytes() == expected[r][i].tobytes()
            np.testing.assert_array_equal(xs[r][i], originals[r][i])
    inplace = ops.all_reduce(xs, out=xs)
    for r in range(n):
        for i in range(4):
            assert inplace[r][i] is xs[r][i]
            assert xs[r][i].tobytes() == expected[r][i].tobytes()


def test_non_contiguous_and_scalar_inputs():
    base = make_inputs(3, [(6, 8), ()], [np.float64, np.float64], seed=9)
    xs = [[row[0].T, row[1]] for row in base]
    results = RingAllReduce().all_reduce(xs)
    assert_matches_sum(results[1][0], xs, 0)
    assert results[1][1].shape == ()
    assert_matches_sum(results[1][1], xs, 1)


@pytest.mark.parametrize("workers", [1, 2, 8])
def test_fewer_threads_than_replicas_give_the_same_bits(workers):
    n = 8
    xs = make_inputs(n, [(50001,), (300,)], [np.float32, np.float64], seed=13)
    ref = RingAllReduce(max_workers=1).all_reduce(xs)
    ops = RingAllReduce(max_workers=workers, parallel_threshold_bytes=0, subchunk_bytes=8192)
    got = ops.all_reduce(xs)
    for r in range(n):
        for a, b in zip(got[r], ref[r], strict=True):
            assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("n", REPLICAS)
@pytest.mark.parametrize("size", [0, 1, 7, 1000, 2**16 + 3])
def test_reduction_to_one_device_equals_float64_sum(n, size):
    xs = make_inputs(n, [(size,), (3,)], [np.float32, np.float64], seed=size * 3 + n)
    ops = ReductionToOneDevice(parallel_threshold_bytes=0)
    for op in (ReduceOp.SUM, ReduceOp.MEAN):
        results = ops.all_reduce(xs, op)
        for r in range(n):
            assert_matches_sum(results[r][0], xs, 0, op)
            assert_matches_sum(results[r][1], xs, 1, op)
        assert_identical_everywhere(results)


@pytest.mark.parametrize("dest", [0, 2])
def test_reduce_to_a_destination(dest):
    xs = make_inputs(3, [(1001,), (4, 4)], [np.float32, np.int64], seed=17)
    for ops in (RingAllReduce(), ReductionToOneDevice()):
        got = ops.reduce(xs, "sum", destination_replica=dest)
        assert len(got) == 2
        assert_matches_sum(got[0], xs, 0)
        assert_matches_sum(got[1], xs, 1)
    with pytest.raises(errors.InvalidArgumentError, match="rank 3"):
        RingAllReduce().reduce(xs, "sum", destination_replica=3)


def test_reduction_to_one_sends_everything_through_the_destination():
    n, size = 4, 1000
    ops = ReductionToOneDevice(parallel_threshold_bytes=0)
    ops.all_reduce(make_inputs(n, [(size,)], [np.float32]))
    s = size * 4
    assert ops.bytes_sent == [(n - 1) * s, s, s, s]


# -- bad input: typed errors naming the value, no state change -------------------------------
def test_replicas_with_different_numbers_of_arrays():
    xs = [[np.ones(3)], [np.ones(3), np.ones(3)]]
    with pytest.raises(errors.InvalidArgumentError, match=r"per_replica\[1\] has 2 arrays"):
        RingAllReduce().all_reduce(xs)


def test_shape_mismatch_across_replicas():
    xs = [[np.ones(3), np.ones((2, 2))], [np.ones(3), np.ones((2, 3))]]
    with pytest.raises(errors.InvalidArgumentError, match=r"\(2, 3\)"):
        RingAllReduce().all_reduce(xs)


def test_dtype_mismatch_across_replicas():
    xs = [[np.ones(3, np.float32)], [np.ones(3, np.float64)]]
    with pytest.raises(errors.InvalidArgumentError, match="float64"):
        ReductionToOneDevice().all_reduce(xs)


def test_unknown_op_is_named():
    xs = [[np.ones(3)], [np.ones(3)]]
    with pytest.raises(errors.InvalidArgumentError, match="'PROD'"):
        RingAllReduce().all_reduce(xs, "PROD")


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ([], "empty"),
        ("ab", "list or tuple"),
        ([np.ones(3)], "list or tuple"),
        ([[[1.0, 2.0]], [[1.0, 2.0]]], "NumPy or CuPy array"),
        ([[np.array([True])], [np.array([False])]], "bool"),
        ([[np.array(["a"])], [np.array(["b"])]], "<U1"),
    ],
)
def test_malformed_calls_are_refused(bad, match):
    with pytest.raises(errors.InvalidArgumentError, match=match):
        RingAllReduce().all_reduce(bad)


def test_bad_out_arrays_are_refused_and_change_nothing():
    xs = [[np.ones(4, np.float32)], [np.ones(4, np.float32)]]
    out = [[np.zeros(4, np.float32)], [np.zeros(5, np.float32)]]
    with pytest.raises(errors.InvalidArgumentError, match=r"out\[1\]\[0\]"):
        RingAllReduce().all_reduce(xs, out=out)
    assert not out[0][0].any()
    shared = np.zeros(4, np.float32)
    with pytest.raises(errors.InvalidArgumentError, match="same array"):
        RingAllReduce().all_reduce(xs, out=[[shared], [shared]])
    readonly = np.zeros(4, np.float32)
    readonly.flags.writeable = False
    with pytest.raises(errors.InvalidArgumentError, match="writeable"):
        RingAllReduce().all_reduce(xs, out=[[readonly], [np.zeros(4, np.float32)]])


def test_held_results_survive_later_calls():
    ops = RingAllReduce()
    a = ops.all_reduce([[np.ones(1000, np.float32)], [np.ones(1000, np.float32)]])
    kept = a[1][0].copy()
    for k in range(3):
        ops.all_reduce([[np.full(1000, k, np.float32)], [np.ones(1000, np.float32)]])
    np.testing.assert_array_equal(a[1][0], kept)

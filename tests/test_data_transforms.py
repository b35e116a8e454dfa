"""Dataset transformations: TF's documented examples, element structure and errors."""

from __future__ import annotations

import collections
import threading

import numpy as np
import pytest

import psflow as pf
from psflow.data import Dataset, TensorSpec


def values(ds):
    return [np.asarray(x).tolist() for x in ds.as_numpy_iterator()]


def slow_path(ds):
    """The same elements through a map (no index plan), to compare with the fast path."""
    return ds.map(lambda *x: x if len(x) > 1 else x[0])


# -- batch and friends --------------------------------------------------------------------------


def test_batch_tf_doc_examples():
    assert values(Dataset.range(8).batch(3)) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert values(Dataset.range(8).batch(3, drop_remainder=True)) == [[0, 1, 2], [3, 4, 5]]


def test_batch_spec_leading_dim():
    assert Dataset.range(8).batch(3).element_spec == TensorSpec([None], pf.int64)
    assert Dataset.range(8).batch(3, True).element_spec == TensorSpec([3], pf.int64)


def test_batch_of_dict_of_rows():
    x = np.arange(20, dtype=np.float32).reshape(10, 2)
    y = np.arange(10)
    ds = Dataset.from_tensor_slices({"x": x, "y": y}).batch(4)
    batches = list(ds)
    assert [b["x"].shape.as_list() for b in batches] == [[4, 2], [4, 2], [2, 2]]
    np.testing.assert_array_equal(batches[2]["x"].numpy(), x[8:])
    np.testing.assert_array_equal(batches[1]["y"].numpy(), y[4:8])


@pytest.mark.parametrize("drop", [False, True])
def test_batch_fast_path_equals_element_path(drop):
    x = np.random.default_rng(0).normal(size=(53, 3)).astype(np.float32)
    src = Dataset.from_tensor_slices((x, np.arange(53)))
    fast = src.shuffle(20, seed=3).repeat(2).skip(5).take(90).shard(2, 1).batch(7, drop)
    slow = slow_path(src).shuffle(20, seed=3).repeat(2).skip(5).take(90).shard(2, 1).batch(7, drop)
    assert fast._inputs[0]._has_plan() and not slow._inputs[0]._has_plan()
    f, s = list(fast.as_numpy_iterator()), list(slow.as_numpy_iterator())
    assert len(f) == len(s) == len(fast)
    for (fa, fb), (sa, sb) in zip(f, s):
        np.testing.assert_array_equal(fa, sa)
        np.testing.assert_array_equal(fb, sb)


def test_batch_rejects_bad_sizes():
    for bad in (0, -1):
        with pytest.raises(pf.errors.InvalidArgumentError, match=str(bad)):
            Dataset.range(3).batch(bad)
    with pytest.raises(TypeError, match=r"2\.5"):
        Dataset.range(3).batch(2.5)


def test_batch_rejects_different_shapes_naming_them():
    ds = Dataset.range(1, 4).map(lambda x: pf.fill([x], x)).batch(2)
    with pytest.raises(pf.errors.InvalidArgumentError, match=r"\[1\].*\[2\]"):
        list(ds)


def test_batch_size_from_tensor():
    assert values(Dataset.range(4).batch(pf.constant(2))) == [[0, 1], [2, 3]]


def test_unbatch_inverts_batch():
    ds = Dataset.from_tensor_slices(([1, 2, 3, 4, 5], [5, 6, 7, 8, 9])).batch(2).unbatch()
    assert values(ds) == [[1, 5], [2, 6], [3, 7], [4, 8], [5, 9]]
    assert values(Dataset.range(10).batch(3).unbatch().batch(4)) == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9],
    ]


def test_unbatch_rejects_scalars():
    with pytest.raises(pf.errors.InvalidArgumentError, match="scalar"):
        Dataset.range(3).unbatch()


def test_rebatch_scalar_and_list_sizes():
    assert values(Dataset.range(10).batch(4).rebatch(3)) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert values(Dataset.range(10).batch(4).rebatch(3, drop_remainder=True)) == [
        [0, 1, 2],
        [3, 4, 5],
        [6, 7, 8],
    ]
    assert values(Dataset.range(10).batch(4).rebatch([1, 3])) == [
        [0],
        [1, 2, 3],
        [4],
        [5, 6, 7],
        [8],
        [9],
    ]


def test_rebatch_zero_sizes_give_empty_batches_and_errors():
    assert values(Dataset.range(4).batch(4).rebatch([2, 0, 2])) == [[0, 1], [], [2, 3]]
    with pytest.raises(pf.errors.InvalidArgumentError):
        Dataset.range(4).batch(2).rebatch(0)
    with pytest.raises(pf.errors.InvalidArgumentError):
        Dataset.range(4).batch(2).rebatch([0, 0])
    with pytest.raises(pf.errors.InvalidArgumentError, match="rank"):
        Dataset.range(4).rebatch(2)


def test_padded_batch_default_and_explicit_shapes():
    ds = Dataset.range(1, 4).map(lambda x: pf.fill([x], x))
    assert values(ds.padded_batch(2)) == [[[1, 0], [2, 2]], [[3, 3, 3]]]
    out = values(ds.padded_batch(2, padded_shapes=[4], padding_values=pf.constant(-1, pf.int64)))
    assert out == [[[1, -1, -1, -1], [2, 2, -1, -1]], [[3, 3, 3, -1]]]
    assert ds.padded_batch(3, padded_shapes=[5]).element_spec == TensorSpec([None, 5], pf.int64)
    assert int(Dataset.range(10).padded_batch(3).cardinality()) == 4


def test_padded_batch_too_small_shape_and_wrong_padding_dtype():
    ds = Dataset.range(1, 4).map(lambda x: pf.fill([x], x))
    with pytest.raises(pf.errors.InvalidArgumentError, match="smaller"):
        list(ds.padded_batch(2, padded_shapes=[2]))
    with pytest.raises(TypeError, match="dtype"):
        ds.padded_batch(2, padding_values=pf.constant(0.5))


# -- repeat / take / skip / shard / enumerate ---------------------------------------------------


def test_repeat_take_skip_shard_docs():
    assert values(Dataset.range(3).repeat(2)) == [0, 1, 2, 0, 1, 2]
    assert values(Dataset.range(3).repeat().take(7)) == [0, 1, 2, 0, 1, 2, 0]
    assert values(Dataset.range(10).take(3)) == [0, 1, 2]
    assert values(Dataset.range(10).take(-1)) == list(range(10))
    assert values(Dataset.range(10).skip(7)) == [7, 8, 9]
    assert values(Dataset.range(10).skip(-1)) == []
    assert values(Dataset.range(10).shard(num_shards=3, index=0)) == [0, 3, 6, 9]
    assert values(Dataset.range(10).shard(num_shards=3, index=2)) == [2, 5, 8]


def test_same_on_element_path():
    src = slow_path(Dataset.range(10))
    assert values(src.repeat(2).take(13)) == (list(range(10)) * 2)[:13]
    assert values(src.skip(7)) == [7, 8, 9]
    assert values(src.skip(-1)) == []
    assert values(src.shard(3, 1)) == [1, 4, 7]
    assert values(src.repeat(0)) == []


def test_repeat_of_empty_dataset_ends():
    assert values(Dataset.range(0).repeat()) == []
    assert values(Dataset.range(5).filter(lambda x: x > 10).repeat()) == []


def test_take_does_not_pull_more_than_needed():
    pulled = []

    def gen():
        for i in range(100):
            pulled.append(i)
            yield i

    ds = Dataset.from_generator(gen, output_types=pf.int64).take(3)
    assert values(ds) == [0, 1, 2]
    assert pulled == [0, 1, 2]


@pytest.mark.parametrize("num,index", [(3, 3), (3, -1), (0, 0), (-2, 0)])
def test_shard_rejects_bad_index_or_count(num, index):
    with pytest.raises(pf.errors.InvalidArgumentError, match=f"{index if num > 0 else num}"):
        Dataset.range(10).shard(num, index)


def test_enumerate():
    ds = Dataset.from_tensor_slices([7, 8, 9]).enumerate(start=5)
    assert values(ds) == [[5, 7], [6, 8], [7, 9]]
    assert ds.element_spec == (TensorSpec([], pf.int64), TensorSpec([], pf.int32))


# -- zip / concatenate --------------------------------------------------------------------------


def test_zip_forms_and_stops_at_shortest():
    a, b = Dataset.range(1, 4), Dataset.range(4, 7)
    assert values(Dataset.zip(a, b)) == [[1, 4], [2, 5], [3, 6]]
    assert values(Dataset.zip((a, b))) == [[1, 4], [2, 5], [3, 6]]
    c = Dataset.range(7, 13).batch(2)
    e = next(iter(Dataset.zip({"a": a, "bc": (b, c)})))
    assert int(e["a"]) == 1 and int(e["bc"][0]) == 4 and e["bc"][1].numpy().tolist() == [7, 8]
    assert values(Dataset.zip((a, Dataset.range(2)))) == [[1, 0], [2, 1]]


def test_zip_rejects_non_datasets():
    with pytest.raises(TypeError, match="list"):
        Dataset.zip([Dataset.range(2), Dataset.range(2)])
    with pytest.raises(TypeError, match="3"):
        Dataset.zip((Dataset.range(2), 3))


def test_concatenate_and_its_checks():
    a = Dataset.range(1, 4)
    b = Dataset.range(4, 8)
    assert values(a.concatenate(b)) == [1, 2, 3, 4, 5, 6, 7]
    with pytest.raises(TypeError, match="Incompatible"):
        a.concatenate(a.map(lambda x: pf.cast(x, pf.float32)))
    with pytest.raises(TypeError, match="Incompatible"):
        a.concatenate(Dataset.zip((a, a)))
    x = Dataset.from_tensor_slices(np.zeros((4, 3)))
    y = Dataset.from_tensor_slices(np.zeros((4, 5)))
    assert x.concatenate(y).element_spec == TensorSpec([None], pf.float64)


# -- map / filter / flat_map / reduce -----------------------------------------------------------


def test_map_unpacks_tuples_passes_dicts_whole():
    ds = Dataset.from_tensor_slices(([1, 2], [10, 20]))
    assert values(ds.map(lambda x, y: x + y)) == [11, 22]
    d = Dataset.from_tensor_slices({"a": [1, 2], "b": [3, 4]})
    assert values(d.map(lambda e: e["a"] * e["b"])) == [3, 8]


def test_map_passes_namedtuple_whole():
    Pair = collections.namedtuple("Pair", ["x", "y"])
    ds = Dataset.from_tensor_slices(Pair([1, 2], [3, 4]))
    assert values(ds.map(lambda p: p.x - p.y)) == [-2, -2]


def test_map_output_structures():
    ds = Dataset.range(3).map(lambda x: [x, x * 2])  # a top-level list becomes a tuple
    assert ds.element_spec == (TensorSpec([], pf.int64), TensorSpec([], pf.int64))
    assert values(ds) == [[0, 0], [1, 2], [2, 4]]
    nested = Dataset.range(2).map(lambda x: {"a": x, "b": (x, [x, x])})
    assert nested.element_spec["b"][1] == TensorSpec([2], pf.int64)
    assert values(Dataset.range(2).map(lambda x: 1.5)) == [1.5, 1.5]
    assert Dataset.range(2).map(lambda x: 1.5).element_spec.dtype == pf.float32


def test_map_element_spec_marks_unknown_dims():
    ds = Dataset.range(10).batch(4).map(lambda x: pf.reshape(x, [-1, 1]) * 2)
    assert ds.element_spec == TensorSpec([None, 1], pf.int64)


def test_map_element_spec_falls_back_to_a_real_element():
    seen = []

    def strict(x):
        seen.append(int(x))
        if int(x) < 3:
            raise ValueError("small values not allowed")
        return x + 1

    ds = Dataset.range(3, 5).map(strict)
    assert ds.element_spec == TensorSpec([], pf.int64)
    assert seen == [1, 3]  # a placeholder call failed, then one real element
    assert values(ds) == [4, 5]


def test_map_rejects_changing_structure_or_dtype():
    flip = Dataset.range(3).map(lambda x: (x, x) if int(x) == 1 else x)
    with pytest.raises(TypeError):
        list(flip)
    dtype = Dataset.range(3).map(lambda x: 1 if int(x) == 0 else 1.5)
    with pytest.raises(TypeError, match="dtype"):
        list(dtype)
    with pytest.raises(TypeError, match="callable"):
        Dataset.range(3).map(3)


def test_map_output_must_be_numbers_or_text():
    with pytest.raises(TypeError, match="None"):
        list(Dataset.range(2).map(lambda x: None))
    with pytest.raises(TypeError, match="object"):
        list(Dataset.range(2).map(lambda x: object()))


def test_map_runs_on_host():
    devices = []

    def fn(x):
        devices.append(pf.constant(1.0).device)
        return x

    list(Dataset.range(2).map(fn))
    assert all(d.endswith("CPU:0") for d in devices)


@pytest.mark.parametrize("calls", [2, pf.data.AUTOTUNE])
def test_parallel_map_keeps_order_and_uses_threads(calls):
    threads = set()

    def fn(x):
        threads.add(threading.current_thread().name)
        return x * 3

    ds = Dataset.range(200).map(fn, num_parallel_calls=calls)
    assert values(ds) == [3 * i for i in range(200)]
    assert all(name.startswith("psflow-data-map") for name in threads)


def test_parallel_map_propagates_errors():
    def fn(x):
        if int(x) == 5:
            raise RuntimeError("bad element 5")
        return x

    with pytest.raises(RuntimeError, match="bad element 5"):
        list(Dataset.range(10).map(fn, num_parallel_calls=3))
    with pytest.raises(pf.errors.InvalidArgumentError, match="-3"):
        Dataset.range(3).map(fn, num_parallel_calls=-3)


def test_filter_doc_examples():
    assert values(Dataset.range(6).filter(lambda x: x % 2 == 0)) == [0, 2, 4]
    ds = Dataset.from_tensor_slices(([1, 2, 3], [4, 5, 6])).filter(lambda x, y: y > 4)
    assert values(ds) == [[2, 5], [3, 6]]
    assert values(Dataset.range(3).filter(lambda x: True)) == [0, 1, 2]


def test_filter_rejects_non_bool_predicates():
    with pytest.raises(pf.errors.InvalidArgumentError, match="int64"):
        list(Dataset.range(3).filter(lambda x: x))
    with pytest.raises(pf.errors.InvalidArgumentError, match="shape"):
        list(Dataset.range(3).filter(lambda x: pf.constant([True, False])))


def test_flat_map():
    ds = Dataset.range(1, 4).flat_map(lambda x: Dataset.from_tensors(x).repeat(x))
    assert values(ds) == [1, 2, 2, 3, 3, 3]
    assert ds.element_spec == TensorSpec([], pf.int64)
    with pytest.raises(TypeError, match="Dataset"):
        list(Dataset.range(2).flat_map(lambda x: x))


def test_reduce():
    total = Dataset.range(5).reduce(np.int64(0), lambda s, x: s + x)
    assert isinstance(total, pf.Tensor) and int(total) == 10
    count = Dataset.range(5).reduce(np.int64(0), lambda s, _: s + 1)
    assert int(count) == 5
    pairs = Dataset.from_tensor_slices(([1, 2], [3, 4]))
    a, b = pairs.reduce((0, 0), lambda s, e: (s[0] + e[0], s[1] + e[1]))
    assert (int(a), int(b)) == (3, 7)


def test_reduce_rejects_state_dtype_change():
    with pytest.raises(TypeError, match="dtypes"):
        Dataset.range(3).reduce(np.int64(0), lambda s, x: pf.cast(s + x, pf.float32))


# -- cache / apply / options ----------------------------------------------------------------------


def test_cache_replays_first_complete_pass():
    calls = []

    def gen():
        calls.append(1)
        yield from range(3)

    ds = Dataset.from_generator(gen, output_types=pf.int64).cache()
    it = iter(ds)
    next(it)  # an abandoned pass caches nothing
    assert values(ds) == [0, 1, 2]
    assert values(ds) == [0, 1, 2]
    assert len(calls) == 2


def test_cache_after_shuffle_freezes_the_order():
    ds = Dataset.range(20).shuffle(20, seed=1).cache()
    first, second = values(ds), values(ds)
    assert first == second and sorted(first) == list(range(20))
    uncached = Dataset.range(20).shuffle(20, seed=1)
    assert values(uncached) != values(uncached)


def test_apply():
    assert values(Dataset.range(5).apply(lambda d: d.filter(lambda x: x < 2))) == [0, 1]
    with pytest.raises(TypeError, match="must return a Dataset"):
        Dataset.range(5).apply(lambda d: 3)

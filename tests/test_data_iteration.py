"""Iteration, prefetch, cardinality, options, pickling and the docstring examples."""

from __future__ import annotations

import doctest
import importlib
import threading
import time

import cloudpickle
import numpy as np
import pytest

import psflow as pf
from psflow.data import Dataset, TensorSpec


def values(ds):
    return [np.asarray(x).tolist() for x in ds.as_numpy_iterator()]


# -- iterators ----------------------------------------------------------------------------------


def test_iterator_protocols():
    it = iter(Dataset.range(3))
    assert int(next(it)) == 0
    assert int(it.get_next()) == 1
    opt = it.get_next_as_optional()
    assert bool(opt.has_value()) and int(opt.get_value()) == 2
    empty = it.get_next_as_optional()
    assert not bool(empty.has_value())
    assert empty.element_spec == TensorSpec([], pf.int64)
    with pytest.raises(pf.errors.InvalidArgumentError):
        empty.get_value()
    with pytest.raises(pf.errors.OutOfRangeError):
        it.get_next()
    with pytest.raises(StopIteration):
        next(it)
    assert it.element_spec == TensorSpec([], pf.int64)


def test_each_for_loop_is_a_new_pass():
    ds = Dataset.range(3)
    assert [int(x) for x in ds] == [0, 1, 2]
    assert [int(x) for x in ds] == [0, 1, 2]


def test_as_numpy_iterator_gives_numpy_values():
    out = list(Dataset.from_tensor_slices({"a": [1, 2], "b": [[1.0], [2.0]]}).as_numpy_iterator())
    assert isinstance(out[0]["a"], np.int32) and isinstance(out[0]["b"], np.ndarray)


def test_repr_shows_element_spec():
    assert repr(Dataset.range(3).batch(2)) == (
        "<BatchDataset element_spec=TensorSpec(shape=(None,), dtype=psflow.int64, name=None)>"
    )
    assert "TensorSliceDataset" in repr(Dataset.from_tensor_slices([1]))


# -- prefetch -----------------------------------------------------------------------------------


def _prefetch_threads():
    return [t for t in threading.enumerate() if t.name == "psflow-data-prefetch"]


def _wait_for(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_prefetch_keeps_order_and_runs_in_a_thread():
    where = []

    def fn(x):
        where.append(threading.current_thread().name)
        return x * 2

    ds = Dataset.range(50).map(fn).prefetch(3)
    assert values(ds) == [2 * i for i in range(50)]
    assert set(where) == {"psflow-data-prefetch"}
    assert values(Dataset.range(5).prefetch(pf.data.AUTOTUNE)) == [0, 1, 2, 3, 4]
    assert values(Dataset.range(5).prefetch(0)) == [0, 1, 2, 3, 4]


def test_prefetch_is_bounded():
    produced = []

    def gen():
        for i in range(100):
            produced.append(i)
            yield i

    it = iter(Dataset.from_generator(gen, output_types=pf.int64).prefetch(2))
    next(it)
    time.sleep(0.2)
    # one taken, two queued, one held by the blocked producer
    assert len(produced) <= 4
    del it


def test_prefetch_propagates_errors():
    def gen():
        yield 1
        raise RuntimeError("generator broke")

    ds = Dataset.from_generator(gen, output_types=pf.int64).prefetch(2)
    it = iter(ds)
    assert int(next(it)) == 1
    with pytest.raises(RuntimeError, match="generator broke"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)


def test_abandoned_prefetch_iterator_stops_its_thread():
    assert _wait_for(lambda: not _prefetch_threads())
    it = iter(Dataset.range(10**9).prefetch(2))
    next(it)
    assert len(_prefetch_threads()) == 1
    del it
    assert _wait_for(lambda: not _prefetch_threads()), "prefetch thread still running"


def test_prefetch_rejects_bad_buffer():
    with pytest.raises(pf.errors.InvalidArgumentError, match="-5"):
        Dataset.range(3).prefetch(-5)


# -- cardinality --------------------------------------------------------------------------------

INF, UNK = pf.data.INFINITE_CARDINALITY, pf.data.UNKNOWN_CARDINALITY
R = Dataset.range(10)
F = R.filter(lambda x: True)

CARDINALITY_CASES = [
    ("range", lambda: R, 10),
    ("batch", lambda: R.batch(3), 4),
    ("batch drop", lambda: R.batch(3, True), 3),
    ("batch inf", lambda: R.repeat().batch(3), INF),
    ("repeat 0", lambda: R.repeat(0), 0),
    ("repeat 3", lambda: R.repeat(3), 30),
    ("repeat empty", lambda: Dataset.range(0).repeat(), 0),
    ("repeat unknown", lambda: F.repeat(), INF),
    ("repeat unknown 3", lambda: F.repeat(3), UNK),
    ("filter", lambda: F, UNK),
    ("filter inf", lambda: R.repeat().filter(lambda x: True), UNK),
    ("take", lambda: R.take(3), 3),
    ("take big", lambda: R.take(20), 10),
    ("take all", lambda: R.take(-1), 10),
    ("take inf", lambda: R.repeat().take(3), 3),
    ("take unknown", lambda: F.take(3), UNK),
    ("skip", lambda: R.skip(3), 7),
    ("skip big", lambda: R.skip(20), 0),
    ("skip all", lambda: R.skip(-1), 0),
    ("skip inf", lambda: R.repeat().skip(3), INF),
    ("shard 0", lambda: R.shard(3, 0), 4),
    ("shard 2", lambda: R.shard(3, 2), 3),
    ("shard inf", lambda: R.repeat().shard(3, 0), INF),
    ("zip", lambda: Dataset.zip((R, R.repeat())), 10),
    ("zip unknown", lambda: Dataset.zip((R, F)), UNK),
    ("zip inf", lambda: Dataset.zip((R.repeat(), R.repeat())), INF),
    ("concat", lambda: R.concatenate(R), 20),
    ("concat inf", lambda: R.concatenate(R.repeat()), INF),
    ("concat unknown", lambda: R.concatenate(F), UNK),
    ("unbatch", lambda: R.batch(3).unbatch(), UNK),
    ("unbatch drop", lambda: R.batch(2, True).unbatch(), 10),
    ("rebatch", lambda: R.batch(4).rebatch(2), UNK),
    ("generator", lambda: Dataset.from_generator(lambda: iter([1]), output_types=pf.int32), UNK),
    ("map shuffle prefetch cache", lambda: R.map(lambda x: x).shuffle(3).prefetch(1).cache(), 10),
    ("enumerate", lambda: R.enumerate(), 10),
    ("slices", lambda: Dataset.from_tensor_slices(np.zeros((7, 2))), 7),
]


@pytest.mark.parametrize(
    "make,expected", [c[1:] for c in CARDINALITY_CASES], ids=[c[0] for c in CARDINALITY_CASES]
)
def test_cardinality_rules(make, expected):
    card = make().cardinality()
    assert isinstance(card, pf.Tensor) and card.dtype == pf.int64 and card.shape == ()
    assert int(card) == expected
    assert int(pf.data.experimental.cardinality(make())) == expected


def test_len_follows_cardinality():
    assert len(R.batch(3)) == 4
    with pytest.raises(TypeError, match="infinite"):
        len(R.repeat())
    with pytest.raises(TypeError, match="unknown"):
        len(F)
    assert bool(R.repeat())  # truthiness never asks for the length


def test_assert_cardinality():
    ds = F.apply(pf.data.experimental.assert_cardinality(10))
    assert len(ds) == 10 and values(ds) == list(range(10))
    wrong = F.apply(pf.data.experimental.assert_cardinality(4))
    with pytest.raises(pf.errors.FailedPreconditionError, match="4"):
        list(wrong)


# -- options ------------------------------------------------------------------------------------


def test_options_auto_shard_policy_travels_down_the_pipeline():
    policy = pf.data.experimental.AutoShardPolicy
    options = pf.data.Options()
    options.experimental_distribute.auto_shard_policy = policy.DATA
    ds = Dataset.range(8).with_options(options).map(lambda x: x).batch(2)
    assert ds.options().experimental_distribute.auto_shard_policy is policy.DATA
    assert Dataset.range(3).options().experimental_distribute.auto_shard_policy is policy.AUTO
    zipped = Dataset.zip((ds, Dataset.range(3)))
    assert zipped.options().experimental_distribute.auto_shard_policy is policy.DATA
    assert values(ds) == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_options_later_settings_win_and_aliases():
    a, b = pf.data.Options(), pf.data.Options()
    a.deterministic = True
    a.threading.private_threadpool_size = 2
    b.experimental_deterministic = False
    ds = Dataset.range(3).with_options(a).with_options(b)
    assert ds.options().deterministic is False
    assert ds.options().threading.private_threadpool_size == 2
    assert ds.options().experimental_threading.private_threadpool_size == 2


def test_options_validation():
    o = pf.data.Options()
    with pytest.raises(AttributeError, match="foo"):
        o.foo = 1
    with pytest.raises(TypeError, match="'x'"):
        o.experimental_distribute.auto_shard_policy = "x"
    with pytest.raises(TypeError, match="yes"):
        o.deterministic = "yes"
    with pytest.raises(ValueError, match="with_options"):
        Dataset.range(3).options().deterministic = True
    with pytest.raises(TypeError, match="Options"):
        Dataset.range(3).with_options({"deterministic": True})
    o.experimental_optimization.map_parallelization = True
    o.experimental_distribute.auto_shard_policy = 2
    assert o.experimental_distribute.auto_shard_policy.name == "DATA"


# -- pickling (datasets travel to workers) ------------------------------------------------------


def test_pipeline_survives_cloudpickle():
    ds = (
        Dataset.from_tensor_slices((np.arange(20), np.arange(20) % 3))
        .filter(lambda x, y: y > 0)
        .map(lambda x, y: (x * 2, y))
        .shuffle(5, seed=1)
        .batch(4)
        .prefetch(1)
        .cache()
    )
    copy = cloudpickle.loads(cloudpickle.dumps(ds))
    first = values(ds)
    assert values(copy) == first  # same seeds, same pass number
    assert values(ds) == first  # the cache replays
    warm = cloudpickle.loads(cloudpickle.dumps(ds))  # a pickled cache starts empty
    assert sorted(np.concatenate([b[0] for b in values(warm)]).tolist()) == sorted(
        np.concatenate([b[0] for b in first]).tolist()
    )


# -- docstring examples -------------------------------------------------------------------------

MODULES = [
    "psflow.data",
    "psflow.data.batching",
    "psflow.data.dataset",
    "psflow.data.experimental",
    "psflow.data.iterator",
    "psflow.data.mapping",
    "psflow.data.options",
    "psflow.data.ordering",
    "psflow.data.prefetch",
    "psflow.data.shuffle",
    "psflow.data.sources",
    "psflow.data.structure",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0

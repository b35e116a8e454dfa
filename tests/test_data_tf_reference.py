"""The same pipelines in TensorFlow and psflow give the same elements, specs and cardinality.

Shuffle orders are not compared (different random generators); everything
deterministic is.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import psflow as pf

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
tf = pytest.importorskip("tensorflow")


def _filter_mod3(x):
    return x % 3 == 0


def _double(x):
    return x * 2


def _sum_pair(x, y):
    return x + y


PIPELINES = {
    "batch": lambda D, ns: D.range(8).batch(3),
    "batch_drop": lambda D, ns: D.range(8).batch(3, drop_remainder=True),
    "shard0": lambda D, ns: D.range(10).shard(num_shards=3, index=0),
    "shard2": lambda D, ns: D.range(10).shard(3, 2),
    "take": lambda D, ns: D.range(10).take(3),
    "take_big": lambda D, ns: D.range(10).take(20),
    "take_all": lambda D, ns: D.range(10).take(-1),
    "skip": lambda D, ns: D.range(10).skip(7),
    "skip_all": lambda D, ns: D.range(10).skip(-1),
    "repeat": lambda D, ns: D.range(3).repeat(3),
    "repeat_take": lambda D, ns: D.range(3).repeat().take(10),
    "repeat_shard_batch": lambda D, ns: D.range(7).repeat(3).shard(4, 1).batch(2),
    "skip_take_batch": lambda D, ns: D.range(50).skip(3).take(30).batch(7, drop_remainder=True),
    "filter_batch": lambda D, ns: D.range(20).filter(_filter_mod3).batch(2),
    "map_filter": lambda D, ns: D.range(10).map(_double).filter(_filter_mod3),
    "tuple_map": lambda D, ns: D.from_tensor_slices(([1, 2, 3], [10, 20, 30])).map(_sum_pair),
    "unbatch": lambda D, ns: (
        D.from_tensor_slices(([1, 2, 3, 4, 5], [1.0, 2, 3, 4, 5])).batch(2).unbatch()
    ),
    "rebatch": lambda D, ns: D.range(10).batch(4).rebatch(3),
    "rebatch_list": lambda D, ns: D.range(10).batch(4).rebatch([1, 3]),
    "rebatch_drop": lambda D, ns: D.range(10).batch(4).rebatch(3, drop_remainder=True),
    "padded": lambda D, ns: D.range(1, 5).map(lambda x: ns.fill([x], x)).padded_batch(3),
    "padded_shape": lambda D, ns: (
        D.range(1, 4).map(lambda x: ns.fill([x], x)).padded_batch(2, padded_shapes=[5])
    ),
    "enumerate": lambda D, ns: D.range(3).enumerate(start=5),
    "zip": lambda D, ns: D.zip((D.range(5), D.range(10, 13).repeat())),
    "concat": lambda D, ns: D.range(3).concatenate(D.range(10, 12)).batch(2),
    "dict_batch": lambda D, ns: D.from_tensor_slices(
        {"b": [[1, 2], [3, 4], [5, 6]], "a": [0.5, 1.5, 2.5]}
    ).batch(2),
    "from_tensors": lambda D, ns: D.from_tensors(([1, 2], 3.0)).repeat(2),
    "range_step": lambda D, ns: D.range(10, 0, -3),
}


def _leaves(x):
    if isinstance(x, dict):
        return [leaf for k in sorted(x) for leaf in _leaves(x[k])]
    if isinstance(x, tuple):
        return [leaf for c in x for leaf in _leaves(c)]
    return [x]


def _spec_summary(spec):
    out = []
    for s in _leaves(spec):
        shape = None if s.shape is None or s.shape.rank is None else list(s.shape.as_list())
        out.append((shape, s.dtype.name))
    return out


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_pipeline_matches_tensorflow(name):
    make = PIPELINES[name]
    ours = make(pf.data.Dataset, pf)
    theirs = make(tf.data.Dataset, tf)
    a = [[np.asarray(v) for v in _leaves(e)] for e in ours.as_numpy_iterator()]
    b = [[np.asarray(v) for v in _leaves(e)] for e in theirs.as_numpy_iterator()]
    assert len(a) == len(b)
    for ea, eb in zip(a, b):
        for va, vb in zip(ea, eb):
            assert va.dtype == vb.dtype and va.shape == vb.shape
            np.testing.assert_array_equal(va, vb)
    assert int(ours.cardinality()) == int(theirs.cardinality())
    assert _spec_summary(ours.element_spec) == _spec_summary(theirs.element_spec)


CARDINALITY_ONLY = {
    "repeat_filter": lambda D: D.range(10).filter(_filter_mod3).repeat(),
    "repeat_filter_3": lambda D: D.range(10).filter(_filter_mod3).repeat(3),
    "take_unknown": lambda D: D.range(10).filter(_filter_mod3).take(2),
    "skip_inf": lambda D: D.range(10).repeat().skip(4),
    "shard_inf": lambda D: D.range(10).repeat().shard(2, 1),
    "zip_unknown": lambda D: D.zip((D.range(3), D.range(10).filter(_filter_mod3))),
    "concat_inf_unknown": lambda D: (
        D.range(3).repeat().concatenate(D.range(3).filter(_filter_mod3))
    ),
    "batch_inf": lambda D: D.range(3).repeat().batch(2),
    "repeat_empty": lambda D: D.range(0).repeat(),
    "unbatch_known": lambda D: D.range(10).batch(2, drop_remainder=True).unbatch(),
    "shuffle": lambda D: D.range(10).shuffle(4).batch(3),
    "take_zero_inf": lambda D: D.range(3).repeat().take(0),
}


@pytest.mark.parametrize("name", sorted(CARDINALITY_ONLY))
def test_cardinality_matches_tensorflow(name):
    make = CARDINALITY_ONLY[name]
    assert int(make(pf.data.Dataset).cardinality()) == int(make(tf.data.Dataset).cardinality())


def test_shuffle_preserves_elements_like_tensorflow():
    ours = sorted(int(x) for x in pf.data.Dataset.range(100).shuffle(7, seed=3).as_numpy_iterator())
    theirs = sorted(
        int(x) for x in tf.data.Dataset.range(100).shuffle(7, seed=3).as_numpy_iterator()
    )
    assert ours == theirs == list(range(100))

"""The same MirroredStrategy program under TensorFlow and under psflow gives the same results.

Optional: runs only where TensorFlow is installed. Each framework runs the
program in its own process (logical devices are fixed per process, and
TensorFlow stays out of the test process); the program prints JSON.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from tests.tf_reference import run_reference_program

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("tensorflow") is None, reason="TensorFlow is not installed"
    ),
]

PROGRAM = r"""
import json, sys
if sys.argv[1] == "tf":
    import tensorflow as tf
else:
    import psflow as tf
import numpy as np

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 3)
s3 = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2"])
s2 = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
out = {}

def local(s, x):
    return [np.asarray(v).tolist() for v in s.experimental_local_results(x)]

def rid():
    return tf.distribute.get_replica_context().replica_id_in_sync_group

for n, b in [(6, 4), (7, 5), (10, 4), (3, 1), (9, 9)]:
    for s, name in [(s2, "2"), (s3, "3")]:
        dist = s.experimental_distribute_dataset(tf.data.Dataset.range(n).batch(b))
        out[f"rebatch/{name}/{n}/{b}"] = [local(s, e) for e in dist]

def dataset_fn(ctx):
    return tf.data.Dataset.range(7).batch(ctx.get_per_replica_batch_size(6))
out["from_function"] = [local(s3, e) for e in s3.distribute_datasets_from_function(dataset_fn)]

# (TensorFlow's collectives allow one group per process: only s3 runs collectives)
def all_reduce_step():
    ctx = tf.distribute.get_replica_context()
    r = tf.cast(rid(), tf.float32)
    value = {"a": 1.0 + 2.0 * r, "b": [40.0 - 38.0 * r, 1.0 + 97.0 * r]}
    return ctx.all_reduce("SUM", value), ctx.all_reduce("MEAN", value)
total, mean = s3.run(all_reduce_step)
out["all_reduce"] = [local(s3, total["a"]), [local(s3, x) for x in total["b"]],
                     local(s3, mean["a"]), [local(s3, x) for x in mean["b"]]]

dist = s3.experimental_distribute_dataset(
    tf.data.Dataset.range(7).map(lambda x: tf.cast(x, tf.float32)).batch(5))
reduced = []
for e in dist:
    sums = s3.run(lambda x: tf.reduce_sum(x), args=(e,))
    reduced.append([float(s3.reduce("MEAN", e, axis=0)), float(s3.reduce("SUM", e, axis=0)),
                    float(s3.reduce("SUM", sums, axis=None)), float(s3.reduce("MEAN", sums, axis=None)),
                    np.asarray(s3.gather(e, axis=0)).tolist(), local(s3, sums)])
out["reduce"] = reduced

def merge_step():
    ctx = tf.distribute.get_replica_context()
    return ctx.merge_call(lambda st, x: x, args=(rid(),)) + 10
out["merge_call"] = local(s3, s3.run(merge_step))

def gather_step():
    ctx = tf.distribute.get_replica_context()
    return ctx.all_gather(tf.fill([rid() + 1, 1], tf.cast(rid(), tf.float32)), axis=0)
out["all_gather"] = local(s3, s3.run(gather_step))

def create_step():
    return tf.Variable(tf.cast(rid(), tf.float32) + 5.0)
with s3.scope():
    v = s3.run(create_step)
out["created"] = [type(v).__name__, [float(np.asarray(c.read_value())) for c in v.values]]

with s3.scope():
    agg = tf.Variable(1.0, aggregation=tf.VariableAggregation.SUM)
    mean_var = tf.Variable(1.0, aggregation=tf.VariableAggregation.MEAN)
def assign_step():
    agg.assign_add(tf.cast(rid(), tf.float32) + 1.0)
    mean_var.assign(tf.cast(rid(), tf.float32))
    return agg.read_value()
out["assign"] = [local(s3, s3.run(assign_step)), float(np.asarray(mean_var.read_value()))]

try:
    s3.reduce("SUM", tf.constant(1.0), axis=None)
    out["sum_of_non_distributed"] = "no error"
except Exception:
    out["sum_of_non_distributed"] = "error"
out["mean_of_non_distributed"] = float(s3.reduce("MEAN", tf.constant(1.5), axis=None))
print("RESULT " + json.dumps(out))
"""


def run_program(framework: str) -> dict:
    return run_reference_program(PROGRAM, framework)


def test_psflow_gives_tensorflows_results() -> None:
    theirs = run_program("tf")
    ours = run_program("psflow")
    assert ours.keys() == theirs.keys()
    for key in theirs:
        if key == "reduce":  # floats: equal up to float32 rounding
            for a, b in zip(ours[key], theirs[key]):
                np.testing.assert_allclose(a[:4], b[:4], rtol=1e-6, err_msg=key)
                assert a[4:] == b[4:], key
        else:
            assert ours[key] == theirs[key], key

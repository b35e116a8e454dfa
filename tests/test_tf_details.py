"""The TensorFlow details a tutorial trips on, each as TensorFlow 2.21 shows it.

Expected values are TensorFlow's, observed on the same inputs;
``test_tf_reference_gives_the_same_results`` reruns the distribute part under
TensorFlow itself where it is installed.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import psflow as pf
from psflow import errors
from tests.conftest import child_env
from tests.test_mirrored_training import logical_cpus


@pytest.fixture
def two() -> Iterator[Any]:
    """A MirroredStrategy over two logical CPU devices."""
    with logical_cpus(2):
        yield pf.distribute.MirroredStrategy()


def _rid() -> Any:
    return pf.distribute.get_replica_context().replica_id_in_sync_group


def _plain(x: Any) -> Any:
    """Tensors as (dtype name, list); structures kept."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_plain(v) for v in x)
    a = np.asarray(x)
    return (a.dtype.name, a.tolist())


# -- experimental_local_results of nested structures ---------------------------------------------
def test_local_results_of_a_dict_from_all_reduce_is_a_tuple_of_per_replica_dicts(two):
    def step():
        ctx = pf.distribute.get_replica_context()
        r = pf.cast(_rid(), pf.float32)
        return ctx.all_reduce("SUM", {"a": r + 1.0}), {"r": r, "b": [pf.constant(7), r * 10.0]}

    summed, mixed = two.run(step)
    assert isinstance(summed, dict)
    assert _plain(two.experimental_local_results(summed)) == (
        {"a": ("float32", 3.0)},
        {"a": ("float32", 3.0)},
    )
    assert _plain(two.experimental_local_results(mixed)) == (
        {"r": ("float32", 0.0), "b": [("int32", 7), ("float32", 0.0)]},
        {"r": ("float32", 1.0), "b": [("int32", 7), ("float32", 10.0)]},
    )


def test_local_results_of_plain_values(two):
    assert two.experimental_local_results(5) == (5,)
    # a structure without distributed values: one copy per replica, as TensorFlow
    assert two.experimental_local_results({"x": 1}) == ({"x": 1}, {"x": 1})
    default = pf.distribute.get_strategy()
    assert default.experimental_local_results({"x": 1}) == ({"x": 1},)


# -- integer MEAN ----------------------------------------------------------------------------------
def _int_values(two):
    def step():
        ctx = pf.distribute.get_replica_context()
        v = pf.constant([1, 2, 5]) + pf.constant([0, 1, 2]) * pf.cast(_rid(), pf.int32)
        return v, ctx.all_reduce("MEAN", v), ctx.all_reduce("SUM", v)

    return two.run(step)  # replica 0: [1, 2, 5]; replica 1: [1, 3, 7]


def test_integer_mean_is_a_true_division_into_float64_as_in_tensorflow(two):
    v, mean, total = _int_values(two)
    assert _plain(two.reduce("MEAN", v, axis=None)) == ("float64", [1.0, 2.5, 6.0])
    assert _plain(two.reduce("MEAN", v, axis=0)) == ("float64", 19 / 6)
    assert _plain(two.reduce("SUM", v, axis=None)) == ("int32", [2, 5, 12])
    assert _plain(two.reduce("SUM", v, axis=0)) == ("int32", 19)
    assert _plain(two.experimental_local_results(mean)) == (("float64", [1.0, 2.5, 6.0]),) * 2
    assert _plain(two.experimental_local_results(total)) == (("int32", [2, 5, 12]),) * 2


def test_integer_mean_of_negative_values_does_not_round_down(two):
    v = two.run(lambda: pf.constant([-3, 3]) - 2 * pf.cast(_rid(), pf.int32))  # [-3,3], [-5,1]
    assert _plain(two.reduce("MEAN", v, axis=None)) == ("float64", [-4.0, 2.0])
    odd = two.run(lambda: pf.constant([-3]) + pf.cast(_rid(), pf.int32) * 0)  # -3, -3
    half = two.run(lambda: pf.constant([-3]) + pf.cast(_rid(), pf.int32))  # -3, -2
    assert _plain(two.reduce("MEAN", odd, axis=None)) == ("float64", [-3.0])
    assert _plain(two.reduce("MEAN", half, axis=None)) == ("float64", [-2.5])  # floor: -3


def test_small_integer_mean_is_float32_and_one_replica_keeps_the_value():
    with logical_cpus(2):
        two = pf.distribute.MirroredStrategy()
        v = two.run(lambda: pf.cast(pf.constant([1, 2]) + pf.cast(_rid(), pf.int32), pf.int16))
        assert _plain(two.reduce("MEAN", v, axis=None)) == ("float32", [1.5, 2.5])
    one = pf.distribute.MirroredStrategy(["/cpu:0"])

    def step():
        return pf.distribute.get_replica_context().all_reduce("MEAN", pf.constant([1, 2]))

    assert _plain(one.run(step)) == ("int32", [1, 2])  # one replica: nothing to average
    default = pf.distribute.get_strategy()
    assert _plain(default.reduce("MEAN", pf.constant([1, 2]), axis=None)) == ("int32", [1, 2])
    assert _plain(default.reduce("MEAN", pf.constant([1, 2]), axis=0)) == ("float64", 1.5)


# -- per-replica values of different shapes -----------------------------------------------------
def test_reduce_of_per_replica_values_of_different_shapes_raises_naming_them(two):
    ragged = two.run(lambda: pf.ones(pf.stack([_rid() + 1])))  # shapes [1] and [2]
    for op in ("SUM", "MEAN"):
        with pytest.raises(
            errors.InvalidArgumentError, match=r"replica 0: \[1\].*replica 1: \[2\]"
        ):
            two.reduce(op, ragged, axis=None)
    # over axis 0 each replica's part sums to a scalar first: TensorFlow allows it
    assert _plain(two.reduce("SUM", ragged, axis=0)) == ("float32", 3.0)
    wide = two.run(lambda: pf.ones(pf.stack([1, _rid() + 2])))  # [1, 2] and [1, 3]
    with pytest.raises(errors.InvalidArgumentError, match=r"axis=0.*\[2\].*\[3\]"):
        two.reduce("SUM", wide, axis=0)


# -- the same program under TensorFlow ----------------------------------------------------------
PROGRAM = r"""
import json, sys
if sys.argv[1] == "tf":
    import tensorflow as tf
else:
    import psflow as tf
import numpy as np

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
s = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
out = {}

def plain(x):
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    a = np.asarray(x)
    return [a.dtype.name, a.tolist()]

def rid():
    return tf.distribute.get_replica_context().replica_id_in_sync_group

def step():
    ctx = tf.distribute.get_replica_context()
    r = tf.cast(rid(), tf.float32)
    v = tf.constant([1, 2, 5]) + tf.constant([0, 1, 2]) * tf.cast(rid(), tf.int32)
    small = tf.cast(tf.constant([1, 2]) + tf.cast(rid(), tf.int32), tf.int16)
    return (ctx.all_reduce("SUM", {"a": r + 1.0}), {"r": r, "b": [tf.constant(7), r * 10.0]},
            v, ctx.all_reduce("MEAN", v), small)
summed, mixed, v, mean, small = s.run(step)
out["local/all_reduce_dict"] = plain(s.experimental_local_results(summed))
out["local/mixed"] = plain(s.experimental_local_results(mixed))
out["local/plain"] = plain(s.experimental_local_results({"x": 1}))
out["mean/none"] = plain(s.reduce("MEAN", v, axis=None))
out["mean/axis0"] = plain(s.reduce("MEAN", v, axis=0))
out["sum/none"] = plain(s.reduce("SUM", v, axis=None))
out["sum/axis0"] = plain(s.reduce("SUM", v, axis=0))
out["all_reduce_mean"] = plain(s.experimental_local_results(mean))
out["mean/int16"] = plain(s.reduce("MEAN", small, axis=None))
half = s.run(lambda: tf.constant([-3]) + tf.cast(rid(), tf.int32))
out["mean/negative"] = plain(s.reduce("MEAN", half, axis=None))
ragged = s.run(lambda: tf.ones(tf.stack([rid() + 1])))
for op in ("SUM", "MEAN"):
    try:
        s.reduce(op, ragged, axis=None)
        out["ragged/" + op] = "no error"
    except Exception as e:
        out["ragged/" + op] = "InvalidArgumentError" if "InvalidArgument" in type(e).__name__ else repr(e)
out["ragged/axis0"] = plain(s.reduce("SUM", ragged, axis=0))
d = tf.distribute.get_strategy()
out["default/axis0"] = plain(d.reduce("MEAN", tf.constant([1, 2]), axis=0))
print("RESULT " + json.dumps(out))
"""


def _run_program(framework: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", PROGRAM, framework],
        capture_output=True,
        text=True,
        timeout=240,
        env=child_env({"TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None, reason="TensorFlow is not installed"
)
def test_tf_reference_gives_the_same_results() -> None:
    theirs = _run_program("tf")
    ours = _run_program("psflow")
    assert ours.keys() == theirs.keys()
    for key in theirs:
        assert ours[key] == theirs[key], key

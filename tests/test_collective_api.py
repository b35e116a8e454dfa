"""Options, reduce ops, the registry, buffers, all-gather and broadcast batch calls."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import psflow.collective as coll
from psflow import backend, errors
from psflow.collective import (
    CommunicationImplementation,
    CommunicationOptions,
    CrossDeviceOps,
    CrossDeviceOpsRegistry,
    ReduceOp,
    ReductionToOneDevice,
    RingAllReduce,
    create_cross_device_ops,
    default_cross_device_ops,
)
from psflow.collective.buffers import BufferPool
from psflow.collective.copies import device_kind
from psflow.collective.layout import build_layout, split_sizes

try:
    import cupy  # noqa: F401

    HAVE_CUPY = True
except Exception:  # no CuPy, or no CUDA libraries
    HAVE_CUPY = False


# -- ReduceOp and CommunicationOptions -----------------------------------------------------
@pytest.mark.parametrize("value", ["sum", "SUM", " Sum ", ReduceOp.SUM])
def test_reduce_op_parses_names_case_insensitively(value):
    assert ReduceOp.parse(value) is ReduceOp.SUM
    assert ReduceOp("mean") is ReduceOp.MEAN


def test_reduce_op_accepts_a_same_named_foreign_enum():
    import enum

    class Other(enum.Enum):
        MEAN = 1

    assert ReduceOp.parse(Other.MEAN) is ReduceOp.MEAN


@pytest.mark.parametrize("bad", ["prod", "", None, 3])
def test_reduce_op_rejects_unknown_values_by_name(bad):
    with pytest.raises(errors.InvalidArgumentError, match=repr(bad).replace("(", r"\(")):
        ReduceOp.parse(bad)


def test_communication_options_defaults_and_parsing():
    opts = CommunicationOptions()
    assert opts.bytes_per_pack == 0 and opts.timeout_seconds is None
    assert opts.implementation is CommunicationImplementation.AUTO
    assert opts.timeout == coll.DEFAULT_TIMEOUT_SECONDS
    opts = CommunicationOptions(bytes_per_pack=1 << 20, timeout_seconds=2, implementation="nccl")
    assert opts.implementation is CommunicationImplementation.NCCL
    with pytest.raises(AttributeError):
        opts.bytes_per_pack = 3  # frozen


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"bytes_per_pack": -1}, "-1"),
        ({"bytes_per_pack": 1.5}, "1.5"),
        ({"timeout_seconds": 0}, "timeout_seconds"),
        ({"timeout_seconds": float("inf")}, "inf"),
        ({"implementation": "MPI"}, "'MPI'"),
    ],
)
def test_communication_options_reject_bad_values(kwargs, match):
    with pytest.raises(errors.InvalidArgumentError, match=match):
        CommunicationOptions(**kwargs)


def test_communication_options_merge_keeps_non_defaults_of_the_other():
    base = CommunicationOptions(bytes_per_pack=100, timeout_seconds=5)
    merged = base.merge(CommunicationOptions(timeout_seconds=9))
    assert merged == CommunicationOptions(bytes_per_pack=100, timeout_seconds=9)
    assert base.merge(None) is base


# -- registry -------------------------------------------------------------------------------
def test_registry_builds_the_builtins_by_name():
    assert isinstance(create_cross_device_ops("RING"), RingAllReduce)
    r21 = create_cross_device_ops("reduce_to_one", destination_replica=1)
    assert isinstance(r21, ReductionToOneDevice) and r21.destination_replica == 1
    assert coll.cross_device_ops_registry.names() == ["nccl", "reduce_to_one", "ring"]


def test_registry_error_names_the_choices():
    with pytest.raises(errors.NotFoundError, match=r"'hierarchical'.*nccl, reduce_to_one, ring"):
        create_cross_device_ops("hierarchical")


def test_registry_accepts_new_factories_and_refuses_duplicates():
    reg = CrossDeviceOpsRegistry()
    reg.register("mine", lambda **kw: RingAllReduce(**kw))
    assert isinstance(reg.create("Mine", max_workers=1), RingAllReduce)
    with pytest.raises(errors.AlreadyExistsError, match="mine"):
        reg.register("mine", lambda **kw: ReductionToOneDevice(**kw))


def test_default_cross_device_ops_is_the_ring_on_cpus():
    ops = default_cross_device_ops(["/cpu:0", "/job:localhost/replica:0/task:0/device:CPU:1"])
    assert isinstance(ops, RingAllReduce)
    opts = CommunicationOptions(timeout_seconds=3)
    assert default_cross_device_ops(["CPU:0"], opts).options.timeout_seconds == 3
    with pytest.raises(errors.InvalidArgumentError, match="'TPU:0'"):
        default_cross_device_ops(["TPU:0"])
    with pytest.raises(errors.InvalidArgumentError, match="non-empty"):
        default_cross_device_ops([])


@pytest.mark.skipif(HAVE_CUPY, reason="checks the behaviour without CuPy")
def test_without_cupy_gpus_fall_back_to_the_ring_and_nccl_is_a_clear_error():
    assert isinstance(default_cross_device_ops(["/gpu:0", "/gpu:1"]), RingAllReduce)
    with pytest.raises(errors.FailedPreconditionError, match="CuPy"):
        coll.NcclAllReduce()
    with pytest.raises(errors.FailedPreconditionError, match="CuPy"):
        create_cross_device_ops("nccl")
    opts = CommunicationOptions(implementation=CommunicationImplementation.NCCL)
    with pytest.raises(errors.FailedPreconditionError):
        default_cross_device_ops(["/gpu:0", "/gpu:1"], opts)


def test_importing_the_package_does_not_import_cupy():
    code = "import sys, psflow.collective as c; c.RingAllReduce(); print('cupy' in sys.modules)"
    env = dict(os.environ)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("spec", "want"),
    [
        ("/gpu:1", ("GPU", 1)),
        ("CPU", ("CPU", 0)),
        ("/job:worker/replica:0/task:1/device:GPU:3", ("GPU", 3)),
    ],
)
def test_device_kind_parses_tf_device_names(spec, want):
    assert device_kind(spec) == want
    assert device_kind(backend.parse_device(spec)) == want


def test_bad_constructor_arguments_are_named():
    with pytest.raises(errors.InvalidArgumentError, match="max_workers"):
        RingAllReduce(max_workers=0)
    with pytest.raises(errors.InvalidArgumentError, match="subchunk_bytes"):
        RingAllReduce(subchunk_bytes=-5)
    with pytest.raises(errors.InvalidArgumentError, match="options"):
        RingAllReduce(options={"bytes_per_pack": 1})
    with pytest.raises(TypeError):
        CrossDeviceOps()  # abstract


# -- layout ---------------------------------------------------------------------------------
def test_split_sizes_follow_array_split():
    for n, k in [(0, 3), (7, 3), (1000, 8), (5, 8)]:
        assert split_sizes(n, k) == [len(a) for a in np.array_split(np.arange(n), k)]


def test_layout_groups_by_dtype_and_stages_small_tensors():
    shapes = [(1000, 100), (10,), (20,), (0,), (5,), (200000,)]
    dtypes = [np.float32, np.float32, np.float32, np.float32, np.int32, np.float32]
    lay = build_layout(shapes, [np.dtype(d) for d in dtypes], 2, coalesce_bytes=1024)
    assert [g.dtype for g in lay.groups] == [np.float32, np.int32]
    assert lay.groups[0].tensors == (0, 1, 2, 5)
    assert [s.tensors for s in lay.segments] == [(0,), (1, 2), (5,), (4,)]
    assert lay.tensor_place[3] is None  # empty tensors take no room
    assert lay.nbytes == (100000 + 30 + 200000) * 4 + 5 * 4


# -- buffer pool ----------------------------------------------------------------------------
def test_pool_reuses_a_buffer_only_when_no_view_is_left():
    pool = BufferPool(1 << 20)
    a = pool.take(4096)
    view = a.view(np.float32)[10:20]
    addr = a.ctypes.data
    del a
    b = pool.take(4096)
    assert b.ctypes.data != addr  # the view keeps the first buffer in use
    del view
    c = pool.take(4096)
    assert c.ctypes.data == addr
    assert pool.tracked_bytes == 8192


def test_pool_stays_within_its_bound():
    pool = BufferPool(10_000)
    held = [pool.take(4000) for _ in range(4)]
    assert pool.tracked_bytes <= 10_000
    del held
    pool.take(8000)  # evicts free 4000-byte buffers to make room
    assert pool.tracked_bytes <= 10_000
    assert BufferPool(0).take(10).nbytes == 10


# -- batch all-gather and broadcast ---------------------------------------------------------
@pytest.mark.parametrize("ops_cls", [RingAllReduce, ReductionToOneDevice])
def test_batch_all_gather(ops_cls):
    rng = np.random.default_rng(2)
    parts = [rng.standard_normal((3, r + 1)) for r in range(4)]
    got = ops_cls().all_gather(parts, axis=1)
    want = np.concatenate(parts, axis=1)
    assert len(got) == 4
    for g in got:
        np.testing.assert_array_equal(g, want)
    assert got[0] is not got[1]


@pytest.mark.parametrize(
    ("parts", "axis", "match"),
    [
        ([np.ones((2, 3)), np.ones((2, 4))], 0, r"\(2, 4\)"),
        ([np.ones(3, np.float32), np.ones(3)], 0, "float64"),
        ([np.ones(3), np.ones(3)], 1, "axis 1"),
        ([np.float64(1.0), np.float64(2.0)], 0, "scalar"),
        ([], 0, "empty"),
    ],
)
def test_batch_all_gather_rejects_bad_input(parts, axis, match):
    with pytest.raises(errors.InvalidArgumentError, match=match):
        RingAllReduce().all_gather(parts, axis=axis)


def test_batch_broadcast():
    values = [np.arange(12.0).reshape(3, 4), np.array(7, np.int64)]
    ops = RingAllReduce()
    got = ops.broadcast(values, 3)
    assert len(got) == 3
    for row in got:
        for a, b in zip(row, values, strict=True):
            np.testing.assert_array_equal(a, b)
            assert not np.shares_memory(a, b)
    got = ops.broadcast(values, ["/cpu:0", "/cpu:1"])
    assert len(got) == 2
    with pytest.raises(errors.InvalidArgumentError, match="0"):
        ops.broadcast(values, 0)
    with pytest.raises(errors.InvalidArgumentError, match="values"):
        ops.broadcast(np.ones(3), 2)


def test_close_stops_threads_and_a_later_call_still_works():
    ops = RingAllReduce(parallel_threshold_bytes=0, max_workers=4)
    xs = [[np.ones(1000, np.float32)] for _ in range(4)]
    ops.all_reduce(xs)
    ops.close()
    np.testing.assert_array_equal(ops.all_reduce(xs)[3][0], np.full(1000, 4, np.float32))
    ops.close()


@pytest.mark.parametrize(
    "module",
    [
        "",
        "api",
        "buffers",
        "communicator",
        "options",
        "reduce_op",
        "reduce_to_one",
        "registry",
        "ring",
    ],
)
def test_docstring_examples_run(module):
    import doctest
    import importlib

    mod = importlib.import_module(f"psflow.collective.{module}".rstrip("."))
    result = doctest.testmod(mod, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0


def test_replicas_with_no_arrays_get_empty_lists():
    assert RingAllReduce().all_reduce([[], [], []]) == [[], [], []]
    assert ReductionToOneDevice().reduce([[], []]) == []

"""SimpleClusterResolver and UnionClusterResolver: TF's semantics and errors."""

from __future__ import annotations

import pytest

from psflow.distribute.cluster_resolver import (
    ClusterMergeError,
    ClusterResolver,
    ClusterSpec,
    ClusterTypeError,
    SimpleClusterResolver,
    TaskNotFoundError,
    UnionClusterResolver,
    UnionResolver,
    merge_cluster_specs,
)
from psflow.errors import InvalidArgumentError

WORKERS = ClusterSpec({"worker": ["worker0.example.com:2222", "worker1.example.com:2222"]})
PS = ClusterSpec({"ps": ["ps0.example.com:2222", "ps1.example.com:2222"]})


# -- SimpleClusterResolver -------------------------------------------------------


def test_simple_resolver_returns_what_it_was_given():
    r = SimpleClusterResolver(
        WORKERS,
        task_type="worker",
        task_id=1,
        num_accelerators={"GPU": 8},
        rpc_layer="grpc",
        environment="google",
    )
    assert r.cluster_spec() is WORKERS
    assert (r.task_type, r.task_id, r.rpc_layer, r.environment) == ("worker", 1, "grpc", "google")
    assert r.num_accelerators() == {"GPU": 8}
    assert r.num_accelerators("worker", 0) == {"GPU": 8}


def test_simple_resolver_master_rules():
    r = SimpleClusterResolver(WORKERS, master="session:1", rpc_layer="grpc")
    assert r.master() == "grpc://session:1"
    assert r.master("worker", 1) == "grpc://worker1.example.com:2222"
    assert r.master("worker", 1, rpc_layer="test") == "test://worker1.example.com:2222"
    assert r.master("worker") == "grpc://session:1"  # both are needed, as in TF
    assert SimpleClusterResolver(WORKERS).master() == ""


def test_simple_resolver_accepts_a_mapping_and_defaults_to_no_accelerators():
    r = SimpleClusterResolver({"worker": ["w:1"]})
    assert r.cluster_spec() == ClusterSpec({"worker": ["w:1"]})
    assert r.num_accelerators() == {}
    assert (r.task_type, r.task_id, r.rpc_layer, r.environment) == (None, None, None, "")


def test_simple_resolver_num_accelerators_is_a_copy():
    r = SimpleClusterResolver(WORKERS, num_accelerators={"GPU": 2})
    r.num_accelerators()["GPU"] = 99
    assert r.num_accelerators() == {"GPU": 2}


def test_simple_resolver_errors_name_the_value():
    with pytest.raises(ClusterTypeError, match=r"\['w:1'\]"):
        SimpleClusterResolver(["w:1"])
    with pytest.raises(ClusterTypeError, match="master 5"):
        SimpleClusterResolver(WORKERS, master=5)
    with pytest.raises(InvalidArgumentError, match=r"\['GPU'\] = -1"):
        SimpleClusterResolver(WORKERS, num_accelerators={"GPU": -1})
    with pytest.raises(InvalidArgumentError, match="'GPU': '8'"):
        SimpleClusterResolver(WORKERS, num_accelerators={"GPU": "8"})
    with pytest.raises(InvalidArgumentError, match="8"):
        SimpleClusterResolver(WORKERS, num_accelerators=8)
    with pytest.raises(InvalidArgumentError, match="-1"):
        SimpleClusterResolver(WORKERS, task_id=-1)
    with pytest.raises(TaskNotFoundError, match="'ps'"):
        SimpleClusterResolver(WORKERS).master("ps", 0)


def test_cluster_resolver_is_abstract():
    with pytest.raises(TypeError):
        ClusterResolver()


# -- UnionClusterResolver --------------------------------------------------------


def test_union_of_disjoint_jobs_as_in_tf_docstring():
    r0 = SimpleClusterResolver(WORKERS, task_type="worker", task_id=0, rpc_layer="grpc")
    r1 = SimpleClusterResolver(PS, task_type="ps", task_id=0, rpc_layer="grpc")
    union = UnionClusterResolver(r0, r1)
    assert union.cluster_spec().as_dict() == {
        "worker": ["worker0.example.com:2222", "worker1.example.com:2222"],
        "ps": ["ps0.example.com:2222", "ps1.example.com:2222"],
    }
    assert (union.task_type, union.task_id, union.rpc_layer) == ("worker", 0, "grpc")
    assert UnionResolver is UnionClusterResolver


def test_union_concatenates_lists_of_the_same_job_in_order():
    a = SimpleClusterResolver({"worker": ["a:1", "b:1"]})
    b = SimpleClusterResolver({"worker": ["c:1"], "ps": ["p:1"]})
    assert UnionClusterResolver(a, b).cluster_spec().as_dict() == {
        "worker": ["a:1", "b:1", "c:1"],
        "ps": ["p:1"],
    }


def test_union_merges_sparse_jobs_as_dicts():
    a = SimpleClusterResolver({"worker": ["a:1", "b:1"]})
    b = SimpleClusterResolver({"worker": {3: "d:1"}})
    assert UnionClusterResolver(a, b).cluster_spec().as_dict() == {
        "worker": {0: "a:1", 1: "b:1", 3: "d:1"}
    }
    c = SimpleClusterResolver({"worker": {2: "c:1"}})
    assert UnionClusterResolver(a, c).cluster_spec().as_dict() == {"worker": ["a:1", "b:1", "c:1"]}


def test_union_conflicting_task_indices_is_an_error_naming_job_and_indices():
    a = SimpleClusterResolver({"worker": ["a:1", "b:1"]})
    b = SimpleClusterResolver({"worker": {1: "x:1"}})
    union = UnionClusterResolver(a, b)
    with pytest.raises(ClusterMergeError, match=r"job 'worker' defines task indices \[1\]") as info:
        union.cluster_spec()
    assert isinstance(info.value, KeyError)  # TF raises KeyError
    assert isinstance(info.value, InvalidArgumentError)
    assert str(info.value).startswith("job 'worker'")


def test_union_overrides_win_even_when_zero():
    r0 = SimpleClusterResolver(WORKERS, task_type="worker", task_id=1, rpc_layer="grpc")
    union = UnionClusterResolver(r0, task_type="ps", task_id=0, rpc_layer="test")
    assert (union.task_type, union.task_id, union.rpc_layer) == ("ps", 0, "test")
    union.task_id = 1
    assert union.task_id == 1


def test_union_master_and_accelerators_come_from_the_first_resolver():
    gpu_override = SimpleClusterResolver(
        WORKERS, master="w0:1", num_accelerators={"GPU": 1}, environment="x"
    )
    other = SimpleClusterResolver(PS, num_accelerators={"GPU": 4})
    union = UnionClusterResolver(gpu_override, other)
    assert union.num_accelerators() == {"GPU": 1}
    assert union.environment == "x"
    assert union.master() == "w0:1"
    assert union.master("ps", 1) == "ps1.example.com:2222"
    assert (
        UnionClusterResolver(gpu_override, other, rpc_layer="grpc").master("ps", 1)
        == "grpc://ps1.example.com:2222"
    )


def test_union_argument_errors():
    with pytest.raises(InvalidArgumentError, match="at least one"):
        UnionClusterResolver()
    with pytest.raises(ClusterTypeError, match=r"argument 1 \(\{'ps': \['p:1'\]\}\) is a dict"):
        UnionClusterResolver(SimpleClusterResolver(WORKERS), {"ps": ["p:1"]})
    with pytest.raises(InvalidArgumentError, match="-4"):
        UnionClusterResolver(SimpleClusterResolver(WORKERS), task_id=-4)
    with pytest.raises(TypeError):
        UnionClusterResolver(SimpleClusterResolver(WORKERS), bogus=1)


def test_merge_cluster_specs_directly():
    assert merge_cluster_specs() == ClusterSpec({})
    assert merge_cluster_specs(WORKERS, PS) == ClusterSpec({**WORKERS.as_dict(), **PS.as_dict()})

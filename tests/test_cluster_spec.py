"""ClusterSpec: TF's constructor forms and queries, immutability, and errors naming the value."""

from __future__ import annotations

import copy
import pickle
import re

import pytest

from psflow.distribute.cluster_resolver import ClusterSpec, ClusterTypeError, TaskNotFoundError
from psflow.errors import InvalidArgumentError, NotFoundError

DENSE = {
    "worker": ["worker0.example.com:2222", "worker1.example.com:2222", "worker2.example.com:2222"],
    "ps": ["ps0.example.com:2222", "ps1.example.com:2222"],
}


def test_dense_jobs_from_lists_as_in_tf_docstring():
    spec = ClusterSpec(DENSE)
    assert spec.jobs == ["worker", "ps"]
    assert spec.num_tasks("worker") == 3
    assert spec.num_tasks("ps") == 2
    assert spec.task_indices("worker") == [0, 1, 2]
    assert spec.task_address("ps", 1) == "ps1.example.com:2222"
    assert spec.as_dict() == DENSE
    assert spec.job_tasks("ps") == DENSE["ps"]


def test_sparse_job_from_mapping_as_in_tf_docstring():
    spec = ClusterSpec({"worker": {1: "worker1.example.com:2222"}, "ps": DENSE["ps"]})
    assert spec.num_tasks("worker") == 1
    assert spec.task_indices("worker") == [1]
    assert spec.task_address("worker", 1) == "worker1.example.com:2222"
    assert spec.as_dict() == {"worker": {1: "worker1.example.com:2222"}, "ps": DENSE["ps"]}
    assert spec.job_tasks("worker") == [None, "worker1.example.com:2222"]
    assert not spec.is_dense("worker")
    assert spec.is_dense("ps")


def test_mapping_with_dense_indices_becomes_a_list_and_string_keys_are_indices():
    spec = ClusterSpec({"worker": {"1": "b:1", "0": "a:1"}})
    assert spec.as_dict() == {"worker": ["a:1", "b:1"]}
    assert spec.task_indices("worker") == [0, 1]


def test_tuple_of_addresses_is_a_dense_job():
    assert ClusterSpec({"ps": ("a:1", "b:1")}).as_dict() == {"ps": ["a:1", "b:1"]}


def test_empty_spec_is_falsy_and_equal_to_empty_dict():
    spec = ClusterSpec({})
    assert not spec
    assert spec.jobs == []
    assert spec.as_dict() == {}
    assert spec == {}
    assert spec == ClusterSpec({})


def test_job_without_tasks_is_kept_as_empty_dict():
    spec = ClusterSpec({"worker": []})
    assert spec
    assert spec.num_tasks("worker") == 0
    assert spec.as_dict() == {"worker": {}}
    assert spec.job_tasks("worker") == []


def test_copy_from_another_spec_is_equal_and_independent():
    source = ClusterSpec(DENSE)
    copied = ClusterSpec(source)
    assert copied == source
    assert copied.as_dict() == DENSE


def test_equality_ignores_job_order_and_compares_with_mappings():
    a = ClusterSpec({"ps": ["p:1"], "worker": ["w:1"]})
    b = ClusterSpec({"worker": ["w:1"], "ps": ["p:1"]})
    assert a == b
    assert hash(a) == hash(b)
    assert a == {"worker": {0: "w:1"}, "ps": ["p:1"]}
    assert a != ClusterSpec({"ps": ["p:1"], "worker": ["w:2"]})
    assert a != {"ps": "not a list"}
    assert a != 42


def test_repr_sorts_jobs_like_tf():
    spec = ClusterSpec({"worker": ["w:1"], "ps": {2: "p:1"}})
    assert repr(spec) == "ClusterSpec({'ps': {2: 'p:1'}, 'worker': ['w:1']})"


def test_spec_is_immutable():
    spec = ClusterSpec(DENSE)
    with pytest.raises(AttributeError, match="immutable"):
        spec._jobs = {}
    with pytest.raises(TypeError):
        spec._jobs["ps"][0] = "evil:1"
    returned = spec.as_dict()
    returned["ps"].append("evil:1")
    returned["new"] = ["x:1"]
    assert spec.as_dict() == DENSE
    indices = spec.task_indices("ps")
    indices.append(7)
    assert spec.task_indices("ps") == [0, 1]


def test_input_mutation_after_construction_does_not_leak_in():
    source = {"ps": ["a:1"]}
    spec = ClusterSpec(source)
    source["ps"].append("b:1")
    source["worker"] = ["c:1"]
    assert spec.as_dict() == {"ps": ["a:1"]}


def test_pickle_and_deepcopy_round_trip():
    spec = ClusterSpec({"worker": {3: "w3:1"}, "ps": ["p:1"], "chief": []})
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert copy.deepcopy(spec) == spec


def test_tasks_iterates_every_task():
    spec = ClusterSpec({"ps": ["p0:1", "p1:1"], "worker": {2: "w2:1"}})
    assert list(spec.tasks()) == [("ps", 0, "p0:1"), ("ps", 1, "p1:1"), ("worker", 2, "w2:1")]


# -- errors name the value ----------------------------------------------------


def test_unknown_job_raises_task_not_found_naming_job():
    spec = ClusterSpec(DENSE)
    for call in (spec.num_tasks, spec.task_indices, spec.job_tasks):
        with pytest.raises(TaskNotFoundError, match="'chief'") as info:
            call("chief")
        assert isinstance(info.value, NotFoundError)
        assert isinstance(info.value, ValueError)  # TF raises ValueError
    with pytest.raises(TaskNotFoundError, match="'evaluator'"):
        spec.task_address("evaluator", 0)


def test_unknown_index_raises_task_not_found_naming_index_and_job():
    spec = ClusterSpec(DENSE)
    with pytest.raises(TaskNotFoundError, match=r"index 5 in job 'ps'"):
        spec.task_address("ps", 5)
    sparse = ClusterSpec({"worker": {1: "w:1"}})
    with pytest.raises(TaskNotFoundError, match=r"index 0 in job 'worker'"):
        sparse.task_address("worker", 0)


@pytest.mark.parametrize("index", [-1, "x", 1.5, True, None])
def test_bad_index_in_lookup_is_invalid_argument_naming_it(index):
    with pytest.raises(InvalidArgumentError, match=re.escape(repr(index))):
        ClusterSpec(DENSE).task_address("ps", index)


@pytest.mark.parametrize("cluster", [None, ["ps:1"], "ps:1", 3])
def test_non_mapping_cluster_is_type_error_naming_it(cluster):
    with pytest.raises(ClusterTypeError, match=re.escape(repr(cluster))) as info:
        ClusterSpec(cluster)
    assert isinstance(info.value, TypeError)
    assert isinstance(info.value, InvalidArgumentError)


def test_job_given_as_string_is_type_error_naming_job():
    with pytest.raises(ClusterTypeError, match=r"job 'ps'.*'p:1'"):
        ClusterSpec({"ps": "p:1"})


@pytest.mark.parametrize("job", ["", "job:1", "a/b", "has space"])
def test_invalid_job_name_is_named(job):
    with pytest.raises(InvalidArgumentError, match=re.escape(repr(job))):
        ClusterSpec({job: ["h:1"]})


def test_non_string_job_name_is_type_error():
    with pytest.raises(ClusterTypeError, match="7"):
        ClusterSpec({7: ["h:1"]})


def test_numeric_job_name_is_accepted_as_in_tf():
    assert ClusterSpec({"123456": ["h:1"]}).jobs == ["123456"]


@pytest.mark.parametrize("address", ["", "host :1", None, 2222])
def test_bad_address_names_task_and_value(address):
    with pytest.raises(InvalidArgumentError, match=r"ps:1") as info:
        ClusterSpec({"ps": ["ok:1", address]})
    assert repr(address) in str(info.value)


def test_negative_sparse_index_is_named():
    with pytest.raises(InvalidArgumentError, match=r"-3"):
        ClusterSpec({"worker": {-3: "w:1"}})


def test_same_sparse_index_twice_is_named():
    with pytest.raises(InvalidArgumentError, match=r"job 'worker'.*index 1 twice"):
        ClusterSpec({"worker": {1: "a:1", "1": "b:1"}})

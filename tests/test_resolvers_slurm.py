"""SlurmClusterResolver: TF's documented results, node-list parsing, and every error case."""

from __future__ import annotations

import re
from types import MappingProxyType

import pytest

from psflow.distribute.cluster_resolver import (
    SlurmClusterResolver,
    expand_hostlist,
    expand_tasks_per_node,
)
from psflow.distribute.cluster_resolver.slurm import MAX_EXPANDED
from psflow.errors import FailedPreconditionError, InvalidArgumentError

THREE_NODES = "t02n13,t02n41,t02n43"


def slurm_env(procid: int, nodelist: str = THREE_NODES, **extra: str) -> dict[str, str]:
    environ = {"SLURM_PROCID": str(procid), "SLURM_STEP_NODELIST": nodelist}
    environ.update(extra)
    return environ


def no_gpu_probe() -> int:
    raise AssertionError("the GPU probe must not be consulted when gpus_per_node is given")


# -- node-list and tasks-per-node expansion ----------------------------------------


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        ("n1", ["n1"]),
        ("n[1,3]", ["n1", "n3"]),
        ("n[1-3]", ["n1", "n2", "n3"]),
        ("node[1-3,7]", ["node1", "node2", "node3", "node7"]),
        ("n[1-2],m5,o[3-4,6,7-9]", ["n1", "n2", "m5", "o3", "o4", "o6", "o7", "o8", "o9"]),
        ("n[0001-0003],m5,o[009-011]", ["n0001", "n0002", "n0003", "m5", "o009", "o010", "o011"]),
        ("n[001-003]", ["n001", "n002", "n003"]),
        ("a[1-2],b3", ["a1", "a2", "b3"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("rack[1-2]-gpu[0-1]", ["rack1-gpu0", "rack1-gpu1", "rack2-gpu0", "rack2-gpu1"]),
        ("[1-2]x", ["1x", "2x"]),
        (" n[1-2] ", ["n1", "n2"]),
    ],
)
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize(
    ("hostlist", "named"),
    [
        ("", "''"),
        ("n[1-3", "unclosed"),
        ("n1-3]", "unmatched"),
        ("n[[1]]", "nests"),
        ("n[3-1]", "'3-1'"),
        ("n[a-b]", "'a-b'"),
        ("n[]", "''"),
        ("n1,,n2", "empty entry"),
        ("n 1", "'n 1'"),
        ("n[1-2-3]", "'1-2-3'"),
    ],
)
def test_malformed_hostlist_is_named(hostlist, named):
    with pytest.raises(InvalidArgumentError, match=re.escape(named)):
        expand_hostlist(hostlist)


def test_hostlist_expansion_is_bounded():
    with pytest.raises(InvalidArgumentError, match=f"more than {MAX_EXPANDED}"):
        expand_hostlist("n[0-999999999]")
    with pytest.raises(InvalidArgumentError, match=f"more than {MAX_EXPANDED}"):
        expand_hostlist("a[0-999]b[0-999]")


@pytest.mark.parametrize(
    ("spec", "counts"),
    [
        ("2", [2]),
        ("2,1,3", [2, 1, 3]),
        ("3(x2),2,1", [3, 3, 2, 1]),
        ("3(x2),2,11(x4)", [3, 3, 2, 11, 11, 11, 11]),
        ("13(x10)", [13] * 10),
        ("2(x3),1", [2, 2, 2, 1]),
    ],
)
def test_expand_tasks_per_node(spec, counts):
    assert expand_tasks_per_node(spec) == counts


@pytest.mark.parametrize("spec", ["", "2x3", "2(x0)", "a", "2(x3", "-1", "2,,1"])
def test_malformed_tasks_per_node_is_named(spec):
    with pytest.raises(InvalidArgumentError, match=re.escape(repr(spec))):
        expand_tasks_per_node(spec)


def test_tasks_per_node_expansion_is_bounded():
    with pytest.raises(InvalidArgumentError, match=f"more than {MAX_EXPANDED}"):
        expand_tasks_per_node("1(x999999999)")


# -- TF's documented results ---------------------------------------------------------


def test_simple_retrieval_from_env():
    environ = slurm_env(
        0, SLURM_STEP_NUM_TASKS="3", SLURM_STEP_TASKS_PER_NODE="1(x3)", CUDA_VISIBLE_DEVICES="0"
    )
    r = SlurmClusterResolver(environ=environ)
    assert r.cluster_spec().as_dict() == {"worker": ["t02n13:8888", "t02n41:8888", "t02n43:8888"]}
    assert r.master("worker", 0, rpc_layer="grpc") == "grpc://t02n13:8888"
    assert r.num_accelerators() == {"GPU": 1}
    assert environ["CUDA_VISIBLE_DEVICES"] == "0"
    assert r.get_task_info() == ("worker", 0)


def test_simple_successful_retrieval():
    r = SlurmClusterResolver(
        jobs={"ps": 1, "worker": 2},
        port_base=8888,
        tasks_per_node=1,
        gpus_per_node=1,
        gpus_per_task=1,
        auto_set_gpu=False,
        environ=slurm_env(0, SLURM_STEP_NUM_TASKS="3"),
        gpu_probe=no_gpu_probe,
    )
    assert r.cluster_spec().as_dict() == {
        "ps": ["t02n13:8888"],
        "worker": ["t02n41:8888", "t02n43:8888"],
    }
    assert (r.task_type, r.task_id) == ("ps", 0)


def test_simple_master_retrieval():
    r = SlurmClusterResolver(
        jobs={"ps": 1, "worker": 2},
        tasks_per_node=1,
        gpus_per_node=1,
        gpus_per_task=1,
        auto_set_gpu=False,
        environ=slurm_env(0, SLURM_STEP_NUM_TASKS="3"),
    )
    r.task_type = "worker"
    r.task_id = 1
    assert r.master() == "grpc://t02n43:8888"
    r.rpc_layer = "ab"
    assert r.master("ps", 0) == "ab://t02n13:8888"
    assert r.master("ps", 0, rpc_layer="test") == "test://t02n13:8888"


def test_task_per_node_not_set_retrieval():
    r = SlurmClusterResolver(
        jobs={"ps": 1, "worker": 2},
        gpus_per_node=1,
        gpus_per_task=1,
        auto_set_gpu=False,
        environ=slurm_env(0, SLURM_STEP_NUM_TASKS="3", SLURM_STEP_TASKS_PER_NODE="1(x3)"),
    )
    assert r.cluster_spec().as_dict() == {
        "ps": ["t02n13:8888"],
        "worker": ["t02n41:8888", "t02n43:8888"],
    }


def test_multi_task_per_node_retrieval():
    environ = slurm_env(
        1, SLURM_STEP_NUM_TASKS="5", SLURM_STEP_TASKS_PER_NODE="2(x2),1", CUDA_VISIBLE_DEVICES=""
    )
    r = SlurmClusterResolver(
        jobs={"ps": 1, "worker": 4}, gpus_per_node=2, gpus_per_task=1, environ=environ
    )
    assert r.cluster_spec().as_dict() == {
        "ps": ["t02n13:8888"],
        "worker": ["t02n13:8889", "t02n41:8888", "t02n41:8889", "t02n43:8888"],
    }
    assert (r.task_type, r.task_id) == ("worker", 0)
    assert environ["CUDA_VISIBLE_DEVICES"] == "1"


def test_multiple_gpus_per_task_retrieval():
    environ = slurm_env(
        1, SLURM_STEP_NUM_TASKS="5", SLURM_STEP_TASKS_PER_NODE="2(x2),1", CUDA_VISIBLE_DEVICES=""
    )
    r = SlurmClusterResolver(
        jobs={"ps": 1, "worker": 4}, gpus_per_node=4, gpus_per_task=2, environ=environ
    )
    assert r.cluster_spec().task_address("worker", 0) == "t02n13:8889"
    assert environ["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert r.num_accelerators() == {"GPU": 2}


def test_readme_basic_example_two_nodes_two_tasks_four_gpus():
    for rank, (task_id, gpus) in enumerate([(0, "0,1"), (1, "2,3"), (2, "0,1"), (3, "2,3")]):
        environ = slurm_env(
            rank,
            "t02n[13,41]",
            SLURM_STEP_NUM_TASKS="4",
            SLURM_STEP_TASKS_PER_NODE="2(x2)",
            CUDA_VISIBLE_DEVICES="0,1,2,3",
        )
        r = SlurmClusterResolver(environ=environ)
        assert r.cluster_spec().as_dict() == {
            "worker": ["t02n13:8888", "t02n13:8889", "t02n41:8888", "t02n41:8889"]
        }
        assert (r.task_type, r.task_id) == ("worker", task_id)
        assert environ["CUDA_VISIBLE_DEVICES"] == gpus


def test_readme_advanced_example():
    r = SlurmClusterResolver(
        {"ps": 1, "worker": 3},
        port_base=1337,
        tasks_per_node=2,
        gpus_per_node=2,
        gpus_per_task=1,
        auto_set_gpu=False,
        environ=slurm_env(2, "t02n[13,41]"),
    )
    assert r.cluster_spec().as_dict() == {
        "ps": ["t02n13:1337"],
        "worker": ["t02n13:1338", "t02n41:1337", "t02n41:1338"],
    }
    assert r.get_task_info() == ("worker", 1)


def test_bracket_nodelist_with_two_tasks_per_node_ports():
    r = SlurmClusterResolver(
        gpus_per_node=0,
        environ=slurm_env(
            5, "node[1-3,7]", SLURM_STEP_NUM_TASKS="8", SLURM_STEP_TASKS_PER_NODE="2(x4)"
        ),
    )
    assert r.cluster_spec().as_dict() == {
        "worker": [
            "node1:8888",
            "node1:8889",
            "node2:8888",
            "node2:8889",
            "node3:8888",
            "node3:8889",
            "node7:8888",
            "node7:8889",
        ]
    }
    assert (r.task_type, r.task_id) == ("worker", 5)
    assert r.master() == "grpc://node3:8889"


def test_jobs_are_filled_in_sorted_name_order_like_tf():
    environ = slurm_env(0, "n[1-4]", SLURM_STEP_TASKS_PER_NODE="1(x4)")
    r = SlurmClusterResolver(
        jobs={"worker": 2, "chief": 1, "ps": 1}, gpus_per_node=0, environ=environ
    )
    assert r.cluster_spec().as_dict() == {
        "chief": ["n1:8888"],
        "ps": ["n2:8888"],
        "worker": ["n3:8888", "n4:8888"],
    }
    assert (r.task_type, r.task_id) == ("chief", 0)


def test_hosts_keep_nodelist_order_where_tf_sorts_names():
    r = SlurmClusterResolver(
        gpus_per_node=0, environ=slurm_env(1, "node[2,10]", SLURM_STEP_TASKS_PER_NODE="1(x2)")
    )
    assert r.cluster_spec().as_dict() == {"worker": ["node2:8888", "node10:8888"]}
    assert r.master() == "grpc://node10:8888"


def test_default_worker_count_without_step_num_tasks_is_the_layout_total():
    r = SlurmClusterResolver(
        gpus_per_node=0, environ=slurm_env(2, "n[1-2]", SLURM_STEP_TASKS_PER_NODE="2,1")
    )
    assert r.cluster_spec().as_dict() == {"worker": ["n1:8888", "n1:8889", "n2:8888"]}


def test_tasks_per_node_mapping_gives_layout_in_its_order():
    r = SlurmClusterResolver(
        tasks_per_node={"b": 1, "a": 2}, gpus_per_node=0, environ={"SLURM_PROCID": "1"}
    )
    assert r.cluster_spec().as_dict() == {"worker": ["b:8888", "a:8888", "a:8889"]}


def test_gpus_come_from_the_visible_devices_list_when_it_names_the_node_gpus():
    environ = slurm_env(1, "n1", SLURM_STEP_TASKS_PER_NODE="2", CUDA_VISIBLE_DEVICES="4,5,6,7")
    r = SlurmClusterResolver(environ=environ)
    assert r.num_accelerators() == {"GPU": 2}
    assert environ["CUDA_VISIBLE_DEVICES"] == "6,7"
    assert r.gpu_allocation == ("4,5", "6,7")


def test_no_gpus_leaves_cuda_visible_devices_alone():
    environ = slurm_env(0, "n1", SLURM_STEP_TASKS_PER_NODE="2")
    r = SlurmClusterResolver(gpu_probe=lambda: 0, environ=environ)
    assert r.num_accelerators() == {"GPU": 0}
    assert "CUDA_VISIBLE_DEVICES" not in environ
    assert r.gpu_allocation == ("", "")


def test_injected_probe_counts_gpus_per_node():
    environ = slurm_env(1, "n1", SLURM_STEP_TASKS_PER_NODE="2")
    r = SlurmClusterResolver(gpu_probe=lambda: 8, environ=environ)
    assert r.num_accelerators() == {"GPU": 4}
    assert environ["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"


def test_empty_visible_devices_counts_as_no_gpus():
    environ = slurm_env(0, "n1", SLURM_STEP_TASKS_PER_NODE="1", CUDA_VISIBLE_DEVICES="")
    assert SlurmClusterResolver(environ=environ).num_accelerators() == {"GPU": 0}


# -- errors ------------------------------------------------------------------------


def test_missing_procid_is_failed_precondition_naming_it():
    with pytest.raises(FailedPreconditionError, match="SLURM_PROCID"):
        SlurmClusterResolver(
            environ={"SLURM_STEP_NODELIST": "n1", "SLURM_STEP_TASKS_PER_NODE": "1"}
        )


@pytest.mark.parametrize("missing", ["SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE"])
def test_missing_step_variable_is_named(missing):
    environ = slurm_env(0, "n1", SLURM_STEP_TASKS_PER_NODE="1")
    del environ[missing]
    with pytest.raises(FailedPreconditionError, match=missing):
        SlurmClusterResolver(gpus_per_node=0, environ=environ)


@pytest.mark.parametrize("procid", ["-1", "x", ""])
def test_bad_procid_is_named(procid):
    environ = slurm_env(0, "n1", SLURM_STEP_TASKS_PER_NODE="1")
    environ["SLURM_PROCID"] = procid
    with pytest.raises(InvalidArgumentError, match=rf"SLURM_PROCID '{re.escape(procid)}'"):
        SlurmClusterResolver(gpus_per_node=0, environ=environ)


def test_procid_out_of_range_is_named():
    with pytest.raises(InvalidArgumentError, match=r"SLURM_PROCID 3 is out of range.*3 tasks"):
        SlurmClusterResolver(
            gpus_per_node=0, environ=slurm_env(3, SLURM_STEP_TASKS_PER_NODE="1(x3)")
        )


def test_malformed_nodelist_is_named():
    with pytest.raises(InvalidArgumentError, match=r"'n\[1-'"):
        SlurmClusterResolver(
            gpus_per_node=0, environ=slurm_env(0, "n[1-", SLURM_STEP_TASKS_PER_NODE="1")
        )


def test_node_listed_twice_is_named():
    with pytest.raises(InvalidArgumentError, match=r"node\(s\) \['n1'\] more than once"):
        SlurmClusterResolver(
            gpus_per_node=0, environ=slurm_env(0, "n1,n[1-2]", SLURM_STEP_TASKS_PER_NODE="1(x3)")
        )


def test_tasks_per_node_count_mismatch_names_both_variables():
    with pytest.raises(
        InvalidArgumentError, match=r"'1\(x2\)' gives 2 node\(s\).*'t02n13,t02n41,t02n43' has 3"
    ):
        SlurmClusterResolver(
            gpus_per_node=0, environ=slurm_env(0, SLURM_STEP_TASKS_PER_NODE="1(x2)")
        )


def test_jobs_not_matching_the_step_are_named():
    with pytest.raises(
        InvalidArgumentError, match=r"\{'ps': 1, 'worker': 3\} ask for 4 tasks.*has 3"
    ):
        SlurmClusterResolver(
            jobs={"ps": 1, "worker": 3},
            gpus_per_node=0,
            environ=slurm_env(0, SLURM_STEP_TASKS_PER_NODE="1(x3)"),
        )
    with pytest.raises(InvalidArgumentError, match=r"ask for 4 tasks.*has 3"):
        SlurmClusterResolver(
            gpus_per_node=0,
            environ=slurm_env(0, SLURM_STEP_NUM_TASKS="4", SLURM_STEP_TASKS_PER_NODE="1(x3)"),
        )


@pytest.mark.parametrize(
    ("jobs", "named"),
    [({}, "{}"), ({"ps": -1, "worker": 4}, "-1"), ({"a b": 3}, "'a b'"), ([3], "[3]")],
)
def test_bad_jobs_are_named(jobs, named):
    with pytest.raises(InvalidArgumentError, match=re.escape(named)):
        SlurmClusterResolver(
            jobs=jobs, gpus_per_node=0, environ=slurm_env(0, SLURM_STEP_TASKS_PER_NODE="1(x3)")
        )


def test_more_gpus_requested_than_the_node_has_is_named():
    with pytest.raises(
        InvalidArgumentError, match=r"2 tasks per node x gpus_per_task 2.*gpus_per_node 3"
    ):
        SlurmClusterResolver(
            gpus_per_node=3,
            gpus_per_task=2,
            environ=slurm_env(0, "n1", SLURM_STEP_TASKS_PER_NODE="2"),
        )


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"port_base": 0}, "port_base 0"),
        ({"port_base": 65535}, "port_base 65535"),
        ({"port_base": "8888"}, "port_base '8888'"),
        ({"gpus_per_node": -1}, "gpus_per_node -1"),
        ({"gpus_per_node": 2, "gpus_per_task": -1}, "gpus_per_task -1"),
        ({"tasks_per_node": 0}, "tasks_per_node 0"),
        ({"tasks_per_node": {"bad host": 1}}, "'bad host'"),
        ({"tasks_per_node": {"n1": -2}}, "-2"),
    ],
)
def test_bad_arguments_are_named(kwargs, named):
    kwargs.setdefault("gpus_per_node", 0)
    with pytest.raises(InvalidArgumentError, match=re.escape(named)):
        SlurmClusterResolver(environ=slurm_env(0, "n1", SLURM_STEP_TASKS_PER_NODE="2"), **kwargs)


def test_read_only_environ_with_auto_set_gpu_is_an_error():
    environ = MappingProxyType(slurm_env(0, "n1", SLURM_STEP_TASKS_PER_NODE="1"))
    with pytest.raises(InvalidArgumentError, match="mappingproxy"):
        SlurmClusterResolver(gpus_per_node=1, environ=environ)
    r = SlurmClusterResolver(gpus_per_node=1, auto_set_gpu=False, environ=environ)
    assert r.num_accelerators() == {"GPU": 1}

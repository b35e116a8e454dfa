"""Reference tests: the same inputs through TensorFlow's resolvers and psflow's.

Skipped where TensorFlow is not installed.  TensorFlow reads ``os.environ``;
psflow gets the same variables through ``environ=``.
"""

from __future__ import annotations

import json
import os

import pytest

tf = pytest.importorskip("tensorflow")
tf_slurm = pytest.importorskip(
    "tensorflow.python.distribute.cluster_resolver.slurm_cluster_resolver"
)

from psflow.distribute import cluster_resolver as pf  # noqa: E402  (after the skip)

SPECS = [
    {},
    {"worker": ["w0:1", "w1:1", "w2:1"], "ps": ["p0:1", "p1:1"]},
    {"worker": {1: "w1:1"}, "ps": ["p0:1"]},
    {"worker": {"3": "w3:1", "0": "w0:1"}, "chief": ["c:1"]},
    {"worker": {0: "w0:1", 1: "w1:1"}},
    {"ps": []},
    {"123456": ["x:1"]},
]


@pytest.mark.parametrize("cluster", SPECS)
def test_cluster_spec_matches_tf(cluster):
    ours, theirs = pf.ClusterSpec(cluster), tf.train.ClusterSpec(cluster)
    assert ours.as_dict() == theirs.as_dict()
    assert ours.jobs == theirs.jobs
    assert bool(ours) == bool(theirs)
    assert repr(ours) == repr(theirs)
    for job in theirs.jobs:
        assert ours.num_tasks(job) == theirs.num_tasks(job)
        assert ours.task_indices(job) == theirs.task_indices(job)
        if theirs.num_tasks(job):
            assert ours.job_tasks(job) == theirs.job_tasks(job)
        for index in theirs.task_indices(job):
            assert ours.task_address(job, index) == theirs.task_address(job, index)
    # Both reject unknown jobs with a ValueError.
    with pytest.raises(ValueError):
        theirs.num_tasks("nope")
    with pytest.raises(ValueError):
        ours.num_tasks("nope")


CLUSTER = {
    "ps": ["ps0:2222", "ps1:2222"],
    "worker": ["worker0:2222", "worker1:2222", "worker2:2222"],
}

TF_CONFIGS = [
    {"cluster": CLUSTER, "task": {"type": "ps", "index": 0}},
    {"cluster": CLUSTER, "task": {"type": "worker", "index": "2"}, "rpc_layer": "grpc"},
    {"cluster": CLUSTER, "task": {"type": "ps", "index": 1}, "session_master": "sm:2222"},
    {
        "cluster": {"chief": ["c0:2222"], **CLUSTER},
        "task": {"type": "chief", "index": 0},
        "rpc_layer": "grpc",
        "environment": "cloud",
    },
    {
        "cluster": {"worker": {"1": "w1:2222"}, "ps": ["p0:2222"]},
        "task": {"type": "worker", "index": 1},
    },
    {"cluster": {"worker": ["worker0:2222"]}},
    {},
]


@pytest.mark.parametrize("config", TF_CONFIGS)
def test_tfconfig_resolver_matches_tf(config, monkeypatch):
    text = json.dumps(config)
    monkeypatch.setenv("TF_CONFIG", text)
    theirs = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    ours = pf.TFConfigClusterResolver(environ={"TF_CONFIG": text})
    assert ours.cluster_spec().as_dict() == theirs.cluster_spec().as_dict()
    assert ours.task_type == theirs.task_type
    assert ours.task_id == theirs.task_id
    assert ours.rpc_layer == theirs.rpc_layer
    assert ours.master() == theirs.master()
    for job in theirs.cluster_spec().jobs:
        for index in theirs.cluster_spec().task_indices(job):
            assert ours.master(job, index) == theirs.master(job, index)
            assert ours.master(job, index, rpc_layer="x") == theirs.master(
                job, index, rpc_layer="x"
            )


SLURM_CASES = [
    # (environment, constructor arguments) - TF's tests and README, and a bracket node list.
    (
        {
            "SLURM_PROCID": "0",
            "SLURM_STEP_NUM_TASKS": "3",
            "SLURM_STEP_TASKS_PER_NODE": "1(x3)",
            "SLURM_STEP_NODELIST": "t02n13,t02n41,t02n43",
            "CUDA_VISIBLE_DEVICES": "0",
        },
        {},
    ),
    (
        {
            "SLURM_PROCID": "2",
            "SLURM_STEP_NUM_TASKS": "3",
            "SLURM_STEP_NODELIST": "t02n13,t02n41,t02n43",
        },
        {
            "jobs": {"ps": 1, "worker": 2},
            "tasks_per_node": 1,
            "gpus_per_node": 1,
            "gpus_per_task": 1,
            "auto_set_gpu": False,
        },
    ),
    (
        {
            "SLURM_PROCID": "1",
            "SLURM_STEP_NUM_TASKS": "5",
            "SLURM_STEP_TASKS_PER_NODE": "2(x2),1",
            "SLURM_STEP_NODELIST": "t02n13,t02n41,t02n43",
            "CUDA_VISIBLE_DEVICES": "",
        },
        {"jobs": {"ps": 1, "worker": 4}, "gpus_per_node": 4, "gpus_per_task": 2},
    ),
    (
        {
            "SLURM_PROCID": "3",
            "SLURM_STEP_NUM_TASKS": "4",
            "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
            "SLURM_STEP_NODELIST": "t02n[13,41]",
            "CUDA_VISIBLE_DEVICES": "0,1,2,3",
        },
        {},
    ),
    (
        {
            "SLURM_PROCID": "6",
            "SLURM_STEP_NUM_TASKS": "8",
            "SLURM_STEP_TASKS_PER_NODE": "2(x4)",
            "SLURM_STEP_NODELIST": "node[1-3,7]",
            "CUDA_VISIBLE_DEVICES": "0,1",
        },
        {"jobs": {"worker": 6, "ps": 2}},
    ),
    (
        {
            "SLURM_PROCID": "1",
            "SLURM_STEP_NUM_TASKS": "4",
            "SLURM_STEP_NODELIST": "n[001-002]",
            "CUDA_VISIBLE_DEVICES": "0,1",
        },
        {
            "jobs": {"ps": 1, "worker": 3},
            "port_base": 1337,
            "tasks_per_node": 2,
            "gpus_per_node": 2,
            "gpus_per_task": 1,
            "auto_set_gpu": False,
        },
    ),
]


@pytest.mark.parametrize(("environ", "kwargs"), SLURM_CASES)
def test_slurm_resolver_matches_tf(environ, kwargs, monkeypatch):
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", environ.get("CUDA_VISIBLE_DEVICES", "unset"))
    ours_env = dict(environ)
    ours = pf.SlurmClusterResolver(environ=ours_env, **kwargs)
    theirs = tf.distribute.cluster_resolver.SlurmClusterResolver(**kwargs)
    assert ours.cluster_spec().as_dict() == theirs.cluster_spec().as_dict()
    assert ours.get_task_info() == theirs.get_task_info()  # TF's is set by cluster_spec()
    assert ours.num_accelerators() == theirs.num_accelerators()
    assert ours.master() == theirs.master()
    assert ours_env.get("CUDA_VISIBLE_DEVICES", "unset") == os.environ["CUDA_VISIBLE_DEVICES"]


@pytest.mark.parametrize(
    "hostlist",
    [
        "n1",
        "n[1,3]",
        "node[1-3,7]",
        "n[1-2],m5,o[3-4,6,7-9]",
        "n[0001-0003],m5,o[009-011]",
        "a[1-2],b3",
        "n[8-10]",
    ],
)
def test_expand_hostlist_matches_tf(hostlist):
    assert pf.expand_hostlist(hostlist) == tf_slurm.expand_hostlist(hostlist)


@pytest.mark.parametrize("spec", ["2", "2,1,3", "3(x2),2,1", "3(x2),2,11(x4)", "13(x10)"])
def test_expand_tasks_per_node_matches_tf(spec):
    assert pf.expand_tasks_per_node(spec) == tf_slurm.expand_tasks_per_node(spec)


UNIONS = [
    ({"worker": ["a:1", "b:1"]}, {"ps": ["p:1"]}),
    ({"worker": ["a:1", "b:1"]}, {"worker": ["c:1"], "ps": ["p:1"]}),
    ({"worker": ["a:1", "b:1"]}, {"worker": {3: "d:1"}}),
    ({"worker": {2: "c:1"}}, {"worker": ["a:1", "b:1"]}),
]


@pytest.mark.parametrize(("first", "second"), UNIONS)
def test_union_resolver_matches_tf(first, second):
    scr = tf.distribute.cluster_resolver.SimpleClusterResolver
    theirs = tf.distribute.cluster_resolver.UnionResolver(
        scr(tf.train.ClusterSpec(first), task_type="worker", task_id=0),
        scr(tf.train.ClusterSpec(second)),
    )
    ours = pf.UnionClusterResolver(
        pf.SimpleClusterResolver(first, task_type="worker", task_id=0),
        pf.SimpleClusterResolver(second),
    )
    assert ours.cluster_spec().as_dict() == theirs.cluster_spec().as_dict()
    assert (ours.task_type, ours.task_id) == (theirs.task_type, theirs.task_id)


def test_union_conflict_raises_key_error_in_both():
    scr = tf.distribute.cluster_resolver.SimpleClusterResolver
    first, second = {"worker": ["a:1", "b:1"]}, {"worker": {1: "x:1"}}
    theirs = tf.distribute.cluster_resolver.UnionResolver(
        scr(tf.train.ClusterSpec(first)), scr(tf.train.ClusterSpec(second))
    )
    ours = pf.UnionClusterResolver(
        pf.SimpleClusterResolver(first), pf.SimpleClusterResolver(second)
    )
    with pytest.raises(KeyError):
        theirs.cluster_spec()
    with pytest.raises(KeyError):
        ours.cluster_spec()

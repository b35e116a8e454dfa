"""KubernetesClusterResolver: the StatefulSet naming contract and every error case."""

from __future__ import annotations

import re
import socket

import pytest

from psflow.distribute.cluster_resolver import KubernetesClusterResolver, TaskNotFoundError
from psflow.errors import InvalidArgumentError

JOBS = {"chief": 1, "ps": 2, "worker": 3}


def test_peers_use_set_and_service_names_within_the_namespace():
    r = KubernetesClusterResolver(JOBS, service="train", hostname="worker-2")
    assert r.cluster_spec().as_dict() == {
        "chief": ["chief-0.train:2222"],
        "ps": ["ps-0.train:2222", "ps-1.train:2222"],
        "worker": ["worker-0.train:2222", "worker-1.train:2222", "worker-2.train:2222"],
    }
    assert (r.task_type, r.task_id) == ("worker", 2)
    assert r.master() == "grpc://worker-2.train:2222"
    assert r.master("ps", 1, rpc_layer="dns") == "dns://ps-1.train:2222"
    bare = KubernetesClusterResolver(JOBS, service="train", hostname="ps-0", rpc_layer=None)
    assert bare.master() == "ps-0.train:2222"


def test_namespace_gives_cluster_wide_names():
    r = KubernetesClusterResolver(
        {"ps": 1, "worker": 1}, service="train", namespace="ml", hostname="ps-0"
    )
    assert r.cluster_spec().as_dict() == {
        "ps": ["ps-0.train.ml.svc:2222"],
        "worker": ["worker-0.train.ml.svc:2222"],
    }


def test_default_service_is_each_sets_own_name():
    r = KubernetesClusterResolver({"ps": 1, "worker": 2}, hostname="ps-0")
    assert r.cluster_spec().as_dict() == {
        "ps": ["ps-0.ps:2222"],
        "worker": ["worker-0.worker:2222", "worker-1.worker:2222"],
    }


def test_per_job_services_ports_and_statefulset_names():
    r = KubernetesClusterResolver(
        {"ps": 1, "worker": 2},
        service={"ps": "mnist-ps-svc", "worker": "mnist-worker-svc"},
        port={"ps": 5000, "worker": 6000},
        statefulsets={"ps": "mnist-ps", "worker": "mnist-worker"},
        hostname="mnist-worker-1.mnist-worker-svc.ml.svc.cluster.local",
    )
    assert r.cluster_spec().as_dict() == {
        "ps": ["mnist-ps-0.mnist-ps-svc:5000"],
        "worker": ["mnist-worker-0.mnist-worker-svc:6000", "mnist-worker-1.mnist-worker-svc:6000"],
    }
    assert (r.task_type, r.task_id) == ("worker", 1)
    assert r.statefulsets == {"ps": "mnist-ps", "worker": "mnist-worker"}


def test_overlapping_set_names_resolve_by_the_whole_prefix():
    jobs = {"worker": 2, "evaluator": 1}
    sets = {"worker": "job-worker", "evaluator": "job-worker-eval"}
    r = KubernetesClusterResolver(jobs, statefulsets=sets, hostname="job-worker-eval-0")
    assert (r.task_type, r.task_id) == ("evaluator", 0)
    r = KubernetesClusterResolver(jobs, statefulsets=sets, hostname="job-worker-1")
    assert (r.task_type, r.task_id) == ("worker", 1)


def test_hostname_comes_from_environ_then_socket(monkeypatch):
    r = KubernetesClusterResolver(JOBS, environ={"HOSTNAME": "ps-1"})
    assert (r.task_type, r.task_id, r.hostname) == ("ps", 1, "ps-1")
    monkeypatch.setattr(socket, "gethostname", lambda: "chief-0")
    r = KubernetesClusterResolver(JOBS, environ={})
    assert (r.task_type, r.task_id) == ("chief", 0)


def test_explicit_task_skips_the_hostname():
    r = KubernetesClusterResolver(JOBS, task_type="ps", task_id=1, hostname="not-a-pod")
    assert (r.task_type, r.task_id, r.hostname) == ("ps", 1, None)


def test_num_accelerators_uses_the_probe():
    r = KubernetesClusterResolver(JOBS, hostname="ps-0", gpu_probe=lambda: 2)
    assert r.num_accelerators() == {"GPU": 2}


def test_job_with_zero_replicas_is_an_empty_job():
    r = KubernetesClusterResolver({"ps": 1, "worker": 0}, hostname="ps-0")
    assert r.cluster_spec().num_tasks("worker") == 0


# -- errors ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "hostname", ["laptop", "worker", "worker-x", "worker-01", "trainer-0", "worker--1"]
)
def test_hostname_that_is_not_a_pod_of_the_sets_is_named(hostname):
    with pytest.raises(TaskNotFoundError, match=re.escape(repr(hostname))) as info:
        KubernetesClusterResolver(JOBS, hostname=hostname)
    assert "['chief', 'ps', 'worker']" in str(info.value)


def test_ordinal_beyond_replicas_is_named():
    with pytest.raises(TaskNotFoundError, match=r"'worker-3'.*ordinal 3.*'worker' with 3 replicas"):
        KubernetesClusterResolver(JOBS, hostname="worker-3")


def test_explicit_task_not_in_cluster_is_named():
    with pytest.raises(TaskNotFoundError, match=r"task index 5.*'ps'"):
        KubernetesClusterResolver(JOBS, task_type="ps", task_id=5)
    with pytest.raises(TaskNotFoundError, match=r"'evaluator'"):
        KubernetesClusterResolver(
            {"ps": 1, "worker": 1, "evaluator": 0}, task_type="evaluator", task_id=0
        )


def test_task_type_without_task_id_is_an_error():
    with pytest.raises(InvalidArgumentError, match=r"together \(got 'ps', None\)"):
        KubernetesClusterResolver(JOBS, task_type="ps")


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"service": "Train"}, "'Train'"),
        ({"service": "-train"}, "'-train'"),
        ({"service": "a" * 64}, "a" * 64),
        ({"namespace": "ML"}, "'ML'"),
        ({"namespace": 3}, "3"),
        ({"statefulsets": {"chief": "c", "ps": "p_s", "worker": "w"}}, "'p_s'"),
        ({"statefulsets": {"chief": "c", "ps": "p"}}, "missing ['worker']"),
        ({"statefulsets": "sets"}, "'sets'"),
        ({"service": {"chief": "c", "ps": "p", "worker": "w", "extra": "e"}}, "unknown ['extra']"),
        ({"port": 0}, "port of 'chief' 0"),
        ({"port": 70000}, "70000"),
        ({"port": "2222"}, "'2222'"),
        ({"port": {"chief": 1, "ps": 2}}, "missing ['worker']"),
        (
            {"statefulsets": {"chief": "same", "ps": "same", "worker": "w"}},
            "share StatefulSet 'same'",
        ),
        ({"statefulsets": {"chief": "c" * 62, "ps": "p", "worker": "w"}}, "c" * 62),
    ],
)
def test_bad_arguments_are_named(kwargs, named):
    with pytest.raises(InvalidArgumentError, match=re.escape(named)):
        KubernetesClusterResolver(JOBS, hostname="ps-0", **kwargs)


@pytest.mark.parametrize(
    ("jobs", "named"), [({}, "{}"), ({"ps": -1}, "-1"), ({"ps": True}, "True"), (["ps"], "['ps']")]
)
def test_bad_jobs_are_named(jobs, named):
    with pytest.raises(InvalidArgumentError, match=re.escape(named)):
        KubernetesClusterResolver(jobs, hostname="ps-0")

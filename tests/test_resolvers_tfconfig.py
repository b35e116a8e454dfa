"""TFConfigClusterResolver: TF's documented behaviour, Kubeflow's forms, and every error case."""

from __future__ import annotations

import json
import re

import pytest

from psflow.distribute.cluster_resolver import (
    ClusterSpec,
    ClusterTypeError,
    TaskNotFoundError,
    TFConfigClusterResolver,
    parse_tf_config,
)
from psflow.errors import FailedPreconditionError, InvalidArgumentError

CLUSTER = {
    "ps": ["ps0:2222", "ps1:2222"],
    "worker": ["worker0:2222", "worker1:2222", "worker2:2222"],
}


def env(config: dict | str) -> dict[str, str]:
    """An environ holding TF_CONFIG."""
    return {"TF_CONFIG": config if isinstance(config, str) else json.dumps(config)}


def resolver(config: dict | str, **kwargs) -> TFConfigClusterResolver:
    return TFConfigClusterResolver(environ=env(config), **kwargs)


# -- TF's documented behaviour (its tfconfig_cluster_resolver tests) ----------


def test_normal_cluster_spec_read():
    r = resolver({"cluster": CLUSTER, "task": {"type": "ps", "index": 0}})
    assert r.cluster_spec() == ClusterSpec(CLUSTER)
    assert r.cluster_spec().as_dict() == CLUSTER


def test_automatic_master_read():
    r = resolver({"cluster": CLUSTER, "task": {"type": "ps", "index": 0}})
    assert r.master() == "ps0:2222"


def test_specified_task_type_and_index_master_read():
    r = resolver({"cluster": CLUSTER, "task": {"type": "ps", "index": 0}})
    assert r.master("worker", 1) == "worker1:2222"


def test_session_master_read():
    r = resolver(
        {
            "cluster": CLUSTER,
            "session_master": "sessionmaster:2222",
            "task": {"type": "ps", "index": 0},
        }
    )
    assert r.master() == "sessionmaster:2222"


def test_rpc_layer_read():
    r = resolver({"cluster": CLUSTER, "rpc_layer": "grpc", "task": {"type": "ps", "index": 0}})
    assert r.master() == "grpc://ps0:2222"
    assert (r.task_type, r.task_id, r.rpc_layer) == ("ps", 0, "grpc")


def test_parameter_overrides_and_setters():
    r = resolver(
        {"cluster": CLUSTER, "rpc_layer": "grpc", "task": {"type": "ps", "index": 1}},
        task_type="ps",
        task_id=0,
    )
    assert r.master() == "grpc://ps0:2222"
    assert (r.task_type, r.task_id) == ("ps", 0)
    r.task_type = "worker"
    r.task_id = 1
    r.rpc_layer = "test"
    assert r.master() == "test://worker1:2222"
    assert (r.task_type, r.task_id, r.rpc_layer) == ("worker", 1, "test")


def test_task_type_cast_to_string():
    r = resolver(
        {
            "cluster": {"123456": ["ps0:2222", "ps1:2222"], "worker": ["worker0:2222"]},
            "task": {"type": 123456, "index": 0},
        }
    )
    assert r.task_type == "123456"


def test_task_index_cast_to_integer():
    r = resolver({"cluster": CLUSTER, "task": {"type": "ps", "index": "1"}})
    assert r.task_id == 1


def test_task_index_override():
    r = resolver(
        {
            "cluster": {"worker": ["worker0:2222", "worker1:2222"]},
            "task": {"type": "worker", "index": "0"},
        },
        task_id=1,
    )
    assert r.task_id == 1


def test_zero_items_in_cluster_spec_master_read():
    r = resolver("{}")
    assert r.master() == ""
    assert not r.cluster_spec()


def test_one_item_in_cluster_spec_master_read():
    r = resolver({"cluster": {"worker": ["worker0:2222"]}})
    assert r.master() == ""


# -- environment ----------------------------------------------------------------


@pytest.mark.parametrize("environ", [{}, {"TF_CONFIG": ""}, {"TF_CONFIG": "  \n"}])
def test_missing_or_blank_tf_config_is_empty_spec_and_no_task(environ):
    r = TFConfigClusterResolver(environ=environ)
    assert r.cluster_spec() == ClusterSpec({})
    assert (r.task_type, r.task_id, r.rpc_layer) == (None, None, None)
    assert r.master() == ""
    assert r.environment == ""


def test_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv(
        "TF_CONFIG", json.dumps({"cluster": CLUSTER, "task": {"type": "worker", "index": 2}})
    )
    r = TFConfigClusterResolver()
    assert (r.task_type, r.task_id) == ("worker", 2)


def test_tf_config_is_parsed_once_at_construction():
    environ = env({"cluster": CLUSTER, "task": {"type": "ps", "index": 0}})
    r = TFConfigClusterResolver(environ=environ)
    environ["TF_CONFIG"] = "{not json"
    assert r.cluster_spec() == ClusterSpec(CLUSTER)
    assert r.task_type == "ps"


def test_environment_key_and_override():
    config = {"cluster": CLUSTER, "task": {"type": "ps", "index": 0}, "environment": "cloud"}
    assert resolver(config).environment == "cloud"
    assert resolver(config, environment="google").environment == "google"


def test_unknown_keys_are_ignored():
    r = resolver(
        {"cluster": CLUSTER, "task": {"type": "ps", "index": 0}, "model_dir": "/x", "service": {}}
    )
    assert r.task_type == "ps"


def test_explicit_task_without_tf_config_task():
    r = resolver({"cluster": CLUSTER}, task_type="worker", task_id=2)
    assert r.master() == "worker2:2222"


def test_num_accelerators_uses_injected_probe_and_never_fails():
    r = resolver({"cluster": CLUSTER, "task": {"type": "ps", "index": 0}}, gpu_probe=lambda: 4)
    assert r.num_accelerators() == {"GPU": 4}
    assert r.num_accelerators("worker", 1) == {"GPU": 4}

    def broken() -> int:
        raise RuntimeError("driver exploded")

    r.gpu_probe = broken
    assert r.num_accelerators() == {"GPU": 0}
    r.gpu_probe = lambda: "lots"
    assert r.num_accelerators() == {"GPU": 0}


# -- master is the chief ----------------------------------------------------------


def test_master_job_is_read_as_the_chief():
    r = resolver(
        {
            "cluster": {"master": ["m0:2222"], "ps": ["ps0:2222"], "worker": ["w0:2222"]},
            "task": {"type": "master", "index": 0},
        }
    )
    assert r.task_type == "chief"
    assert r.cluster_spec().as_dict() == {
        "chief": ["m0:2222"],
        "ps": ["ps0:2222"],
        "worker": ["w0:2222"],
    }
    assert r.master() == "m0:2222"
    assert r.master("master", 0) == "m0:2222"
    explicit = resolver(
        {"cluster": {"master": ["m0:2222"], "worker": ["w0:2222"]}}, task_type="master", task_id=0
    )
    assert explicit.task_type == "chief"


def test_chief_and_master_together_is_more_than_one_chief():
    with pytest.raises(InvalidArgumentError, match=r"more than one chief.*'c0:1'.*'m0:1'"):
        resolver({"cluster": {"chief": ["c0:1"], "master": ["m0:1"], "worker": ["w:1"]}})


@pytest.mark.parametrize("job", ["chief", "master"])
def test_two_chief_tasks_is_an_error_naming_the_job(job):
    with pytest.raises(InvalidArgumentError, match=rf"more than one chief: job '{job}'.*'c1:1'"):
        resolver({"cluster": {job: ["c0:1", "c1:1"], "worker": ["w:1"]}})


# -- the evaluator is not part of the training cluster ----------------------------

WITH_EVALUATOR = {
    "chief": ["c0:2222"],
    "ps": ["p0:2222"],
    "worker": ["w0:2222", "w1:2222"],
    "evaluator": ["e0:2222"],
}


def test_evaluator_is_kept_out_of_the_training_cluster():
    r = resolver({"cluster": WITH_EVALUATOR, "task": {"type": "worker", "index": 0}})
    assert "evaluator" not in r.cluster_spec().jobs
    assert r.cluster_spec().jobs == ["chief", "ps", "worker"]
    assert r.full_cluster_spec() == ClusterSpec(WITH_EVALUATOR)


def test_evaluator_sees_only_its_own_job():
    r = resolver({"cluster": WITH_EVALUATOR, "task": {"type": "evaluator", "index": 0}})
    assert r.cluster_spec().as_dict() == {"evaluator": ["e0:2222"]}
    assert r.master() == ""


def test_evaluator_outside_the_cluster_is_valid():
    cluster = {k: v for k, v in WITH_EVALUATOR.items() if k != "evaluator"}
    r = resolver({"cluster": cluster, "task": {"type": "evaluator", "index": 0}})
    assert r.task_type == "evaluator"
    assert not r.cluster_spec()


def test_two_evaluators_is_an_error():
    with pytest.raises(InvalidArgumentError, match=r"more than one evaluator.*'e1:1'"):
        resolver({"cluster": {"worker": ["w:1"], "evaluator": ["e0:1", "e1:1"]}})


# -- Kubeflow's sparseCluster -------------------------------------------------------


def test_kubeflow_sparse_cluster_for_a_worker():
    r = resolver(
        {
            "sparseCluster": {
                "worker": {"1": "job-worker-1.ns.svc:2222"},
                "ps": ["job-ps-0.ns.svc:2222", "job-ps-1.ns.svc:2222"],
            },
            "task": {"type": "worker", "index": 1},
        }
    )
    assert r.is_sparse
    assert (r.task_type, r.task_id) == ("worker", 1)
    assert r.cluster_spec().as_dict() == {
        "worker": {1: "job-worker-1.ns.svc:2222"},
        "ps": ["job-ps-0.ns.svc:2222", "job-ps-1.ns.svc:2222"],
    }
    assert r.master() == "job-worker-1.ns.svc:2222"


def test_kubeflow_sparse_cluster_for_a_ps_holds_only_itself_at_its_index():
    r = resolver(
        {
            "sparseCluster": {"worker": {}, "ps": ["job-ps-1.ns.svc:2222"]},
            "task": {"type": "ps", "index": 1},
        }
    )
    assert r.cluster_spec().as_dict() == {"worker": {}, "ps": {1: "job-ps-1.ns.svc:2222"}}
    assert r.cluster_spec().task_address("ps", 1) == "job-ps-1.ns.svc:2222"


def test_sparse_cluster_null_jobs_are_absent():
    r = resolver(
        {
            "sparseCluster": {"worker": {"0": "w:1"}, "ps": ["p:1"], "chief": None},
            "task": {"type": "worker", "index": 0},
        }
    )
    assert r.cluster_spec().jobs == ["worker", "ps"]


def test_sparse_worker_index_not_in_its_job_is_named():
    with pytest.raises(TaskNotFoundError, match=r"task index 2.*'worker'"):
        resolver(
            {
                "sparseCluster": {"worker": {"1": "w:1"}, "ps": ["p:1"]},
                "task": {"type": "worker", "index": 2},
            }
        )


def test_cluster_and_sparse_cluster_together_is_an_error():
    with pytest.raises(InvalidArgumentError, match=r"'cluster' and 'sparseCluster'"):
        resolver({"cluster": CLUSTER, "sparseCluster": CLUSTER})


# -- errors: typed, naming the key or value, constructed nothing -----------------


def test_malformed_json_names_the_text_and_position():
    with pytest.raises(
        InvalidArgumentError, match=r"not valid JSON.*line 1 column 2.*'\{cluster"
    ) as info:
        resolver("{cluster: 1}")
    assert "TF_CONFIG" in str(info.value)


def test_long_malformed_json_is_shortened_in_the_message():
    text = "{" + "x" * 5000
    with pytest.raises(InvalidArgumentError) as info:
        resolver(text)
    assert len(str(info.value)) < 400


def test_repeated_key_is_named():
    with pytest.raises(InvalidArgumentError, match=r"repeats the key 'task'"):
        resolver('{"task": {"type": "ps", "index": 0}, "task": {"type": "worker", "index": 0}}')


@pytest.mark.parametrize("text", ["[]", "3", '"worker"', "null"])
def test_non_object_tf_config_is_named(text):
    with pytest.raises(InvalidArgumentError, match=re.escape(text)):
        resolver(text)


def test_cluster_of_wrong_type_names_key():
    with pytest.raises(InvalidArgumentError, match=r"TF_CONFIG\['cluster'\].*\['w:1'\]"):
        resolver({"cluster": ["w:1"]})


def test_job_of_wrong_type_is_type_error_naming_key_and_job():
    with pytest.raises(ClusterTypeError, match=r"TF_CONFIG\['cluster'\].*job 'worker'.*'w:1'"):
        resolver({"cluster": {"worker": "w:1"}})


def test_task_not_in_the_cluster_names_the_type():
    with pytest.raises(TaskNotFoundError, match=r"'chief'.*jobs: \['ps', 'worker'\]") as info:
        resolver({"cluster": CLUSTER, "task": {"type": "chief", "index": 0}})
    assert isinstance(info.value, ValueError)


def test_index_out_of_range_names_index_and_job():
    with pytest.raises(TaskNotFoundError, match=r"task index 3 is out of range for job 'worker'"):
        resolver({"cluster": CLUSTER, "task": {"type": "worker", "index": 3}})


def test_explicit_override_out_of_range_is_an_error():
    with pytest.raises(TaskNotFoundError, match=r"task index 2 .* job 'ps'"):
        resolver({"cluster": CLUSTER, "task": {"type": "ps", "index": 0}}, task_id=2)


@pytest.mark.parametrize("index", [-1, "one", 1.5, True, [0]])
def test_bad_task_index_is_named(index):
    with pytest.raises(InvalidArgumentError, match=re.escape(repr(index))):
        resolver({"cluster": CLUSTER, "task": {"type": "ps", "index": index}})


@pytest.mark.parametrize("task_type", ["", True, ["ps"], {"a": 1}])
def test_bad_task_type_is_named(task_type):
    with pytest.raises(InvalidArgumentError, match=re.escape(repr(task_type))):
        resolver({"cluster": CLUSTER, "task": {"type": task_type, "index": 0}})


def test_task_of_wrong_type_is_named():
    with pytest.raises(InvalidArgumentError, match=r"TF_CONFIG\['task'\].*'worker:0'"):
        resolver({"cluster": CLUSTER, "task": "worker:0"})


def test_task_type_without_index_and_index_without_type_are_errors():
    with pytest.raises(InvalidArgumentError, match=r"'type' but no 'index'"):
        resolver({"cluster": CLUSTER, "task": {"type": "ps"}})
    with pytest.raises(InvalidArgumentError, match=r"'index' but no 'type'"):
        resolver({"cluster": CLUSTER, "task": {"index": 0}})
    with pytest.raises(InvalidArgumentError, match=r"task type 'ps' is given without a task index"):
        resolver({"cluster": CLUSTER}, task_type="ps")


def test_duplicate_addresses_name_the_address_and_both_tasks():
    with pytest.raises(InvalidArgumentError, match=r"duplicate address 'h:1'.*ps:1 and worker:0"):
        resolver({"cluster": {"ps": ["h:0", "h:1"], "worker": ["h:1"]}})


@pytest.mark.parametrize("key", ["rpc_layer", "environment", "session_master"])
def test_string_keys_of_wrong_type_are_named(key):
    with pytest.raises(InvalidArgumentError, match=rf"TF_CONFIG\['{key}'\] 7 must be a string"):
        resolver({"cluster": CLUSTER, key: 7})


def test_task_without_cluster_must_be_the_lone_worker():
    assert resolver({"task": {"type": "worker", "index": 0}}).task_type == "worker"
    assert resolver({"task": {"type": "evaluator", "index": 0}}).task_type == "evaluator"
    with pytest.raises(InvalidArgumentError, match=r"no cluster.*ps:1"):
        resolver({"task": {"type": "ps", "index": 1}})


def test_bad_explicit_arguments_are_named():
    with pytest.raises(InvalidArgumentError, match="-2"):
        resolver({"cluster": CLUSTER}, task_type="ps", task_id=-2)
    with pytest.raises(InvalidArgumentError, match="5"):
        resolver({"cluster": CLUSTER}, task_type=5, task_id=0)
    with pytest.raises(InvalidArgumentError, match=r"\['grpc'\]"):
        resolver({"cluster": CLUSTER}, rpc_layer=["grpc"])
    with pytest.raises(InvalidArgumentError, match="3"):
        resolver({"cluster": CLUSTER}, environment=3)


def test_setters_reject_bad_values_and_keep_state():
    r = resolver({"cluster": CLUSTER, "task": {"type": "ps", "index": 0}})
    with pytest.raises(InvalidArgumentError, match="-1"):
        r.task_id = -1
    with pytest.raises(InvalidArgumentError, match="''"):
        r.task_type = ""
    assert (r.task_type, r.task_id) == ("ps", 0)


def test_master_without_task_in_multi_task_cluster_is_failed_precondition():
    r = resolver({"cluster": CLUSTER})
    with pytest.raises(FailedPreconditionError, match=r"task_type=None"):
        r.master()
    with pytest.raises(TaskNotFoundError, match=r"'chief'"):
        r.master("chief", 0)


def test_parse_tf_config_returns_frozen_config():
    config = parse_tf_config(
        json.dumps({"cluster": CLUSTER, "task": {"type": "ps", "index": 1}, "rpc_layer": "grpc"})
    )
    assert (config.task_type, config.task_id, config.rpc_layer) == ("ps", 1, "grpc")
    assert config.cluster == ClusterSpec(CLUSTER)
    with pytest.raises(AttributeError):
        config.task_id = 0
    assert parse_tf_config(None).cluster == ClusterSpec({})

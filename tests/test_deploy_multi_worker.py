"""Worker-only (MultiWorkerMirroredStrategy) deployments: Compose, a StatefulSet, a TFJob.

Checked offline as ``tests/test_deploy_k8s.py`` and ``tests/test_deploy_compose.py``
check the parameter-server ones: Kubernetes objects against Kubernetes' own
schemas (``kubernetes-validate``, oldest and newest supported version), the
TFJob's Worker pod template as a PodTemplate, the Compose file against the
Compose schema.  The TF_CONFIG each StatefulSet pod derives from its name
(``docker/psflow_k8s_env.py``) must be the strategy's group of the set's pods
behind the headless Service; and the Compose services' commands run as local
processes on 127.0.0.1 (service names mapped to free ports) and train together.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time
from typing import Any

import pytest

from psflow.distribute.cluster_resolver import ClusterSpec, SimpleClusterResolver
from psflow.distribute.multi_worker_mirrored_strategy import WorkerGroup
from psflow.errors import InvalidArgumentError, NotFoundError
from tests.conftest import ROOT, child_env, pick_free_port
from tests.test_deploy_k8s import MIN_KUBERNETES, NAMESPACE, k8s_env

yaml = pytest.importorskip("yaml")

MANIFESTS = ROOT / "docker" / "k8s" / "multi-worker"
COMPOSE = ROOT / "docker" / "compose.multi-worker.yaml"
SCHEMA = ROOT / "tests" / "schemas" / "compose-spec.json"
RING_PORT = 2222


def _objects(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((MANIFESTS / name).read_text()) if d]


def _one(name: str, kind: str) -> dict[str, Any]:
    (found,) = [o for o in _objects(name) if o["kind"] == kind]
    return found


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


@pytest.fixture(scope="module")
def kubernetes_validate():
    return pytest.importorskip("kubernetes_validate")


def test_statefulset_and_service_match_kubernetes_schemas(kubernetes_validate):
    objects = _objects("workers.yaml")
    assert sorted(o["kind"] for o in objects) == ["Service", "StatefulSet"]
    for version in (MIN_KUBERNETES, kubernetes_validate.latest_version()):
        for obj in objects:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{obj['kind']} ({version}): {'.'.join(map(str, e.path))}: {e.message}")


def test_tfjob_has_only_worker_replicas_and_valid_pod_templates(kubernetes_validate):
    tfjob = _one("tfjob.yaml", "TFJob")
    assert tfjob["apiVersion"] == "kubeflow.org/v1"
    replicas = tfjob["spec"]["tfReplicaSpecs"]
    assert list(replicas) == ["Worker"]  # no Chief, no PS: a worker-only job
    assert tfjob["spec"]["successPolicy"] == "AllWorkers"
    worker = replicas["Worker"]
    assert worker["replicas"] >= 2 and worker["restartPolicy"] == "ExitCode"
    (container,) = worker["template"]["spec"]["containers"]
    assert container["name"] == "tensorflow"  # the operator finds its port there
    assert [p["containerPort"] for p in container["ports"]] == [RING_PORT]
    template = {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": {"name": "tfjob-worker"},
        "template": worker["template"],
    }
    for version in (MIN_KUBERNETES, kubernetes_validate.latest_version()):
        kubernetes_validate.validate(template, version, strict=True)
    # the same program as the StatefulSet's pods, without the wrapper (the operator
    # writes TF_CONFIG itself)
    (sts_container,) = _one("workers.yaml", "StatefulSet")["spec"]["template"]["spec"]["containers"]
    command = sts_container["command"]
    assert command[: command.index("--") + 1] == ["psflow-k8s-env", "--"]
    assert container["command"] == command[command.index("--") + 1 :]


def _pod_env(ordinal: int) -> tuple[str, dict[str, str]]:
    sts = _one("workers.yaml", "StatefulSet")
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    return f"{sts['metadata']['name']}-{ordinal}", {
        **_env(container),
        "PSFLOW_K8S_NAMESPACE": NAMESPACE,
    }


def test_every_pod_derives_its_place_in_one_worker_group():
    sts, service = _one("workers.yaml", "StatefulSet"), _one("workers.yaml", "Service")
    spec = sts["spec"]
    # peers must start together, and find each other while they start
    assert spec["podManagementPolicy"] == "Parallel"
    assert spec["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    labels = spec["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    (container,) = spec["template"]["spec"]["containers"]
    assert [p["containerPort"] for p in container["ports"]] == [RING_PORT]
    # the ring needs the token: a non-loopback address is refused without one
    assert _env(container)["PSFLOW_AUTH_TOKEN_FILE"].startswith("/run/secrets/psflow/")
    pods = [
        f"{sts['metadata']['name']}-{i}.{service['metadata']['name']}.{NAMESPACE}.svc:{RING_PORT}"
        for i in range(spec["replicas"])
    ]
    for ordinal in range(spec["replicas"]):
        hostname, env = _pod_env(ordinal)
        config = k8s_env.tf_config_for(k8s_env.layout_from_env(env), hostname)
        assert config == {"cluster": {"worker": pods}, "task": {"type": "worker", "index": ordinal}}
        resolver = SimpleClusterResolver(
            ClusterSpec(config["cluster"]), task_type="worker", task_id=ordinal
        )
        group = WorkerGroup.from_resolver(resolver)
        assert (group.addresses, group.rank, group.size) == (tuple(pods), ordinal, len(pods))


def test_a_worker_only_layout_with_another_task_type_is_refused_naming_it():
    hostname, plain = _pod_env(0)
    env = {
        **plain,
        "PSFLOW_K8S_JOBS": "worker=2,evaluator=1",
        "PSFLOW_K8S_STATEFULSETS": "worker=psflow-mw-worker,evaluator=psflow-mw-eval",
    }
    with pytest.raises(InvalidArgumentError, match="evaluator"):
        k8s_env.tf_config_for(k8s_env.layout_from_env(env), hostname)
    with pytest.raises(NotFoundError):  # no worker at all: this pod is not in the group
        k8s_env.tf_config_for(
            k8s_env.layout_from_env({**plain, "PSFLOW_K8S_JOBS": "worker=0"}), hostname
        )


def test_a_worker_pod_added_by_kubectl_scale_lists_the_workers_up_to_itself():
    """An elastic group scaled up: the new pod's TF_CONFIG ends with itself, the others'
    stay as they started (the group learns the new address when it asks to join)."""
    hostname, env = _pod_env(3)  # replicas 2 -> 4
    layout = k8s_env.layout_from_env({**env, "PSFLOW_K8S_WORKER_MAX": "4"})
    config = k8s_env.tf_config_for(layout, hostname)
    assert config["task"] == {"type": "worker", "index": 3}
    assert len(config["cluster"]["worker"]) == 4
    assert config["cluster"]["worker"][3].startswith(hostname + ".")
    first, _ = _pod_env(0)
    assert len(k8s_env.tf_config_for(layout, first)["cluster"]["worker"]) == 2
    with pytest.raises(NotFoundError, match="psflow-mw-worker-4"):
        k8s_env.tf_config_for(layout, "psflow-mw-worker-4")  # at the maximum: not a task
    with pytest.raises(NotFoundError, match="psflow-mw-worker-3"):
        k8s_env.tf_config_for(k8s_env.layout_from_env(env), hostname)  # no maximum: fixed
    with pytest.raises(InvalidArgumentError, match="PSFLOW_K8S_WORKER_MAX='1'"):
        k8s_env.layout_from_env({**env, "PSFLOW_K8S_WORKER_MAX": "1"})  # below replicas


# -- Compose -------------------------------------------------------------------------------


def _compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_file_matches_the_compose_schema():
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text()))
    errors = [
        "/".join(map(str, e.absolute_path)) + ": " + e.message
        for e in validator.iter_errors(_compose())
    ]
    assert errors == []


def _tf_config(service: dict[str, Any]) -> dict[str, Any]:
    return json.loads(service["environment"]["TF_CONFIG"])


def test_compose_tf_configs_are_one_worker_group_of_the_services():
    services = _compose()["services"]
    names = sorted(services)
    for index, name in enumerate(names):
        config = _tf_config(services[name])
        assert config["cluster"] == {"worker": [f"{n}:{RING_PORT}" for n in names]}
        assert config["task"] == {"type": "worker", "index": index}
        assert services[name]["command"] == services[names[0]]["command"]
        assert "psflow_token" in services[name]["secrets"]


@pytest.mark.timeout(240)
def test_compose_services_train_together_as_local_processes(tmp_path):
    # each service's command as it runs in the image (WORKDIR /opt/psflow holds examples/),
    # its service name mapped to a free port on 127.0.0.1, /checkpoints to tmp_path
    services = _compose()["services"]
    ports = {name: pick_free_port() for name in services}
    token = "compose-multi-worker-token-0123456789"
    procs, logs = [], []
    try:
        for name, service in sorted(services.items()):
            config = _tf_config(service)
            config["cluster"] = {
                job: [f"127.0.0.1:{ports[a.split(':')[0]]}" for a in tasks]
                for job, tasks in config["cluster"].items()
            }
            env = {k: v for k, v in service["environment"].items() if k != "PSFLOW_AUTH_TOKEN_FILE"}
            env.update(TF_CONFIG=json.dumps(config), PSFLOW_AUTH_TOKEN=token)
            argv = [a.replace("/checkpoints", str(tmp_path)) for a in service["command"]] + [
                "--epochs",
                "1",
            ]
            assert argv[0] == "python"
            log = tmp_path / f"{name}.log"
            logs.append(log)
            with open(log, "wb") as f:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, *argv[1:]],
                        cwd=ROOT,
                        env=child_env(env),
                        stdout=f,
                        stderr=subprocess.STDOUT,
                    )
                )
        deadline = time.monotonic() + 180
        codes = [p.wait(max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    texts = [pathlib.Path(log).read_text(errors="replace") for log in logs]
    assert codes == [0, 0], "\n---\n".join(t[-3000:] for t in texts)
    finals = [ln for t in texts for ln in t.splitlines() if "final training" in ln]
    assert len(finals) == 2 and finals[0] == finals[1]  # the same all-worker accuracy
    # worker 0 saved the model; worker 1's temporary copy is gone
    assert sorted(p.name for p in (tmp_path / "keras").iterdir()) == ["keras-model.keras"]

"""docker/k8s: valid Kubernetes objects, a valid cluster for every pod, and the TF_CONFIG wrapper.

The manifests are validated against Kubernetes' own schemas (the
``kubernetes-validate`` package ships them, so this runs offline) for the
oldest and the newest Kubernetes version we support.  The TFJob's schema comes
with Kubeflow's CRD, not with Kubernetes: its fields are checked here, and its
pod templates are validated as Kubernetes PodTemplates.

Every StatefulSet pod (and the chief Job's pod) derives its TF_CONFIG from its
name with ``docker/psflow_k8s_env.py``; the tests derive it for every ordinal
and check it is a valid parameter-server cluster whose addresses are the pods
of the manifests' StatefulSets behind their headless Services.  The wrapper's
waiting and exec are tested against real PS processes on 127.0.0.1.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import pathlib
import re
import subprocess
import sys
import time
from typing import Any

import pytest

from psflow.distribute.cluster_resolver import (
    TaskNotFoundError,
    TFConfigClusterResolver,
    validate_ps_cluster,
)
from psflow.errors import DeadlineExceededError, InvalidArgumentError
from psflow.exit_codes import ExitCode, is_retryable
from tests.conftest import ROOT, child_env

yaml = pytest.importorskip("yaml")

K8S = ROOT / "docker" / "k8s"
WRAPPER = ROOT / "docker" / "psflow_k8s_env.py"
MIN_KUBERNETES = "1.29"  # native gRPC probes (1.27) and podFailurePolicy rules with status
NAMESPACE = "ml"
ENTRYPOINTS = {"chief": "chief", "ps": "ps_server", "worker": "worker"}
DNS_1123 = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def _load_wrapper():
    spec = importlib.util.spec_from_file_location("psflow_k8s_env", WRAPPER)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


k8s_env = _load_wrapper()


def load_all() -> list[tuple[str, dict[str, Any]]]:
    """Every object of every manifest, as ``(file name, object)``."""
    objects = []
    for path in sorted(K8S.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document:
                objects.append((path.name, document))
    return objects


OBJECTS = load_all()


def find(kind: str, name: str | None = None) -> list[dict[str, Any]]:
    """The objects of ``kind`` (and ``name``)."""
    return [o for _, o in OBJECTS if o["kind"] == kind and name in (None, o["metadata"]["name"])]


def one(kind: str, name: str) -> dict[str, Any]:
    (found,) = find(kind, name)
    return found


def selected(selector: str) -> list[dict[str, Any]]:
    """The objects ``kubectl apply -f docker/k8s/ -l KEY!=VALUE[,KEY!=VALUE]`` applies.

    ``!=`` also selects objects without the label, as Kubernetes' selectors do.
    """
    terms = [term.partition("!=")[::2] for term in selector.split(",")]
    return [
        o
        for _, o in OBJECTS
        if all((o["metadata"].get("labels") or {}).get(key) != value for key, value in terms)
    ]


def pod_specs() -> list[tuple[str, dict[str, Any]]]:
    """``(owner, pod spec)`` for every pod template (StatefulSets, the Job, TFJob replicas)."""
    specs = []
    for _, o in OBJECTS:
        if o["kind"] in ("StatefulSet", "Job"):
            specs.append((o["metadata"]["name"], o["spec"]["template"]["spec"]))
        elif o["kind"] == "TFJob":
            for role, replica in o["spec"]["tfReplicaSpecs"].items():
                specs.append((f"{o['metadata']['name']}/{role}", replica["template"]["spec"]))
    return specs


def wrapped_command(container: dict[str, Any]) -> list[str]:
    """What the container runs (``command`` + ``args``), after ``--`` under psflow-k8s-env."""
    command = [*container["command"], *container.get("args", [])]
    if command[0] == "psflow-k8s-env":
        return command[command.index("--") + 1 :]
    return command


def grpc_port(container: dict[str, Any]) -> dict[str, Any]:
    """The container's gRPC port: the one that is not ``metrics``."""
    (port,) = [p for p in container["ports"] if p["name"] != "metrics"]
    return port


def cluster_env() -> dict[str, str]:
    """The environment the manifests give a pod: the ConfigMap and the namespace."""
    return {**one("ConfigMap", "psflow-cluster")["data"], "PSFLOW_K8S_NAMESPACE": NAMESPACE}


# -- Kubernetes' schemas ------------------------------------------------------------------


@pytest.fixture(scope="module")
def kubernetes_validate():
    return pytest.importorskip("kubernetes_validate")


@pytest.mark.parametrize("version", [MIN_KUBERNETES, "latest"])
def test_manifests_match_kubernetes_schemas(kubernetes_validate, version):
    if version == "latest":
        version = kubernetes_validate.latest_version()
    checked = []
    for name, obj in OBJECTS:
        if obj["kind"] == "TFJob":
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(map(str, e.path))
            pytest.fail(f"{name}: {obj['kind']}/{obj['metadata']['name']}: {path}: {e.message}")
        checked.append(obj["kind"])
    assert sorted(set(checked)) == sorted(
        [
            "ConfigMap",
            "Job",
            "PersistentVolumeClaim",
            "PodDisruptionBudget",
            "Role",
            "RoleBinding",
            "Secret",
            "Service",
            "ServiceAccount",
            "StatefulSet",
        ]
    )


@pytest.mark.parametrize(
    "breakage",
    [
        ("spec", "template", "spec", "containers", 0, "livenesProbe", {"grpc": {"port": 2222}}),
        ("spec", "replicas", "two"),
        ("spec", "template", "spec", "containers", 0, "readinessProbe", "grpc", "port", "grpc"),
    ],
    ids=["misspelt-field", "replicas-not-an-int", "grpc-probe-port-not-a-number"],
)
def test_schema_rejects_a_broken_statefulset(kubernetes_validate, breakage):
    # The validator is live: one bad field in a copy of the PS StatefulSet fails it.
    broken = copy.deepcopy(one("StatefulSet", "psflow-ps"))
    *path, key, value = breakage
    node = broken
    for part in path:
        node = node[part]
    node[key] = value
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, MIN_KUBERNETES, strict=True)


# -- the cluster every pod derives --------------------------------------------------------


def test_configmap_matches_the_statefulsets_and_the_job():
    layout = k8s_env.layout_from_env(cluster_env())
    assert layout.port == 2222
    assert list(layout.jobs) == ["chief", "ps", "worker"]
    for job in ("ps", "worker"):
        statefulset = one("StatefulSet", layout.statefulsets[job])
        assert statefulset["spec"]["replicas"] == layout.jobs[job]
    chief = one("Job", layout.statefulsets["chief"])
    assert layout.jobs["chief"] == chief["spec"]["completions"] == chief["spec"]["parallelism"] == 1


def test_every_pod_derives_a_valid_cluster_of_the_manifests_pods():
    env = cluster_env()
    layout = k8s_env.layout_from_env(env)
    pods = {}  # pod name -> (task, its Service, its container)
    for job, set_name in layout.statefulsets.items():
        if job == "chief":
            pod = one("Job", set_name)["spec"]["template"]
            hostnames = [pod["spec"]["hostname"]]
            service_name = pod["spec"]["subdomain"]
        else:
            statefulset = one("StatefulSet", set_name)
            pod = statefulset["spec"]["template"]
            hostnames = [f"{set_name}-{i}" for i in range(statefulset["spec"]["replicas"])]
            service_name = statefulset["spec"]["serviceName"]
        service = one("Service", service_name)
        assert service["spec"]["clusterIP"] == "None", f"{service_name} must be headless"
        assert service["spec"]["publishNotReadyAddresses"] is True
        labels = pod["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items(), service_name
        for i, hostname in enumerate(hostnames):
            pods[f"{hostname}.{service_name}.{NAMESPACE}.svc"] = ((job, i), service, pod)

    configs = []
    for fqdn, ((job, index), service, pod) in pods.items():
        hostname = fqdn.split(".")[0]
        config = k8s_env.tf_config_for(layout, hostname)
        assert config["task"] == {"type": job, "index": index}
        validate_ps_cluster(config["cluster"], task_type=job, task_id=index)
        configs.append(config["cluster"])
        # The servers and the chief read exactly this through their resolver.
        resolver = TFConfigClusterResolver(environ={"TF_CONFIG": json.dumps(config)})
        assert (resolver.task_type, resolver.task_id) == (job, index)
        (container,) = pod["spec"]["containers"]
        command = wrapped_command(container)
        assert command[:3] == ["python", "-m", ENTRYPOINTS[job]], fqdn
        assert container["command"][0] == "psflow-k8s-env"
        if job != "chief":
            port = grpc_port(container)
            assert port["containerPort"] == 2222
            assert service["spec"]["ports"][0]["targetPort"] == port["name"]
    assert all(c == configs[0] for c in configs), "pods disagree on the cluster"
    # Every address in it is one of the pods above, on the port its Service and container use.
    addresses = [a for tasks in configs[0].values() for a in tasks]
    assert sorted(addresses) == sorted(f"{fqdn}:2222" for fqdn in pods)


def test_a_hostname_outside_the_sets_is_refused_naming_it():
    layout = k8s_env.layout_from_env(cluster_env())
    with pytest.raises(TaskNotFoundError, match="psflow-ps-4"):
        k8s_env.tf_config_for(layout, "psflow-ps-4")  # 2 replicas, PSFLOW_K8S_PS_MAX 4
    with pytest.raises(TaskNotFoundError, match="psflow-worker-2"):
        k8s_env.tf_config_for(layout, "psflow-worker-2")  # only ps is elastic
    with pytest.raises(TaskNotFoundError, match="psflow-web-0"):
        k8s_env.tf_config_for(layout, "psflow-web-0")


@pytest.mark.parametrize(
    ("variable", "value", "named"),
    [
        ("PSFLOW_K8S_JOBS", "", "PSFLOW_K8S_JOBS"),
        ("PSFLOW_K8S_JOBS", "ps=2,worker", "'worker'"),
        ("PSFLOW_K8S_JOBS", "ps=two,worker=1", "'two'"),
        ("PSFLOW_K8S_JOBS", "ps=1,ps=2", "'ps' twice"),
        ("PSFLOW_K8S_PORT", "22x", "'22x'"),
    ],
)
def test_bad_layout_variables_are_named(variable, value, named):
    env = {**cluster_env(), variable: value}
    with pytest.raises(InvalidArgumentError, match=re.escape(named)):
        k8s_env.layout_from_env(env)


def test_a_ps_pod_added_by_kubectl_scale_gets_a_cluster_up_to_itself():
    layout = k8s_env.layout_from_env(cluster_env())
    config = k8s_env.tf_config_for(layout, "psflow-ps-3")  # replicas 2 -> 4
    assert config["task"] == {"type": "ps", "index": 3}
    assert len(config["cluster"]["ps"]) == 4 and config["cluster"]["ps"][3].startswith(
        "psflow-ps-3."
    )
    assert len(k8s_env.tf_config_for(layout, "psflow-worker-0")["cluster"]["ps"]) == 2
    with pytest.raises(InvalidArgumentError, match="PSFLOW_K8S_PS_MAX='1'"):
        k8s_env.layout_from_env({**cluster_env(), "PSFLOW_K8S_PS_MAX": "1"})  # below replicas


def test_a_layout_without_workers_is_not_a_ps_cluster():
    env = {**cluster_env(), "PSFLOW_K8S_JOBS": "chief=1,ps=2,worker=0"}
    with pytest.raises(InvalidArgumentError, match="'worker'"):
        k8s_env.tf_config_for(k8s_env.layout_from_env(env), "psflow-ps-0")


# -- what the pods run and mount ----------------------------------------------------------


def test_servers_have_native_grpc_probes_on_their_port():
    for owner, spec in pod_specs():
        (container,) = spec["containers"]
        command = wrapped_command(container)
        if command[2] == "chief":
            assert "readinessProbe" not in container, owner  # the chief serves nothing
            continue
        port = grpc_port(container)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"] == {"port": port["containerPort"]}, (owner, probe)


def test_every_pod_mounts_the_token_secret_and_runs_unprivileged():
    secret = one("Secret", "psflow-auth")
    for owner, spec in pod_specs():
        (container,) = spec["containers"]
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        token_file = pathlib.PurePosixPath(env["PSFLOW_AUTH_TOKEN_FILE"])
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volume = mounts[str(token_file.parent)]
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes[volume]["secret"]["secretName"] == "psflow-auth", owner
        assert token_file.name in secret["stringData"], owner
        security = spec["securityContext"]
        assert security["runAsNonRoot"] is True and security["runAsUser"] == 10001, owner
        assert security["fsGroup"] == 10001, owner  # the mounted token is group-readable
        assert volumes[volume]["secret"]["defaultMode"] == 0o440, owner


def test_ps_and_chief_share_the_checkpoint_claim():
    claim = one("PersistentVolumeClaim", "psflow-checkpoints")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    for owner, spec in pod_specs():
        (container,) = spec["containers"]
        command = wrapped_command(container)
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        if command[2] == "ps_server":
            path = command[command.index("--checkpoint-dir") + 1]
        elif command[2] == "chief":
            path = "/checkpoints"
        else:
            continue
        claim_name = volumes[mounts[path]]["persistentVolumeClaim"]["claimName"]
        assert claim_name == "psflow-checkpoints", owner


def worker_containers(objects: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """``(owner, pod spec)`` of every worker pod template among ``objects``."""
    found = []
    for obj in objects:
        for spec in _specs_of(obj):
            (container,) = spec["containers"]
            if wrapped_command(container)[2] == "worker":
                found.append((obj["metadata"]["name"], spec))
    return found


def gpu_requests(spec: dict[str, Any]) -> list[str]:
    """Every ``*/gpu`` resource a pod spec's containers request or limit."""
    return [
        name
        for container in spec["containers"]
        for part in ("requests", "limits")
        for name in (container.get("resources") or {}).get(part, {})
        if name.endswith("/gpu")
    ]


def test_default_manifests_request_no_gpu_so_a_cpu_cluster_schedules_them():
    workers = worker_containers([o for _, o in OBJECTS])
    assert sorted(owner for owner, _ in workers) == ["psflow-digits", "psflow-worker"]
    for owner, spec in pod_specs():
        assert gpu_requests(spec) == [], owner
        assert "tolerations" not in spec, owner
        (container,) = spec["containers"]
        assert container["image"] == "psflow:latest", owner  # the CPU image


def json_patch(document: dict[str, Any], patch: list[dict[str, Any]]) -> dict[str, Any]:
    """``document`` with an RFC 6902 patch applied (add, replace, remove), as kubectl does."""
    result = copy.deepcopy(document)
    for op in patch:
        *parents, last = [
            p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]
        ]
        node = result
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        key = int(last) if isinstance(node, list) else last
        if op["op"] == "add":
            node[key] = copy.deepcopy(op["value"])
        elif op["op"] == "replace":
            assert key in node if isinstance(node, dict) else key < len(node), op["path"]
            node[key] = copy.deepcopy(op["value"])
        elif op["op"] == "remove":
            del node[key]
        else:
            raise AssertionError(f"unsupported op {op['op']!r}")
    return result


GPU_PATCHES = {
    "StatefulSet": K8S / "gpu" / "worker.yaml",
    "TFJob": K8S / "gpu" / "tfjob-worker.yaml",
}


@pytest.mark.parametrize("kind", sorted(GPU_PATCHES))
def test_gpu_patch_gives_each_worker_a_gpu_and_the_cuda_image(kubernetes_validate, kind):
    (target,) = [o for o in find(kind) if worker_containers([o])]
    patched = json_patch(target, yaml.safe_load(GPU_PATCHES[kind].read_text()))
    ((_, spec),) = worker_containers([patched])
    (container,) = spec["containers"]
    assert container["image"] == "psflow:cuda"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec[
        "tolerations"
    ]
    # Only the worker changes: its command, probes and mounts are the CPU set's.
    ((_, before),) = worker_containers([target])
    assert wrapped_command(container) == wrapped_command(before["containers"][0])
    if kind == "TFJob":
        for role, replica in patched["spec"]["tfReplicaSpecs"].items():
            if role != "Worker":
                assert gpu_requests(replica["template"]["spec"]) == [], role
        template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": "tfjob-worker-gpu"},
            "template": patched["spec"]["tfReplicaSpecs"]["Worker"]["template"],
        }
        kubernetes_validate.validate(template, MIN_KUBERNETES, strict=True)
    else:
        for version in (MIN_KUBERNETES, kubernetes_validate.latest_version()):
            kubernetes_validate.validate(patched, version, strict=True)


USER_SCRIPT = K8S / "user-script"
USER_SELECTOR = "psflow.io/deployment!=tfjob,psflow.io/program!=example"


def user_script_objects() -> list[dict[str, Any]]:
    return [
        d
        for path in sorted(USER_SCRIPT.glob("*.yaml"))
        for d in yaml.safe_load_all(path.read_text())
        if d
    ]


def test_user_script_manifests_match_kubernetes_schemas(kubernetes_validate):
    objects = user_script_objects()
    assert sorted(o["kind"] for o in objects) == ["ConfigMap", "Job"]
    for obj in objects:
        for version in (MIN_KUBERNETES, kubernetes_validate.latest_version()):
            kubernetes_validate.validate(obj, version, strict=True)


def test_user_script_chief_reads_the_configmap_where_it_is_mounted():
    (job,) = [o for o in user_script_objects() if o["kind"] == "Job"]
    (configmap,) = [o for o in user_script_objects() if o["kind"] == "ConfigMap"]
    spec = job["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    command = wrapped_command(container)
    assert command[:3] == ["python", "-m", "chief"]
    script = pathlib.PurePosixPath(command[3])
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    mount = mounts[str(script.parent)]
    assert mount["readOnly"] is True
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == configmap["metadata"]["name"] == "psflow-job"
    # The file the chief runs is a key of the ConfigMap: the sample job, verbatim.
    assert configmap["data"][script.name] == (ROOT / "docker" / "job" / "train.py").read_text()
    compile(configmap["data"][script.name], str(script), "exec")


def test_user_script_chief_is_the_example_job_but_for_its_program():
    (job,) = [o for o in user_script_objects() if o["kind"] == "Job"]
    example = copy.deepcopy(one("Job", "psflow-chief"))
    mine = copy.deepcopy(job)
    assert example["metadata"]["labels"].pop("psflow.io/program") == "example"
    assert mine["metadata"]["labels"].pop("psflow.io/program") == "user-script"
    (c_example,) = example["spec"]["template"]["spec"]["containers"]
    (c_mine,) = mine["spec"]["template"]["spec"]["containers"]
    assert c_example.pop("args")[0] == "examples/digits_ps.py"
    assert c_mine.pop("args")[0].startswith("/opt/psflow/job/")
    (job_mount,) = [m for m in c_mine["volumeMounts"] if m["name"] == "job"]
    c_mine["volumeMounts"].remove(job_mount)
    volumes = mine["spec"]["template"]["spec"]["volumes"]
    volumes.remove(next(v for v in volumes if v["name"] == "job"))
    assert mine == example


def test_user_script_selector_swaps_the_example_chief_for_yours():
    kept = selected(USER_SELECTOR)
    dropped = [o for _, o in OBJECTS if o not in kept and o["kind"] != "TFJob"]
    assert [(o["kind"], o["metadata"]["name"]) for o in dropped] == [("Job", "psflow-chief")]
    jobs = [o for o in kept + user_script_objects() if o["kind"] == "Job"]
    assert [j["metadata"]["labels"]["psflow.io/program"] for j in jobs] == ["user-script"]
    # The chief's headless Service (its pod's DNS name) stays.
    assert ("Service", "psflow-chief") in {(o["kind"], o["metadata"]["name"]) for o in kept}


def test_disruption_budgets_cover_ps_and_workers():
    budgets = {b["metadata"]["name"]: b["spec"] for b in find("PodDisruptionBudget")}
    assert budgets["psflow-ps"]["maxUnavailable"] == 0
    assert budgets["psflow-worker"]["maxUnavailable"] == 1
    for name, budget in budgets.items():
        labels = one("StatefulSet", name)["spec"]["template"]["metadata"]["labels"]
        assert budget["selector"]["matchLabels"].items() <= labels.items(), name


def test_chief_job_fails_fast_on_permanent_exit_codes():
    job = one("Job", "psflow-chief")
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    rules = job["spec"]["podFailurePolicy"]["rules"]
    (fail,) = [r for r in rules if r["action"] == "FailJob"]
    assert fail["onExitCodes"]["operator"] == "In"
    codes = fail["onExitCodes"]["values"]
    # Exactly psflow's permanent codes (and the shell's "command not found") fail the job.
    assert set(codes) == {int(c) for c in ExitCode if c and not is_retryable(c)} | {127}
    assert not is_retryable(127) and is_retryable(ExitCode.RETRYABLE)


def test_selectors_split_the_two_ways_of_running():
    # README: `kubectl apply -f docker/k8s/ -l psflow.io/deployment!=tfjob` (StatefulSets)
    # and `... -l psflow.io/deployment!=statefulsets` (the TFJob).
    plain = selected("psflow.io/deployment!=tfjob")
    tfjob = selected("psflow.io/deployment!=statefulsets")
    assert "TFJob" not in {o["kind"] for o in plain}
    assert sorted(o["kind"] for o in tfjob) == ["PersistentVolumeClaim", "Secret", "TFJob"]
    # Each selection carries every Secret, claim and ConfigMap its pods refer to.
    for objs in (plain, tfjob):
        names = {(o["kind"], o["metadata"]["name"]) for o in objs}
        for o in objs:
            for spec in _specs_of(o):
                for volume in spec["volumes"]:
                    if "secret" in volume:
                        assert ("Secret", volume["secret"]["secretName"]) in names
                    if "persistentVolumeClaim" in volume:
                        claim = volume["persistentVolumeClaim"]["claimName"]
                        assert ("PersistentVolumeClaim", claim) in names
                for container in spec["containers"]:
                    for source in container.get("envFrom", []):
                        assert ("ConfigMap", source["configMapRef"]["name"]) in names


def test_the_readmes_use_the_tested_selectors():
    pattern = r"kubectl (?:apply|delete) -f docker/k8s/ -l '([^']+)'"
    for readme in (ROOT / "README.md", ROOT / "docker" / "README.md"):
        found = set(re.findall(pattern, readme.read_text()))
        expected = {"psflow.io/deployment!=tfjob", "psflow.io/deployment!=statefulsets"}
        if readme.parent.name == "docker":
            expected.add(USER_SELECTOR)  # "Your own script"
        assert found == expected, (readme.name, found)


def _specs_of(obj: dict[str, Any]) -> list[dict[str, Any]]:
    if obj["kind"] in ("StatefulSet", "Job"):
        return [obj["spec"]["template"]["spec"]]
    if obj["kind"] == "TFJob":
        return [r["template"]["spec"] for r in obj["spec"]["tfReplicaSpecs"].values()]
    return []


# -- the TFJob ----------------------------------------------------------------------------

TFJOB_REPLICA_TYPES = {"Chief", "Master", "PS", "Worker", "Evaluator"}
TFJOB_RESTART_POLICIES = {"Always", "OnFailure", "Never", "ExitCode"}


def test_tfjob_has_the_fields_the_operator_requires():
    (tfjob,) = find("TFJob")
    assert tfjob["apiVersion"] == "kubeflow.org/v1"
    assert DNS_1123.fullmatch(tfjob["metadata"]["name"])
    spec = tfjob["spec"]
    assert set(spec) <= {"runPolicy", "tfReplicaSpecs", "successPolicy", "enableDynamicWorker"}
    assert spec["runPolicy"]["cleanPodPolicy"] in {"All", "Running", "None"}
    assert isinstance(spec["runPolicy"]["backoffLimit"], int)
    replicas = spec["tfReplicaSpecs"]
    assert set(replicas) <= TFJOB_REPLICA_TYPES
    assert {"Chief", "PS", "Worker"} <= set(replicas)
    assert replicas["Chief"]["replicas"] == 1
    for role, replica in replicas.items():
        assert set(replica) <= {"replicas", "restartPolicy", "template"}, role
        assert isinstance(replica["replicas"], int) and replica["replicas"] >= 1, role
        assert replica["restartPolicy"] in TFJOB_RESTART_POLICIES, role
        assert replica["restartPolicy"] == "ExitCode", role
        (container,) = replica["template"]["spec"]["containers"]
        # The operator's defaults: container "tensorflow", port "tfjob-port" 2222.
        assert container["name"] == "tensorflow", role
        # (the operator finds its port by name; a server also serves its metrics)
        assert container["ports"][0] == {"name": "tfjob-port", "containerPort": 2222}, role
        assert [p["name"] for p in container["ports"][1:]] in ([], ["metrics"]), role


def test_tfjob_pod_templates_match_kubernetes_schemas(kubernetes_validate):
    (tfjob,) = find("TFJob")
    for role, replica in tfjob["spec"]["tfReplicaSpecs"].items():
        template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": f"tfjob-{role.lower()}"},
            "template": replica["template"],
        }
        for version in (MIN_KUBERNETES, kubernetes_validate.latest_version()):
            try:
                kubernetes_validate.validate(template, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"TFJob {role}: {'.'.join(map(str, e.path))}: {e.message}")


def test_tfjob_runs_the_statefulset_commands_and_a_valid_cluster():
    (tfjob,) = find("TFJob")
    name = tfjob["metadata"]["name"]
    replicas = tfjob["spec"]["tfReplicaSpecs"]
    by_entrypoint = {}
    for _, spec in pod_specs():
        (container,) = spec["containers"]
        command = wrapped_command(container)
        by_entrypoint.setdefault(command[2], []).append(command)
    for commands in by_entrypoint.values():
        assert all(c == commands[0] for c in commands), commands  # same job both ways
    # The operator's TF_CONFIG: <job>-<type>-<i>.<namespace>.svc:<port>, types lowercase.
    cluster = {
        role.lower(): [
            f"{name}-{role.lower()}-{i}.{NAMESPACE}.svc:2222" for i in range(replica["replicas"])
        ]
        for role, replica in replicas.items()
    }
    for role, replica in replicas.items():
        for i in range(replica["replicas"]):
            validate_ps_cluster(cluster, task_type=role.lower(), task_id=i)
    assert sorted(by_entrypoint) == ["chief", "ps_server", "worker"]


# -- psflow-k8s-env, run ------------------------------------------------------------------


def run_wrapper(args: list[str], env: dict[str, str], timeout: float = 60.0):
    return subprocess.run(
        [sys.executable, str(WRAPPER), *args],
        env=child_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def test_wrapper_execs_the_command_with_the_derived_tf_config():
    env = {**cluster_env(), "HOSTNAME": "psflow-worker-1", "TF_CONFIG": ""}
    show = "import os; print(os.environ['TF_CONFIG'])"
    result = run_wrapper(["--", sys.executable, "-c", show], env)
    assert result.returncode == 0, result.stderr
    config = json.loads(result.stdout)
    assert config["task"] == {"type": "worker", "index": 1}
    assert config["cluster"]["ps"] == [
        f"psflow-ps-{i}.psflow-ps.{NAMESPACE}.svc:2222" for i in range(2)
    ]


def test_wrapper_keeps_an_operators_tf_config():
    operator = {"cluster": {"ps": ["j-ps-0:2222"], "worker": ["j-worker-0:2222"]}}
    operator["task"] = {"type": "ps", "index": 0}
    env = {"TF_CONFIG": json.dumps(operator), "HOSTNAME": "j-ps-0"}
    show = "import os; print(os.environ['TF_CONFIG'])"
    result = run_wrapper(["--", sys.executable, "-c", show], env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == operator


def test_wrapper_exits_2_naming_a_pod_outside_the_cluster():
    env = {**cluster_env(), "HOSTNAME": "psflow-worker-7", "TF_CONFIG": ""}
    result = run_wrapper(["--", sys.executable, "-c", "pass"], env)
    assert result.returncode == ExitCode.USAGE_ERROR
    assert "psflow-worker-7" in result.stderr


def test_wait_until_serving_returns_once_a_live_ps_serves(start_ps):
    ps = start_ps()
    started = time.monotonic()
    k8s_env.wait_until_serving([ps.address], timeout=30)
    assert time.monotonic() - started < 30


def test_wait_until_serving_names_what_never_came_up(start_ps):
    ps = start_ps()
    ps.stop()
    started = time.monotonic()
    with pytest.raises(DeadlineExceededError, match=re.escape(ps.address)):
        k8s_env.wait_until_serving([ps.address], timeout=1.5, poll=0.2)
    assert time.monotonic() - started < 10


def test_wait_until_serving_rejects_a_non_positive_timeout():
    with pytest.raises(InvalidArgumentError, match="-1"):
        k8s_env.wait_until_serving(["127.0.0.1:1"], timeout=-1)


@pytest.mark.slow
def test_wrapper_waits_for_the_servers_then_runs_the_chief_command(start_ps):
    ps = start_ps()
    config = {
        "cluster": {"chief": ["127.0.0.1:1"], "ps": [ps.address], "worker": ["127.0.0.1:2"]},
        "task": {"type": "chief", "index": 0},
    }
    env = {"TF_CONFIG": json.dumps(config)}
    ran = [sys.executable, "-c", "print('ran')"]
    result = run_wrapper(["--wait-for", "ps", "--", *ran], env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ran"
    # A worker that never answers: exit 138, so Kubernetes/Kubeflow restarts the chief.
    result = run_wrapper(["--wait-for", "ps,worker", "--wait-timeout", "1", "--", *ran], env)
    assert result.returncode == ExitCode.RETRYABLE, result.stderr
    assert "127.0.0.1:2" in result.stderr and "ran" not in result.stdout
    result = run_wrapper(["--wait-for", "evaluator", "--", *ran], env)
    assert result.returncode == ExitCode.USAGE_ERROR and "evaluator" in result.stderr


# -- monitoring: metrics ports, annotations, the ServiceMonitor -----------------------------

METRICS_PORT = 9100
SERVICE_MONITOR = K8S / "monitoring" / "servicemonitor.yaml"


def test_statefulset_servers_serve_metrics_where_prometheus_looks():
    for name in ("psflow-ps", "psflow-worker"):
        pod = one("StatefulSet", name)["spec"]["template"]
        (container,) = pod["spec"]["containers"]
        command = wrapped_command(container)
        assert command[command.index("--metrics-port") + 1] == str(METRICS_PORT), name
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["metrics"] == METRICS_PORT, name
        annotations = pod["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true", name
        assert annotations["prometheus.io/port"] == str(METRICS_PORT), name
        assert annotations["prometheus.io/path"] == "/metrics", name
        service_ports = {p["name"]: p for p in one("Service", name)["spec"]["ports"]}
        assert service_ports["metrics"]["targetPort"] == "metrics", name


def test_service_monitor_selects_the_server_services_by_their_metrics_port():
    (monitor,) = [d for d in yaml.safe_load_all(SERVICE_MONITOR.read_text()) if d]
    assert (monitor["apiVersion"], monitor["kind"]) == (
        "monitoring.coreos.com/v1",
        "ServiceMonitor",
    )
    selector = monitor["spec"]["selector"]

    def matches(labels: dict[str, str]) -> bool:
        if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
            return False
        for rule in selector.get("matchExpressions", []):
            assert rule["operator"] == "In", rule  # the only operator this test evaluates
            if labels.get(rule["key"]) not in rule["values"]:
                return False
        return True

    chosen = {s["metadata"]["name"] for s in find("Service") if matches(s["metadata"]["labels"])}
    assert chosen == {"psflow-ps", "psflow-worker"}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["path"] == "/metrics"
        for name in chosen:
            assert endpoint["port"] in {p["name"] for p in one("Service", name)["spec"]["ports"]}
    # Kept out of the directory `kubectl apply -f docker/k8s/` reads: it needs the operator's CRD.
    assert all(o["kind"] != "ServiceMonitor" for _, o in OBJECTS)


def test_every_psflow_container_budgets_its_blas_threads():
    """A pod with no CPU limit sees every core of its node: each psflow container says how
    many BLAS threads it may use (1 for a PS, what it requested for a worker or chief)."""
    for owner, spec in pod_specs():
        for container in spec["containers"]:
            command = wrapped_command(container)
            module = command[2] if command[:2] == ["python", "-m"] else None
            if module not in ("ps_server", "worker", "chief"):
                continue
            env = {e["name"]: e for e in container.get("env", [])}
            budget = env.get("PSFLOW_BLAS_THREADS")
            assert budget is not None, (owner, container["name"])
            if module == "ps_server":
                assert budget["value"] == "1", owner
            else:
                ref = budget["valueFrom"]["resourceFieldRef"]
                assert ref["resource"] == "requests.cpu", owner
                assert "cpu" in container["resources"]["requests"], owner

"""docker/compose.yaml: valid Compose, a consistent cluster, and the topology run without Docker.

The static tests validate the files against the Compose specification's JSON
schema (vendored in tests/schemas, see the NOTICE there) and check what the
schema cannot: every ``depends_on`` names a service, every TF_CONFIG address
names a service and a port it exposes, the shared token and checkpoint volume
are wired the same way everywhere.

``test_compose_topology_runs_as_local_processes`` then runs the file itself:
each service's command with its environment as a process on 127.0.0.1, in
``depends_on`` order, gated by the services' own health checks.  Every service
listens on port 2222 in compose, so each one gets its own free loopback port
and TF_CONFIG addresses and health-check targets are rewritten to match;
mounts (the checkpoint volume, the token secret) become temporary directories.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib.util
import json
import pathlib
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any

import pytest

from psflow.distribute.cluster_resolver import validate_ps_cluster
from tests.conftest import ROOT, child_env

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")

DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "compose.yaml"
COMPOSE_GPU = DOCKER / "compose.gpu.yaml"
COMPOSE_JOB = DOCKER / "compose.job.yaml"
JOB_MOUNT = "/opt/psflow/job"
DASHBOARD_PORT = 8080
SCHEMA = ROOT / "tests" / "schemas" / "compose-spec.json"
SERVER_MODULES = ("ps_server", "worker")


def load(path: pathlib.Path) -> dict[str, Any]:
    """The YAML document in ``path`` (anchors and ``<<`` merges resolved)."""
    return yaml.safe_load(path.read_text())


def schema_errors(document: dict[str, Any]) -> list[str]:
    """Every violation of the Compose schema in ``document``, as ``path: message``."""
    schema = json.loads(SCHEMA.read_text())
    validator = jsonschema.Draft202012Validator(schema)
    return [
        "/".join(map(str, e.absolute_path)) + ": " + e.message
        for e in validator.iter_errors(document)
    ]


def depends_on(service: dict[str, Any]) -> dict[str, str]:
    """A service's dependencies as name -> condition (the list form means service_started)."""
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):
        return dict.fromkeys(deps, "service_started")
    return {name: (spec or {}).get("condition", "service_started") for name, spec in deps.items()}


def tf_config(service: dict[str, Any]) -> dict[str, Any] | None:
    """The service's TF_CONFIG, parsed (None when it has none)."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    text = env.get("TF_CONFIG")
    return None if text is None else json.loads(text)


def exposed_ports(service: dict[str, Any]) -> set[int]:
    """The container ports a service exposes to its network."""
    return {int(str(p).split("/")[0]) for p in service.get("expose") or []}


def module_of(command: list[str]) -> str | None:
    """``ps_server`` for ``python -m ps_server ...``; None for anything else."""
    if len(command) >= 3 and command[0] == "python" and command[1] == "-m":
        return command[2]
    return None


_VARIABLE = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}")


def interpolate(value: str, environ: dict[str, str]) -> str:
    """Compose's ``${VAR}`` / ``${VAR:-default}`` in ``value``, from ``environ``."""
    return _VARIABLE.sub(lambda m: environ.get(m[1]) or (m[2] or ""), value)


def mount_target(volume: str) -> str:
    """The container path of a ``SOURCE:TARGET[:MODE]`` volume (SOURCE may be ``${...}``)."""
    return interpolate(volume, {}).split(":")[1]


def merged(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``docker compose -f base -f override``'s services: keys replaced, volumes merged by target."""
    document = copy.deepcopy(base)
    for name, changes in override["services"].items():
        service = document["services"][name]
        for key, value in changes.items():
            if key == "volumes":
                targets = {mount_target(v): v for v in service.get("volumes") or []}
                targets.update({mount_target(v): v for v in value})
                service["volumes"] = list(targets.values())
            else:
                service[key] = copy.deepcopy(value)
    return document


def chief_script(command: list[str]) -> str:
    """The program ``python -m chief [OPTIONS] SCRIPT ...`` runs."""
    options = {"--log-level", "--dashboard-port", "--dashboard-bind"}
    rest = command[3:]
    while rest[0] in options:
        rest = rest[2:]
    return rest[0]


@pytest.fixture(scope="module")
def compose_file() -> dict[str, Any]:
    return load(COMPOSE)


@pytest.fixture(scope="module")
def compose(compose_file) -> dict[str, Any]:
    """What ``docker compose up`` runs: the services of no profile (monitoring is opt-in)."""
    document = copy.deepcopy(compose_file)
    document["services"] = {
        name: s for name, s in document["services"].items() if not s.get("profiles")
    }
    return document


# -- the schema ---------------------------------------------------------------------------


def test_compose_file_matches_the_compose_schema(compose_file):
    assert schema_errors(compose_file) == []


def test_gpu_override_matches_the_compose_schema():
    assert schema_errors(load(COMPOSE_GPU)) == []


def test_job_override_matches_the_compose_schema(compose_file):
    assert schema_errors(load(COMPOSE_JOB)) == []
    assert schema_errors(merged(compose_file, load(COMPOSE_JOB))) == []


def test_chief_runs_the_example_by_default_and_your_mounted_script_with_the_override(compose):
    assert chief_script(compose["services"]["chief"]["command"]) == "examples/digits_ps.py"
    job = merged(compose, load(COMPOSE_JOB))["services"]
    script = interpolate(chief_script(job["chief"]["command"]), {})
    assert script == f"{JOB_MOUNT}/train.py"
    chosen = {"PSFLOW_JOB_SCRIPT": "mine.py", "PSFLOW_JOB_DIR": "/srv/myjob"}
    assert interpolate(chief_script(job["chief"]["command"]), chosen) == f"{JOB_MOUNT}/mine.py"
    # The chief and every worker mount the one host directory there, read-only.
    for name, service in job.items():
        mounts = {mount_target(v): v for v in service.get("volumes") or []}
        if name == "chief" or module_of(service["command"]) == "worker":
            volume = mounts[JOB_MOUNT]
            assert interpolate(volume, {}) == f"./job:{JOB_MOUNT}:ro", name
            assert interpolate(volume, chosen) == f"/srv/myjob:{JOB_MOUNT}:ro", name
            assert (DOCKER / "job" / "train.py").is_file()
        else:
            assert JOB_MOUNT not in mounts, name  # the PS tasks need none of it
    # The override changes nothing else of the chief: its options stay the default's.
    default = compose["services"]["chief"]["command"]
    assert (
        job["chief"]["command"][: default.index("examples/digits_ps.py")]
        == default[: default.index("examples/digits_ps.py")]
    )


def test_chief_publishes_the_dashboard_on_the_hosts_loopback(compose):
    chief = compose["services"]["chief"]
    command = chief["command"]
    assert int(command[command.index("--dashboard-port") + 1]) == DASHBOARD_PORT
    # Inside its container the chief must listen beyond loopback for the port to reach it...
    assert command[command.index("--dashboard-bind") + 1] == "0.0.0.0"
    # ...and the host publishes it on its own loopback only; the page wants the token.
    assert chief["ports"] == [f"127.0.0.1:{DASHBOARD_PORT}:{DASHBOARD_PORT}"]
    assert "PSFLOW_AUTH_TOKEN_FILE" in chief["environment"]
    for name, service in compose["services"].items():
        if name != "chief":
            assert "ports" not in service, name  # nothing else is published


@pytest.mark.parametrize(
    "breakage",
    [
        ("services", "chief", "depends_on", "ps-0", "condition", "service_ready"),
        ("services", "ps-0", "healthcheck", "retries", [3]),
        ("services", "worker-0", "restart_policy", "always"),
    ],
    ids=["unknown-condition", "retries-not-a-number", "unknown-key"],
)
def test_schema_rejects_a_broken_copy(compose, breakage):
    # The validator is live: the same file with one bad value does not pass.
    broken = copy.deepcopy(compose)
    *path, key, value = breakage
    node = broken
    for part in path:
        node = node.setdefault(part, {})
    node[key] = value
    assert schema_errors(broken)


# -- the cluster the file describes -------------------------------------------------------


def test_every_depends_on_names_another_service(compose):
    services = compose["services"]
    for name, service in services.items():
        for dep in depends_on(service):
            assert dep in services, f"{name} depends on {dep!r}, which is no service"
            assert dep != name


def test_chief_waits_for_every_healthy_ps_and_worker(compose):
    services = compose["services"]
    servers = {n for n, s in services.items() if module_of(s["command"]) in SERVER_MODULES}
    assert len([n for n in servers if n.startswith("ps-")]) == 2
    assert len([n for n in servers if n.startswith("worker-")]) == 2
    chief = services["chief"]
    assert module_of(chief["command"]) == "chief"
    assert depends_on(chief) == dict.fromkeys(servers, "service_healthy")
    for name in servers:
        check = services[name]["healthcheck"]
        assert not check.get("disable")
        assert check["test"][:3] == ["CMD", "psflow", "health"], name
        host, _, port = check["test"][3].rpartition(":")
        assert host == "127.0.0.1" and int(port) in exposed_ports(services[name]), name
    # The chief serves nothing, so the image's server health check is off for it.
    assert chief["healthcheck"] == {"disable": True}


def test_every_tf_config_is_one_valid_cluster_of_the_services(compose):
    services = compose["services"]
    clusters = []
    for name, service in services.items():
        config = tf_config(service)
        assert config is not None, f"{name} has no TF_CONFIG"
        cluster, task = config["cluster"], config["task"]
        validate_ps_cluster(cluster, task_type=task["type"], task_id=task["index"])
        clusters.append(cluster)
        # Every address is a service and a port it exposes.
        for job, addresses in cluster.items():
            for index, address in enumerate(addresses):
                host, _, port = address.rpartition(":")
                assert host in services, f"{name}: {job}:{index} at {address!r} is no service"
                assert int(port) in exposed_ports(services[host]), (name, address)
        # The service is the task its TF_CONFIG names.
        own = cluster[task["type"]][task["index"]]
        assert own.rpartition(":")[0] == name, f"{name}'s TF_CONFIG says it is {own}"
        expected = {"chief": "chief", "ps": "ps_server", "worker": "worker"}[task["type"]]
        assert module_of(service["command"]) == expected, name
    assert all(c == clusters[0] for c in clusters), "services disagree on the cluster"


def test_token_secret_and_checkpoint_volume_are_shared(compose):
    services = compose["services"]
    assert set(compose["secrets"]) == {"psflow_token"}
    assert compose["secrets"]["psflow_token"]["file"] == "./psflow_token"
    checkpoint_mounts = {}
    for name, service in services.items():
        assert service["secrets"] == ["psflow_token"], name
        assert service["environment"]["PSFLOW_AUTH_TOKEN_FILE"] == "/run/secrets/psflow_token"
        for volume in service.get("volumes") or []:
            source, target = volume.split(":")[:2]
            checkpoint_mounts[name] = (source, target)
    for name, service in services.items():
        command = service["command"]
        if "--checkpoint-dir" in command:
            path = command[command.index("--checkpoint-dir") + 1]
            assert checkpoint_mounts[name] == ("checkpoints", path), name
    ps = [n for n in services if n.startswith("ps-")]
    # Every PS writes its shard, the chief its manifest: one volume, one path.
    assert {checkpoint_mounts[n] for n in [*ps, "chief"]} == {("checkpoints", "/checkpoints")}
    assert "checkpoints" in compose["volumes"]


def test_build_sections_name_existing_dockerfiles(compose):
    for name, service in [
        *compose["services"].items(),
        *load(COMPOSE_GPU)["services"].items(),
    ]:
        build = service["build"]
        context = (DOCKER / build["context"]).resolve()
        assert context == ROOT, name
        assert (context / build["dockerfile"]).is_file(), name


def test_gpu_override_gives_each_worker_its_own_gpu(compose):
    override = load(COMPOSE_GPU)["services"]
    workers = [n for n, s in compose["services"].items() if module_of(s["command"]) == "worker"]
    assert sorted(override) == sorted(workers)
    device_ids = []
    for name in workers:
        assert override[name]["build"]["dockerfile"] == "docker/Dockerfile.cuda"
        (device,) = override[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        device_ids += device["device_ids"]
    assert len(set(device_ids)) == len(workers), "two workers reserve the same GPU"


# -- the topology, run as local processes -------------------------------------------------


def free_port() -> int:
    """A port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health_status(address: str, timeout: float = 3.0) -> str:
    """The standard gRPC health status of ``address`` (or the failed call's code)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout
            )
        except grpc.RpcError as e:
            return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


@dataclasses.dataclass
class LocalService:
    """One compose service turned into a local process."""

    name: str
    argv: list[str]
    env: dict[str, str]
    health: list[str] | None
    log_path: pathlib.Path
    proc: subprocess.Popen | None = None
    healthy: bool = False

    def log_tail(self, n: int = 30) -> str:
        with contextlib.suppress(OSError):
            lines = self.log_path.read_text(errors="replace").splitlines()
            return f"--- {self.name} ---\n" + "\n".join(lines[-n:])
        return ""

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)


class LocalCompose:
    """Translates a compose file's services into commands for this machine.

    Service names map to 127.0.0.1 and a free port each; container paths of
    mounts map to directories under ``root``; ``python`` is this interpreter and
    ``psflow`` the CLI of this checkout.  Parts still being merged are stood in
    for (``psflow health`` by the same gRPC health check done here, ``python -m
    chief SCRIPT`` by running SCRIPT with the chief's TF_CONFIG), so the test
    exercises the file with what the tree has.
    """

    def __init__(self, compose: dict[str, Any], root: pathlib.Path) -> None:
        self.compose = compose
        self.root = root
        self.ports = {name: free_port() for name in compose["services"]}
        self.dashboard_port = free_port()
        self.mounts: dict[str, pathlib.Path] = {}
        for volume in compose.get("volumes") or {}:
            (root / "volumes" / volume).mkdir(parents=True)
        token_dir = root / "secrets"
        token_dir.mkdir()
        for name in compose.get("secrets") or {}:
            (token_dir / name).write_text(secrets.token_hex(32) + "\n")
            self.mounts[f"/run/secrets/{name}"] = token_dir / name
        self.has_cli = importlib.util.find_spec("psflow.cli") is not None
        self.has_chief_main = importlib.util.find_spec("chief.__main__") is not None

    def _address(self, address: str, own: str) -> str:
        host, _, port = address.rpartition(":")
        if host in ("127.0.0.1", "localhost"):
            host = own
        if host in self.ports and int(port) in exposed_ports(self.compose["services"][host]):
            return f"127.0.0.1:{self.ports[host]}"
        return address

    def _value(self, value: str, name: str, mounts: dict[str, pathlib.Path]) -> str:
        if value.startswith("{"):
            config = json.loads(value)
            config["cluster"] = {
                job: [self._address(a, name) for a in addresses]
                for job, addresses in config["cluster"].items()
            }
            return json.dumps(config)
        for target, local in mounts.items():
            if value == target or value.startswith(target + "/"):
                return str(local) + value[len(target) :]
        if ":" in value and not value.startswith("/"):
            return self._address(value, name)
        return value

    def _mounts(self, service: dict[str, Any]) -> dict[str, pathlib.Path]:
        mounts = dict(self.mounts)
        for volume in service.get("volumes") or []:
            source, target = interpolate(volume, {}).split(":")[:2]
            if source.startswith((".", "/")):  # a bind mount: a host path, relative to docker/
                mounts[target] = (DOCKER / source).resolve()
            else:
                mounts[target] = self.root / "volumes" / source
        return mounts

    def _argv(self, command: list[str]) -> list[str]:
        if command[0] == "psflow":
            return [
                sys.executable,
                "-c",
                "import sys; from psflow.cli import main; sys.exit(main())",
                *command[1:],
            ]
        assert command[0] == "python", f"unexpected program {command[0]!r}"
        argv = [sys.executable, *command[1:]]
        if module_of(command) in SERVER_MODULES:
            argv += ["--bind", "127.0.0.1"]  # compose binds 0.0.0.0 in a container
        if "--dashboard-port" in argv:
            argv[argv.index("--dashboard-port") + 1] = str(self.dashboard_port)
            argv[argv.index("--dashboard-bind") + 1] = "127.0.0.1"
        if "--metrics-port" in argv:  # one port per container there, one machine here
            argv[argv.index("--metrics-port") + 1] = "auto"
        elif module_of(command) == "chief" and not self.has_chief_main:
            argv = [sys.executable, *command[3:]]  # the script itself, as TF_CONFIG's chief
        return argv

    def service(self, name: str) -> LocalService:
        service = self.compose["services"][name]
        mounts = self._mounts(service)
        env = child_env(
            {k: self._value(str(v), name, mounts) for k, v in service["environment"].items()}
        )
        command = [interpolate(a, {}) for a in service["command"]]
        argv = self._argv([self._value(a, name, mounts) for a in command])
        check = service.get("healthcheck") or {}
        health = None
        if check and not check.get("disable"):
            assert check["test"][0] == "CMD"
            health = [self._value(a, name, mounts) for a in check["test"][1:]]
        return LocalService(name, argv, env, health, self.root / f"{name}.log")

    def check_health(self, svc: LocalService) -> bool:
        """Runs the service's health check once; True when it passes."""
        assert svc.health is not None
        if self.has_cli:
            argv = self._argv(svc.health)
            result = subprocess.run(argv, env=svc.env, capture_output=True, timeout=30)
            return result.returncode == 0
        assert svc.health[:2] == ["psflow", "health"]
        return health_status(svc.health[2]) == "SERVING"


def start_order(compose: dict[str, Any]) -> list[str]:
    """The services with every dependency before its dependents."""
    order: list[str] = []
    pending = dict(compose["services"])
    for _ in range(len(pending)):
        ready = [n for n, s in pending.items() if set(depends_on(s)) <= set(order)]
        assert ready, f"depends_on has a cycle among {sorted(pending)}"
        for name in ready:
            order.append(name)
            del pending[name]
        if not pending:
            break
    return order


def dashboard_answers(port: int) -> bool:
    """True when the chief's dashboard at ``port`` serves its cluster document."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/cluster", timeout=2) as r:
            return "workers" in json.loads(r.read())
    except (OSError, ValueError):
        return False


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("job", ["example", "mounted-script"])
def test_compose_topology_runs_as_local_processes(compose, tmp_path, job):
    if job == "mounted-script":
        compose = merged(compose, load(COMPOSE_JOB))
    local = LocalCompose(compose, tmp_path)
    services = {name: local.service(name) for name in start_order(compose)}
    deadline = time.monotonic() + 120
    try:
        # Start each service once its dependencies meet their condition, as compose does.
        for _ in range(10_000):
            for name, svc in services.items():
                deps = depends_on(compose["services"][name])
                if svc.proc is not None or not all(
                    services[d].healthy if cond == "service_healthy" else services[d].proc
                    for d, cond in deps.items()
                ):
                    continue
                with open(svc.log_path, "wb") as log:
                    svc.proc = subprocess.Popen(
                        svc.argv, env=svc.env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT
                    )
            for svc in services.values():
                if svc.proc is None or svc.healthy or svc.health is None:
                    continue
                assert svc.proc.poll() is None, f"{svc.name} exited early\n{svc.log_tail()}"
                svc.healthy = local.check_health(svc)
            if all(svc.proc is not None for svc in services.values()):
                break
            assert time.monotonic() < deadline, "services not healthy in time:\n" + "\n".join(
                s.log_tail() for s in services.values()
            )
            time.sleep(0.3)

        chief = services["chief"]
        dashboard_seen = False
        while chief.proc.poll() is None and time.monotonic() < deadline:
            dashboard_seen = dashboard_seen or dashboard_answers(local.dashboard_port)
            time.sleep(0.2)
        try:
            code = chief.proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail("the chief did not finish in time\n" + chief.log_tail())
        assert code == 0, chief.log_tail()
        if job == "example":
            assert "test accuracy" in chief.log_path.read_text()
            # The published dashboard port is the one the chief serves (a run of seconds).
            assert dashboard_seen, chief.log_tail()
        else:  # the mounted directory's script ran, and only it
            log = chief.log_path.read_text()
            assert "test accuracy" not in log, chief.log_tail()
            # asynchronous training: close to y = 3x - 2, not the same digits every run
            done = re.search(r"job done: y = (-?[\d.]+) x \+ (-?[\d.]+)", log)
            assert done, chief.log_tail()
            assert abs(float(done[1]) - 3.0) < 0.05 and abs(float(done[2]) + 2.0) < 0.05, done[0]

        # `up --exit-code-from chief` then stops the rest: SIGTERM, graceful exit 0.
        for svc in services.values():
            if svc.proc.poll() is None:
                svc.proc.send_signal(signal.SIGTERM)
        for svc in services.values():
            assert svc.proc.wait(60) == 0, svc.log_tail()
        # Both PS tasks wrote their final shard into the one shared volume.
        shards = sorted(p.name for p in (tmp_path / "volumes" / "checkpoints").glob("*.json"))
        assert shards == ["ps-0.manifest.json", "ps-1.manifest.json"]
    finally:
        for svc in services.values():
            svc.kill()
    assert all(svc.proc.returncode is not None for svc in services.values())


# -- the monitoring profile (Prometheus + Grafana) ------------------------------------------

PROMETHEUS_CONFIG = DOCKER / "prometheus" / "prometheus.yml"
GRAFANA = DOCKER / "grafana"
GRAFANA_DASHBOARD = GRAFANA / "dashboards" / "psflow.json"
METRICS_PORT = 9100
PROMQL_BUILTINS = {"up"}  # series Prometheus itself adds to every target


def compose_mounts(service: dict[str, Any]) -> dict[str, pathlib.Path]:
    """A service's bind mounts, container path -> file or directory of this repository."""
    mounts = {}
    for volume in service.get("volumes") or []:
        source, target = volume.split(":")[:2]
        if source.startswith("./"):
            mounts[target] = DOCKER / source[2:]
    return mounts


def test_monitoring_services_run_only_with_their_profile(compose_file):
    services = compose_file["services"]
    profiled = {n for n, s in services.items() if s.get("profiles")}
    assert profiled == {"prometheus", "grafana"}
    assert all(services[n]["profiles"] == ["monitoring"] for n in profiled)
    assert depends_on(services["grafana"]) == {"prometheus": "service_started"}
    for name in profiled:  # reachable from this host only
        assert all(str(p).startswith("127.0.0.1:") for p in services[name]["ports"]), name
        for target, source in compose_mounts(services[name]).items():
            assert source.exists(), f"{name} mounts {source} at {target}, which does not exist"


def test_prometheus_scrapes_every_server_on_its_metrics_port(compose_file):
    services = compose_file["services"]
    mounts = compose_mounts(services["prometheus"])
    config_path = services["prometheus"]["command"][0].split("=", 1)[1]
    assert mounts[config_path] == PROMETHEUS_CONFIG
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    targets = {
        job["job_name"]: {t for sc in job["static_configs"] for t in sc["targets"]}
        for job in config["scrape_configs"]
    }
    servers = {
        "psflow-ps": {
            n for n, s in services.items() if module_of(s.get("command", [])) == "ps_server"
        },
        "psflow-worker": {
            n for n, s in services.items() if module_of(s.get("command", [])) == "worker"
        },
    }
    assert set(targets) == set(servers)
    for job, names in servers.items():
        assert targets[job] == {f"{n}:{METRICS_PORT}" for n in names}, job
        for name in names:
            command = services[name]["command"]
            assert command[command.index("--metrics-port") + 1] == str(METRICS_PORT), name
            assert METRICS_PORT in exposed_ports(services[name]), name


def test_grafana_provisions_the_prometheus_datasource_and_the_dashboard(compose_file):
    mounts = compose_mounts(compose_file["services"]["grafana"])
    provisioning = mounts["/etc/grafana/provisioning"]
    (datasource,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())[
        "datasources"
    ]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "psflow.yaml").read_text())[
        "providers"
    ]
    assert mounts[provider["options"]["path"]] == GRAFANA_DASHBOARD.parent
    dashboard = json.loads(GRAFANA_DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and isinstance(dashboard["schemaVersion"], int)
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == datasource["uid"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert panel["targets"] and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == datasource["uid"], panel["title"]
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]


def grafana_metric_names() -> set[str]:
    dashboard = json.loads(GRAFANA_DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    names = {m for e in exprs for m in re.findall(r"\bpsflow_[a-z_]+\b", e)}
    assert names, "the dashboard queries no psflow metric"
    return names


def exposed_metric_names(text: str) -> set[str]:
    """Every series name a /metrics page can carry (histograms: _bucket, _sum, _count)."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names.add(name)
            if kind == "histogram":
                names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return names


@pytest.mark.slow
def test_grafana_queries_only_metrics_the_servers_expose(tmp_path):
    # The names come from real processes' /metrics pages, not from a list kept by hand.
    from tests.conftest import start_server

    ps = start_server(
        "ps_server",
        ["--port", "0", "--task", "ps:0", "--metrics-port", "auto"],
        "PSFLOW_READY ps",
        log_dir=tmp_path,
    )
    try:
        worker = start_server(
            "worker",
            [
                "--port",
                "0",
                "--task",
                "worker:0",
                "--ps",
                ps.address,
                "--workers",
                "1",
                "--metrics-port",
                "auto",
            ],
            "PSFLOW_READY worker",
            log_dir=tmp_path,
        )
        try:
            exposed = set()
            for server in (ps, worker):
                fields = dict(f.split("=", 1) for f in server.ready_line.split() if "=" in f)
                url = f"http://127.0.0.1:{fields['metrics_port']}/metrics"
                with urllib.request.urlopen(url, timeout=10) as reply:
                    exposed |= exposed_metric_names(reply.read().decode())
        finally:
            worker.reap()
    finally:
        ps.reap()
    missing = grafana_metric_names() - exposed - PROMQL_BUILTINS
    assert not missing, f"the Grafana dashboard queries metrics nobody exposes: {sorted(missing)}"

"""Mutual TLS between psflow processes, with certificates generated here (``openssl`` CLI).

One CA signs the cluster's certificate; another CA signs a rogue one.  A
client presenting the rogue certificate, a client without TLS, and a client
that does not trust the server's CA all get ``UnauthenticatedError`` (at once,
not after retrying to the deadline) and change nothing; the cluster's own
processes (chief, worker, PS) talk to each other over TLS.
"""

from __future__ import annotations

import shutil
import subprocess
import time

import numpy as np
import pytest

from psflow.cli import main as psflow_main
from psflow.distribute.coordinator.workers import GrpcWorker
from psflow.errors import UnauthenticatedError
from psflow.security.config import SecurityConfig
from psflow.transport.client import PSClient
from psflow.transport.embedding_client import EmbeddingClient
from tests.conftest import start_server

TLS_ENV = ("PSFLOW_TLS_CERT", "PSFLOW_TLS_KEY", "PSFLOW_TLS_CA", "PSFLOW_TLS_SERVER_NAME")
TOKEN_ENV = ("PSFLOW_AUTH_TOKEN", "PSFLOW_AUTH_TOKEN_FILE")


def _openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_pki(directory) -> dict[str, str]:
    """CA ``ca``/``other-ca``; ``node`` (signed by ca) and ``rogue`` (by other-ca): PEM paths."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to generate test certificates")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    ext = directory / "node.ext"
    ext.write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
        "extendedKeyUsage=serverAuth,clientAuth\n"
        "basicConstraints=CA:FALSE\n"
    )
    for ca in ("ca", "other-ca"):
        _openssl(
            "req", "-x509", *ec, "-keyout", f"{ca}.key", "-out", f"{ca}.pem",
            "-days", "2", "-subj", f"/CN=psflow test {ca}", cwd=directory,
        )  # fmt: skip
    for name, ca in (("node", "ca"), ("rogue", "other-ca")):
        _openssl(
            "req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}",
            cwd=directory,
        )  # fmt: skip
        _openssl(
            "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
            "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", "node.ext",
            cwd=directory,
        )  # fmt: skip
    return {p.stem + p.suffix: str(p) for p in directory.iterdir()}


def tls(pki, cert="node", ca="ca", token=None) -> SecurityConfig:
    """Client configuration presenting ``cert`` and trusting ``ca``."""
    return SecurityConfig.from_environment(
        {},
        token=token,
        tls_cert=pki[f"{cert}.pem"],
        tls_key=pki[f"{cert}.key"],
        tls_ca=pki[f"{ca}.pem"],
    )


def tls_env(pki, cert="node", ca="ca") -> dict[str, str]:
    return {
        "PSFLOW_TLS_CERT": pki[f"{cert}.pem"],
        "PSFLOW_TLS_KEY": pki[f"{cert}.key"],
        "PSFLOW_TLS_CA": pki[f"{ca}.pem"],
    }


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_cluster(pki, tmp_path_factory):
    """A PS (TLS from flags) and a worker (TLS from the environment), both mutual TLS."""
    log_dir = tmp_path_factory.mktemp("tls")
    started = []
    try:
        flags = ["--tls-cert", pki["node.pem"], "--tls-key", pki["node.key"]]
        ps = start_server(
            "ps_server",
            ["--port", "0", *flags, "--tls-ca", pki["ca.pem"]],
            "PSFLOW_READY ps",
            log_dir=log_dir,
        )
        started.append(ps)
        worker = start_server(
            "worker",
            ["--port", "0", "--ps", ps.address, "--workers", "1"],
            "PSFLOW_READY worker",
            log_dir=log_dir,
            env=tls_env(pki),
        )
        started.append(worker)
        with PSClient(ps.address, security=tls(pki), timeout=30) as client:
            client.create_variable("control", np.arange(3.0), optimizer={"name": "sgd"})
        yield ps, worker
    finally:
        for server in started:
            server.reap()


def _state(address, pki):
    with PSClient(address, security=tls(pki), timeout=30) as client:
        return client.pull("control").tolist(), client.stats()["pushes_applied"]


@pytest.mark.parametrize(
    "who, match",
    [
        ("rogue-cert", "does not accept it"),
        ("no-tls", "requires TLS"),
        ("untrusted-server", "server's certificate is not accepted"),
    ],
)
def test_ps_rejects_clients_outside_the_ca_at_once(tls_cluster, pki, who, match):
    ps, _ = tls_cluster
    security = {
        "rogue-cert": lambda: tls(pki, cert="rogue"),
        "no-tls": SecurityConfig,
        "untrusted-server": lambda: tls(pki, cert="rogue", ca="other-ca"),
    }[who]()
    before = _state(ps.address, pki)
    with PSClient(ps.address, security=security, timeout=20) as client:
        for call in (
            lambda: client.push({"control": np.ones(3)}),
            lambda: client.assign("control", np.zeros(3)),
            lambda: client.pull("control"),
        ):
            start = time.monotonic()
            with pytest.raises(UnauthenticatedError, match=match) as info:
                call()
            assert time.monotonic() - start < 10, "retried until the deadline"
            assert info.value.task == "ps:0"
    # the table client stands on the same client core: the same error, at once
    with EmbeddingClient([ps.address], security=security, timeout=20) as tables:
        start = time.monotonic()
        with pytest.raises(UnauthenticatedError, match=match) as info:
            tables.lookup("control", np.arange(3))
        assert time.monotonic() - start < 10, "retried until the deadline"
        assert info.value.task == "ps:0"
    assert _state(ps.address, pki) == before


def test_worker_rejects_a_rogue_certificate(tls_cluster, pki):
    _, worker = tls_cluster
    rogue = GrpcWorker(0, worker.address, security=tls(pki, cert="rogue"))
    try:
        with pytest.raises(UnauthenticatedError, match="does not accept it"):
            rogue.status()
    finally:
        rogue.close()
    good = GrpcWorker(0, worker.address, security=tls(pki))
    try:
        assert good.status().task == "worker:0"
    finally:
        good.close()


def test_health_over_mutual_tls(tls_cluster, pki, monkeypatch, capsys):
    ps, worker = tls_cluster
    for key in TLS_ENV + TOKEN_ENV:
        monkeypatch.delenv(key, raising=False)
    assert psflow_main(["health", ps.address, "--timeout", "10"]) == 1
    assert capsys.readouterr().out.strip() == "UNAUTHENTICATED"
    for key, value in tls_env(pki).items():
        monkeypatch.setenv(key, value)
    for server in (ps, worker):
        assert psflow_main(["health", server.address, "--timeout", "10"]) == 0


def test_chief_worker_and_ps_train_over_mutual_tls(tls_cluster, pki, monkeypatch):
    """The chief's clients and the worker's PS connection all use the environment's TLS."""
    import psflow as pf
    from psflow.distribute.cluster_resolver import ClusterSpec, SimpleClusterResolver
    from psflow.distribute.coordinator.cluster_coordinator import shutdown_all

    ps, worker = tls_cluster
    for key, value in tls_env(pki).items():
        monkeypatch.setenv(key, value)
    spec = ClusterSpec({"ps": [ps.address], "worker": [worker.address], "chief": ["127.0.0.1:1"]})
    resolver = SimpleClusterResolver(spec, task_type="chief", task_id=0)
    try:
        strategy = pf.distribute.ParameterServerStrategy(resolver)
        coordinator = pf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            counter = pf.Variable([0], name="tls_counter")

        def bump():
            counter.assign_add([2])
            return 1

        results = [coordinator.schedule(bump) for _ in range(3)]
        coordinator.join()
        assert [r.fetch() for r in results] == [1, 1, 1]
        assert int(counter.numpy()[0]) == 6
    finally:
        shutdown_all()


def test_token_and_tls_together(pki, tmp_path):
    """With both, a client needs both: a good certificate without the token is refused."""
    token = "tls-and-token-0123456789"
    server = start_server(
        "ps_server",
        ["--port", "0"],
        "PSFLOW_READY ps",
        log_dir=tmp_path,
        env={**tls_env(pki), "PSFLOW_AUTH_TOKEN": token},
    )
    try:
        with PSClient(server.address, security=tls(pki), timeout=20) as client:
            with pytest.raises(UnauthenticatedError, match="authorization"):
                client.list_variables()
            assert client.health() == "SERVING"
        with PSClient(server.address, security=tls(pki, token=token), timeout=20) as client:
            assert client.list_variables() == []
        plain = SecurityConfig(token=token)
        with (
            PSClient(server.address, security=plain, timeout=20) as client,
            pytest.raises(UnauthenticatedError, match="requires TLS"),
        ):
            client.list_variables()
    finally:
        server.reap()

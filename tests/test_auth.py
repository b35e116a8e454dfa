"""Token authentication on the PS and the worker: real processes on 127.0.0.1.

A caller without the token, or with a wrong one, gets UNAUTHENTICATED from
every method and changes nothing; the health service answers without a token;
a server bound beyond loopback without authentication refuses to start; and
``psflow local`` gives its cluster a token that its own processes use.
"""

from __future__ import annotations

import doctest
import importlib
import json
import subprocess
import sys

import grpc
import numpy as np
import pytest

from psflow.cli import main as psflow_main
from psflow.distribute.coordinator.workers import GrpcWorker
from psflow.errors import FailedPreconditionError, InvalidArgumentError, UnauthenticatedError
from psflow.proto import ps_pb2, worker_pb2
from psflow.security.config import (
    ENV_TOKEN,
    ENV_TOKEN_FILE,
    SecurityConfig,
    check_bind,
    default_security,
    is_loopback,
    with_generated_token,
)
from psflow.security.grpc_auth import AuthInterceptor
from psflow.transport import framing
from psflow.transport.client import PSClient
from psflow.transport.service import METHODS, method_path
from tests.conftest import ROOT, child_env, start_server

TOKEN = "test-token-" + "0123456789abcdef"
GOOD = SecurityConfig(token=TOKEN)
NO_AUTH_ENV = {ENV_TOKEN: "", ENV_TOKEN_FILE: ""}


# -- configuration ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "module", ["psflow.security.config", "psflow.security.probe", "psflow.security.flags"]
)
def test_security_doctests(module):
    result = doctest.testmod(importlib.import_module(module))
    assert result.failed == 0 and result.attempted > 0


def test_explicit_token_file_wins_over_the_environment(tmp_path):
    path = tmp_path / "token"
    path.write_text("from-the-file-0123456789\n")
    env = {ENV_TOKEN: "from-the-environment-0123"}
    assert SecurityConfig.from_environment(env).token == "from-the-environment-0123"
    explicit = SecurityConfig.from_environment(env, token_file=str(path))
    assert explicit.token == "from-the-file-0123456789"  # newline stripped
    assert SecurityConfig.from_environment({ENV_TOKEN_FILE: str(path)}).token == explicit.token
    assert SecurityConfig.from_environment({}).authenticated is False


@pytest.mark.parametrize(
    "env, kwargs, match",
    [
        ({ENV_TOKEN: "short"}, {}, "5 characters; at least 16"),
        ({ENV_TOKEN: "has space in the token 123"}, {}, "printable ASCII without spaces"),
        ({ENV_TOKEN: "a" * 20, ENV_TOKEN_FILE: "/x"}, {}, "both PSFLOW_AUTH_TOKEN and"),
        ({}, {"token_file": "/nonexistent/token"}, "'/nonexistent/token' cannot be read"),
        ({"PSFLOW_TLS_CERT": "/c.pem"}, {}, "without PSFLOW_TLS_KEY, PSFLOW_TLS_CA"),
        ({}, {"tls_cert": "/c", "tls_ca": "/a"}, "without --tls-key"),
    ],
)
def test_bad_configuration_names_the_setting(env, kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        SecurityConfig.from_environment(env, **kwargs)


def test_the_token_never_appears_in_repr_or_errors(tmp_path):
    config = SecurityConfig.from_environment({ENV_TOKEN: TOKEN})
    assert TOKEN not in repr(config) and "PSFLOW_AUTH_TOKEN" in repr(config)
    path = tmp_path / "t"
    path.write_text("secret with spaces 0123456789")
    with pytest.raises(InvalidArgumentError) as info:
        SecurityConfig.from_environment({}, token_file=str(path))
    assert "secret" not in str(info.value) and str(path) in str(info.value)


def test_default_security_is_parsed_once_per_environment():
    a = default_security({ENV_TOKEN: TOKEN})
    assert default_security({ENV_TOKEN: TOKEN}) is a
    assert default_security({}) is not a and not default_security({}).authenticated


def test_generated_tokens_are_fresh_and_respect_existing_settings():
    a, b = with_generated_token({}), with_generated_token({"X": "1"})
    assert a[ENV_TOKEN] != b[ENV_TOKEN] and b["X"] == "1"
    SecurityConfig.from_environment(a)  # valid
    assert ENV_TOKEN not in with_generated_token({ENV_TOKEN_FILE: "/run/token"})


def test_bind_check_refuses_public_addresses_without_auth():
    for host in ("127.0.0.1", "127.5.0.1", "::1", "[::1]", "localhost"):
        assert is_loopback(host)
        check_bind(host, SecurityConfig())
    for host in ("0.0.0.0", "::", "10.1.2.3", "ps-0.svc"):
        assert not is_loopback(host)
        with pytest.raises(FailedPreconditionError, match="--insecure"):
            check_bind(host, SecurityConfig())
        check_bind(host, GOOD)
        check_bind(host, SecurityConfig(), insecure=True)


def test_interceptor_compares_the_whole_value():
    interceptor = AuthInterceptor(TOKEN)
    assert interceptor._authorized([("authorization", f"Bearer {TOKEN}")])[0]
    for metadata in (
        [],
        [("authorization", TOKEN)],
        [("authorization", f"Bearer {TOKEN}x")],
        [("authorization", f"bearer {TOKEN}")],
        [("authorization", f"Bearer {TOKEN[:-1]}")],
        [("authorization", f"Bearer {TOKEN}"), ("authorization", "Bearer other-token-000000")],
        [("x-authorization", f"Bearer {TOKEN}")],
    ):
        assert not interceptor._authorized(metadata)[0], metadata


# -- a live PS and worker with a token ------------------------------------------------------
@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    """A PS and a worker requiring TOKEN (both started with it in their environment)."""
    log_dir = tmp_path_factory.mktemp("auth")
    env = {ENV_TOKEN: TOKEN}
    started = []
    try:
        ps = start_server("ps_server", ["--port", "0"], "PSFLOW_READY ps", log_dir=log_dir, env=env)
        started.append(ps)
        worker = start_server(
            "worker",
            ["--port", "0", "--ps", ps.address, "--workers", "1"],
            "PSFLOW_READY worker",
            log_dir=log_dir,
            env=env,
        )
        started.append(worker)
        with PSClient(ps.address, security=GOOD, timeout=30) as client:
            client.create_variable("control", np.arange(4.0), optimizer={"name": "sgd"})
        yield ps, worker
    finally:
        for server in started:
            server.reap()


def _ps_state(address):
    with PSClient(address, security=GOOD, timeout=30) as client:
        stats = client.stats()
        return (
            client.pull("control").tolist(),
            [(v.name, v.version) for v in client.list_variables()],
            stats["pushes_applied"],
        )


BAD_CLIENTS = {
    "no-token": SecurityConfig(),
    "wrong-token": SecurityConfig(token="wrong-token-0123456789abcdef"),
    "token-prefix": SecurityConfig(token=TOKEN[:-1] + "X"),
}


@pytest.mark.parametrize("who", sorted(BAD_CLIENTS))
def test_ps_rejects_calls_without_the_token_and_changes_nothing(secured, who):
    ps, _ = secured
    before = _ps_state(ps.address)
    with PSClient(ps.address, security=BAD_CLIENTS[who], timeout=10) as client:
        calls = [
            lambda: client.push({"control": np.ones(4)}),
            lambda: client.assign("control", np.zeros(4)),
            lambda: client.assign_add("control", np.ones(4)),
            lambda: client.create_variable("intruder", np.zeros(2)),
            lambda: client.configure_optimizer(["control"], {"name": "adam"}),
            lambda: client.pull("control"),
            lambda: client.pull_rows("control", [1]),
            lambda: client.push({"control": np.ones(3 << 18)}),  # streamed
            lambda: client.list_variables(),
            lambda: client.stats(),
            lambda: client.save("/tmp/should-not-exist"),
            lambda: client.restore("/tmp/should-not-exist"),
        ]
        for call in calls:
            with pytest.raises(UnauthenticatedError, match="authorization") as info:
                call()
            assert info.value.task == "ps:0"
        assert client.health() == "SERVING"  # probes need no token
    assert _ps_state(ps.address) == before


def test_every_raw_method_and_unknown_ones_are_unauthenticated(secured):
    ps, _ = secured
    header = ps_pb2.PushHeader(items=[ps_pb2.PushItem(name="control", base_version=-1)])
    header.id.client_id, header.id.sequence = "raw", 1
    header.items[0].values.dtype, header.items[0].values.shape[:] = 3, [4]
    push = framing.encode_message(header.SerializeToString(), [np.ones(4).tobytes()])
    before = _ps_state(ps.address)
    with grpc.insecure_channel(ps.address) as channel:
        for name, (kind, *_rest) in METHODS.items():
            call = getattr(channel, kind.value)(method_path(name))
            request = push if name in ("Push", "PushStream", "Write", "WriteStream") else b""
            if kind.value.startswith("stream"):
                request = iter([request])
            with pytest.raises(grpc.RpcError) as info:
                result = call(request, timeout=10)
                list(result) if kind.value == "unary_stream" else None
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
        for path in ("/psflow.v1.ParameterServer/Nope", "/other.Service/Call"):
            with pytest.raises(grpc.RpcError) as info:
                channel.unary_unary(path)(b"", timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, path
        reflection = channel.stream_stream(
            "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
        )
        with pytest.raises(grpc.RpcError) as info:
            list(reflection(iter([b""]), timeout=10))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert _ps_state(ps.address) == before


def test_health_answers_without_a_token(secured, monkeypatch):
    for key in NO_AUTH_ENV:
        monkeypatch.delenv(key, raising=False)
    for server in secured:
        assert psflow_main(["health", server.address, "--timeout", "10"]) == 0


def test_worker_rejects_calls_without_the_token(secured):
    ps, worker = secured
    before = _ps_state(ps.address)

    def push_to_control(address=ps.address, token=TOKEN):  # changes the control if it runs
        import numpy as np

        from psflow.security.config import SecurityConfig
        from psflow.transport.client import PSClient

        with PSClient(address, security=SecurityConfig(token=token), timeout=10) as c:
            c.push({"control": np.ones(4)})

    import cloudpickle

    request = worker_pb2.RunClosureRequest(
        session_id="intruder",
        closure_id=1,
        function_key="once-push",
        function=cloudpickle.dumps(push_to_control),
    )
    for who, security in BAD_CLIENTS.items():
        client = GrpcWorker(0, worker.address, security=security)
        try:
            with pytest.raises(UnauthenticatedError, match="authorization"):
                client.status()
            with pytest.raises(UnauthenticatedError):
                client._call(client._stub.RunClosure, request, 10)
            assert not client.healthy(), who
        finally:
            client.close()
    assert _ps_state(ps.address) == before
    good = GrpcWorker(0, worker.address, security=GOOD)
    try:
        status = good.status()
        assert status.task == "worker:0" and "intruder" not in status.session_ids
    finally:
        good.close()


def test_clients_take_the_token_from_the_environment(secured, monkeypatch):
    ps, worker = secured
    monkeypatch.setenv(ENV_TOKEN, TOKEN)
    monkeypatch.delenv(ENV_TOKEN_FILE, raising=False)
    with PSClient(ps.address, timeout=10) as client:
        assert client.pull("control").shape == (4,)
    w = GrpcWorker(0, worker.address)
    try:
        assert w.healthy()
    finally:
        w.close()
    # An explicit configuration wins over the environment.
    with (
        PSClient(ps.address, security=SecurityConfig(), timeout=10) as client,
        pytest.raises(UnauthenticatedError),
    ):
        client.pull("control")


# -- refusing public binds ------------------------------------------------------------------
@pytest.mark.parametrize("module", ["ps_server", "worker"])
def test_public_bind_without_auth_refuses_to_start(module):
    args = [sys.executable, "-m", module, "--bind", "0.0.0.0", "--port", "0"]
    if module == "worker":
        args += ["--ps", "127.0.0.1:1", "--workers", "1"]
    env = child_env()
    for key in (*NO_AUTH_ENV, "PSFLOW_TLS_CERT", "PSFLOW_TLS_KEY", "PSFLOW_TLS_CA"):
        env.pop(key, None)
    run = subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert run.returncode == 2, run.stderr
    assert "--insecure" in run.stderr and "'0.0.0.0'" in run.stderr
    assert "PSFLOW_READY" not in run.stdout


@pytest.mark.parametrize("extra, env", [(["--insecure"], {}), ([], {ENV_TOKEN: TOKEN})])
def test_public_bind_starts_with_insecure_or_a_token(tmp_path, extra, env):
    # Bound to 0.0.0.0, reached only through loopback.
    server = start_server(
        "ps_server",
        ["--bind", "0.0.0.0", "--port", "0", *extra],
        "PSFLOW_READY ps",
        log_dir=tmp_path,
        env=env,
    )
    try:
        assert psflow_main(["health", server.address, "--timeout", "10"]) == 0
        assert server.stop() == 0
    finally:
        server.reap()


# -- psflow local ---------------------------------------------------------------------------
CHIEF = """
import json, os
import psflow as pf
from psflow.errors import UnauthenticatedError
from psflow.security.config import SecurityConfig
from psflow.transport.client import PSClient

cluster = json.loads(os.environ["TF_CONFIG"])["cluster"]
out = {"token_chars": len(os.environ.get("PSFLOW_AUTH_TOKEN", ""))}
with PSClient(cluster["ps"][0], security=SecurityConfig(), timeout=20) as anonymous:
    try:
        anonymous.list_variables()
        out["anonymous"] = "accepted"
    except UnauthenticatedError:
        out["anonymous"] = "UNAUTHENTICATED"
strategy = pf.distribute.ParameterServerStrategy()
coordinator = pf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
with strategy.scope():
    counter = pf.Variable([0], name="auth_counter")

def bump():
    counter.assign_add([1])
    return int(os.environ.get("PSFLOW_AUTH_TOKEN") is not None)

results = [coordinator.schedule(bump) for _ in range(3)]
coordinator.join()
out["worker_had_token"] = [r.fetch() for r in results]
out["counter"] = int(counter.numpy()[0])
with open(os.environ["AUTH_TEST_TOKEN_FILE"], "w") as f:  # for the test, not the log
    f.write(os.environ["PSFLOW_AUTH_TOKEN"])
print("AUTH_CHECK " + json.dumps(out), flush=True)
"""


@pytest.mark.slow
def test_psflow_local_runs_its_cluster_with_a_generated_token(tmp_path):
    script = tmp_path / "chief_auth.py"
    script.write_text(CHIEF)
    token_file = tmp_path / "seen-token"
    env = child_env({"AUTH_TEST_TOKEN_FILE": str(token_file)})
    for key in (*NO_AUTH_ENV, "PSFLOW_TLS_CERT", "PSFLOW_TLS_KEY", "PSFLOW_TLS_CA", "TF_CONFIG"):
        env.pop(key, None)
    run = subprocess.run(
        [sys.executable, "-m", "chief.local", "--ps", "1", "--workers", "1", str(script)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=180,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    line = next(x for x in run.stdout.splitlines() if "AUTH_CHECK " in x)
    result = json.loads(line.split("AUTH_CHECK ", 1)[1])
    assert result == {
        "token_chars": 43,
        "anonymous": "UNAUTHENTICATED",
        "worker_had_token": [1, 1, 1],
        "counter": 3,
    }
    token = token_file.read_text()
    assert len(token) == 43 and token not in run.stdout + run.stderr  # never logged

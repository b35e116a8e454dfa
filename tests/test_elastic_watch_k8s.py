"""``KubernetesClusterResolver.refresh`` against a Kubernetes API answered by a real HTTP server.

The server (``http.server`` on 127.0.0.1, port 0, in a thread) answers the two
GETs the resolver makes - the StatefulSet and its pods - from a state the test
changes as ``kubectl scale`` and the kubelet would: replicas first, pods ready
later, pods of a scale-down still running.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
import urllib.parse

import pytest

from psflow.distribute.cluster_resolver import KubernetesClusterResolver, RefreshableResolver
from psflow.distribute.cluster_resolver.kubernetes_api import KubernetesApi
from psflow.errors import (
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    UnavailableError,
)

LABELS = {"app.kubernetes.io/name": "psflow", "app.kubernetes.io/component": "ps"}
TOKEN = "test-token-1234"


class FakeCluster:
    """What the API server knows: replicas of psflow-ps and which of its pods are ready."""

    def __init__(self, replicas: int, ready: list[int]) -> None:
        self.replicas = replicas
        self.ready = set(ready)
        self.running = set(ready)
        self.requests: list[str] = []
        self.lock = threading.Lock()

    def answer(self, path: str, token: str | None) -> tuple[int, object]:
        self.requests.append(path)
        if token != f"Bearer {TOKEN}":
            return 403, {"kind": "Status", "code": 403}
        url = urllib.parse.urlsplit(path)
        with self.lock:
            if url.path == "/apis/apps/v1/namespaces/ml/statefulsets/psflow-ps":
                return 200, {
                    "spec": {"replicas": self.replicas, "selector": {"matchLabels": LABELS}}
                }
            if url.path == "/api/v1/namespaces/ml/pods":
                selector = urllib.parse.parse_qs(url.query)["labelSelector"][0]
                assert dict(kv.split("=") for kv in selector.split(",")) == LABELS
                items = [
                    {
                        "metadata": {"name": f"psflow-ps-{i}"},
                        "status": {
                            "conditions": [{"type": "Ready", "status": str(i in self.ready)}]
                        },
                    }
                    for i in sorted(self.running)
                ]
                return 200, {"items": items}
        return 404, {"kind": "Status", "code": 404}


@pytest.fixture
def api_server():
    cluster = FakeCluster(2, [0, 1])

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            code, body = cluster.answer(self.path, self.headers.get("Authorization"))
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield cluster, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def _resolver(url: str, token: str = TOKEN) -> KubernetesClusterResolver:
    return KubernetesClusterResolver(
        {"chief": 1, "ps": 2, "worker": 2},
        service={"chief": "psflow-chief", "ps": "psflow-ps", "worker": "psflow-worker"},
        namespace="ml",
        statefulsets={"chief": "psflow-chief", "ps": "psflow-ps", "worker": "psflow-worker"},
        hostname="psflow-chief-0",
        api=KubernetesApi(url, namespace="ml", token=token, timeout=5.0),
    )


def test_refresh_follows_kubectl_scale_up_once_pods_are_ready_and_down_at_once(api_server):
    cluster, url = api_server
    resolver = _resolver(url)
    assert isinstance(resolver, RefreshableResolver)
    assert resolver.refresh().num_tasks("ps") == 2

    cluster.replicas = 3  # kubectl scale --replicas=3: the pod exists but is not ready yet
    cluster.running.add(2)
    assert resolver.refresh().num_tasks("ps") == 2
    cluster.ready.add(2)
    spec = resolver.refresh()
    assert spec.num_tasks("ps") == 3
    assert spec.task_address("ps", 2) == "psflow-ps-2.psflow-ps.ml.svc:2222"
    assert resolver.cluster_spec() is spec  # cluster_spec() is the last refresh's view
    assert spec.num_tasks("worker") == 2  # only the elastic job is re-read

    cluster.replicas = 1  # scale down: the removed pods still run (preStop) until drained
    assert resolver.refresh().num_tasks("ps") == 1

    cluster.ready.discard(0)  # ps-0 not ready: a hole at the front -> keep the last view
    assert resolver.refresh().num_tasks("ps") == 1


def test_refresh_errors_are_typed_and_keep_the_view(api_server):
    _, url = api_server
    denied = _resolver(url, token="wrong")
    with pytest.raises(PermissionDeniedError, match="statefulsets"):
        denied.refresh()
    assert denied.cluster_spec().num_tasks("ps") == 2

    missing = KubernetesClusterResolver(
        {"chief": 1, "ps": 2, "worker": 1},
        hostname="chief-0",
        api=KubernetesApi(url, namespace="ml", token=TOKEN),
    )
    with pytest.raises(NotFoundError, match="statefulsets/ps"):
        missing.refresh()

    with socket_closed() as dead_url:
        gone = _resolver(dead_url)
        with pytest.raises(UnavailableError, match="unreachable"):
            gone.refresh()
        assert gone.cluster_spec().num_tasks("ps") == 2


@contextlib.contextmanager
def socket_closed():
    """A URL on 127.0.0.1 where nothing listens."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    yield f"http://127.0.0.1:{port}"


def test_bad_api_settings_are_named():
    with pytest.raises(InvalidArgumentError, match="ftp://x"):
        KubernetesApi("ftp://x", namespace="ml")
    with pytest.raises(InvalidArgumentError, match="timeout 0"):
        KubernetesApi("https://k:443", namespace="ml", timeout=0)
    with pytest.raises(InvalidArgumentError, match="elastic_jobs"):
        KubernetesClusterResolver(
            {"ps": 1, "worker": 1}, hostname="ps-0", elastic_jobs=("evaluator",)
        )
    with pytest.raises(NotFoundError, match="not in a pod"):
        KubernetesApi.in_cluster(environ={})
    assert TOKEN not in repr(KubernetesApi("https://k:443", namespace="ml", token=TOKEN))


def test_the_watch_follows_kubectl_scale_through_the_api(api_server):
    import numpy as np

    import psflow as pf
    from psflow.distribute.coordinator.elastic_watch import ClusterWatch

    cluster, url = api_server
    strategy = pf.distribute.ParameterServerStrategy()  # in-process PS tasks resize alike
    with strategy.scope():
        v = pf.Variable(np.arange(12.0, dtype="float32"), name="v")
    watch = ClusterWatch(strategy, _resolver(url), interval=0.05)
    assert watch.poll().new_num_ps == 2  # the set lists 2, the embedded job ran on 1
    cluster.replicas, cluster.running, cluster.ready = 3, {0, 1, 2}, {0, 1}
    assert watch.poll() is None  # psflow-ps-2 not ready yet
    cluster.ready.add(2)
    assert watch.poll().new_num_ps == 3
    cluster.replicas = 1
    assert (watch.poll().old_num_ps, watch.num_ps) == (3, 1)
    assert watch.poll() is None and len(watch.reports) == 3
    np.testing.assert_array_equal(v.numpy(), np.arange(12.0, dtype="float32"))

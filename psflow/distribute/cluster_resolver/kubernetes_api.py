"""``KubernetesApi``: how many pods of a StatefulSet are up, asked of the Kubernetes API.

The one question an elastic job asks Kubernetes: after ``kubectl scale
statefulset/psflow-ps --replicas=K``, how many parameter servers should the job
run on?  The answer (:meth:`KubernetesApi.ready_replicas`) is the StatefulSet's
``spec.replicas`` when scaling down (the pods being removed still run - a
``preStop`` hook keeps them until they are drained, see ``docker/README.md``),
and, when scaling up, only as many as form a ready prefix ``<set>-0 ..
<set>-(n-1)``: a task is used once its pod passes its readiness probe.

Plain HTTPS GETs with the pod's service-account token (``urllib``; no client
library): ``/apis/apps/v1/namespaces/NS/statefulsets/NAME`` and
``/api/v1/namespaces/NS/pods?labelSelector=...``.  The chief needs a Role that
may ``get`` statefulsets and ``list`` pods (``docker/k8s/elastic-rbac.yaml``).

Example (in a pod)::

    api = KubernetesApi.in_cluster()
    api.ready_replicas("psflow-ps")
"""

from __future__ import annotations

import dataclasses
import json
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import Any

from psflow.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    UnavailableError,
)

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
"""Where Kubernetes mounts a pod's service-account token, CA and namespace."""

MAX_RESPONSE_BYTES = 16 << 20


@dataclasses.dataclass(frozen=True, repr=False)
class KubernetesApi:
    """A read-only view of the Kubernetes API: StatefulSets and their pods.

    Attributes:
        base_url: ``https://HOST:PORT`` of the API server (``http://`` for tests).
        namespace: where the StatefulSets are.
        token: the bearer token (kept out of ``repr``), or None.
        ca_file: the CA bundle that signs the API server's certificate, or None.
        timeout: seconds each request may take.

    Raises:
        InvalidArgumentError: a bad URL, namespace or timeout (naming it).
    """

    base_url: str
    namespace: str
    token: str | None = None
    ca_file: str | None = None
    timeout: float = 5.0

    def __post_init__(self) -> None:
        url = urllib.parse.urlsplit(self.base_url)
        if url.scheme not in ("http", "https") or not url.netloc:
            raise InvalidArgumentError(
                f"Kubernetes API URL {self.base_url!r} must be http(s)://HOST:PORT"
            )
        if not isinstance(self.namespace, str) or not self.namespace:
            raise InvalidArgumentError(f"namespace {self.namespace!r} must be a non-empty string")
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)):
            raise InvalidArgumentError(f"timeout {self.timeout!r} must be a number of seconds")
        if not self.timeout > 0:
            raise InvalidArgumentError(f"timeout {self.timeout!r} must be > 0 seconds")

    def __repr__(self) -> str:
        return f"KubernetesApi({self.base_url!r}, namespace={self.namespace!r})"

    @classmethod
    def in_cluster(
        cls,
        environ: Mapping[str, str] | None = None,
        account_dir: str = SERVICE_ACCOUNT_DIR,
        timeout: float = 5.0,
    ) -> KubernetesApi:
        """The API as seen from a pod: ``KUBERNETES_SERVICE_HOST``/``_PORT`` and the account files.

        Raises:
            NotFoundError: not in a pod (no such variables or files).
        """
        env = os.environ if environ is None else environ
        host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")
        if not host or not port:
            raise NotFoundError(
                "KUBERNETES_SERVICE_HOST/KUBERNETES_SERVICE_PORT are not set: not in a pod"
            )
        host = f"[{host}]" if ":" in host else host

        def read(name: str) -> str:
            try:
                with open(os.path.join(account_dir, name), encoding="utf-8") as f:
                    return f.read().strip()
            except OSError as e:
                raise NotFoundError(f"service account file {name!r} cannot be read: {e}") from None

        return cls(
            f"https://{host}:{port}",
            namespace=read("namespace"),
            token=read("token"),
            ca_file=os.path.join(account_dir, "ca.crt"),
            timeout=timeout,
        )

    def _get(self, path: str) -> Any:
        request = urllib.request.Request(self.base_url.rstrip("/") + path)
        request.add_header("Accept", "application/json")
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        context = None
        if self.base_url.startswith("https"):
            context = ssl.create_default_context(cafile=self.ca_file)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout, context=context) as reply:
                body = reply.read(MAX_RESPONSE_BYTES + 1)
        except urllib.error.HTTPError as e:
            if e.code == 404:
                raise NotFoundError(f"Kubernetes API: {path} not found") from None
            if e.code in (401, 403):
                raise PermissionDeniedError(
                    f"Kubernetes API refused {path} ({e.code}): the chief's service account "
                    "needs get on statefulsets and list on pods"
                ) from None
            raise UnavailableError(f"Kubernetes API: {path} answered {e.code}") from None
        except TimeoutError:
            raise DeadlineExceededError(
                f"Kubernetes API: {path} took more than {self.timeout:g}s"
            ) from None
        except (urllib.error.URLError, OSError) as e:
            raise UnavailableError(f"Kubernetes API at {self.base_url} unreachable: {e}") from None
        if len(body) > MAX_RESPONSE_BYTES:
            raise UnavailableError(f"Kubernetes API: {path} answered more than 16 MiB")
        try:
            return json.loads(body)
        except ValueError:
            raise UnavailableError(f"Kubernetes API: {path} did not answer JSON") from None

    def ready_replicas(self, statefulset: str) -> int:
        """The tasks of ``statefulset`` a job should use now (see the module docstring).

        Raises:
            NotFoundError: no such StatefulSet.
            PermissionDeniedError: the token may not read it.
            UnavailableError, DeadlineExceededError: the API did not answer.
        """
        ns = urllib.parse.quote(self.namespace, safe="")
        name = urllib.parse.quote(statefulset, safe="")
        sts = self._get(f"/apis/apps/v1/namespaces/{ns}/statefulsets/{name}")
        spec = sts.get("spec") or {}
        wanted = spec.get("replicas", 1)
        labels = (spec.get("selector") or {}).get("matchLabels") or {}
        if isinstance(wanted, bool) or not isinstance(wanted, int) or wanted < 0 or not labels:
            raise UnavailableError(
                f"StatefulSet {statefulset!r} has no usable spec.replicas/selector: {spec!r}"
            )
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        query = urllib.parse.urlencode({"labelSelector": selector})
        pods = self._get(f"/api/v1/namespaces/{ns}/pods?{query}")
        ready = {
            (pod.get("metadata") or {}).get("name")
            for pod in pods.get("items") or []
            if _is_ready(pod)
        }
        prefix = 0
        while prefix < wanted and f"{statefulset}-{prefix}" in ready:
            prefix += 1
        # Down: the wanted count at once (the removed pods wait to be drained); up: ready ones.
        return prefix


def _is_ready(pod: Mapping[str, Any]) -> bool:
    """Whether a pod's ``Ready`` condition is ``True``."""
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)

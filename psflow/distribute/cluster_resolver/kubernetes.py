"""``KubernetesClusterResolver``: the cluster of StatefulSets behind headless Services.

psflow's own resolver (TF's talks to the Kubernetes API; this one needs no API
access, no credentials and no client library): every address follows from
Kubernetes' stable naming of StatefulSet pods.

The naming contract:

* each task type ``t`` of ``jobs`` runs as a StatefulSet named
  ``statefulsets[t]`` (default: ``t`` itself) with ``jobs[t]`` replicas, so its
  pods are ``<set>-0``, ``<set>-1``, ...;
* the set is governed by a headless Service (its ``serviceName``):
  ``service[t]`` when ``service`` is a mapping, ``service`` when it is one
  name shared by all sets, or the set's own name when ``None``;
* the pod ``<set>-<i>`` is then reachable as ``<set>-<i>.<service>`` from its
  own namespace, and as ``<set>-<i>.<service>.<namespace>.svc`` from anywhere
  when ``namespace`` is given; every task listens on ``port`` (or
  ``port[t]``);
* a pod's hostname is its name, ``<set>-<i>``, which tells this process its
  task type and index: ``hostname`` if given, else ``$HOSTNAME``, else
  ``socket.gethostname()`` (only the first DNS label counts).

Elastic jobs: given ``api`` (a
:class:`~psflow.distribute.cluster_resolver.kubernetes_api.KubernetesApi`),
:meth:`KubernetesClusterResolver.refresh` asks Kubernetes how many pods of each
set in ``elastic_jobs`` (``("ps",)`` by default) are up, and the cluster view
follows ``kubectl scale`` (see ``KubernetesApi.ready_replicas``); the chief's
``ClusterWatch`` then resizes.  ``cluster_spec()`` returns the view of the last
refresh; without ``api`` the view never changes.

Example:
    >>> resolver = KubernetesClusterResolver(
    ...     {"chief": 1, "ps": 2, "worker": 2}, service="mnist", namespace="ml",
    ...     statefulsets={"chief": "mnist-chief", "ps": "mnist-ps", "worker": "mnist-worker"},
    ...     hostname="mnist-worker-1")
    >>> resolver.task_type, resolver.task_id
    ('worker', 1)
    >>> resolver.cluster_spec().task_address("ps", 0)
    'mnist-ps-0.mnist.ml.svc:2222'
"""

from __future__ import annotations

import re
import socket
import threading
from collections.abc import Mapping
from typing import Protocol

from psflow import settings
from psflow.distribute.cluster_resolver.accelerators import GpuProbe
from psflow.distribute.cluster_resolver.base import (
    ClusterResolver,
    check_rpc_layer,
    check_task_id,
    check_task_type,
)
from psflow.distribute.cluster_resolver.cluster_spec import ClusterSpec, TaskNotFoundError
from psflow.distribute.cluster_resolver.validation import validate_task
from psflow.errors import InvalidArgumentError


class ReplicaCounter(Protocol):
    """Counts the pods of a StatefulSet a job should use (``KubernetesApi``)."""

    def ready_replicas(self, statefulset: str) -> int:
        """The tasks of ``statefulset`` to use now."""
        ...


_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_MAX_LABEL = 63
_POD_NAME = re.compile(r"(?P<set>.+)-(?P<ordinal>0|[1-9][0-9]*)")


def _check_label(value: object, what: str) -> str:
    if not isinstance(value, str) or len(value) > _MAX_LABEL or not _DNS_LABEL.fullmatch(value):
        raise InvalidArgumentError(
            f"{what} {value!r} must be a DNS label: at most {_MAX_LABEL} lowercase letters, "
            "digits and '-', starting and ending with a letter or digit"
        )
    return value


def _per_job(value: object, jobs: Mapping[str, int], what: str) -> dict[str, object] | None:
    """Returns ``value`` as job -> item when it is a mapping (keys must be the jobs)."""
    if not isinstance(value, Mapping):
        return None
    missing = [job for job in jobs if job not in value]
    extra = [key for key in value if key not in jobs]
    if missing or extra:
        raise InvalidArgumentError(
            f"{what} {dict(value)!r} must name exactly the jobs {list(jobs)}"
            + (f"; missing {missing}" if missing else "")
            + (f"; unknown {extra}" if extra else "")
        )
    return dict(value)


def _check_port(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise InvalidArgumentError(f"{what} {value!r} must be an integer port in 1..65535")
    return value


class KubernetesClusterResolver(ClusterResolver):
    """The cluster of StatefulSet pods, by Kubernetes' naming alone (see the module docstring).

    Args:
        jobs: task type -> replicas of its StatefulSet (in cluster order).
        service: the headless Service of every set (one name), of each set
            (task type -> name), or ``None`` for each set's own name.
        namespace: the pods' namespace; when given, addresses are the
            cluster-wide ``<pod>.<service>.<namespace>.svc``.
        port: every task's port, or task type -> port.
        hostname: this pod's name (default ``$HOSTNAME``, then
            ``socket.gethostname()``).
        statefulsets: task type -> StatefulSet name (default: the task type).
        task_type: this process's job, instead of parsing the hostname.
        task_id: this process's index, instead of parsing the hostname.
        rpc_layer: the protocol prefix ``master()`` adds.
        environ: where to read ``HOSTNAME``; the process environment (:func:`psflow.settings.environ`) by default.
        gpu_probe: counts this machine's GPUs for ``num_accelerators``.
        api: asked by :meth:`refresh` for the pods that are up (anything with
            ``ready_replicas(statefulset) -> int``), or None for a fixed view.
        elastic_jobs: the task types whose count :meth:`refresh` re-reads
            (default: ``("ps",)`` when there is a ``ps`` job).

    Raises:
        InvalidArgumentError: a name is not a DNS label, a count or port is
            invalid, a mapping does not name exactly the jobs, two task types
            share a StatefulSet, or only one of ``task_type``/``task_id`` is
            given.
        TaskNotFoundError: the hostname is not ``<set>-<ordinal>`` of one of
            the sets, or its ordinal is not below the set's replicas (or the
            explicit task is not in the cluster).
    """

    def __init__(
        self,
        jobs: Mapping[str, int],
        service: Mapping[str, str] | str | None = None,
        namespace: str | None = None,
        port: int | Mapping[str, int] = 2222,
        hostname: str | None = None,
        *,
        statefulsets: Mapping[str, str] | None = None,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = "grpc",
        environ: Mapping[str, str] | None = None,
        gpu_probe: GpuProbe | None = None,
        api: ReplicaCounter | None = None,
        elastic_jobs: tuple[str, ...] | None = None,
    ) -> None:
        if not isinstance(jobs, Mapping) or not jobs:
            raise InvalidArgumentError(
                f"jobs {jobs!r} must be a non-empty mapping of task type to replicas"
            )
        replicas: dict[str, int] = {}
        for job in ClusterSpec({job: [] for job in jobs}).jobs:  # validates the names
            count = jobs[job]
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise InvalidArgumentError(f"replicas of {job!r} ({count!r}) must be an int >= 0")
            replicas[job] = count

        set_map = _per_job(statefulsets, replicas, "statefulsets")
        if statefulsets is not None and set_map is None:
            raise InvalidArgumentError(
                f"statefulsets {statefulsets!r} must map each task type to a StatefulSet name"
            )
        sets = {job: (set_map[job] if set_map else job) for job in replicas}
        for job, name in sets.items():
            _check_label(name, f"StatefulSet name of {job!r}")
            if replicas[job] and len(f"{name}-{replicas[job] - 1}") > _MAX_LABEL:
                raise InvalidArgumentError(
                    f"pod names of StatefulSet {name!r} would exceed {_MAX_LABEL} characters"
                )
        shared = [name for name in set(sets.values()) if list(sets.values()).count(name) > 1]
        if shared:
            raise InvalidArgumentError(
                f"task types {[j for j in sets if sets[j] in shared]} share StatefulSet "
                f"{shared[0]!r}; give each its own"
            )

        service_map = _per_job(service, replicas, "service")
        if service_map is not None:
            services = {job: _check_label(service_map[job], f"service of {job!r}") for job in sets}
        elif service is None:
            services = dict(sets)
        else:
            _check_label(service, "service")
            services = dict.fromkeys(sets, service)
        if namespace is not None:
            _check_label(namespace, "namespace")
        port_map = _per_job(port, replicas, "port")
        ports = {
            job: _check_port(port_map[job] if port_map else port, f"port of {job!r}")
            for job in sets
        }

        if elastic_jobs is None:
            elastic_jobs = ("ps",) if "ps" in replicas else ()
        unknown = [job for job in elastic_jobs if job not in replicas]
        if unknown:
            raise InvalidArgumentError(
                f"elastic_jobs {list(elastic_jobs)!r}: {unknown} are not jobs {list(replicas)}"
            )
        self._suffix = f".{namespace}.svc" if namespace else ""
        self._services, self._ports = services, ports
        self._statefulsets = sets
        self._replicas = dict(replicas)
        self._api = api
        self._elastic_jobs = tuple(elastic_jobs)
        self._lock = threading.Lock()
        self._cluster_spec = self._spec_for(replicas)
        self._rpc_layer = check_rpc_layer(rpc_layer)
        self.gpu_probe = gpu_probe

        task_type = check_task_type(task_type)
        task_id = check_task_id(task_id)
        if (task_type is None) != (task_id is None):
            raise InvalidArgumentError(
                f"give task_type and task_id together (got {task_type!r}, {task_id!r})"
            )
        if task_type is not None:
            validate_task(self._cluster_spec, task_type, task_id)
            self._hostname = None
        else:
            env = settings.environ() if environ is None else environ
            if hostname is None:
                hostname = env.get("HOSTNAME") or socket.gethostname()
            if not isinstance(hostname, str):
                raise InvalidArgumentError(f"hostname {hostname!r} must be a string")
            self._hostname = hostname
            task_type, task_id = self._task_from_hostname(hostname, replicas)
        self._task_type, self._task_id = task_type, task_id

    def _spec_for(self, replicas: Mapping[str, int]) -> ClusterSpec:
        sets, services, ports = self._statefulsets, self._services, self._ports
        return ClusterSpec(
            {
                job: [
                    f"{sets[job]}-{i}.{services[job]}{self._suffix}:{ports[job]}"
                    for i in range(replicas[job])
                ]
                for job in sets
            }
        )

    def refresh(self) -> ClusterSpec:
        """Re-reads the count of each elastic job's pods from ``api``; returns the new view.

        A set with no pod up keeps its previous count (a job is never left
        without its tasks by an API hiccup or a set scaled to zero).

        Raises:
            OpError: the API did not answer (the previous view is kept).
        """
        if self._api is None:
            return self.cluster_spec()
        counts = {
            job: self._api.ready_replicas(self._statefulsets[job]) for job in self._elastic_jobs
        }
        with self._lock:
            for job, count in counts.items():
                if count > 0:
                    self._replicas[job] = count
            self._cluster_spec = self._spec_for(self._replicas)
            return self._cluster_spec

    def _task_from_hostname(self, hostname: str, replicas: Mapping[str, int]) -> tuple[str, int]:
        pod = hostname.split(".", 1)[0]
        match = _POD_NAME.fullmatch(pod)
        by_set = {name: job for job, name in self._statefulsets.items()}
        if match is None or match.group("set") not in by_set:
            raise TaskNotFoundError(
                f"hostname {hostname!r} is not a pod '<set>-<ordinal>' of the StatefulSets "
                f"{sorted(by_set)}"
            )
        job = by_set[match.group("set")]
        ordinal = int(match.group("ordinal"))
        if ordinal >= replicas[job]:
            raise TaskNotFoundError(
                f"hostname {hostname!r}: ordinal {ordinal} is out of range for "
                f"{job!r} with {replicas[job]} replicas"
            )
        return job, ordinal

    @property
    def hostname(self) -> str | None:
        """The hostname the task was read from (``None`` when given explicitly)."""
        return self._hostname

    @property
    def statefulsets(self) -> dict[str, str]:
        """Task type -> StatefulSet name."""
        return dict(self._statefulsets)

    def cluster_spec(self) -> ClusterSpec:
        """Returns the cluster as of construction or the last :meth:`refresh`."""
        with self._lock:
            return self._cluster_spec

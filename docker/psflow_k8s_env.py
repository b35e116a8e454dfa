#!/usr/bin/env python3
"""``psflow-k8s-env [--wait-for JOBS] -- COMMAND...``: TF_CONFIG for a StatefulSet pod, then exec.

The psflow processes read their role and peers from ``TF_CONFIG``.  Kubeflow's
operator writes it; plain Kubernetes does not, but every address follows from
the StatefulSet naming (``<set>-<i>.<service>.<namespace>.svc:<port>``) and
this pod's hostname gives its own task.  This wrapper, installed in the images
as ``/usr/local/bin/psflow-k8s-env``, derives ``TF_CONFIG`` that way with
:class:`~psflow.distribute.cluster_resolver.KubernetesClusterResolver`, checks
it is a valid parameter-server cluster (or, without ``ps`` tasks, a
``MultiWorkerMirroredStrategy`` group of workers), optionally waits until the tasks of
some jobs answer their gRPC health check, and replaces itself with COMMAND.

Configuration (environment; the manifests fill it from the ``psflow-cluster``
ConfigMap and the downward API):

``PSFLOW_K8S_JOBS``
    task type -> replicas, in cluster order: ``chief=1,ps=2,worker=2``.
``PSFLOW_K8S_STATEFULSETS``
    task type -> StatefulSet name (``ps=psflow-ps,...``); default the task type.
``PSFLOW_K8S_SERVICES``
    one headless Service for every set, or ``type=service,...``; default
    each set's own name.
``PSFLOW_K8S_NAMESPACE``
    the pods' namespace (cluster-wide names ``....<namespace>.svc``); optional.
``PSFLOW_K8S_PORT``
    every task's port (default 2222).
``PSFLOW_K8S_PS_MAX``
    elastic parameter servers (optional): a ``ps`` pod whose ordinal is at or
    beyond the ``ps`` replicas of ``PSFLOW_K8S_JOBS`` but below this (it was
    added by ``kubectl scale``) still gets its TF_CONFIG, listing ``ps`` tasks
    up to its own; the chief's ``ClusterWatch`` then moves a share of the
    variables to it (``docker/README.md``, "Resizing the parameter servers").
``PSFLOW_K8S_WORKER_MAX``
    the same for the workers of an elastic ``MultiWorkerMirroredStrategy``
    group (optional): a ``worker`` pod added by ``kubectl scale`` gets a
    ``TF_CONFIG`` listing workers up to its own, and asks the running group to
    admit it (up to the strategy's ``ElasticOptions.max_workers``).
``HOSTNAME``
    this pod's name, ``<set>-<ordinal>`` (Kubernetes sets it).

A ``TF_CONFIG`` already in the environment (a Kubeflow TFJob) is kept as it is.

Exit status: 2 for a bad configuration or command line (restarting cannot
help), 138 when ``--wait-for`` ran out of time (retryable, see
``psflow.exit_codes``); otherwise COMMAND's own.

Example::

    PSFLOW_K8S_JOBS=chief=1,ps=2,worker=2 HOSTNAME=ps-1 psflow-k8s-env --print
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Mapping, Sequence

from psflow.distribute.cluster_resolver import KubernetesClusterResolver, validate_ps_cluster
from psflow.errors import DeadlineExceededError, InvalidArgumentError, OpError
from psflow.exit_codes import ExitCode

log = logging.getLogger("psflow.k8s_env")

DEFAULT_PORT = 2222


@dataclasses.dataclass(frozen=True)
class ClusterLayout:
    """The StatefulSets of a psflow cluster, as the ``PSFLOW_K8S_*`` variables describe them."""

    jobs: dict[str, int]
    statefulsets: dict[str, str] | None = None
    services: dict[str, str] | str | None = None
    namespace: str | None = None
    port: int = DEFAULT_PORT
    ps_max: int | None = None
    worker_max: int | None = None


def _pairs(variable: str, text: str) -> dict[str, str]:
    """Parses ``a=x,b=y`` (the order kept)."""
    result: dict[str, str] = {}
    for item in (part.strip() for part in text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise InvalidArgumentError(f"{variable}={text!r}: {item!r} is not 'name=value'")
        if key.strip() in result:
            raise InvalidArgumentError(f"{variable}={text!r} names {key.strip()!r} twice")
        result[key.strip()] = value.strip()
    return result


def layout_from_env(environ: Mapping[str, str]) -> ClusterLayout:
    """Reads the ``PSFLOW_K8S_*`` variables (see the module docstring).

    Raises:
        InvalidArgumentError: a variable is missing or malformed; the message
            names it and its value.
    """
    text = environ.get("PSFLOW_K8S_JOBS", "").strip()
    if not text:
        raise InvalidArgumentError(
            "PSFLOW_K8S_JOBS is not set; give task type -> replicas, e.g. 'chief=1,ps=2,worker=2'"
        )
    jobs: dict[str, int] = {}
    for job, count in _pairs("PSFLOW_K8S_JOBS", text).items():
        if not count.isdigit():
            raise InvalidArgumentError(
                f"PSFLOW_K8S_JOBS={text!r}: replicas of {job!r} ({count!r}) must be an int >= 0"
            )
        jobs[job] = int(count)
    sets_text = environ.get("PSFLOW_K8S_STATEFULSETS", "").strip()
    statefulsets = _pairs("PSFLOW_K8S_STATEFULSETS", sets_text) if sets_text else None
    services_text = environ.get("PSFLOW_K8S_SERVICES", "").strip()
    services: dict[str, str] | str | None = None
    if "=" in services_text:
        services = _pairs("PSFLOW_K8S_SERVICES", services_text)
    elif services_text:
        services = services_text
    port_text = environ.get("PSFLOW_K8S_PORT", "").strip() or str(DEFAULT_PORT)
    if not port_text.isdigit():
        raise InvalidArgumentError(f"PSFLOW_K8S_PORT={port_text!r} must be a port number")
    return ClusterLayout(
        ps_max=_job_max(environ, "ps", jobs),
        worker_max=_job_max(environ, "worker", jobs),
        jobs=jobs,
        statefulsets=statefulsets,
        services=services,
        namespace=environ.get("PSFLOW_K8S_NAMESPACE", "").strip() or None,
        port=int(port_text),
    )


def _job_max(environ: Mapping[str, str], job: str, jobs: dict[str, int]) -> int | None:
    """``PSFLOW_K8S_<JOB>_MAX``: how far ``kubectl scale`` may grow ``job`` (None: fixed)."""
    variable = f"PSFLOW_K8S_{job.upper()}_MAX"
    text = environ.get(variable, "").strip()
    if text and (not text.isdigit() or int(text) < jobs.get(job, 0)):
        raise InvalidArgumentError(
            f"{variable}={text!r} must be a number >= the {job} replicas ({jobs.get(job, 0)})"
        )
    return int(text) if text else None


def tf_config_for(layout: ClusterLayout, hostname: str) -> dict:
    """Returns the ``TF_CONFIG`` (as a dict) of the pod named ``hostname``.

    A layout without ``ps`` tasks is a worker-only job (MultiWorkerMirroredStrategy):
    checked as the strategy reads it, chief and workers only.

    Raises:
        InvalidArgumentError: the layout is not a valid parameter-server cluster, nor a
            group of workers (no worker at all, or another task type; named).
        TaskNotFoundError: ``hostname`` is not ``<set>-<ordinal>`` of a set in it.
    """
    resolver = KubernetesClusterResolver(
        _jobs_for(layout, hostname),
        service=layout.services,
        namespace=layout.namespace,
        port=layout.port,
        hostname=hostname,
        statefulsets=layout.statefulsets,
    )
    spec = resolver.cluster_spec()
    if "ps" in layout.jobs:
        validate_ps_cluster(spec, task_type=resolver.task_type, task_id=resolver.task_id)
    else:
        _check_worker_group(resolver)
    return {
        "cluster": spec.as_dict(),
        "task": {"type": resolver.task_type, "index": resolver.task_id},
    }


def _check_worker_group(resolver: KubernetesClusterResolver) -> None:
    """A worker-only job: chief and worker tasks, at least one worker, this pod among them."""
    from psflow.distribute.multi_worker_mirrored_strategy import WorkerGroup

    jobs = resolver.cluster_spec().as_dict()
    others = sorted(set(jobs) - {"chief", "worker"})
    if others or not jobs.get("worker"):
        raise InvalidArgumentError(
            f"PSFLOW_K8S_JOBS: a job without ps tasks is a MultiWorkerMirroredStrategy group "
            f"of chief and worker tasks with at least one worker; got {jobs}"
        )
    WorkerGroup.from_resolver(resolver)


def _jobs_for(layout: ClusterLayout, hostname: str) -> dict[str, int]:
    """``layout.jobs``, with ``ps`` (or ``worker``) grown to include this pod when
    ``kubectl scale`` added it, below ``PSFLOW_K8S_PS_MAX`` (``_WORKER_MAX``)."""
    jobs = dict(layout.jobs)
    pod = hostname.split(".", 1)[0]
    prefix, _, ordinal = pod.rpartition("-")
    for job, most in (("ps", layout.ps_max), ("worker", layout.worker_max)):
        if most is None or job not in jobs:
            continue
        job_set = (layout.statefulsets or {}).get(job, job)
        if prefix == job_set and ordinal.isdigit() and jobs[job] <= int(ordinal) < most:
            jobs[job] = int(ordinal) + 1
    return jobs


def wait_until_serving(addresses: Sequence[str], timeout: float, *, poll: float = 1.0) -> None:
    """Waits until every address answers the standard gRPC health check with SERVING.

    Each check is bounded by the time left; ``timeout`` bounds the whole wait.

    Raises:
        InvalidArgumentError: ``timeout`` is not positive.
        DeadlineExceededError: some address was not SERVING in time; the
            message names them and their last status.
    """
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if not timeout > 0:
        raise InvalidArgumentError(f"wait timeout {timeout!r} must be > 0 seconds")
    deadline = time.monotonic() + timeout
    pending = {address: "not checked" for address in addresses}
    while pending:
        for address in list(pending):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            with grpc.insecure_channel(address) as channel:
                try:
                    reply = health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(service=""), timeout=min(left, 5.0)
                    )
                except grpc.RpcError as e:
                    pending[address] = e.code().name
                    continue
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                del pending[address]
                log.info("%s is SERVING", address)
            else:
                pending[address] = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        if not pending:
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceededError(
                f"not SERVING after {timeout:g}s: "
                + ", ".join(f"{a} ({status})" for a, status in sorted(pending.items()))
            )
        time.sleep(min(poll, left))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="psflow-k8s-env", description=__doc__.splitlines()[0].split(": ", 1)[1]
    )
    p.add_argument(
        "--wait-for",
        metavar="JOBS",
        default="",
        help="comma-separated jobs (e.g. ps,worker) whose tasks must be SERVING first",
    )
    p.add_argument("--wait-timeout", type=float, default=600.0, metavar="S")
    p.add_argument("--print", action="store_true", help="print TF_CONFIG and exit")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    return p


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Entry point; execs the command, or returns an exit status."""
    args = _parser().parse_args(argv)
    env = dict(os.environ if environ is None else environ)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="psflow-k8s-env: %(message)s")
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command and not args.print:
        sys.stderr.write("psflow-k8s-env: give a command after '--'\n")
        return int(ExitCode.USAGE_ERROR)
    try:
        if env.get("TF_CONFIG", "").strip():
            config = json.loads(env["TF_CONFIG"])
            log.info("keeping the TF_CONFIG in the environment")
        else:
            hostname = env.get("HOSTNAME", "").strip() or os.uname().nodename
            config = tf_config_for(layout_from_env(env), hostname)
            env["TF_CONFIG"] = json.dumps(config)
        if args.print:
            sys.stdout.write(json.dumps(config) + "\n")
            return int(ExitCode.OK)
        jobs = [job.strip() for job in args.wait_for.split(",") if job.strip()]
        cluster = config.get("cluster", {})
        missing = [job for job in jobs if job not in cluster]
        if missing:
            raise InvalidArgumentError(
                f"--wait-for names jobs {missing} that the cluster {sorted(cluster)} lacks"
            )
        addresses = [
            address
            for job in jobs
            for address in (
                cluster[job] if isinstance(cluster[job], list) else cluster[job].values()
            )
        ]
        if addresses:
            wait_until_serving(addresses, args.wait_timeout)
    except DeadlineExceededError as e:
        sys.stderr.write(f"psflow-k8s-env: {e}\n")
        return int(ExitCode.RETRYABLE)
    except (OpError, ValueError) as e:
        sys.stderr.write(f"psflow-k8s-env: {e}\n")
        return int(ExitCode.USAGE_ERROR)
    sys.stdout.flush()
    try:
        os.execvpe(command[0], command, env)
    except OSError as e:
        sys.stderr.write(f"psflow-k8s-env: cannot run {command[0]!r}: {e}\n")
    return 127  # the shell's "command not found"; permanent


if __name__ == "__main__":
    sys.exit(main())

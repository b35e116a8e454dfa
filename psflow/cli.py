"""The ``psflow`` command: start the processes of a cluster, inspect it, check health.

::

    psflow ps [ARGS]        = python -m ps_server [ARGS]   (a parameter-server task)
    psflow worker [ARGS]    = python -m worker [ARGS]      (a worker task)
    psflow chief [ARGS]     = python -m chief [ARGS]       (run a script as the chief)
    psflow local [ARGS]     = python -m chief.local [ARGS] (a whole cluster on loopback)
    psflow scale --ps K     = python -m chief.scale ...    (resize a `psflow local --ps-max` run)
    psflow cluster [--tf-config JSON|@FILE]   print the cluster and this task's role
    psflow health HOST:PORT [--service NAME] [--timeout S] [--wait]
                            standard gRPC health check: exit 0 when SERVING, else 1

The first five replace this process (``exec``) with the entrypoint, arguments
passed through unchanged, so signals and exit codes are the entrypoint's own
(see ``psflow.exit_codes``).  This package never imports those entrypoints.

Example (a docker-compose or Kubernetes health check)::

    psflow health 127.0.0.1:2222 --timeout 3
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

from psflow.errors import InvalidArgumentError, OpError
from psflow.exit_codes import ExitCode

log = logging.getLogger("psflow.cli")

ENTRYPOINTS: Mapping[str, str] = {
    "ps": "ps_server",
    "worker": "worker",
    "chief": "chief",
    "local": "chief.local",
    "scale": "chief.scale",
}
"""``psflow <command>`` -> the module ``python -m`` runs for it."""

SERVING = "SERVING"
"""What ``psflow health`` prints for a healthy server."""


# -- exec -------------------------------------------------------------------------------
def entrypoint_argv(command: str, args: list[str]) -> list[str]:
    """The ``python -m <module> ARGS`` command line for ``psflow <command> ARGS``.

    Raises:
        InvalidArgumentError: ``command`` is not one of :data:`ENTRYPOINTS`.

    Example:
        >>> entrypoint_argv("ps", ["--port", "0"])[1:]
        ['-m', 'ps_server', '--port', '0']
    """
    if command not in ENTRYPOINTS:
        raise InvalidArgumentError(
            f"unknown command {command!r}; entrypoints are {sorted(ENTRYPOINTS)}"
        )
    return [sys.executable, "-m", ENTRYPOINTS[command], *args]


def _exec(argv: list[str]) -> int:
    """Replaces this process with ``argv``; returns only if that fails."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    try:
        os.execv(argv[0], argv)
    except OSError as e:
        sys.stderr.write(f"psflow: cannot execute {argv[0]!r}: {e}\n")
    return 127


# -- cluster ----------------------------------------------------------------------------
def _read_tf_config(value: str | None, environ: Mapping[str, str]) -> str | None:
    """The TF_CONFIG text: ``--tf-config`` (``@FILE`` reads a file), else the environment."""
    if value is None:
        return environ.get("TF_CONFIG")
    if value.startswith("@"):
        path = value[1:]
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except OSError as e:
            raise InvalidArgumentError(f"--tf-config file {path!r} cannot be read: {e}") from None
    return value


def describe_cluster(tf_config_text: str | None, *, check_ps: bool = True) -> dict[str, Any]:
    """Resolves ``TF_CONFIG`` text into what ``psflow cluster`` prints.

    Returns a dict with ``cluster`` (job -> addresses), ``task`` (``{"type",
    "index"}`` or None), ``role`` (``"worker:1"`` or None), ``address`` (this
    task's, or None), ``embedded`` (no cluster: ``ParameterServerStrategy``
    runs in-process) and ``num_tasks`` per job.

    Raises:
        InvalidArgumentError: the text is invalid or, with ``check_ps``, not a
            parameter-server cluster (the message names the key or value).
        TaskNotFoundError: the task is not in the cluster.

    Example:
        >>> info = describe_cluster('{"cluster": {"ps": ["p:1"], "worker": ["w:1"]},'
        ...                         ' "task": {"type": "worker", "index": 0}}')
        >>> info["role"], info["address"], info["num_tasks"]
        ('worker:0', 'w:1', {'ps': 1, 'worker': 1})
    """
    from psflow.distribute.cluster_resolver import (
        TFConfigClusterResolver,
        task_string,
        validate_ps_cluster,
    )

    environ = {} if tf_config_text is None else {"TF_CONFIG": tf_config_text}
    resolver = TFConfigClusterResolver(environ=environ)
    spec = resolver.full_cluster_spec()
    task_type, task_id = resolver.task_type, resolver.task_id
    if check_ps and spec.jobs:
        validate_ps_cluster(spec, task_type=task_type, task_id=task_id)
    has_task = task_type is not None and task_id is not None
    in_cluster = has_task and task_type in spec.jobs and task_id in spec.task_indices(task_type)
    return {
        "cluster": {
            job: {str(i): a for i, a in tasks.items()} if isinstance(tasks, dict) else tasks
            for job, tasks in spec.as_dict().items()
        },
        "task": {"type": task_type, "index": task_id} if has_task else None,
        "role": task_string(task_type, task_id) if has_task else None,
        "address": spec.task_address(task_type, task_id) if in_cluster else None,
        "embedded": not spec.jobs,
        "num_tasks": {job: spec.num_tasks(job) for job in spec.jobs},
    }


def _cluster(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    try:
        text = _read_tf_config(args.tf_config, environ)
        info = describe_cluster(text, check_ps=not args.no_ps_check)
    except (OpError, ValueError) as e:
        sys.stderr.write(f"psflow cluster: invalid TF_CONFIG: {e}\n")
        return int(ExitCode.USAGE_ERROR)
    sys.stdout.write(json.dumps(info, indent=2) + "\n")
    return int(ExitCode.OK)


# -- health -----------------------------------------------------------------------------
def check_address(address: str) -> str:
    """Returns ``address`` if it is ``HOST:PORT`` (``[v6]:PORT`` for IPv6).

    Raises:
        InvalidArgumentError: naming the address.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgumentError(f"address {address!r} must look like HOST:PORT")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise InvalidArgumentError(f"address {address!r}: write an IPv6 host as [HOST]:PORT")
    return address


def health_check(
    address: str,
    service: str = "",
    timeout: float = 5.0,
    wait: bool = False,
    security: Any = None,
) -> tuple[str, str]:
    """Asks ``address`` for the health of ``service`` (``""``: the whole server).

    Uses the standard ``grpc.health.v1.Health/Check`` RPC.  With ``wait``,
    waits up to ``timeout`` seconds for the server to become reachable.
    The health service needs no token, but a server with mutual TLS needs the
    TLS material of ``security`` (default: the environment's ``PSFLOW_TLS_*``);
    a server refusing it gives ``"UNAUTHENTICATED"``.

    Returns:
        ``(status, detail)``: status is ``"SERVING"``, ``"NOT_SERVING"``,
        ``"SERVICE_UNKNOWN"``, ``"UNKNOWN"``, or the gRPC code of a failed call
        (``"UNAVAILABLE"``, ``"DEADLINE_EXCEEDED"``...); detail explains it.

    Raises:
        InvalidArgumentError: ``address`` is not ``HOST:PORT`` or ``timeout``
            is not positive.
    """
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from psflow.security.config import default_security
    from psflow.security.grpc_auth import open_channel
    from psflow.security.probe import diagnose_unavailable

    check_address(address)
    if not timeout > 0:
        raise InvalidArgumentError(f"timeout {timeout!r} must be > 0 seconds")
    security = default_security() if security is None else security
    with open_channel(address, security) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(
                health_pb2.HealthCheckRequest(service=service),
                timeout=timeout,
                wait_for_ready=wait,
            )
        except grpc.RpcError as e:
            code = e.code()
            if code == grpc.StatusCode.NOT_FOUND:
                return "SERVICE_UNKNOWN", f"{address} does not know service {service!r}"
            if code == grpc.StatusCode.UNAVAILABLE:
                reason = diagnose_unavailable(address, security, e.details() or "")
                if reason is not None:
                    return "UNAUTHENTICATED", f"{address}: {reason}"
            return code.name, f"{address}: {e.details() or code.name}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return status, f"{address} service {service!r}: {status}"


def _health(args: argparse.Namespace) -> int:
    try:
        status, detail = health_check(args.address, args.service, args.timeout, args.wait)
    except InvalidArgumentError as e:  # a bad address, timeout or PSFLOW_TLS_* setting
        sys.stderr.write(f"psflow health: {e}\n")
        return int(ExitCode.USAGE_ERROR)
    sys.stdout.write(status + "\n")
    if status != SERVING:
        sys.stderr.write(f"psflow health: {detail}\n")
    return int(ExitCode.OK) if status == SERVING else int(ExitCode.USER_ERROR)


# -- main -------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="psflow",
        description="psflow: parameter-server and mirrored training processes.",
        epilog="ps, worker, chief, local and scale pass every argument on to the entrypoint; "
        "`psflow ps --help` shows its options.",
    )
    from psflow import __version__

    p.add_argument("--version", action="version", version=f"psflow {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in ENTRYPOINTS.items():
        sub.add_parser(name, help=f"run `python -m {module}` with the remaining arguments")
    c = sub.add_parser("cluster", help="print the cluster and this task's role from TF_CONFIG")
    c.add_argument(
        "--tf-config", metavar="JSON|@FILE", help="TF_CONFIG text (default: the environment)"
    )
    c.add_argument(
        "--no-ps-check",
        action="store_true",
        help="do not require a parameter-server cluster (ps and worker jobs)",
    )
    h = sub.add_parser("health", help="gRPC health check: exit 0 when SERVING, else 1")
    h.add_argument("address", metavar="HOST:PORT")
    h.add_argument("--service", default="", help="service name (default: the whole server)")
    h.add_argument("--timeout", type=float, default=5.0, metavar="S", help="seconds (default 5)")
    h.add_argument(
        "--wait", action="store_true", help="wait up to the timeout for the server to come up"
    )
    return p


def main(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Entry point of the ``psflow`` console script; returns the exit status.

    ``ps``, ``worker``, ``chief``, ``local`` and ``scale`` do not return: this process
    becomes the entrypoint.
    """
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ENTRYPOINTS:
        return _exec(entrypoint_argv(argv[0], argv[1:]))
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "cluster":
        return _cluster(args, os.environ if environ is None else environ)
    if args.command == "health":
        return _health(args)
    parser.print_help(sys.stderr)
    return int(ExitCode.USAGE_ERROR)


if __name__ == "__main__":
    sys.exit(main())

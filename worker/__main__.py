"""``python -m worker``: run one worker task.

Examples::

    python -m worker --port 0 --ps 127.0.0.1:5000,127.0.0.1:5001 --workers 2 --task worker:0
    TF_CONFIG='{"cluster": {"ps": ["ps0:2222"], "worker": ["w0:2222"]},
                "task": {"type": "worker", "index": 0}}' python -m worker

Once bound it prints ``PSFLOW_READY worker port=<port> task=<task> pid=<pid>``
(plus `` data_port=<port>``, `` metrics_port=<port>`` with ``--metrics-port``,
and `` blas_threads=<n>``) on stdout; logs go to stderr (``--log-format json``:
one JSON object per line).  SIGTERM: health NOT_SERVING, the running closure
finishes (``--grace`` seconds), exit 0.

Data plane (:mod:`worker.plane`): beside the gRPC port the worker serves
RunClosure on a raw TCP port (``--data-port``, any free one by default),
announced to the chief in its GetStatus reply (``--data-advertise HOST:PORT``
where the chief must dial another address); ``PSFLOW_CLOSURE_PLANE=off``
serves none (every closure then comes over gRPC).

BLAS threads (:mod:`psflow.thread_budget`): the cores of its container
(affinity, capped by a cgroup v2 ``cpu.max`` quota) unless
``PSFLOW_BLAS_THREADS=N`` (``psflow local`` sets it) or
``OPENBLAS_NUM_THREADS``/``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` say
otherwise; a bad value exits 2.

Security (see :mod:`psflow.security`): the same token and/or TLS settings as
the parameter servers (``PSFLOW_AUTH_TOKEN``, ``--auth-token-file``,
``--tls-cert/--tls-key/--tls-ca``...) protect this worker and are what it
presents to them.  Binding an address other machines can reach without
authentication needs ``--insecure``: a worker runs the code it is sent.
"""

from __future__ import annotations

import argparse
import logging

from psflow import serving
from psflow.errors import OpError
from psflow.security.limits import WorkerLimits
from psflow.security.probe import split_host_port
from worker.executor import ClosureExecutor
from worker.server import serve

log = logging.getLogger("psflow.worker")


def _parser() -> argparse.ArgumentParser:
    grace = "seconds to finish a closure on SIGTERM"
    p = serving.server_parser("worker", __doc__, "worker", grace)
    p.add_argument("--ps", help="comma-separated PS addresses (default from TF_CONFIG)")
    p.add_argument("--workers", type=int, help="number of worker tasks (default from TF_CONFIG)")
    p.add_argument(
        "--ps-timeout",
        type=float,
        default=60.0,
        help="deadline in seconds of each call to a parameter server (a push, a pull)",
    )
    p.add_argument(
        "--data-port", type=int, default=0, help="the closures' data-plane port (0: any)"
    )
    p.add_argument(
        "--data-advertise",
        default="",
        metavar="HOST:PORT",
        help="address the chief dials for the data plane (default: the gRPC host, --data-port)",
    )
    return p


def _data_plane_problem(port: int, advertise: str) -> str | None:
    """What is wrong with ``--data-port`` / ``--data-advertise`` (None: nothing)."""
    if not 0 <= port <= 65535:
        return f"--data-port {port} is not a port (0..65535)"
    if advertise and split_host_port(advertise) is None:
        return f"--data-advertise {advertise!r} is not host:port"
    return None


def _from_tf_config() -> tuple[str, int, str, list[str], int]:
    """``(bind, port, task, ps_addresses, num_workers)`` from TF_CONFIG."""
    from psflow.distribute.cluster_resolver import TFConfigClusterResolver, validate_ps_cluster

    resolver = TFConfigClusterResolver()
    spec = resolver.cluster_spec()
    if resolver.task_type != "worker":
        raise ValueError(
            f"TF_CONFIG says this task is {resolver.task_type}:{resolver.task_id}, not a worker"
        )
    validate_ps_cluster(spec)
    address = spec.task_address("worker", resolver.task_id)
    ps = [spec.task_address("ps", i) for i in sorted(spec.task_indices("ps"))]
    return (
        "0.0.0.0",
        int(address.rpartition(":")[2]),
        f"worker:{resolver.task_id}",
        ps,
        spec.num_tasks("worker"),
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    args = _parser().parse_args(argv)
    bind, port, task = args.bind, args.port, args.task
    ps = [a for a in (args.ps or "").split(",") if a]
    num_workers = args.workers
    if port is None or not ps:
        try:
            tf_bind, tf_port, tf_task, tf_ps, tf_workers = _from_tf_config()
        except (OpError, ValueError, KeyError) as e:
            why = f"give --port and --ps, or a TF_CONFIG naming this worker: {e}"
            return serving.usage_error("worker", why)
        bind, port, task = bind or tf_bind, tf_port if port is None else port, task or tf_task
        ps, num_workers = ps or tf_ps, num_workers or tf_workers
    if not 0 < args.ps_timeout < float("inf"):
        return serving.usage_error("worker", f"--ps-timeout must be > 0, got {args.ps_timeout}")
    problem = _data_plane_problem(args.data_port, args.data_advertise)
    if problem is not None:
        return serving.usage_error("worker", problem)
    try:
        bind, task, security = serving.setup_process(args, "worker", task, bind)
    except OpError as e:
        return serving.usage_error("worker", e)

    def strategy_factory():
        from psflow.distribute.parameter_server_strategy import ParameterServerStrategy

        # The worker reaches the parameter servers with its own credentials.
        return ParameterServerStrategy._for_worker(
            ps, num_workers or 1, task, security=security, ps_timeout=args.ps_timeout
        )

    limits = WorkerLimits(
        max_closure_bytes=args.max_closure_bytes,
        max_sessions=args.max_sessions,
        session_ttl=args.session_ttl,
    )
    executor = ClosureExecutor(
        task, strategy_factory, max_sessions=limits.max_sessions, session_ttl=limits.session_ttl
    )
    try:
        return serve(
            executor,
            bind,
            port,
            grace=args.grace,
            security=security,
            insecure=args.insecure,
            limits=limits,
            metrics_port=args.metrics_port,
            metrics_bind=args.metrics_bind,
            data_port=args.data_port,
            data_advertise=args.data_advertise,
        )
    except OpError as e:
        log.error("worker failed: %s", e)
        return 1


if __name__ == "__main__":
    serving.exit_process(main())

"""Building the worker's gRPC server (:func:`create_server`) and running it (:func:`serve`)."""

from __future__ import annotations

import threading

import grpc
from grpc_health.v1 import health

from psflow import serving
from psflow.observability.metrics import Registry
from psflow.observability.services import WorkerMetrics
from psflow.security.config import SecurityConfig
from psflow.security.limits import WorkerLimits
from worker.executor import ClosureExecutor
from worker.servicer import SERVICE, WorkerServicer

__all__ = ["MAX_MESSAGE_BYTES", "SERVICE", "create_server", "serve"]

MAX_MESSAGE_BYTES = 2**31 - 1  # closure results are whatever the user returns
_SLACK = 1 << 20


def create_server(
    executor: ClosureExecutor,
    bind: str = "127.0.0.1",
    port: int = 0,
    *,
    health_servicer: health.HealthServicer | None = None,
    max_workers: int = 16,
    security: SecurityConfig | None = None,
    insecure: bool = False,
    limits: WorkerLimits | None = None,
    metrics: WorkerMetrics | None = None,
) -> tuple[grpc.Server, int]:
    """Builds and binds (does not start) a worker server; returns ``(server, port)``.

    With ``security``, every call but the health check needs the token and/or
    a client certificate.  Requests above ``limits.max_closure_bytes`` are
    refused with RESOURCE_EXHAUSTED (by the servicer, naming the limit, up to
    twice the limit; by gRPC's message size limit beyond that).

    Raises:
        FailedPreconditionError: ``bind`` is not loopback, ``security``
            authenticates nobody and ``insecure`` is False.
        UnavailableError: the address cannot be bound.
    """
    limits = limits or WorkerLimits()
    receive_limit = min(MAX_MESSAGE_BYTES, 2 * limits.max_closure_bytes + _SLACK)
    servicer = WorkerServicer(executor, limits=limits, metrics=metrics)
    return serving.build_server(
        (servicer.generic_handler(),),
        SERVICE,
        bind=bind,
        port=port,
        security=security or SecurityConfig(),
        insecure=insecure,
        task=executor.task,
        threads=max_workers,
        thread_name_prefix="worker-rpc",
        metrics=metrics,
        health_servicer=health_servicer,
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", receive_limit),
            ("grpc.so_reuseport", 0),
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ("grpc.http2.max_ping_strikes", 0),
        ],
    )


def serve(
    executor: ClosureExecutor,
    bind: str = "127.0.0.1",
    port: int = 0,
    *,
    grace: float = 10.0,
    stop_event: threading.Event | None = None,
    security: SecurityConfig | None = None,
    insecure: bool = False,
    limits: WorkerLimits | None = None,
    metrics_port: int | None = None,
    metrics_bind: str | None = None,
) -> int:
    """Runs a worker until SIGTERM/SIGINT (or ``stop_event``); returns 0.

    ``metrics_port`` (0: any free port, None: no metrics) serves Prometheus
    metrics on ``metrics_bind`` (default ``bind``); the ready line then ends
    with `` metrics_port=<port>``.
    """
    health_servicer = health.HealthServicer()
    metrics = None
    if metrics_port is not None:
        metrics = WorkerMetrics(
            Registry(), executor.task, sessions=lambda: len(executor.session_ids())
        )
    server, bound = create_server(
        executor,
        bind,
        port,
        health_servicer=health_servicer,
        security=security,
        insecure=insecure,
        limits=limits,
        metrics=metrics,
    )
    return serving.serve_until_stopped(
        server,
        bound,
        health_servicer,
        SERVICE,
        role="worker",
        task=executor.task,
        grace=grace,
        stop_event=stop_event,
        metrics=metrics,
        metrics_address=(metrics_bind or bind, metrics_port),
    )

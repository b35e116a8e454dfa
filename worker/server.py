"""Building the worker's gRPC server (:func:`create_server`) and running it (:func:`serve`),
with its data plane for closures (:mod:`worker.plane`) beside it."""

from __future__ import annotations

import threading

import grpc
from grpc_health.v1 import health

from psflow import serving, settings
from psflow.observability.metrics import Registry
from psflow.observability.services import WorkerMetrics
from psflow.security.config import SecurityConfig
from psflow.security.limits import WorkerLimits
from worker.executor import ClosureExecutor
from worker.plane import WorkerPlane
from worker.servicer import SERVICE, WorkerServicer

__all__ = ["MAX_MESSAGE_BYTES", "SERVICE", "create_server", "serve"]

MAX_MESSAGE_BYTES = 2**31 - 1  # closure results are whatever the user returns
_SLACK = 1 << 20
_RPC_THREADS = 16


def create_server(
    executor: ClosureExecutor,
    bind: str = "127.0.0.1",
    port: int = 0,
    *,
    health_servicer: health.HealthServicer | None = None,
    max_workers: int = _RPC_THREADS,
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
    *_, server, bound = _build(
        executor, bind, port, health_servicer, max_workers, security, insecure, limits, metrics
    )
    return server, bound


def _receive_limit(limits: WorkerLimits) -> int:
    """The largest request either transport accepts (the servicer names the limit
    up to twice ``max_closure_bytes``; beyond, the transport refuses it)."""
    return min(MAX_MESSAGE_BYTES, 2 * limits.max_closure_bytes + _SLACK)


def _build(
    executor: ClosureExecutor,
    bind: str,
    port: int,
    health_servicer: health.HealthServicer | None,
    max_workers: int,
    security: SecurityConfig | None,
    insecure: bool,
    limits: WorkerLimits | None,
    metrics: WorkerMetrics | None,
) -> tuple[WorkerServicer, grpc.Server, int]:
    """:func:`create_server`, also returning the servicer (the data plane calls it)."""
    limits = limits or WorkerLimits()
    servicer = WorkerServicer(executor, limits=limits, metrics=metrics)
    server, bound = serving.build_server(
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
            ("grpc.max_receive_message_length", _receive_limit(limits)),
            ("grpc.so_reuseport", 0),
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ("grpc.http2.max_ping_strikes", 0),
        ],
    )
    return servicer, server, bound


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
    data_plane: bool | None = None,
    data_port: int = 0,
    data_advertise: str = "",
) -> int:
    """Runs a worker until SIGTERM/SIGINT (or ``stop_event``); returns 0.

    ``metrics_port`` (0: any free port, None: no metrics) serves Prometheus
    metrics on ``metrics_bind`` (default ``bind``); the ready line then ends
    with `` metrics_port=<port>``.  ``data_plane`` (None: ``PSFLOW_CLOSURE_PLANE``,
    on unless ``off``) also serves RunClosure on a data plane at ``data_port``
    (0: any free one), announced as ``data_advertise`` if given, and the ready
    line names its port (`` data_port=<port>``); on the signal it refuses new
    closures and gives those running ``grace`` seconds, as the gRPC server does.

    Raises:
        UnavailableError: a port cannot be bound.
    """
    health_servicer = health.HealthServicer()
    metrics = None
    if metrics_port is not None:
        metrics = WorkerMetrics(
            Registry(), executor.task, sessions=lambda: len(executor.session_ids())
        )
    limits = limits or WorkerLimits()
    servicer, server, bound = _build(
        executor, bind, port, health_servicer, _RPC_THREADS, security, insecure, limits, metrics
    )
    stop = stop_event or threading.Event()
    plane = None
    if settings.current().closure_plane if data_plane is None else data_plane:
        plane = WorkerPlane(
            servicer,
            bind,
            data_port,
            security or SecurityConfig(),
            stop,
            advertise=data_advertise,
            max_payload=_receive_limit(limits),
            on_reject=None if metrics is None else metrics.record_rejection,
        ).start()
    try:
        return serving.serve_until_stopped(
            server,
            bound,
            health_servicer,
            SERVICE,
            role="worker",
            task=executor.task,
            grace=grace,
            stop_event=stop,
            metrics=metrics,
            metrics_address=(metrics_bind or bind, metrics_port),
            after_drain=None if plane is None else plane.drain,
            ready_extra="" if plane is None else f"data_port={plane.port}",
        )
    finally:
        if plane is not None:
            plane.stop(1.0)

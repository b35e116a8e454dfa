"""Building the worker's gRPC server (:func:`create_server`) and running it (:func:`serve`)."""

from __future__ import annotations

import concurrent.futures
import threading

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from psflow import serving
from psflow.errors import UnavailableError
from psflow.proto import worker_pb2, worker_pb2_grpc
from worker.executor import ClosureExecutor
from worker.servicer import WorkerServicer

SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
MAX_MESSAGE_BYTES = 2**31 - 1  # closure results are whatever the user returns


def create_server(
    executor: ClosureExecutor,
    bind: str = "127.0.0.1",
    port: int = 0,
    *,
    health_servicer: health.HealthServicer | None = None,
    max_workers: int = 16,
) -> tuple[grpc.Server, int]:
    """Builds and binds (does not start) a worker server; returns ``(server, port)``.

    Raises:
        UnavailableError: the address cannot be bound.
    """
    server = grpc.server(
        concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="worker-rpc"),
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ("grpc.http2.max_ping_strikes", 0),
        ],
    )
    worker_pb2_grpc.add_WorkerServicer_to_server(WorkerServicer(executor), server)
    if health_servicer is None:
        health_servicer = health.HealthServicer()
        serving.set_health(health_servicer, (SERVICE,), serving=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    address = serving.host_port(bind, port)
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as e:
        raise UnavailableError(f"cannot bind {address}: {e}", task=executor.task) from e
    if not bound:
        raise UnavailableError(f"cannot bind {address}", task=executor.task)
    return server, bound


def serve(
    executor: ClosureExecutor,
    bind: str = "127.0.0.1",
    port: int = 0,
    *,
    grace: float = 10.0,
    stop_event: threading.Event | None = None,
) -> int:
    """Runs a worker until SIGTERM/SIGINT (or ``stop_event``); returns 0."""
    health_servicer = health.HealthServicer()
    server, bound = create_server(executor, bind, port, health_servicer=health_servicer)
    return serving.run_until_stopped(
        server,
        bound,
        health_servicer,
        (SERVICE,),
        role="worker",
        task=executor.task,
        grace=grace,
        stop_event=stop_event,
    )

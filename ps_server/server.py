"""Building and running the parameter-server gRPC server.

:func:`create_server` only builds and binds (tests call it with port 0);
:func:`serve` runs a server until SIGTERM/SIGINT: health NOT_SERVING until
ready (after an optional restore), SERVING while up, NOT_SERVING again on the
signal, then in-flight calls get ``grace`` seconds to finish, an optional final
checkpoint is written, and it returns 0.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

import grpc
from grpc_health.v1 import health

from psflow import launch, serving
from psflow.io import manifest as mf
from psflow.observability.metrics import Registry
from psflow.observability.services import PSMetrics
from psflow.ps.checkpoint import restore_shard, save_shard
from psflow.ps.store import VariableStore
from psflow.ps.table_metrics import watch_tables
from psflow.ps.tables import TableRegistry
from psflow.security.config import SecurityConfig
from psflow.transport.dataplane import DataPlaneServer
from psflow.transport.options import server_options
from psflow.transport.service import SERVICE

from .edge import Edge
from .embedding_servicer import EmbeddingServicer
from .options import DataPlaneOptions, ServerOptions
from .servicer import ParameterServerServicer

__all__ = ["READY_PREFIX", "create_server", "serve", "start_data_plane"]

log = logging.getLogger(__name__)

READY_PREFIX = launch.READY_PREFIX + "ps"
# printed on stdout by a task that exits because a resize drained it (exit code 0)
DRAINED_LINE = "PSFLOW_DRAINED"


def create_server(
    store: VariableStore,
    options: ServerOptions | None = None,
    *,
    security: SecurityConfig | None = None,
    health_servicer: health.HealthServicer | None = None,
    metrics: PSMetrics | None = None,
    tables: TableRegistry | None = None,
) -> tuple[grpc.Server, int]:
    """Builds a gRPC server for ``store`` and binds it; returns ``(server, port)``.

    The server is not started.  It also serves the standard health service (a
    given ``health_servicer``, or a new one already SERVING) and reflection.
    With ``security``, every call but the health check needs the token and/or
    a client certificate; ``options.limits.max_streams`` bounds the calls
    served at once (the thread pool grows to ``max_streams + 2`` so the limit,
    not the pool, is what a caller meets).  ``tables`` (a new registry if
    None) is served by the EmbeddingService beside the ParameterServer service.

    Raises:
        FailedPreconditionError: ``bind`` is not loopback, ``security``
            authenticates nobody and ``options.insecure`` is False.
        UnavailableError: the address cannot be bound.
    """
    *_, server, bound = _build(
        store, options or ServerOptions(), security, health_servicer, metrics, tables
    )
    return server, bound


def _build(
    store: VariableStore,
    options: ServerOptions,
    security: SecurityConfig | None,
    health_servicer: health.HealthServicer | None,
    metrics: PSMetrics | None,
    tables: TableRegistry | None,
) -> tuple[ParameterServerServicer, EmbeddingServicer, grpc.Server, int]:
    """:func:`create_server`, also returning the servicers (the data plane calls them)."""
    limits = options.limits
    edge = Edge(  # one for both services and both transports
        store.task,
        max_streams=limits.max_streams,
        max_streams_per_client=limits.max_streams_per_client,
        stream_idle_timeout=limits.stream_idle_timeout,
        metrics=metrics,
    )
    if metrics is not None and edge.gate is not None:
        gate = edge.gate
        metrics.watch_streams(lambda: gate.active)
    servicer = ParameterServerServicer(
        store,
        chunk_bytes=options.chunk_bytes,
        max_message_bytes=options.max_message_bytes,
        edge=edge,
    )
    embedding = EmbeddingServicer(
        tables or TableRegistry(store.task, options.tier), store.max_tensor_bytes, edge
    )
    threads = options.threads
    server, bound = serving.build_server(
        (servicer.generic_handler(), embedding.generic_handler()),
        SERVICE,
        bind=options.bind,
        port=options.port,
        security=security or SecurityConfig(),
        insecure=options.insecure,
        task=store.task,
        threads=max(threads, limits.max_streams + 2) if limits.max_streams else threads,
        thread_name_prefix="ps-rpc",
        options=server_options(options.max_message_bytes),
        metrics=metrics,
        health_servicer=health_servicer,
    )
    return servicer, embedding, server, bound


def start_data_plane(
    servicer: ParameterServerServicer,
    options: ServerOptions,
    security: SecurityConfig,
    *,
    metrics: PSMetrics | None = None,
    embedding: EmbeddingServicer | None = None,
) -> DataPlaneServer:
    """Starts the data plane ``options.data_plane`` describes, serving ``servicer``'s
    Push and Pull (and ``embedding``'s Lookup and PushGradients, when given) on
    ``options.bind``, and announces it (DataPlaneInfo).  A frame carries at most a
    gRPC message's bytes; larger pushes and pulls stream over gRPC, whose chunks
    come from the heap the process already holds (a 1 GB frame buffer cost a
    fresh 1 GB mapping).

    Raises:
        UnavailableError: its port cannot be bound.
    """
    plane_options = options.data_plane or DataPlaneOptions()
    max_payload = options.max_message_bytes
    handlers = servicer.data_plane_handlers()
    if embedding is not None:  # through the same edge: gate, limits, metrics, log context
        handlers.update(embedding.data_plane_handlers())
    plane = DataPlaneServer(
        options.bind,
        plane_options.port,
        security,
        handlers,
        max_connections=plane_options.max_connections,
        idle_timeout=plane_options.idle_timeout,
        hello_timeout=plane_options.hello_timeout,
        io_timeout=plane_options.io_timeout,
        max_payload=max_payload,
        on_reject=None if metrics is None else metrics.record_rejection,
        around=servicer.edge.plane_call,  # the one edge of every call, both services'
    ).start()
    advertise = plane_options.advertise
    servicer.announce_data_plane(plane.port, advertise, max_payload)
    log.info(
        "data plane on %s%s",
        serving.host_port(options.bind, plane.port),
        f" (advertised as {advertise})" if advertise else "",
    )
    return plane


def serve(
    store: VariableStore,
    options: ServerOptions | None = None,
    *,
    security: SecurityConfig | None = None,
    stop_event: threading.Event | None = None,
    tables: TableRegistry | None = None,
) -> int:
    """Runs a parameter server until SIGTERM/SIGINT (or ``stop_event``); returns 0.

    Prints ``PSFLOW_READY ps port=<port> task=<task> pid=<pid>`` on stdout once
    bound (followed by `` data_port=<port>`` when ``options.data_plane`` is set and
    `` metrics_port=<port>`` when ``options.metrics_port`` is not None: 0 picks a
    free one).  The data plane stops before the final checkpoint is written.
    Signal handlers are installed only when called from the main thread.  A task
    drained by a resize (the Drain RPC, once it holds no variables) stops the
    same way, then prints ``PSFLOW_DRAINED task=<task> pid=<pid>`` and returns 0.
    """
    options = options or ServerOptions()
    bind, grace = options.bind, options.grace
    restore_dir, checkpoint_dir = options.restore_dir, options.checkpoint_dir
    health_servicer = health.HealthServicer()
    tables = tables or TableRegistry(store.task, options.tier)
    metrics = None
    if options.metrics_port is not None:
        metrics = PSMetrics(Registry(), store.task, store_stats=lambda: _store_stats(store))
        watch_tables(metrics.registry, store.task, tables)
    servicer, embedding, server, bound = _build(
        store, options, security, health_servicer, metrics, tables
    )
    log.info("listening on %s", serving.host_port(bind, bound))
    plane = None
    if options.data_plane is not None:
        plane = start_data_plane(
            servicer, options, security or SecurityConfig(), metrics=metrics, embedding=embedding
        )
    prefix = store.task.replace(":", "-")

    def restore() -> None:
        if restore_dir:
            shard = tables.saved_shard(restore_dir, prefix)
            if shard is not None:  # this task's dynamic embedding tables
                names, rows = tables.restore(restore_dir, *shard)
                log.info("restored tables %s (%d rows) from %s", names, rows, restore_dir)
                if not os.path.exists(mf.manifest_path(restore_dir, prefix)):
                    return
            result = restore_shard(store, restore_dir, prefix)
            log.info(
                "restored step %d (%d variables) from %s",
                result.step,
                len(result.names),
                restore_dir,
            )

    def finish(left: float) -> None:
        if plane is not None:  # no push may land after the final checkpoint: a push
            # being applied gets what the grace has left (at least a second) to finish
            plane.stop(max(left, 1.0))
        if checkpoint_dir:
            result = save_shard(store, checkpoint_dir, prefix)
            log.info("final checkpoint %s (%d bytes)", result.manifest_path, result.bytes_written)
            if tables.stats():
                tables.save(checkpoint_dir, prefix)

    stop = stop_event or threading.Event()

    def watch_drain() -> None:
        # a resize moved every variable away and told this task to go: stop like SIGTERM
        while not stop.is_set():
            if store.drained.wait(0.5):
                stop.set()

    threading.Thread(target=watch_drain, name="ps-drain-watch", daemon=True).start()
    try:
        code = serving.serve_until_stopped(
            server,
            bound,
            health_servicer,
            SERVICE,
            role="ps",
            task=store.task,
            grace=grace,
            stop_event=stop,
            metrics=metrics,
            metrics_address=(options.metrics_bind or bind, options.metrics_port),
            before_serving=restore,
            after_drain=finish,
            ready_extra="" if plane is None else f"data_port={plane.port}",
        )
    finally:
        if plane is not None:
            plane.stop(1.0)
    if store.drained.is_set():  # a supervisor must not restart a drained task
        sys.stdout.write(f"{DRAINED_LINE} task={store.task} pid={os.getpid()}\n")
        sys.stdout.flush()
    return code


def _store_stats(store: VariableStore) -> dict:
    """The store's counters as the metrics read them at scrape time."""
    stats = store.stats_snapshot()
    stats["applied_by_variable"] = store.stats.applied_counts()
    return stats

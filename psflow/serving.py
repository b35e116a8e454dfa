"""Running a psflow gRPC server process: readiness line, health, signals, graceful drain.

Shared by ``python -m ps_server`` and ``python -m worker``: both build their
server with :func:`build_server`, run it with :func:`serve_until_stopped` and
parse their flags with :func:`server_parser`.  Both print one
machine-readable line once bound (``PSFLOW_READY <role> port=<port> task=<task>
pid=<pid>``), answer the standard gRPC health check (NOT_SERVING until ready,
SERVING while up, NOT_SERVING again on SIGTERM), and on SIGTERM or SIGINT let
in-flight calls finish within a grace period before exiting.
"""

from __future__ import annotations

import argparse
import atexit
import concurrent.futures
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from psflow import thread_budget
from psflow.errors import UnavailableError
from psflow.launch import READY_FORMAT
from psflow.security.grpc_auth import add_port, server_interceptors

log = logging.getLogger("psflow.serving")

# how soon the serving loop notices a stop signal (the handler only records it)
_STOP_POLL_SECONDS = 0.1
# how long a stopped server's exit may wait for threads still running calls
_EXIT_LINGER_SECONDS = 2.0


def host_port(bind: str, port: int) -> str:
    """``host:port``, with IPv6 hosts bracketed."""
    if ":" in bind and not bind.startswith("["):
        bind = f"[{bind}]"
    return f"{bind}:{port}"


def set_health(servicer: health.HealthServicer, services: Sequence[str], serving: bool) -> None:
    """Sets the overall and per-service health status."""
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for name in ("", *services):
        servicer.set(name, status)


class RecordsRejections(Protocol):
    """The servers' metrics: counts a rejected request by reason."""

    def record_rejection(self, reason: str) -> None:
        """One rejected request."""


class HasRegistry(Protocol):
    """The servers' metrics: their families live in ``registry``."""

    registry: Any


def _new_server(
    bind: str,
    security: Any,
    insecure: bool,
    *,
    threads: int,
    thread_name_prefix: str,
    options: Sequence[tuple[str, Any]],
    metrics: RecordsRejections | None = None,
) -> grpc.Server:
    """A gRPC server (not bound, not started) with ``security``'s interceptors.

    A call refused for missing credentials is counted as ``unauthenticated``
    in ``metrics``.

    Raises:
        FailedPreconditionError: ``bind`` is not loopback, ``security``
            authenticates nobody and ``insecure`` is False.
    """
    from psflow.security.config import check_bind

    check_bind(bind, security, insecure)
    on_reject = (
        None if metrics is None else (lambda _m: metrics.record_rejection("unauthenticated"))
    )
    return grpc.server(
        concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=thread_name_prefix),
        options=list(options),
        interceptors=server_interceptors(security, on_reject),
    )


def start_metrics(metrics: HasRegistry | None, bind: str, port: int | None) -> Any:
    """A ``MetricsServer`` for ``metrics`` on ``bind:port``, or None without metrics.

    Raises:
        UnavailableError: the metrics port cannot be bound.
    """
    if metrics is None or port is None:
        return None
    from psflow.observability.http import MetricsServer

    return MetricsServer(metrics.registry, bind, port)


def ready_fields(metrics_server: Any) -> str:
    """The ready line's extra fields: `` metrics_port=<port>`` when metrics are served."""
    return "" if metrics_server is None else f"metrics_port={metrics_server.port}"


def server_parser(module: str, doc: str, role: str, grace_help: str) -> argparse.ArgumentParser:
    """``python -m module``'s parser (described by ``doc``'s first line) with the flags
    every server process takes: address, task, grace (``grace_help`` says what the
    role does meanwhile), memory, security, limits and observability (``role``:
    ``"ps"`` or ``"worker"``)."""
    from psflow.observability.flags import add_observability_flags
    from psflow.security.flags import add_limit_flags, add_security_flags

    p = argparse.ArgumentParser(prog=f"python -m {module}", description=doc.splitlines()[0])
    p.add_argument("--port", type=int, help="port to listen on (0: any); default from TF_CONFIG")
    p.add_argument("--bind", help="address to bind (default 127.0.0.1; 0.0.0.0 with TF_CONFIG)")
    p.add_argument("--task", help=f"task name (default from TF_CONFIG, else {role}:0)")
    p.add_argument("--grace", type=float, default=10.0, help=grace_help)
    p.add_argument("--no-malloc-tuning", action="store_true", help="keep glibc's malloc defaults")
    add_security_flags(p)
    add_limit_flags(p, role)
    add_observability_flags(p)
    return p


def setup_process(
    args: argparse.Namespace, role: str, task: str | None, bind: str | None
) -> tuple[str, str, Any]:
    """Configures logging, malloc tuning and the BLAS thread budget
    (:mod:`psflow.thread_budget`) from :func:`server_parser`'s flags and the environment.

    Returns:
        ``(bind, task, security)``: ``bind`` (default ``127.0.0.1``), ``task``
        (default ``<role>:0``) and the ``SecurityConfig`` the server binds with.

    Raises:
        OpError: a bad log level or format, unusable security settings, or a
            bad ``PSFLOW_BLAS_THREADS`` / ``OPENBLAS_NUM_THREADS``... value.
    """
    from psflow import memory
    from psflow.observability.logs import configure_logging
    from psflow.security.flags import security_from_flags

    bind = bind or "127.0.0.1"
    task = task or f"{role}:0"
    configure_logging(role, task, args.log_level, args.log_format)
    security = security_from_flags(args, bind)
    thread_budget.start_process_budget(role)
    # gradients and pulled values are megabyte buffers every step
    memory.ensure_tuned(False if args.no_malloc_tuning else None)
    return bind, task, security


def usage_error(prog: str, error: object) -> int:
    """Writes ``prog: error`` on stderr; returns the exit status of a usage error (2)."""
    sys.stderr.write(f"{prog}: {error}\n")
    return 2


def build_server(
    handlers: Sequence[grpc.GenericRpcHandler],
    service: str,
    *,
    bind: str,
    port: int,
    security: Any,
    insecure: bool,
    task: str,
    threads: int,
    thread_name_prefix: str,
    options: Sequence[tuple[str, Any]],
    metrics: RecordsRejections | None = None,
    health_servicer: health.HealthServicer | None = None,
) -> tuple[grpc.Server, int]:
    """A server (not started) serving ``handlers`` (the first one ``service``), health
    and reflection, with ``security``'s interceptors, bound to ``bind:port``; returns
    ``(server, port)``.

    Raises:
        FailedPreconditionError: ``bind`` is not loopback, ``security``
            authenticates nobody and ``insecure`` is False.
        UnavailableError: the address cannot be bound (named).
    """
    server = _new_server(
        bind,
        security,
        insecure,
        threads=threads,
        thread_name_prefix=thread_name_prefix,
        options=options,
        metrics=metrics,
    )
    main, *others = handlers
    if others:
        server.add_generic_rpc_handlers(tuple(others))
    bound = _register_and_bind(server, main, service, health_servicer, bind, port, security, task)
    return server, bound


def _register_and_bind(
    server: grpc.Server,
    handler: grpc.GenericRpcHandler,
    service: str,
    health_servicer: health.HealthServicer | None,
    bind: str,
    port: int,
    security: Any,
    task: str,
) -> int:
    """Adds ``handler``, health (SERVING unless a servicer is given) and reflection to
    ``server`` and binds ``bind:port`` with ``security``'s credentials; returns the port.

    Raises:
        UnavailableError: the address cannot be bound (named).
    """
    server.add_generic_rpc_handlers((handler,))
    if health_servicer is None:
        health_servicer = health.HealthServicer()
        set_health(health_servicer, (service,), serving=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (service, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    address = host_port(bind, port)
    try:
        bound = add_port(server, address, security)
    except RuntimeError as e:
        raise UnavailableError(f"cannot bind {address}: {e}", task=task) from e
    if not bound:
        raise UnavailableError(f"cannot bind {address}", task=task)
    return bound


def install_stop_signals(stop: threading.Event) -> Callable[[], bool]:
    """SIGTERM and SIGINT ask for a stop; returns whether one came (check it with
    :func:`stop_requested`).  Handlers are set only from the main thread, where
    Python allows it; elsewhere the returned check is always False.

    The handler only records the signal, it does not set ``stop``: Python runs it in
    the main thread between two bytecodes, which may be inside ``stop.wait()`` while
    that thread holds the event's own lock, and setting the event there would wait
    for that lock forever (the process then ignored every later SIGTERM).
    """
    received: list[int] = []
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: received.append(signum))
    return lambda: bool(received)


def stop_requested(stop: threading.Event, signalled: Callable[[], bool], poll: float) -> bool:
    """Waits up to ``poll`` seconds for ``stop``; a stop signal sets it (outside the handler).

    Returns:
        Whether the caller should stop.
    """
    if stop.wait(poll):
        return True
    if signalled():
        stop.set()
        return True
    return False


def exit_process(code: int, linger: float = _EXIT_LINGER_SECONDS) -> NoReturn:
    """Ends a server process that stopped serving with ``code``, within ``linger`` seconds.

    Python's exit waits for every non-daemon thread, gRPC's handler pool among them,
    so a call still running when the drain's grace ran out (a closure that sleeps,
    a read from a PS that is gone) kept a stopped worker alive until it returned,
    or until a supervisor's SIGKILL.  Past ``linger`` the exit stops waiting: it
    says so, runs the exit handlers (they remove shared-memory segments and
    temporary files) and leaves.
    """

    def leave() -> None:
        time.sleep(linger)
        main = threading.main_thread()  # waiting for the others, in Python's exit
        busy = [t.name for t in threading.enumerate() if t is not main and not t.daemon]
        log.warning(
            "exiting %.1fs after serving stopped, not waiting for %d thread(s) still running: %s",
            linger,
            len(busy),
            ", ".join(sorted(busy)[:5]),
        )
        try:
            atexit._run_exitfuncs()
        finally:
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    threading.Thread(target=leave, name="psflow-exit", daemon=True).start()
    sys.exit(code)


def serve_until_stopped(
    server: grpc.Server,
    port: int,
    health_servicer: health.HealthServicer,
    service: str,
    *,
    role: str,
    task: str,
    grace: float = 10.0,
    stop_event: threading.Event | None = None,
    metrics: HasRegistry | None = None,
    metrics_address: tuple[str, int | None] = ("127.0.0.1", None),
    before_serving: Callable[[], None] | None = None,
    after_drain: Callable[[float], None] | None = None,
    ready_extra: str = "",
) -> int:
    """Serves ``metrics`` on ``metrics_address`` (``(bind, port)``; port None: no
    metrics, 0: any free one, named in the ready line), then
    :func:`run_until_stopped`; closes the metrics server after the drain.
    ``ready_extra`` (``key=value`` fields) goes into the ready line too.

    Raises:
        UnavailableError: the metrics port cannot be bound.
    """
    metrics_server = start_metrics(metrics, *metrics_address)
    try:
        return run_until_stopped(
            server,
            port,
            health_servicer,
            (service,),
            role=role,
            task=task,
            grace=grace,
            stop_event=stop_event,
            before_serving=before_serving,
            after_drain=after_drain,
            ready_extra=" ".join(f for f in (ready_extra, ready_fields(metrics_server)) if f),
        )
    finally:
        if metrics_server is not None:
            metrics_server.close()


def run_until_stopped(
    server: grpc.Server,
    port: int,
    health_servicer: health.HealthServicer,
    services: Sequence[str],
    *,
    role: str,
    task: str,
    grace: float = 10.0,
    stop_event: threading.Event | None = None,
    before_serving: Callable[[], None] | None = None,
    after_drain: Callable[[float], None] | None = None,
    ready_extra: str = "",
) -> int:
    """Starts ``server``, announces readiness, serves until a stop signal, drains; returns 0.

    ``before_serving`` runs after the ready line and before health turns SERVING
    (e.g. a restore); ``after_drain`` runs once in-flight calls finished (e.g. a
    final checkpoint), given the seconds left of ``grace`` since the stop: what
    another transport's calls may still take, so that the whole drain keeps to one
    grace (a supervisor's kill comes after it).  ``ready_extra`` (``key=value`` fields) ends the ready line,
    followed by ``blas_threads=N``: the BLAS threads this process runs with.
    """
    stop = stop_event or threading.Event()
    signalled = install_stop_signals(stop)
    set_health(health_servicer, services, serving=False)
    server.start()
    ready = READY_FORMAT.format(role=role, port=port, task=task, pid=os.getpid())
    ready_extra = " ".join(f for f in (ready_extra, thread_budget.ready_field()) if f)
    sys.stdout.write(f"{ready} {ready_extra}\n")
    sys.stdout.flush()
    try:
        if before_serving is not None:
            before_serving()
    except BaseException:
        server.stop(0)
        raise
    set_health(health_servicer, services, serving=True)
    log.info("serving on port %d", port)
    while not stop_requested(stop, signalled, _STOP_POLL_SECONDS):
        pass
    log.info("stopping: health NOT_SERVING, draining in-flight calls for up to %.1fs", grace)
    start = time.monotonic()
    # Refuse new calls first, then report NOT_SERVING (to watches already open):
    # the other order leaves a moment where a new call is still accepted.
    drained = server.stop(grace)
    health_servicer.enter_graceful_shutdown()
    drained.wait(grace + 5.0)
    log.info("drained in %.2fs", time.monotonic() - start)
    if after_drain is not None:
        after_drain(max(0.0, grace - (time.monotonic() - start)))
    return 0

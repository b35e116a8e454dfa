"""The server edge: where every call enters a PS task, by gRPC or by the data plane.

One :class:`Edge` serves both servicers (the ParameterServer and the
EmbeddingService) on both transports.  Around each call it does, once:

* **admission**: a ``--max-streams`` slot for the caller (when every slot is
  taken, a streaming call idle over :data:`EVICT_AFTER_IDLE` s yields its own);
* **idleness**: a streaming gRPC call that stops moving is cancelled (:mod:`.idle`);
* **log context**: records carry the call's request id, rejections included;
* **metrics**: the call's status and latency, and every rejection's reason;
* **typed errors**: a psflow :class:`OpError` passes out as it is; a call whose
  client left is a :class:`CancelledError` (neither a rejection nor a server
  error); anything else is logged and becomes an :class:`InternalError`.

The transports then only render the error's :func:`~psflow.errors.status_of`:
gRPC aborts with it (:meth:`Edge.grpc_method`), the data-plane server sends it
in an ERROR frame (:meth:`Edge.plane_call` lets it propagate).
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import grpc

from psflow.errors import (
    CancelledError,
    InternalError,
    InvalidArgumentError,
    OpError,
    ResourceExhaustedError,
    status_of,
    to_grpc_code,
)
from psflow.observability.logs import log_context
from psflow.observability.services import PSMetrics
from psflow.security.limits import StreamGate
from psflow.transport.dataplane import Request

from .idle import IdleWatch, Watched, touching

__all__ = ["EVICT_AFTER_IDLE", "EVICT_WAIT", "Edge", "Malformed", "check", "lenient"]

log = logging.getLogger(__name__)

# With every slot taken, a streaming call idle this long is cancelled to admit a new
# call, which waits up to EVICT_WAIT for the slot to be released.
EVICT_AFTER_IDLE = 1.0
EVICT_WAIT = 2.0


class Malformed:
    """A request that failed to parse; :func:`check` raises ``error`` in the handler."""

    __slots__ = ("error",)

    def __init__(self, error: OpError) -> None:
        self.error = error


def lenient(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """Wraps a deserializer so malformed bytes reach the handler as a :class:`Malformed`
    (its call then fails INVALID_ARGUMENT through the edge), not gRPC's INTERNAL."""

    def deserialize(raw: bytes) -> Any:
        try:
            return parse(raw)
        except OpError as e:
            return Malformed(e)
        except Exception as e:  # protobuf DecodeError and friends
            return Malformed(InvalidArgumentError(f"malformed request: {e}"))

    return deserialize


def check(message: Any) -> Any:
    """``message``, or the error of a request that did not parse (raised)."""
    if isinstance(message, Malformed):
        raise message.error
    return message


class Edge:
    """Admission, idleness, log context, metrics and typed errors for every call.

    Args:
        task: this task's name (request ids are ``task/n``).
        max_streams: calls served at once; one more is refused with
            RESOURCE_EXHAUSTED (None: no limit beyond the thread pool).
        max_streams_per_client: of those, calls one client connection may have.
        stream_idle_timeout: seconds a streaming gRPC call may go without a
            message before it is cancelled (None: never).
        metrics: where to record calls, latencies and rejections.
    """

    def __init__(
        self,
        task: str,
        *,
        max_streams: int | None = None,
        max_streams_per_client: int | None = None,
        stream_idle_timeout: float | None = None,
        metrics: PSMetrics | None = None,
    ) -> None:
        self.task = task
        self.metrics = metrics
        self.gate = (
            StreamGate(max_streams, per_client=max_streams_per_client) if max_streams else None
        )
        self.idle = None
        if stream_idle_timeout:
            on_expire = None
            if metrics is not None:
                on_expire = lambda _label: metrics.record_rejection("stream_idle")  # noqa: E731
            self.idle = IdleWatch(stream_idle_timeout, on_expire)
        self._ids = itertools.count(1)

    # -- the transports -------------------------------------------------------------------
    def grpc_method(self, name: str, fn: Callable, *, streaming: bool) -> Callable:
        """``fn(request, context)`` as a gRPC handler; ``streaming``: the request or the
        reply is a stream (then watched for idleness)."""
        watch = streaming and self.idle is not None

        if inspect.isgeneratorfunction(fn):

            @functools.wraps(fn)
            def replies(request: Any, context: grpc.ServicerContext) -> Any:
                try:
                    with self._grpc_call(name, context) as call:
                        out = fn(request, context)
                        yield from touching(out, call.watch(context)) if watch else out
                except OpError as e:
                    _abort(context, e)

            return replies

        @functools.wraps(fn)
        def unary(request: Any, context: grpc.ServicerContext) -> Any:
            try:
                with self._grpc_call(name, context) as call:
                    if watch:
                        request = touching(request, call.watch(context))
                    return fn(request, context)
            except OpError as e:
                _abort(context, e)

        return unary

    def _grpc_call(self, name: str, context: grpc.ServicerContext) -> _Call:
        peer = context.peer() if self.gate is not None or self.idle is not None else ""
        return _Call(self, name, peer, lambda: not context.is_active(), context.time_remaining)

    def plane_call(self, request: Request) -> _Call:
        """The context a data-plane call runs in (the data-plane server's ``around``);
        its typed errors propagate to the server, which answers them in an ERROR frame."""
        return _Call(self, request.method, request.peer, request.peer_gone, request.time_remaining)

    # -- admission ------------------------------------------------------------------------
    def take_slot(self, peer: str) -> None:
        """A slot of the gate for ``peer``; release it with ``gate.release(peer)``."""
        try:
            self.gate.acquire(peer)
        except ResourceExhaustedError as e:
            # every slot taken: a streaming call that stopped moving yields its own
            if getattr(e, "reason", None) != "too_many_streams" or not (
                self.idle is not None and self.idle.evict_idlest(EVICT_AFTER_IDLE)
            ):
                raise
            self.gate.acquire(peer, wait=EVICT_WAIT)


class _Call:
    """One call through the :class:`Edge`: entering takes its slot (a refusal is
    recorded like any other failure); leaving records the call and turns what it
    raised into the typed error it ends with."""

    __slots__ = (
        "_log",
        "_watched",
        "_watching",
        "edge",
        "gone",
        "held",
        "name",
        "peer",
        "start",
        "time_left",
    )

    def __init__(
        self,
        edge: Edge,
        name: str,
        peer: str,
        gone: Callable[[], bool],
        time_left: Callable[[], float | None],
    ) -> None:
        self.edge, self.name, self.peer = edge, name, peer
        self.gone, self.time_left = gone, time_left
        self.held = False
        self._watched: Any = None

    def __enter__(self) -> _Call:
        edge = self.edge
        self.start = time.perf_counter() if edge.metrics is not None else 0.0
        # the log context spans the rejection too, so its record carries the request id
        self._log = log_context(request_id=f"{edge.task}/{next(edge._ids)}")
        self._log.__enter__()
        if edge.gate is not None:
            try:
                edge.take_slot(self.peer)
            except BaseException as e:
                self.__exit__(type(e), e, None)
                raise
            self.held = True
        return self

    def watch(self, context: grpc.ServicerContext) -> Watched:
        """Watches this (streaming gRPC) call for idleness until it ends."""
        self._watching = self.edge.idle.watching(f"{self.name} from {self.peer}", context.cancel)
        self._watched = self._watching.__enter__()
        return self._watched

    def __exit__(self, kind: Any, error: BaseException | None, tb: Any) -> None:
        edge, code = self.edge, "OK"
        try:
            if error is not None and isinstance(error, Exception):
                code, typed = self._outcome(error)
                if typed is not error:
                    raise typed from error
        finally:
            if self._watched is not None:
                self._watching.__exit__(None, None, None)
            if self.held:
                edge.gate.release(self.peer)
            if edge.metrics is not None:
                edge.metrics.record_rpc(self.name, code, time.perf_counter() - self.start)
            self._log.__exit__(None, None, None)

    def _outcome(self, error: Exception) -> tuple[str, OpError]:
        """The status name a failed call is counted under, and the typed error it ends with."""
        watched = self._watched
        if self.gone() or (watched is not None and watched.expired):
            # the client cancelled or its deadline passed (a request stream then breaks
            # off however it may): nobody waits for an answer, and a client giving up
            # is neither a rejection nor a server error
            log.debug("%s ended by its client: %s: %s", self.name, type(error).__name__, error)
            left = self.time_left()
            code = "DEADLINE_EXCEEDED" if left is not None and left <= 0 else "CANCELLED"
            return code, CancelledError("the call ended on the client side")
        if isinstance(error, OpError):
            log.debug("%s rejected: %s", self.name, error)
            if self.edge.metrics is not None:
                reason = getattr(error, "reason", None) or error.code.name.lower()
                self.edge.metrics.record_rejection(reason)
            return error.code.name, error
        log.exception("%s failed", self.name)
        return "INTERNAL", InternalError(f"{self.name}: {type(error).__name__}: {error}")


def _abort(context: grpc.ServicerContext, error: OpError) -> None:
    """Ends a gRPC call with ``error``'s status (a redirect as trailing metadata)."""
    status = status_of(error)
    if status.metadata:
        context.set_trailing_metadata(status.metadata)
    context.abort(to_grpc_code(error), status.details)

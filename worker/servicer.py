"""The Worker servicer: translates calls into calls on the :class:`ClosureExecutor`.

The calls come over gRPC (every method) or over the worker's data plane
(``RunClosure`` only, see :mod:`worker.plane`): both go through
:meth:`WorkerServicer.run_closure` and :meth:`WorkerServicer.recorded`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from psflow import compression as compression_lib
from psflow import errors
from psflow.distribute.ps import session as session_lib
from psflow.observability.logs import log_context
from psflow.observability.services import WorkerMetrics
from psflow.proto import ps_pb2, worker_pb2, worker_pb2_grpc
from psflow.security.limits import WorkerLimits, limit_exceeded
from psflow.transport.dataplane import Handler, Reply, Request
from worker.executor import ClosureExecutor

SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
MAX_DETAILS_CHARS = 4096  # gRPC refuses status details beyond its metadata limit

log = logging.getLogger(__name__)


class _Malformed:
    """A request whose bytes did not parse; the handler answers INVALID_ARGUMENT."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _lenient(message_cls: type) -> Callable[[bytes], Any]:
    # gRPC would answer a deserializer's exception with INTERNAL; malformed
    # input is the caller's error, so it becomes INVALID_ARGUMENT.
    def parse(raw: bytes) -> Any:
        try:
            return message_cls.FromString(raw)
        except Exception as e:
            return _Malformed(f"malformed {message_cls.__name__}: {e}")

    return parse


def _details(message: str) -> str:
    """A status message that fits gRPC's metadata and encodes as UTF-8."""
    if len(message) > MAX_DETAILS_CHARS:
        message = f"{message[:MAX_DETAILS_CHARS]}... ({len(message)} chars)"
    return message.encode("utf-8", "backslashreplace").decode("utf-8")


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Runs closures; a closure's own exception is a reply, never an RPC error.

    Args:
        executor: runs the closures.
        limits: the closure size limit (default :class:`WorkerLimits`).
        metrics: where to record closures, calls and rejections.
    """

    def __init__(
        self,
        executor: ClosureExecutor,
        *,
        limits: WorkerLimits | None = None,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self._executor = executor
        self._limits = limits or WorkerLimits()
        self._metrics = metrics
        # where this worker's data plane serves RunClosure (port 0: none), for GetStatus
        self._data_plane = ps_pb2.DataPlaneInfoResponse()
        self._parse_closure = _lenient(worker_pb2.RunClosureRequest)

    def generic_handler(self) -> grpc.GenericRpcHandler:
        """Every method of the Worker service, with lenient request parsing and metrics."""
        methods = {
            "RunClosure": worker_pb2.RunClosureRequest,
            "EndSession": worker_pb2.EndSessionRequest,
            "GetStatus": worker_pb2.GetStatusRequest,
        }
        handlers = {
            name: grpc.unary_unary_rpc_method_handler(
                self._edge(name, getattr(self, name)),
                request_deserializer=_lenient(request_cls),
                response_serializer=lambda m: m.SerializeToString(),
            )
            for name, request_cls in methods.items()
        }
        return grpc.method_handlers_generic_handler(SERVICE, handlers)

    # -- the data plane ---------------------------------------------------------------
    def announce_data_plane(self, port: int, address: str, max_payload: int) -> None:
        """Where this worker's data plane serves RunClosure, as GetStatus answers it."""
        self._data_plane = ps_pb2.DataPlaneInfoResponse(
            port=port, address=address, max_payload_bytes=max_payload
        )

    def data_plane_handlers(self) -> dict[str, Handler]:
        """The data plane's one method, RunClosure: the serialized request is the
        frame's payload, and the serialized reply the reply's."""
        return {"RunClosure": self._plane_run_closure}

    def _plane_run_closure(self, request: Request) -> Reply | None:
        parsed = self._parse_closure(request.payload)
        if isinstance(parsed, _Malformed):
            raise errors.InvalidArgumentError(parsed.reason)
        # sent from here, inside the call's edge: a drain on SIGTERM waits for the reply
        return request.respond(buffers=(self.run_closure(parsed).SerializeToString(),))

    @contextlib.contextmanager
    def recorded(self, name: str, gone: Callable[[], bool]) -> Iterator[None]:
        """Records one call of ``name`` (its status code; a refusal's reason) in the
        metrics, whichever transport brought it; ``gone``: whether its caller left."""
        code = "OK"
        try:
            yield
        except errors.OpError as e:
            code = e.code.name
            if self._metrics is not None:
                self._metrics.record_rejection(getattr(e, "reason", None) or e.code.name.lower())
            raise
        except Exception:
            code = "CANCELLED" if gone() else "INTERNAL"
            raise
        finally:
            if self._metrics is not None:
                self._metrics.record_rpc(name, code)

    def _edge(self, name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def handle(request: Any, context: grpc.ServicerContext) -> Any:
            try:
                with self.recorded(name, lambda: not context.is_active()):
                    if isinstance(request, _Malformed):
                        raise errors.InvalidArgumentError(request.reason)
                    return fn(request, context)
            except errors.OpError as e:
                context.abort(errors.to_grpc_code(e), _details(str(e)))
            except Exception as e:
                if not context.is_active():  # the caller gave up: not a worker error
                    log.debug("%s ended by its client: %s", name, e)
                    context.abort(grpc.StatusCode.CANCELLED, "the call ended on the client side")
                log.exception("%s failed", name)
                context.abort(
                    grpc.StatusCode.INTERNAL, _details(f"{name}: {type(e).__name__}: {e}")
                )

        return handle

    def RunClosure(
        self, request: worker_pb2.RunClosureRequest, context: grpc.ServicerContext
    ) -> worker_pb2.RunClosureResponse:
        """Runs one closure (its own exception comes back in the reply)."""
        return self.run_closure(request)

    def run_closure(self, request: worker_pb2.RunClosureRequest) -> worker_pb2.RunClosureResponse:
        """Checks and runs one closure, whichever transport brought it (gRPC's
        ``RunClosure``, the data plane's).

        Raises:
            InvalidArgumentError: no session id or function key, a bad training mode.
            ResourceExhaustedError: the closure is above ``max_closure_bytes``.
        """
        if not request.session_id:
            raise errors.InvalidArgumentError("RunClosure needs a session_id")
        if not request.function_key:
            raise errors.InvalidArgumentError("RunClosure needs a function_key")
        nbytes = len(request.function) + len(request.arguments)
        limit = self._limits.max_closure_bytes
        if nbytes > limit:
            raise limit_exceeded(
                "closure_too_large",
                f"closure {request.function_key!r} of {nbytes} bytes (function "
                f"{len(request.function)} + arguments {len(request.arguments)})",
                nbytes,
                limit,
                "--max-closure-bytes",
            )
        training = _training_mode(request)
        start = time.perf_counter()
        request_id = f"{request.session_id}/c{request.closure_id}"
        with log_context(step=request.step or None, request_id=request_id):
            outcome = self._executor.run(
                request.session_id,
                request.function_key,
                request.function,
                request.arguments,
                request.resource_key,
                request.step,
                request.closure_id,
                training,
            )  # an OpError here means the worker itself failed (e.g. its PS session)
        reply = worker_pb2.RunClosureResponse(
            result=outcome.result,
            function_missing=outcome.function_missing,
            missing_resource=outcome.missing_resource,
            run_seconds=outcome.run_seconds,
        )
        if outcome.error is not None:
            reply.error.CopyFrom(worker_pb2.ClosureError(**outcome.error))
        if self._metrics is not None:
            kind = (
                "error"
                if outcome.error is not None
                else "function_missing"
                if outcome.function_missing
                else "missing_resource"
                if outcome.missing_resource
                else "ok"
            )
            self._metrics.record_closure(
                kind, time.perf_counter() - start, nbytes, int(request.step)
            )
        return reply

    def EndSession(
        self, request: worker_pb2.EndSessionRequest, context: grpc.ServicerContext
    ) -> worker_pb2.EndSessionResponse:
        """Forgets a coordinator session."""
        return worker_pb2.EndSessionResponse(existed=self._executor.end_session(request.session_id))

    def GetStatus(
        self, request: worker_pb2.GetStatusRequest, context: grpc.ServicerContext
    ) -> worker_pb2.GetStatusResponse:
        """Describes this worker."""
        ex = self._executor
        return worker_pb2.GetStatusResponse(
            task=ex.task,
            session_ids=ex.session_ids(),
            closures_run=ex.closures_run,
            closures_failed=ex.closures_failed,
            pid=os.getpid(),
            started_at=ex.started_at,
            data_plane=self._data_plane,
        )


def _training_mode(request: worker_pb2.RunClosureRequest) -> session_lib.TrainingMode | None:
    """The closure's training mode, validated before anything runs (None: not sent).

    Raises:
        InvalidArgumentError: an unknown mode, a timeout that is not a finite
            number > 0, no workers, or an unknown compression codec.
    """
    if not request.HasField("training"):
        return None
    t = request.training
    if t.num_workers < 1:
        raise errors.InvalidArgumentError(f"training.num_workers must be >= 1, got {t.num_workers}")
    compression: str | dict[str, str] | None = (
        dict(t.compression_by_variable) or t.compression or None
    )
    compression_lib.feedback_from_option(compression)  # validates the codec names
    return session_lib.TrainingMode(
        session_lib.SyncConfig(t.mode, t.num_workers, t.sync_timeout), compression
    )

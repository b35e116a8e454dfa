"""The Worker gRPC servicer: translates RPCs into calls on the :class:`ClosureExecutor`."""

from __future__ import annotations

import os

import grpc

from psflow import errors
from psflow.proto import worker_pb2, worker_pb2_grpc
from worker.executor import ClosureExecutor


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Runs closures; a closure's own exception is a reply, never an RPC error."""

    def __init__(self, executor: ClosureExecutor) -> None:
        self._executor = executor

    def RunClosure(
        self, request: worker_pb2.RunClosureRequest, context: grpc.ServicerContext
    ) -> worker_pb2.RunClosureResponse:
        if not request.session_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "RunClosure needs a session_id")
        if not request.function_key:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "RunClosure needs a function_key")
        try:
            outcome = self._executor.run(
                request.session_id,
                request.function_key,
                request.function,
                request.arguments,
                request.resource_key,
                request.step,
                request.closure_id,
            )
        except errors.OpError as e:  # the worker itself failed (e.g. its PS session)
            context.abort(errors.to_grpc_code(e), str(e))
        reply = worker_pb2.RunClosureResponse(
            result=outcome.result,
            function_missing=outcome.function_missing,
            missing_resource=outcome.missing_resource,
            run_seconds=outcome.run_seconds,
        )
        if outcome.error is not None:
            reply.error.CopyFrom(worker_pb2.ClosureError(**outcome.error))
        return reply

    def EndSession(
        self, request: worker_pb2.EndSessionRequest, context: grpc.ServicerContext
    ) -> worker_pb2.EndSessionResponse:
        return worker_pb2.EndSessionResponse(existed=self._executor.end_session(request.session_id))

    def GetStatus(
        self, request: worker_pb2.GetStatusRequest, context: grpc.ServicerContext
    ) -> worker_pb2.GetStatusResponse:
        ex = self._executor
        return worker_pb2.GetStatusResponse(
            task=ex.task,
            session_ids=ex.session_ids(),
            closures_run=ex.closures_run,
            closures_failed=ex.closures_failed,
            pid=os.getpid(),
            started_at=ex.started_at,
        )

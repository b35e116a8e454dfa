"""The ParameterServer gRPC servicer: translates RPCs to VariableStore calls.

It holds no algorithm.  Requests are parsed and validated (dtype, shape, byte
counts) here because that is wire format; everything else is the store's job.
Typed psflow errors become gRPC status codes only here, at the edge.  Framed
payloads (see :mod:`psflow.transport.framing`) are never copied on receipt:
gradients reach the update rule as views of the received chunks.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc
import numpy as np

from psflow.errors import InvalidArgumentError, ResourceExhaustedError
from psflow.proto import ps_pb2
from psflow.ps import write_ops
from psflow.ps.checkpoint import restore_shard, save_shard
from psflow.ps.names import quote
from psflow.ps.push_types import PushReply
from psflow.ps.rule_cache import parse_config
from psflow.ps.store import VariableMeta, VariableStore
from psflow.ps.tensors import check_extent
from psflow.security.limits import limit_exceeded
from psflow.transport import codec, framing, messages, shm
from psflow.transport.dataplane import Handler, Reply, Request, Route
from psflow.transport.options import DEFAULT_CHUNK_BYTES, DEFAULT_MAX_MESSAGE_BYTES
from psflow.transport.service import METHODS, SERVICE, Kind

from .edge import Edge
from .edge import check as _check
from .edge import lenient as _lenient

__all__ = ["ParameterServerServicer"]

log = logging.getLogger(__name__)

_HEADER_SLACK = 1 << 20
_MIN_CHUNK = 4096
_SPEC_CACHE_SIZE = 1024
_NO_LIMIT = 1 << 62


def _framed(request_iterator: Iterable[Any]) -> tuple[bytes, Iterator[memoryview]]:
    return framing.split_stream(_check(m) for m in request_iterator)


def _grpc_request(name: str, header: bytes, context: grpc.ServicerContext) -> Request:
    """A gRPC call as a data-plane handler sees one (its payload, if any, apart)."""
    left = context.time_remaining()
    deadline = None if left is None else time.monotonic() + left
    return Request(
        name, header, memoryview(b""), context.peer(), deadline, lambda: not context.is_active()
    )


class ParameterServerServicer:
    """Serves a :class:`VariableStore` over the ``psflow.v1.ParameterServer`` service.

    Args:
        store: the variables.
        chunk_bytes: payload bytes per message of a streamed reply.
        max_message_bytes: the server's message size limit (bounds unary replies).
        edge: where its calls enter: admission, idleness, metrics (its
            ``metrics`` also get the bytes pushed and pulled); None: an edge
            with no limits and no metrics.
    """

    def __init__(
        self,
        store: VariableStore,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        edge: Edge | None = None,
    ) -> None:
        self.store = store
        self.chunk_bytes = chunk_bytes
        self.max_message_bytes = max_message_bytes
        self.max_unary_payload = max_message_bytes - _HEADER_SLACK
        self.edge = edge or Edge(store.task)
        self.metrics = self.edge.metrics
        self._shm_payloads = shm.SegmentCache()
        # (dtype code, shape) -> checked (dtype, shape, nbytes): a worker pushes the same
        # few specs every step, and checking one costs more than the rest of a small push
        self._checked_specs: dict[tuple[int, tuple[int, ...]], tuple[np.dtype, tuple, int]] = {}
        self._decode_push = functools.partial(
            messages.decode_push,
            spec=self._gradient_spec,
            shm_view=self._shm_payloads.view,
            chunk_bytes=chunk_bytes,
        )
        # where this task's data plane listens (port 0: none), for DataPlaneInfo
        self._data_plane = ps_pb2.DataPlaneInfoResponse()

    # -- registration ---------------------------------------------------------
    def generic_handler(self) -> grpc.GenericRpcHandler:
        """A handler serving every method of the service, through the edge, with the
        wire codecs."""
        handlers = {}
        factories = {
            Kind.UNARY_UNARY: grpc.unary_unary_rpc_method_handler,
            Kind.UNARY_STREAM: grpc.unary_stream_rpc_method_handler,
            Kind.STREAM_UNARY: grpc.stream_unary_rpc_method_handler,
        }
        for name, (kind, req_cls, _resp_cls, framed_req, framed_resp) in METHODS.items():
            parse = framing.split_message if framed_req else req_cls.FromString
            if name == "Pull":  # its header is parsed by _pull, which the data plane calls
                parse = bytes
            method = getattr(self, name, None)
            if method is None:  # Write, Push: their stream's handler, of one message
                method = functools.partial(_one_message, getattr(self, f"{name}Stream"))
            fn = self.edge.grpc_method(name, method, streaming=kind is not Kind.UNARY_UNARY)
            handlers[name] = factories[kind](
                fn,
                request_deserializer=_lenient(parse),
                response_serializer=None if framed_resp else framing.serialize,
            )
        return grpc.method_handlers_generic_handler(SERVICE, handlers)

    # -- the data plane's edge ------------------------------------------------------------
    def announce_data_plane(self, port: int, address: str, max_payload: int) -> None:
        """Where this task's data plane listens, as DataPlaneInfo answers it."""
        self._data_plane = ps_pb2.DataPlaneInfoResponse(
            port=port, address=address, max_payload_bytes=max_payload
        )

    def data_plane_handlers(self) -> dict[str, Handler]:
        """The data plane's handlers (run in :meth:`~ps_server.edge.Edge.plane_call`): Pull,
        and Push as a :class:`Route`, its gradients from the decoder straight to the store."""
        push = Route(self._decode_push, self.store.push, self._pushed)
        return {"Push": push, "Pull": self._pull}

    def DataPlaneInfo(
        self, request: Any, context: grpc.ServicerContext
    ) -> ps_pb2.DataPlaneInfoResponse:
        """Where this task's data plane listens (port 0: it runs none)."""
        _check(request)
        return self._data_plane

    def _spec(self, dtype_code: int, shape: Any, what: str) -> tuple[np.dtype, tuple, int]:
        """A checked wire spec; above ``max_tensor_bytes`` is RESOURCE_EXHAUSTED."""
        dtype, shape, nbytes = codec.check_spec(dtype_code, shape, max_bytes=_NO_LIMIT)
        limit = self.store.max_tensor_bytes
        check_extent(shape, dtype.itemsize, limit, what=what)
        if nbytes > limit:
            raise limit_exceeded(
                "tensor_too_large",
                f"{what} of shape {shape} and dtype {dtype.name} ({nbytes} bytes)",
                nbytes,
                limit,
                "--max-tensor-bytes",
            )
        return dtype, shape, nbytes

    def _gradient_spec(self, spec: Any, name: str) -> tuple[np.dtype, tuple, int]:
        """:meth:`_spec` of a push item, remembered once it passed (the limit is fixed)."""
        key = (spec.dtype, tuple(spec.shape))
        checked = self._checked_specs.get(key)
        if checked is None:
            checked = self._spec(spec.dtype, spec.shape, f"gradient for {quote(name)}")
            if len(self._checked_specs) >= _SPEC_CACHE_SIZE:
                self._checked_specs.clear()  # many distinct specs: start over, stay bounded
            self._checked_specs[key] = checked
        return checked

    # -- writes -------------------------------------------------------------------
    def WriteStream(
        self, request_iterator: Iterable[Any], context: grpc.ServicerContext
    ) -> ps_pb2.WriteResponse:
        """Creates or assigns variables (the payload in one message or streamed)."""
        header, specs, values = messages.decode_write(*_framed(request_iterator), self._spec)
        if header.op == ps_pb2.WRITE_OP_CREATE:
            metas = [VariableMeta(v.name, dtype, shape, v.trainable) for v, dtype, shape in specs]
            optimizers = [_optimizer(v.optimizer_json, v.name) for v, *_ in specs]
            results = self.store.create(metas, values, optimizers)
            return ps_pb2.WriteResponse(
                versions=[r[1] for r in results], created=[r[0] for r in results]
            )
        request_id = None
        if header.HasField("id"):
            request_id = (header.id.client_id, header.id.sequence)
        versions = self.store.assign(
            write_ops.from_wire(header.op),
            [v.name for v, *_ in specs],
            values,
            request_id=request_id,
        )
        return ps_pb2.WriteResponse(versions=versions)

    def ConfigureOptimizer(
        self, request: Any, context: grpc.ServicerContext
    ) -> ps_pb2.ConfigureOptimizerResponse:
        """Attaches an update rule to variables."""
        request = _check(request)
        config = _optimizer(request.optimizer_json, "ConfigureOptimizer")
        if config is None:
            raise InvalidArgumentError("ConfigureOptimizer needs an optimizer config")
        slots = self.store.configure_optimizer(list(request.names), config)
        return ps_pb2.ConfigureOptimizerResponse(slot_names=slots)

    # -- pulls ----------------------------------------------------------------------
    def _pulled(self, tensors: list, start: float) -> None:
        if self.metrics is not None:
            sizes = [(t.name, t.value.nbytes) for t in tensors]
            self.metrics.record_pull(sizes, time.perf_counter() - start)

    def _pull(self, request: Request, limit: int | None = None) -> Reply | None:
        """Reads variables: the data plane's Pull (``limit``: its payload limit unless
        given; replied from here), and gRPC's (returned).  The snapshot stays
        consistent until ``release``, once the buffers are sent (writers copy)."""
        start = time.perf_counter() if self.metrics is not None else 0.0
        names, rows = messages.pull_items(
            framing.parse_header(request.header, ps_pb2.PullRequest), self._spec
        )
        limit = self._data_plane.max_payload_bytes if limit is None else limit
        stack = contextlib.ExitStack()
        try:
            tensors = stack.enter_context(self.store.reading(names, rows))
            total = sum(t.value.nbytes for t in tensors)
            if total > limit:
                raise ResourceExhaustedError(
                    f"pull of {total} bytes exceeds the limit of {limit} on one reply; "
                    "use PullStream"
                )
            header = messages.pull_header(tensors)
            buffers = [framing.byte_view(codec.c_contiguous(t.value)) for t in tensors]
            self._pulled(tensors, start)
        except BaseException:
            stack.close()
            raise
        return request.respond(header=header, buffers=buffers, release=stack.close)

    def Pull(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """Reads variables; header and payload in one message."""
        reply = self._pull(_grpc_request("Pull", request, context), self.max_unary_payload)
        try:
            return framing.encode_message(reply.header, reply.buffers)
        finally:
            reply.release()

    def PullStream(self, request: Any, context: grpc.ServicerContext) -> Iterator[bytes]:
        """Reads variables; the payload follows the header in chunks."""
        names, rows = messages.pull_items(_check(request), self._spec)
        chunk = self.chunk_bytes
        if request.chunk_bytes > 0:
            chunk = min(max(request.chunk_bytes, _MIN_CHUNK), self.max_unary_payload)
        start = time.perf_counter()
        with self.store.reading(names, rows) as tensors:
            yield from framing.payload_messages(
                messages.pull_header(tensors), [codec.c_contiguous(t.value) for t in tensors], chunk
            )
            self._pulled(tensors, start)

    # -- pushes ------------------------------------------------------------------------
    def PushStream(self, request_iterator: Iterator[Any], context: grpc.ServicerContext) -> bytes:
        """Applies gradients (the payload in one message or streamed)."""
        header, chunks = _framed(request_iterator)
        decoded = self._decode_push(_grpc_request("Push", header, context), chunks)
        return self._pushed(decoded, self.store.push(*decoded.args)).header

    def _pushed(self, decoded: messages.DecodedPush, result: PushReply) -> Reply:
        """A push applied (or answered from the exactly-once record): its metrics, its reply."""
        if self.metrics is not None:  # only now: a rejected push leaves no series behind
            self.metrics.record_push_seen(decoded.args[1].push_id[0], decoded.args[1].step)
            if not result.duplicate:
                seconds = time.perf_counter() - decoded.start
                self.metrics.record_push(decoded.item_bytes, seconds, result.staleness)
        return Reply(messages.push_reply_bytes(result))

    # -- the rest -------------------------------------------------------------------------
    def ListVariables(
        self, request: Any, context: grpc.ServicerContext
    ) -> ps_pb2.ListVariablesResponse:
        """Describes every variable."""
        _check(request)
        reply = messages.variables_reply(self.store.list_variables())
        size = reply.ByteSize()
        if size > self.max_message_bytes:
            raise ResourceExhaustedError(
                f"the list of {len(reply.variables)} variables is {size} bytes, above the "
                f"message limit of {self.max_message_bytes}"
            )
        return reply

    def _prefix(self, prefix: str) -> str:
        return prefix or self.store.task.replace(":", "-")

    def Save(self, request: Any, context: grpc.ServicerContext) -> ps_pb2.SaveResponse:
        """Checkpoints the shard."""
        request = _check(request)
        if not request.directory:
            raise InvalidArgumentError("Save needs a directory")
        result = save_shard(
            self.store, request.directory, self._prefix(request.prefix), request.step
        )
        return ps_pb2.SaveResponse(
            manifest_path=result.manifest_path,
            bytes_written=result.bytes_written,
            names=result.names,
        )

    def Restore(self, request: Any, context: grpc.ServicerContext) -> ps_pb2.RestoreResponse:
        """Restores the shard from a checkpoint."""
        request = _check(request)
        if not request.directory:
            raise InvalidArgumentError("Restore needs a directory")
        result = restore_shard(
            self.store, request.directory, self._prefix(request.prefix), list(request.names)
        )
        return ps_pb2.RestoreResponse(step=result.step, names=result.names)

    # -- resizing -----------------------------------------------------------------
    def ExportShard(
        self, request: Any, context: grpc.ServicerContext
    ) -> Iterator[ps_pb2.ExportShardResponse]:
        """A copy of variables for their new owner, in chunks."""
        request = _check(request)
        state = memoryview(self.store.export_shard(list(request.names)))
        for start in range(0, max(len(state), 1), self.chunk_bytes):
            yield ps_pb2.ExportShardResponse(state=bytes(state[start : start + self.chunk_bytes]))

    def ImportShard(
        self, request_iterator: Iterator[Any], context: grpc.ServicerContext
    ) -> ps_pb2.ImportShardResponse:
        """Installs variables exported by their old owner (the state in chunks)."""
        chunks, version = [], None
        for message in request_iterator:
            message = _check(message)
            if version is None:
                version = message.placement_version
            chunks.append(message.state)
        if version is None:
            raise InvalidArgumentError("ImportShard without a message")
        names = self.store.import_shard(b"".join(chunks), version)
        return ps_pb2.ImportShardResponse(names=names)

    def ReleaseShard(
        self, request: Any, context: grpc.ServicerContext
    ) -> ps_pb2.ReleaseShardResponse:
        """Gives variables up to their new owner."""
        request = _check(request)
        if request.cancel:
            self.store.unfence(list(request.names))
            return ps_pb2.ReleaseShardResponse()
        self.store.release(
            list(request.names), request.owner, request.owner_address, request.placement_version
        )
        return ps_pb2.ReleaseShardResponse()

    def Drain(self, request: Any, context: grpc.ServicerContext) -> ps_pb2.DrainResponse:
        """Marks the task drained; its process exits once this reply is sent."""
        _check(request)
        self.store.drain()
        return ps_pb2.DrainResponse()

    def GetStats(self, request: Any, context: grpc.ServicerContext) -> ps_pb2.GetStatsResponse:
        """Returns the counters."""
        request = _check(request)
        return messages.stats_reply(self.store.stats_snapshot(include_log=request.include_log))


def _one_message(stream: Callable[[Iterable[Any], Any], Any], request: Any, context: Any) -> Any:
    """A unary call to the handler of its streamed twin."""
    return stream([request], context)


def _optimizer(text: str, what: str) -> dict[str, Any] | None:
    return parse_config(text, f"optimizer config of {quote(what)}") if text else None

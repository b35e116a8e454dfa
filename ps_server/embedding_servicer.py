"""The EmbeddingService gRPC servicer: translates RPCs to TableRegistry calls.

It holds no algorithm: it decodes tensors (dtype, shape and byte counts are
wire format) and calls :class:`psflow.ps.tables.TableRegistry`; its calls
enter through the task's :class:`~ps_server.edge.Edge` (typed errors become
statuses there).  Malformed request bytes are INVALID_ARGUMENT, not INTERNAL.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np

from psflow.errors import InvalidArgumentError
from psflow.proto import embedding_pb2
from psflow.ps.dynamic_table import TableConfig
from psflow.ps.row_moves import COUNTER_COUNT
from psflow.ps.tables import TableRegistry
from psflow.transport import codec, embedding_plane, framing
from psflow.transport.dataplane import Handler, Reply, Request

from .edge import Edge, check, lenient

__all__ = ["EMBEDDING_SERVICE", "EmbeddingServicer", "decode_chunk", "encode_chunk"]

log = logging.getLogger(__name__)

EMBEDDING_SERVICE = embedding_pb2.DESCRIPTOR.services_by_name["EmbeddingService"].full_name


_CHUNK_TENSORS = (
    "ids",
    "rows",
    "touched",
    "traffic",
    "candidate_ids",
    "candidate_counts",
    "candidate_touched",
)


def encode_chunk(config: TableConfig, part: dict[str, np.ndarray]) -> embedding_pb2.RowChunk:
    """A ``RowChunk`` of a part (see :mod:`psflow.ps.row_moves`)."""
    return embedding_pb2.RowChunk(
        table=config.name,
        config_json=config.to_json(),
        slots={k[5:]: codec.encode_tensor(v) for k, v in part.items() if k.startswith("slot/")},
        step=int(part["step"]),
        counters=[int(c) for c in part["counters"]],
        **{k: codec.encode_tensor(part[k]) for k in _CHUNK_TENSORS},
    )


def decode_chunk(
    chunk: embedding_pb2.RowChunk, max_bytes: int
) -> tuple[TableConfig, dict[str, np.ndarray]]:
    """``(config, part)`` of a ``RowChunk``; the part is checked against the table
    that stages it (:func:`psflow.ps.row_moves.check_part`).

    Raises:
        InvalidArgumentError: a bad config, a tensor missing or malformed.
    """
    config = TableConfig.from_json(chunk.config_json)
    part = {}
    for key in _CHUNK_TENSORS:
        if not chunk.HasField(key):
            raise InvalidArgumentError(f"table {chunk.table!r}: chunk {key} is missing")
        part[key] = codec.decode_tensor(getattr(chunk, key), max_bytes=max_bytes)
    for name, tensor in chunk.slots.items():
        part[f"slot/{name}"] = codec.decode_tensor(tensor, max_bytes=max_bytes)
    part["step"] = np.array(chunk.step, np.int64)
    if len(chunk.counters) not in (0, COUNTER_COUNT):
        raise InvalidArgumentError(
            f"table {chunk.table!r}: chunk carries {len(chunk.counters)} counters"
        )
    part["counters"] = np.array(chunk.counters, np.int64)
    return config, part


def _with_context(fn: Callable[[Any], Any]) -> Callable[[Any, Any], Any]:
    """A method of one argument as the edge calls it: ``(request, context)``, the
    request checked (a malformed one raises its error)."""

    @functools.wraps(fn)
    def call(request: Any, context: Any) -> Any:
        return fn(check(request))

    return call


class EmbeddingServicer:
    """Serves a :class:`TableRegistry` over ``psflow.v1.EmbeddingService``.

    Args:
        tables: the task's tables.
        max_tensor_bytes: the largest tensor a request may carry.
        edge: where its calls enter (the ParameterServer servicer's, to share its
            limits and metrics; None: one of its own).
    """

    def __init__(
        self, tables: TableRegistry, max_tensor_bytes: int, edge: Edge | None = None
    ) -> None:
        self.tables = tables
        self.max_tensor_bytes = max_tensor_bytes
        self.edge = edge or Edge(tables.task)
        self._bytes_lock = threading.Lock()
        self.bytes_in = 0
        self.bytes_out = 0

    def generic_handler(self) -> grpc.GenericRpcHandler:
        """A handler for every method of the service, through the edge."""
        service = embedding_pb2.DESCRIPTOR.services_by_name["EmbeddingService"]
        handlers = {}
        for method in service.methods:
            request_cls = getattr(embedding_pb2, method.input_type.name)
            fn = _with_context(getattr(self, method.name))
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                self.edge.grpc_method(method.name, fn, streaming=False),
                request_deserializer=lenient(request_cls.FromString),
                response_serializer=lambda m: m.SerializeToString(),
            )
        return grpc.method_handlers_generic_handler(EMBEDDING_SERVICE, handlers)

    def _count(self, request: Any, reply: Any) -> Any:
        with self._bytes_lock:
            self.bytes_in += request.ByteSize()
            self.bytes_out += reply.ByteSize()
        return reply

    def _tensor(self, message: Any, what: str) -> np.ndarray:
        if not message.ByteSize():
            raise InvalidArgumentError(f"{what} is missing")
        return codec.decode_tensor(message, max_bytes=self.max_tensor_bytes)

    # -- methods ------------------------------------------------------------------------
    def CreateTable(self, request: Any) -> embedding_pb2.CreateTableResponse:
        """Creates a table shard."""
        config = TableConfig.from_json(request.config_json)
        created = self.tables.create(
            config, request.shard_index, request.num_shards, request.move_id
        )
        return embedding_pb2.CreateTableResponse(created=created)

    def Lookup(self, request: Any) -> embedding_pb2.LookupResponse:
        """Reads rows."""
        rows = self._lookup(request, self._tensor(request.ids, "ids"))
        return self._count(request, embedding_pb2.LookupResponse(rows=codec.encode_tensor(rows)))

    def PushGradients(self, request: Any) -> embedding_pb2.PushGradientsResponse:
        """Applies gradient rows, once per request id."""
        ids = self._tensor(request.ids, "ids")
        grads = self._tensor(request.grads, "grads")
        step = self._push(request, ids, grads)
        return self._count(request, embedding_pb2.PushGradientsResponse(step=step))

    # Both edges (gRPC above, the data plane below) decode their tensors and call these.
    def _lookup(self, request: Any, ids: np.ndarray) -> np.ndarray:
        return self.tables.lookup(request.table, ids, request.read_only)

    def _push(self, request: Any, ids: np.ndarray, grads: np.ndarray) -> int:
        request_id = None
        if request.HasField("request_id"):
            request_id = (request.request_id.client_id, request.request_id.sequence)
        optimizer = None
        if request.optimizer_json:
            try:
                optimizer = json.loads(request.optimizer_json)
            except ValueError as e:
                raise InvalidArgumentError(f"optimizer_json is not JSON: {e}") from e
        return self.tables.push(request.table, ids, grads, request_id, optimizer)

    # -- the data plane -------------------------------------------------------------------
    def data_plane_handlers(self) -> dict[str, Handler]:
        """Lookup and PushGradients for a :class:`~psflow.transport.dataplane.DataPlaneServer`.

        A call's header is the gRPC request with its tensors' ``data`` left
        empty (dtype and shape only); the payload is their bytes back to back
        in field order.  A lookup's reply is likewise a ``LookupResponse``
        header and the rows' bytes.  Same tables, checks and typed errors as
        the gRPC methods (see :mod:`psflow.transport.embedding_plane`); the
        server runs them in the edge's :meth:`~ps_server.edge.Edge.plane_call`.
        """
        return {embedding_plane.LOOKUP: self._plane_lookup, embedding_plane.PUSH: self._plane_push}

    def _plane_tensors(self, request: Request, specs: list[tuple[Any, str]]) -> list[np.ndarray]:
        arrays = embedding_plane.split_payload(
            request.payload, specs, max_bytes=self.max_tensor_bytes
        )
        with self._bytes_lock:
            self.bytes_in += len(request.header) + request.payload.nbytes
        return arrays

    def _plane_lookup(self, request: Request) -> Reply:
        header = embedding_plane.parse(request.header, embedding_pb2.LookupRequest)
        (ids,) = self._plane_tensors(request, [(header.ids, "ids")])
        rows = codec.to_host(self._lookup(header, ids))
        reply = embedding_pb2.LookupResponse(rows=embedding_plane.spec(rows)).SerializeToString()
        with self._bytes_lock:
            self.bytes_out += len(reply) + rows.nbytes
        return Reply(reply, (framing.byte_view(rows),))

    def _plane_push(self, request: Request) -> Reply:
        header = embedding_plane.parse(request.header, embedding_pb2.PushGradientsRequest)
        ids, grads = self._plane_tensors(request, [(header.ids, "ids"), (header.grads, "grads")])
        reply = embedding_pb2.PushGradientsResponse(step=self._push(header, ids, grads))
        data = reply.SerializeToString()
        with self._bytes_lock:
            self.bytes_out += len(data)
        return Reply(data)

    def HotRows(self, request: Any) -> embedding_pb2.HotRowsResponse:
        """The busiest rows."""
        if request.count < 0:
            raise InvalidArgumentError(f"count must be >= 0, got {request.count}")
        table = self.tables.table(request.table)
        ids, traffic = table.hot_ids(request.count)
        rows = table.peek(ids)
        return embedding_pb2.HotRowsResponse(
            ids=codec.encode_tensor(ids),
            rows=codec.encode_tensor(rows),
            traffic=codec.encode_tensor(traffic),
        )

    def GetTableStats(self, request: Any) -> embedding_pb2.GetTableStatsResponse:
        """Counters of every table."""
        return embedding_pb2.GetTableStatsResponse(
            tables=[
                embedding_pb2.TableStats(table=name, **vars(stats))
                for name, stats in self.tables.stats().items()
            ],
            bytes_in=self.bytes_in,
            bytes_out=self.bytes_out,
        )

    def SaveTables(self, request: Any) -> embedding_pb2.SaveTablesResponse:
        """Writes this task's tables."""
        if not request.directory:
            raise InvalidArgumentError("SaveTables needs a directory")
        path, names = self.tables.save(request.directory, self.tables.task.replace(":", "-"))
        return embedding_pb2.SaveTablesResponse(path=path, tables=names)

    def RestoreTables(self, request: Any) -> embedding_pb2.RestoreTablesResponse:
        """Restores tables from every table file in a directory."""
        if not request.directory:
            raise InvalidArgumentError("RestoreTables needs a directory")
        names, rows = self.tables.restore(
            request.directory, request.shard_index, request.num_shards
        )
        return embedding_pb2.RestoreTablesResponse(tables=names, rows=rows)

    def ExportRows(self, request: Any) -> embedding_pb2.ExportRowsResponse:
        """A chunk of the rows that leave this task on a resize."""
        max_bytes = min(request.max_bytes or self.max_tensor_bytes, self.max_tensor_bytes)
        config, part, more = self.tables.export_rows(
            request.move_id,
            request.table,
            request.num_shards,
            request.target_shard,
            request.chunk_index,
            max_bytes,
        )
        return embedding_pb2.ExportRowsResponse(chunk=encode_chunk(config, part), more=more)

    def ImportRows(self, request: Any) -> embedding_pb2.ImportRowsResponse:
        """Stages a chunk of rows this task owns after a resize."""
        if not request.HasField("chunk"):
            raise InvalidArgumentError("ImportRows needs a chunk")
        config, part = decode_chunk(request.chunk, self.max_tensor_bytes)
        staged = self.tables.import_rows(
            request.move_id,
            request.source_shard,
            request.chunk_index,
            request.shard_index,
            request.num_shards,
            config,
            part,
        )
        if staged is None:
            return embedding_pb2.ImportRowsResponse(staged=0, duplicate=True)
        return embedding_pb2.ImportRowsResponse(staged=staged)

    def CommitMove(self, request: Any) -> embedding_pb2.CommitMoveResponse:
        """Switches this task's tables to the new layout."""
        rows = self.tables.commit_move(request.move_id, request.shard_index, request.num_shards)
        return embedding_pb2.CommitMoveResponse(rows=rows)

    def AbortMove(self, request: Any) -> embedding_pb2.AbortMoveResponse:
        """Forgets a move; no table changes."""
        self.tables.abort_move(request.move_id)
        return embedding_pb2.AbortMoveResponse()

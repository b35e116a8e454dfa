"""The embedding service's Lookup and PushGradients on the raw TCP data plane.

The PS serves them beside gRPC (see :mod:`psflow.transport.dataplane`), and
:class:`~psflow.transport.embedding_client.EmbeddingClient` uses them when the
PS announces a data plane.  A call's header is the gRPC request message with
its tensors' ``data`` left empty (dtype and shape only); the payload is their
bytes back to back in field order (ids, then gradients).  A lookup's reply is a
``LookupResponse`` header whose ``rows`` carries the spec, and the rows' bytes
as its payload; a push's reply is a ``PushGradientsResponse`` and no payload.
No protobuf copy of the tensor bytes on either side.

Example:
    >>> import numpy as np
    >>> header, buffers = lookup_request("t", np.array([3, 9], np.int64), read_only=False)
    >>> request = parse(header, embedding_pb2.LookupRequest)
    >>> split_payload(memoryview(bytes(buffers[0])), [(request.ids, "ids")])[0].tolist()
    [3, 9]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from psflow.errors import InvalidArgumentError
from psflow.proto import embedding_pb2, ps_pb2, tensor_pb2
from psflow.ps.dynamic_table import TableStats
from psflow.wire import codec

from . import framing

__all__ = [
    "LOOKUP",
    "PUSH",
    "grpc_request",
    "lookup_request",
    "parse",
    "push_request",
    "rows_from_reply",
    "step_from_reply",
    "spec",
    "split_payload",
    "table_stats",
]

# Data-plane method names (their CRC-32 is the wire id).
LOOKUP = "psflow.v1.EmbeddingService/Lookup"
PUSH = "psflow.v1.EmbeddingService/PushGradients"


def spec(array: np.ndarray) -> tensor_pb2.Tensor:
    """A ``Tensor`` message with ``array``'s dtype and shape and no data."""
    return tensor_pb2.Tensor(dtype=codec.dtype_to_wire(array.dtype), shape=list(array.shape))


parse = framing.parse_header
"""The header message ``cls`` of ``raw`` bytes (InvalidArgumentError if they do not parse)."""


def split_payload(
    payload: memoryview, specs: Sequence[tuple[Any, str]], *, max_bytes: int | None = None
) -> list[np.ndarray]:
    """The arrays ``specs`` (``(Tensor spec, what)`` pairs) announce, viewing
    ``payload`` (no copy: valid as long as the payload is).

    Raises:
        InvalidArgumentError: a spec missing, malformed, above ``max_bytes`` or
            carrying data of its own, or a payload of another length.
    """
    arrays, at = [], 0
    for message, what in specs:
        if not message.ByteSize():
            raise InvalidArgumentError(f"{what} is missing")
        if message.data:
            raise InvalidArgumentError(f"{what}: on the data plane the bytes travel as payload")
        dtype, shape, nbytes = codec.check_spec(message.dtype, message.shape, max_bytes=max_bytes)
        if at + nbytes > payload.nbytes:
            raise InvalidArgumentError(
                f"{what} of shape {shape} needs {nbytes} bytes; the payload has "
                f"{payload.nbytes - at} left"
            )
        arrays.append(codec.tensor_from_buffer(dtype, shape, payload[at : at + nbytes], what=what))
        at += nbytes
    if at != payload.nbytes:
        raise InvalidArgumentError(
            f"payload of {payload.nbytes} bytes, but its tensors announce {at}"
        )
    return arrays


def lookup_request(table: str, ids: np.ndarray, read_only: bool) -> tuple[bytes, list[Any]]:
    """``(header, payload buffers)`` of a lookup of int64 ``ids``."""
    ids = codec.to_host(ids)
    header = embedding_pb2.LookupRequest(table=table, ids=spec(ids), read_only=read_only)
    return header.SerializeToString(), [framing.byte_view(ids)]


def push_request(
    table: str,
    ids: np.ndarray,
    grads: np.ndarray,
    request_id: tuple[str, int],
    optimizer_json: str,
) -> tuple[bytes, list[Any]]:
    """``(header, payload buffers)`` of a push of gradient rows."""
    ids, grads = codec.to_host(ids), codec.to_host(grads)
    header = embedding_pb2.PushGradientsRequest(
        table=table,
        ids=spec(ids),
        grads=spec(grads),
        request_id=ps_pb2.RequestId(client_id=request_id[0], sequence=request_id[1]),
        optimizer_json=optimizer_json,
    )
    return header.SerializeToString(), [framing.byte_view(ids), framing.byte_view(grads)]


def rows_from_reply(reply: tuple[bytes, memoryview]) -> np.ndarray:
    """The rows a lookup's reply (header, payload) carries.

    Raises:
        InvalidArgumentError: a malformed reply.
    """
    header = parse(reply[0], embedding_pb2.LookupResponse)
    (rows,) = split_payload(reply[1], [(header.rows, "rows")])
    return rows


def step_from_reply(reply: tuple[bytes, memoryview]) -> int:
    """The step a push's reply (header, payload) reports."""
    return parse(reply[0], embedding_pb2.PushGradientsResponse).step


def grpc_request(header: bytes, cls: Any, **tensors: np.ndarray) -> Any:
    """The gRPC form of a data-plane request: ``header`` with ``tensors``' bytes inside."""
    request = cls.FromString(header)
    for field, array in tensors.items():
        getattr(request, field).CopyFrom(codec.encode_tensor(array))
    return request


def table_stats(reply: embedding_pb2.GetTableStatsResponse) -> dict[str, TableStats]:
    """A task's table counters, by table, from its ``GetTableStatsResponse``."""
    fields = [f.name for f in dataclasses.fields(TableStats)]
    return {t.table: TableStats(**{f: getattr(t, f) for f in fields}) for t in reply.tables}

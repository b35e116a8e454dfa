"""The ParameterServer service's methods and how each is (de)serialized.

Shared by the client and the server so the two cannot drift.  Framed methods
(header + payload chunks, see :mod:`psflow.transport.framing`) travel as raw
bytes built and split by hand; the others use the generated message classes.
"""

from __future__ import annotations

import enum

from psflow.proto import ps_pb2

__all__ = ["METHODS", "SERVICE", "Kind", "method_path"]

SERVICE = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"].full_name


class Kind(enum.Enum):
    """gRPC cardinality of a method."""

    UNARY_UNARY = "unary_unary"
    UNARY_STREAM = "unary_stream"
    STREAM_UNARY = "stream_unary"


# name -> (kind, request class, response class, framed request, framed response)
METHODS: dict[str, tuple[Kind, type, type, bool, bool]] = {
    "Write": (Kind.UNARY_UNARY, ps_pb2.WriteRequest, ps_pb2.WriteResponse, True, False),
    "WriteStream": (Kind.STREAM_UNARY, ps_pb2.WriteRequest, ps_pb2.WriteResponse, True, False),
    "ConfigureOptimizer": (
        Kind.UNARY_UNARY,
        ps_pb2.ConfigureOptimizerRequest,
        ps_pb2.ConfigureOptimizerResponse,
        False,
        False,
    ),
    "Pull": (Kind.UNARY_UNARY, ps_pb2.PullRequest, ps_pb2.PullResponse, False, True),
    "PullStream": (Kind.UNARY_STREAM, ps_pb2.PullRequest, ps_pb2.PullResponse, False, True),
    "Push": (Kind.UNARY_UNARY, ps_pb2.PushRequest, ps_pb2.PushResponse, True, False),
    "PushStream": (Kind.STREAM_UNARY, ps_pb2.PushRequest, ps_pb2.PushResponse, True, False),
    "ListVariables": (
        Kind.UNARY_UNARY,
        ps_pb2.ListVariablesRequest,
        ps_pb2.ListVariablesResponse,
        False,
        False,
    ),
    "Save": (Kind.UNARY_UNARY, ps_pb2.SaveRequest, ps_pb2.SaveResponse, False, False),
    "Restore": (Kind.UNARY_UNARY, ps_pb2.RestoreRequest, ps_pb2.RestoreResponse, False, False),
    "GetStats": (Kind.UNARY_UNARY, ps_pb2.GetStatsRequest, ps_pb2.GetStatsResponse, False, False),
    # resizing: moving variables between tasks, draining a task
    "ExportShard": (
        Kind.UNARY_STREAM,
        ps_pb2.ExportShardRequest,
        ps_pb2.ExportShardResponse,
        False,
        False,
    ),
    "ImportShard": (
        Kind.STREAM_UNARY,
        ps_pb2.ImportShardRequest,
        ps_pb2.ImportShardResponse,
        False,
        False,
    ),
    "ReleaseShard": (
        Kind.UNARY_UNARY,
        ps_pb2.ReleaseShardRequest,
        ps_pb2.ReleaseShardResponse,
        False,
        False,
    ),
    "Drain": (Kind.UNARY_UNARY, ps_pb2.DrainRequest, ps_pb2.DrainResponse, False, False),
    # where the task's raw TCP data plane listens (psflow.transport.dataplane)
    "DataPlaneInfo": (
        Kind.UNARY_UNARY,
        ps_pb2.DataPlaneInfoRequest,
        ps_pb2.DataPlaneInfoResponse,
        False,
        False,
    ),
}


def method_path(name: str) -> str:
    """The full gRPC path of a method, e.g. ``/psflow.v1.ParameterServer/Pull``."""
    return f"/{SERVICE}/{name}"

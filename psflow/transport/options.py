"""gRPC channel and server options, set explicitly (never gRPC's 4 MB defaults).

Payloads above ``stream_threshold`` bytes are streamed in chunks of
``chunk_bytes``; the message size limit only has to hold one chunk (or one
unary payload) plus its header, and is set well above both.  1 MiB chunks
measured best on loopback (see benchmarks/pushpull.py): smaller ones pay the
per-message cost of grpcio more often, larger ones lose pipelining.
"""

from __future__ import annotations

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_STREAM_THRESHOLD",
    "channel_options",
    "server_options",
]

DEFAULT_CHUNK_BYTES = 1 << 20
DEFAULT_STREAM_THRESHOLD = 1 << 20
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20

_KEEPALIVE = [
    # Detect a dead peer on an idle connection within ~40 s.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


def channel_options(
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, extra: list[tuple] | None = None
) -> list[tuple[str, object]]:
    """Options for a client channel to a psflow server."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # psflow retries itself, only where a retry is safe (see PSClient).
        ("grpc.enable_retries", 0),
        *_KEEPALIVE,
        *(extra or []),
    ]


def server_options(
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, extra: list[tuple] | None = None
) -> list[tuple[str, object]]:
    """Options for a psflow gRPC server."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # A busy port is an error, not a silently shared one.
        ("grpc.so_reuseport", 0),
        # Accept the clients' keepalive pings.
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_ping_strikes", 0),
        *(extra or []),
    ]

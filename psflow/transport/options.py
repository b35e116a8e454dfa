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
    "KEEPALIVE_TIMEOUT_MS",
    "KEEPALIVE_TIME_MS",
    "RECONNECT_BACKOFF",
    "channel_options",
    "keepalive_options",
    "server_options",
]

DEFAULT_CHUNK_BYTES = 1 << 20
DEFAULT_STREAM_THRESHOLD = 1 << 20
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20

#: Detect a dead peer (even one that vanished without a reset) within ~40 s.
KEEPALIVE_TIME_MS = 30_000
KEEPALIVE_TIMEOUT_MS = 10_000


#: A path that healed is used again within about a second.  gRPC's default backoff
#: grows to two minutes: after a 30 s link-down (tests/test_netfault_netns.py's link,
#: measured by hand) a worker's pushes resumed 5-10 s after the heal, 0.4-1.2 s with
#: this.  The minimum is also the connection attempt's deadline (TLS handshake
#: included), so it is kept at a second, not lower.
RECONNECT_BACKOFF = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 1000),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def keepalive_options(
    time_ms: int = KEEPALIVE_TIME_MS, timeout_ms: int = KEEPALIVE_TIMEOUT_MS
) -> list[tuple[str, object]]:
    """Client options that ping the server every ``time_ms`` and drop the connection
    (failing its calls with UNAVAILABLE) when a ping goes unanswered for ``timeout_ms``.

    psflow servers accept such pings (see :func:`server_options`).
    """
    return [
        ("grpc.keepalive_time_ms", int(time_ms)),
        ("grpc.keepalive_timeout_ms", int(timeout_ms)),
        # grpcio 1.85 times a keepalive ping out by the general ping timeout (60 s by
        # default), not by keepalive_timeout_ms: measured behind a relay that holds every
        # byte, a 1 s keepalive timeout dropped the connection after 60 s, not 1 s
        ("grpc.http2.ping_timeout_ms", int(timeout_ms)),
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
        *keepalive_options(),
        *RECONNECT_BACKOFF,
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

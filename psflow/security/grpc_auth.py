"""gRPC plumbing of :class:`~psflow.security.config.SecurityConfig`: interceptor, credentials, channels.

Servers: :func:`add_port` binds with TLS credentials when configured, and
:class:`AuthInterceptor` answers UNAUTHENTICATED to any call without the bearer
token (compared in constant time), except the standard health service, which
probes must reach.  The check runs before the request is deserialized, so an
unauthenticated caller reaches no psflow code.

Clients: :func:`open_channel` builds a plain or TLS channel; the token travels
as per-call metadata (:meth:`SecurityConfig.call_metadata`), which works on
plain loopback channels as well as TLS ones.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from .config import SecurityConfig, TLSConfig

__all__ = [
    "HEALTH_PREFIX",
    "AuthInterceptor",
    "add_port",
    "channel_credentials",
    "open_channel",
    "server_credentials",
    "server_interceptors",
]

log = logging.getLogger(__name__)

HEALTH_PREFIX = "/grpc.health.v1.Health/"
"""Methods under this prefix answer without a token (liveness and readiness probes)."""


def server_credentials(tls: TLSConfig) -> grpc.ServerCredentials:
    """Server credentials that present ``tls.cert`` and require client certificates from ``tls.ca``."""
    return grpc.ssl_server_credentials(
        [(tls.key, tls.cert)], root_certificates=tls.ca, require_client_auth=True
    )


def channel_credentials(tls: TLSConfig) -> grpc.ChannelCredentials:
    """Channel credentials that trust ``tls.ca`` and present ``tls.cert``."""
    return grpc.ssl_channel_credentials(
        root_certificates=tls.ca, private_key=tls.key, certificate_chain=tls.cert
    )


def open_channel(
    address: str, security: SecurityConfig, options: Sequence[tuple[str, Any]] = ()
) -> grpc.Channel:
    """A channel to ``address``: TLS when ``security.tls`` is set, else plain."""
    options = list(options)
    if security.tls is None:
        return grpc.insecure_channel(address, options=options)
    if security.tls.server_name:
        options.append(("grpc.ssl_target_name_override", security.tls.server_name))
    return grpc.secure_channel(address, channel_credentials(security.tls), options=options)


def add_port(server: grpc.Server, address: str, security: SecurityConfig) -> int:
    """Binds ``address`` (TLS when configured); returns the port, 0 when it failed."""
    if security.tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, server_credentials(security.tls))


def _rejecting_handler(handler: grpc.RpcMethodHandler | None, message: str):
    """A handler of the same cardinality as ``handler`` that answers UNAUTHENTICATED.

    It reads no request bytes into psflow code (no deserializer is run).
    """

    def unary(request: Any, context: grpc.ServicerContext) -> None:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    def streaming(request: Any, context: grpc.ServicerContext):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - abort raises

    if handler is None or not (handler.request_streaming or handler.response_streaming):
        return grpc.unary_unary_rpc_method_handler(unary)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary)
    return grpc.unary_stream_rpc_method_handler(streaming)


class AuthInterceptor(grpc.ServerInterceptor):
    """Requires ``authorization: Bearer <token>`` on every call outside ``exempt``.

    Args:
        token: the shared token.
        exempt: method-path prefixes served without a token.
        on_reject: called with the method path of each rejected call (metrics).
    """

    def __init__(
        self,
        token: str,
        *,
        exempt: Sequence[str] = (HEALTH_PREFIX,),
        on_reject: Callable[[str], None] | None = None,
    ) -> None:
        self._expected = f"Bearer {token}".encode()
        self._exempt = tuple(exempt)
        self._on_reject = on_reject
        self._log_lock = threading.Lock()
        self._unlogged = 0
        self._next_log = 0.0

    def _log_rejection(self, method: str, why: str) -> None:
        # At most one warning per 10 s: a flood of bad calls must not flood the log.
        with self._log_lock:
            self._unlogged += 1
            now = time.monotonic()
            if now < self._next_log:
                return
            count, self._unlogged, self._next_log = self._unlogged, 0, now + 10.0
        log.warning(
            "rejected %s: %s (%d rejected call(s) since the last report)", method, why, count
        )

    def _authorized(self, metadata: Sequence[tuple[str, Any]] | None) -> tuple[bool, str]:
        values = [v for k, v in (metadata or ()) if k == "authorization"]
        if not values:
            return False, "missing authorization metadata (Bearer token)"
        if len(values) > 1:
            return False, f"{len(values)} authorization entries; send exactly one"
        value = values[0]
        given = value if isinstance(value, bytes) else str(value).encode("utf-8", "replace")
        if hmac.compare_digest(given, self._expected):
            return True, ""
        return False, "invalid authorization token"

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        """Passes authorized and exempt calls on; answers the rest UNAUTHENTICATED."""
        method = handler_call_details.method or ""
        if method.startswith(self._exempt):
            return continuation(handler_call_details)
        ok, why = self._authorized(handler_call_details.invocation_metadata)
        if ok:
            return continuation(handler_call_details)
        if self._on_reject is not None:
            self._on_reject(method)
        self._log_rejection(method, why)
        # The real handler is only looked up for its cardinality; it is never run.
        return _rejecting_handler(continuation(handler_call_details), f"{method}: {why}")


def server_interceptors(
    security: SecurityConfig, on_reject: Callable[[str], None] | None = None
) -> list[grpc.ServerInterceptor]:
    """The interceptors a psflow server needs for ``security`` (none without a token)."""
    if security.token is None:
        return []
    return [AuthInterceptor(security.token, on_reject=on_reject)]

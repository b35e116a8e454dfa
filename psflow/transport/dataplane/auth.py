"""Who may use a data-plane connection: the HELLO frame and TLS contexts.

The data plane trusts exactly whom the gRPC port trusts.  The first frame of a
connection is a HELLO carrying the shared token of the cluster's
:class:`~psflow.security.config.SecurityConfig`, compared in constant time
(as :class:`~psflow.security.grpc_auth.AuthInterceptor` compares the bearer
token); with TLS configured both ends wrap the socket with :mod:`ssl`, from the
same certificate, key and CA files, and the server requires a client
certificate signed by that CA.
"""

from __future__ import annotations

import hmac
import ssl

from psflow.proto import dataplane_pb2
from psflow.security.config import SecurityConfig, TLSConfig

__all__ = ["HELLO_LIMIT", "check_hello", "client_context", "hello", "server_context"]

HELLO_LIMIT = 8 << 10
"""The largest HELLO header a server reads before the peer is authenticated: a
token and a client name fit many times over; nothing larger is allocated."""


def hello(security: SecurityConfig, client: str = "") -> bytes:
    """The serialized HELLO header a client sends first (at most :data:`HELLO_LIMIT`
    bytes: a longer token is refused by the server like a wrong one)."""
    return dataplane_pb2.DataPlaneHello(
        token=security.token or "", client=client[:256]
    ).SerializeToString()


def check_hello(security: SecurityConfig, raw: bytes) -> str | None:
    """Why a HELLO header is refused, or None when it is accepted."""
    try:
        message = dataplane_pb2.DataPlaneHello.FromString(raw)
    except Exception:  # protobuf DecodeError and friends: not a hello at all
        return "malformed hello"
    if security.token is None:
        return None
    if not message.token:
        return "missing token in the data-plane hello"
    given = message.token.encode("utf-8", "replace")
    if hmac.compare_digest(given, security.token.encode()):
        return None
    return "invalid token in the data-plane hello"


def server_context(tls: TLSConfig) -> ssl.SSLContext:
    """A server context presenting ``tls.cert`` and requiring client certificates from ``tls.ca``."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(tls.cert_path, tls.key_path)
    context.load_verify_locations(cadata=tls.ca.decode("ascii", "replace"))
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_context(tls: TLSConfig) -> ssl.SSLContext:
    """A client context trusting ``tls.ca`` and presenting ``tls.cert``."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(tls.cert_path, tls.key_path)
    context.load_verify_locations(cadata=tls.ca.decode("ascii", "replace"))
    context.check_hostname = True
    return context

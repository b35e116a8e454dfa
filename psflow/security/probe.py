"""Telling a rejected TLS client apart from an unreachable server.

With mutual TLS a server refuses a client certificate from another CA during
the TLS handshake, before any RPC exists, so gRPC can only report it to the
client as UNAVAILABLE ("Socket closed"), the same as a server that is down.
psflow clients retry UNAVAILABLE, and the coordinator treats an unavailable
worker as lost; neither helps a client the server will never accept.  So when
a call fails that way, :func:`diagnose_unavailable` asks once, with a short
TLS 1.2 handshake of its own (where the server's verdict on the client
certificate arrives inside the handshake), whether the server is up and
rejecting our credentials; clients then raise ``UnauthenticatedError`` instead.
"""

from __future__ import annotations

import logging
import socket
import ssl

from .config import ENV_TLS_CA, ENV_TLS_SERVER_NAME, SecurityConfig

__all__ = ["diagnose_unavailable", "split_host_port"]

log = logging.getLogger(__name__)

_CLIENT_SIDE = ("CERTIFICATE_VERIFY_FAILED", "Tls handshake failed", "TSI_PROTOCOL_FAILURE")
_CLOSED = ("Socket closed", "Connection reset", "handshake", "Broken pipe")


def split_host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of ``host:port`` or ``[v6]:port`` (a gRPC scheme prefix is dropped).

    Example:
        >>> split_host_port("[::1]:80"), split_host_port("dns:///ps-0:2222")
        (('::1', 80), ('ps-0', 2222))
    """
    for scheme in ("dns:///", "ipv4:", "ipv6:"):
        if address.startswith(scheme):
            address = address[len(scheme) :]
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return (host, int(port)) if host else None


def _context(security: SecurityConfig) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    # TLS 1.2: the server checks our certificate inside the handshake and says
    # why in an alert (with 1.3 it does so after the handshake, by closing).
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["h2"])
    ctx.check_hostname = False
    tls = security.tls
    if tls is None:
        ctx.verify_mode = ssl.CERT_NONE
    else:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cadata=tls.ca.decode("ascii", "replace"))
        ctx.load_cert_chain(tls.cert_path, tls.key_path)
    return ctx


def _drive(obj: ssl.SSLObject, incoming: ssl.MemoryBIO, outgoing: ssl.MemoryBIO, sock) -> bool:
    """Runs the handshake over ``sock``; returns whether the server answered in TLS.

    Raises whatever the handshake raises (``ssl.SSLError``, ``OSError``).
    """
    answered = False
    for _ in range(64):  # a handshake takes a handful of flights
        try:
            obj.do_handshake()
            sock.sendall(outgoing.read())
            return True
        except ssl.SSLWantReadError:
            pending = outgoing.read()
            if pending:
                sock.sendall(pending)
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                if not answered:
                    raise ConnectionResetError("closed before any TLS record") from None
                incoming.write_eof()
                continue
            # A TLS server answers a ClientHello with a handshake record (0x16 0x03 ...).
            answered = answered or chunk[:2] == b"\x16\x03"
            incoming.write(chunk)
    raise TimeoutError("TLS handshake did not finish")


def _handshake(address: str, security: SecurityConfig, timeout: float) -> str | None:
    target = split_host_port(address)
    if target is None:
        return None
    try:
        ctx = _context(security)
    except (ssl.SSLError, OSError) as e:
        return f"this client's TLS material cannot be loaded: {e}"
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname=target[0])
    try:
        with socket.create_connection(target, timeout=timeout) as sock:
            sock.settimeout(timeout)
            _drive(obj, incoming, outgoing, sock)
    except ssl.SSLCertVerificationError as e:
        return f"the server's certificate is not accepted by this client ({ENV_TLS_CA}): {e}"
    except ssl.SSLError as e:
        # The server spoke TLS (we verified its certificate when we have a CA),
        # then broke off the handshake after our (missing) certificate.
        reason = getattr(e, "reason", "") or type(e).__name__
        if any(m in reason for m in ("WRONG_VERSION_NUMBER", "RECORD_LAYER", "PROTOCOL_VERSION")):
            return None  # not a TLS server, or one this probe cannot speak to: no verdict
        if security.tls is None:
            return f"the server requires TLS, and this client has no TLS configured ({reason})"
        return (
            "the server ended the TLS handshake after receiving this client's certificate: "
            f"it does not accept it (signed by a CA the server does not trust?) ({reason})"
        )
    except OSError:
        return None  # unreachable, reset, timed out: a genuine UNAVAILABLE
    if security.tls is None:
        return "the server requires TLS, and this client has no TLS configured"
    return None


def diagnose_unavailable(
    address: str, security: SecurityConfig, details: str, timeout: float = 2.0
) -> str | None:
    """Why a call to ``address`` failed with UNAVAILABLE ``details``, if it is a credentials problem.

    Returns a sentence naming the problem (the server rejects this client's
    certificate, this client rejects the server's, or the server requires TLS
    this client lacks), or None when the server is simply unavailable.  Runs
    at most one TCP connection and TLS handshake, bounded by ``timeout``.
    """
    details = details or ""
    if any(marker in details for marker in _CLIENT_SIDE):
        return (
            f"the server's certificate is not accepted by this client ({ENV_TLS_CA}, "
            f"{ENV_TLS_SERVER_NAME}): {details}"
        )
    if not any(marker in details for marker in _CLOSED):
        return None  # e.g. "Connection refused": nothing listens
    reason = _handshake(address, security, max(0.05, timeout))
    if reason is not None:
        log.debug("%s: %s", address, reason)
    return reason

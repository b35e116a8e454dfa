"""Command-line flags of the security and limit settings, shared by ``python -m ps_server``
and ``python -m worker`` so both spell them the same way.

Example:
    >>> import argparse
    >>> p = argparse.ArgumentParser()
    >>> add_security_flags(p); add_limit_flags(p, "ps")
    >>> args = p.parse_args(["--insecure", "--max-streams", "8"])
    >>> args.insecure, args.max_streams, args.auth_token_file
    (True, 8, None)
"""

from __future__ import annotations

import argparse
import logging

from .config import (
    ENV_TLS_CA,
    ENV_TLS_CERT,
    ENV_TLS_KEY,
    ENV_TOKEN,
    ENV_TOKEN_FILE,
    SecurityConfig,
    check_bind,
    is_loopback,
)
from .limits import (
    DEFAULT_MAX_CLOSURE_BYTES,
    DEFAULT_MAX_SESSIONS,
    DEFAULT_MAX_STREAMS,
    DEFAULT_MAX_STREAMS_PER_CLIENT,
    DEFAULT_MAX_SYNC_CONTRIBUTORS,
    DEFAULT_MAX_VARIABLES,
    DEFAULT_SESSION_TTL,
    DEFAULT_STREAM_IDLE_TIMEOUT,
)

__all__ = [
    "add_limit_flags",
    "add_security_flags",
    "positive_int",
    "positive_seconds",
    "security_from_flags",
]


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def positive_seconds(text: str) -> float:
    """argparse type: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < 1e9:
        raise argparse.ArgumentTypeError(f"{value} must be > 0 seconds (and finite)")
    return value


def add_security_flags(parser: argparse.ArgumentParser) -> None:
    """``--auth-token-file``, ``--tls-cert/--tls-key/--tls-ca`` and ``--insecure``."""
    g = parser.add_argument_group("security")
    g.add_argument(
        "--auth-token-file",
        metavar="FILE",
        help=f"shared token callers must send (default: ${ENV_TOKEN} or ${ENV_TOKEN_FILE})",
    )
    g.add_argument("--tls-cert", metavar="PEM", help=f"this server's certificate (${ENV_TLS_CERT})")
    g.add_argument("--tls-key", metavar="PEM", help=f"its private key (${ENV_TLS_KEY})")
    g.add_argument(
        "--tls-ca",
        metavar="PEM",
        help=f"CA that signs accepted client certificates (${ENV_TLS_CA})",
    )
    g.add_argument(
        "--insecure",
        action="store_true",
        help="serve a non-loopback address without authentication (refused otherwise)",
    )


def security_from_flags(args: argparse.Namespace, bind: str) -> SecurityConfig:
    """The :class:`~psflow.security.config.SecurityConfig` of ``add_security_flags``'s
    flags (and the environment), checked against the address the server binds.

    Warns when a token would travel in plain text beyond loopback.

    Raises:
        OpError: unreadable credentials, or a non-loopback ``bind`` without
            authentication and without ``--insecure``.
    """
    security = SecurityConfig.from_environment(
        token_file=args.auth_token_file,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_ca=args.tls_ca,
    )
    check_bind(bind, security, args.insecure)
    if security.token is not None and security.tls is None and not is_loopback(bind):
        logging.getLogger("psflow.security").warning(
            "the auth token travels in plain text on %s: add TLS (--tls-cert ...)", bind
        )
    return security


def add_limit_flags(parser: argparse.ArgumentParser, role: str) -> None:
    """The limits of ``role`` (``"ps"`` or ``"worker"``)."""
    g = parser.add_argument_group("limits (exceeding one is RESOURCE_EXHAUSTED)")
    if role == "ps":
        g.add_argument(
            "--max-tensor-bytes",
            type=positive_int,
            help="largest variable or pushed tensor (default: half the machine's memory)",
        )
        g.add_argument(
            "--max-variables",
            type=positive_int,
            default=DEFAULT_MAX_VARIABLES,
            help=f"variables this task holds (default {DEFAULT_MAX_VARIABLES})",
        )
        g.add_argument(
            "--max-streams",
            type=positive_int,
            default=DEFAULT_MAX_STREAMS,
            help=f"calls served at once (default {DEFAULT_MAX_STREAMS})",
        )
        g.add_argument(
            "--max-streams-per-client",
            type=positive_int,
            default=DEFAULT_MAX_STREAMS_PER_CLIENT,
            help="of those, calls one client connection may have "
            f"(default {DEFAULT_MAX_STREAMS_PER_CLIENT})",
        )
        g.add_argument(
            "--stream-idle-timeout",
            type=positive_seconds,
            default=DEFAULT_STREAM_IDLE_TIMEOUT,
            help="seconds a streaming call may go without a message before it is "
            f"cancelled (default {DEFAULT_STREAM_IDLE_TIMEOUT:g})",
        )
        g.add_argument(
            "--max-sync-contributors",
            type=positive_int,
            help="largest num_required of a synchronous step (default: the worker count "
            f"of TF_CONFIG's cluster, else {DEFAULT_MAX_SYNC_CONTRIBUTORS})",
        )
    else:
        g.add_argument(
            "--max-closure-bytes",
            type=positive_int,
            default=DEFAULT_MAX_CLOSURE_BYTES,
            help=f"function + arguments of one closure (default {DEFAULT_MAX_CLOSURE_BYTES})",
        )
        g.add_argument(
            "--max-sessions",
            type=positive_int,
            default=DEFAULT_MAX_SESSIONS,
            help="coordinator sessions kept, least recently used dropped first "
            f"(default {DEFAULT_MAX_SESSIONS})",
        )
        g.add_argument(
            "--session-ttl",
            type=positive_seconds,
            default=DEFAULT_SESSION_TTL,
            help=f"seconds an unused session is kept (default {DEFAULT_SESSION_TTL:g})",
        )

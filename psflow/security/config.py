"""Security configuration of a psflow process, parsed once into frozen dataclasses.

Two mechanisms, usable together:

* a **shared token**: every psflow service (PS and worker) requires call
  metadata ``authorization: Bearer <token>``; the token comes from an explicit
  argument (``--auth-token-file``), else ``PSFLOW_AUTH_TOKEN``, else the file
  named by ``PSFLOW_AUTH_TOKEN_FILE``;
* **mutual TLS**: the server presents ``cert``/``key`` and accepts only clients
  whose certificate is signed by ``ca``; clients present the same kind of
  certificate and check the server's against ``ca``.  Explicit arguments
  (``--tls-cert/--tls-key/--tls-ca``) win over ``PSFLOW_TLS_CERT``,
  ``PSFLOW_TLS_KEY``, ``PSFLOW_TLS_CA`` (and ``PSFLOW_TLS_SERVER_NAME``, the
  name to expect in server certificates when it differs from the host dialled).

Servers and clients read the same variables, so one environment configures a
whole cluster (``psflow local`` generates a token and passes it this way).
The token is never logged nor shown in a ``repr``; errors name where it came
from, not its value.

Example:
    >>> cfg = SecurityConfig.from_environment({"PSFLOW_AUTH_TOKEN": "s3cret-token-0123456789"})
    >>> cfg.authenticated, cfg.tls is None
    (True, True)
    >>> cfg
    SecurityConfig(token=<23 chars from PSFLOW_AUTH_TOKEN>, tls=None)
    >>> cfg.call_metadata()[0][0]
    'authorization'
"""

from __future__ import annotations

import dataclasses
import ipaddress
import secrets
from collections.abc import Mapping

from psflow import settings
from psflow.errors import FailedPreconditionError, InvalidArgumentError
from psflow.settings import PerEnvironment

__all__ = [
    "ENV_TLS_CA",
    "ENV_TLS_CERT",
    "ENV_TLS_KEY",
    "ENV_TLS_SERVER_NAME",
    "ENV_TOKEN",
    "ENV_TOKEN_FILE",
    "MIN_TOKEN_CHARS",
    "SecurityConfig",
    "TLSConfig",
    "check_bind",
    "default_security",
    "generate_token",
    "is_loopback",
    "with_generated_token",
]

ENV_TOKEN = "PSFLOW_AUTH_TOKEN"
ENV_TOKEN_FILE = "PSFLOW_AUTH_TOKEN_FILE"
ENV_TLS_CERT = "PSFLOW_TLS_CERT"
ENV_TLS_KEY = "PSFLOW_TLS_KEY"
ENV_TLS_CA = "PSFLOW_TLS_CA"
ENV_TLS_SERVER_NAME = "PSFLOW_TLS_SERVER_NAME"

MIN_TOKEN_CHARS = 16
"""Shorter tokens are refused: a guessable token is no authentication."""

_MAX_PEM_BYTES = 1 << 20


def _read_file(path: str, what: str, limit: int = _MAX_PEM_BYTES) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise InvalidArgumentError(f"{what} {path!r} cannot be read: {e.strerror or e}") from None
    if len(data) > limit:
        raise InvalidArgumentError(f"{what} {path!r} is larger than {limit} bytes")
    return data


def _check_token(token: str, source: str) -> str:
    # Metadata values must be printable ASCII; whitespace inside would be ambiguous.
    if not token:
        raise InvalidArgumentError(f"the auth token from {source} is empty")
    if not all(33 <= ord(c) <= 126 for c in token):
        raise InvalidArgumentError(
            f"the auth token from {source} must be printable ASCII without spaces"
        )
    if len(token) < MIN_TOKEN_CHARS:
        raise InvalidArgumentError(
            f"the auth token from {source} has {len(token)} characters; at least "
            f"{MIN_TOKEN_CHARS} are required"
        )
    return token


def _token_from_file(path: str, source: str) -> str:
    raw = _read_file(path, f"auth token file ({source})", limit=4096)
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise InvalidArgumentError(
            f"auth token file {path!r} ({source}) is not ASCII text"
        ) from None
    return _check_token(text.strip(), f"file {path!r}")


@dataclasses.dataclass(frozen=True)
class TLSConfig:
    """Mutual-TLS material: this process's certificate and key, and the CA it trusts.

    Attributes:
        cert_path, key_path, ca_path: where the PEM files were read from.
        cert, key, ca: their contents (PEM bytes; ``key`` is never shown).
        server_name: name expected in a server's certificate, when it differs
            from the host a client dials (``grpc.ssl_target_name_override``).
    """

    cert_path: str
    key_path: str
    ca_path: str
    cert: bytes = dataclasses.field(repr=False)
    key: bytes = dataclasses.field(repr=False)
    ca: bytes = dataclasses.field(repr=False)
    server_name: str | None = None

    @classmethod
    def load(
        cls, cert: str, key: str, ca: str, server_name: str | None = None, *, source: str = ""
    ) -> TLSConfig:
        """Reads the three PEM files.

        Raises:
            InvalidArgumentError: a file cannot be read or holds no PEM block
                (the message names the file).
        """
        contents = {}
        for what, path in (("certificate", cert), ("private key", key), ("CA", ca)):
            data = _read_file(path, f"TLS {what}{source}")
            if b"-----BEGIN " not in data:
                raise InvalidArgumentError(f"TLS {what}{source} {path!r} holds no PEM data")
            contents[what] = data
        return cls(
            cert,
            key,
            ca,
            contents["certificate"],
            contents["private key"],
            contents["CA"],
            server_name or None,
        )


@dataclasses.dataclass(frozen=True)
class SecurityConfig:
    """How a psflow process authenticates its peers and itself.

    Attributes:
        token: the shared bearer token, or None.
        tls: mutual-TLS material, or None.
        token_source: where the token came from (for messages; never the token).
    """

    token: str | None = None
    tls: TLSConfig | None = None
    token_source: str = ""

    def __post_init__(self) -> None:
        if self.token is not None:
            _check_token(self.token, self.token_source or "the token argument")

    def __repr__(self) -> str:
        token = f"<{len(self.token)} chars from {self.token_source}>" if self.token else None
        return f"SecurityConfig(token={token}, tls={self.tls!r})"

    @property
    def authenticated(self) -> bool:
        """Whether servers with this configuration authenticate callers."""
        return self.token is not None or self.tls is not None

    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        """The metadata a client sends with every call (empty without a token)."""
        if self.token is None:
            return ()
        return (("authorization", f"Bearer {self.token}"),)

    @classmethod
    def from_environment(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        token: str | None = None,
        token_file: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_ca: str | None = None,
        tls_server_name: str | None = None,
    ) -> SecurityConfig:
        """Parses explicit arguments, falling back on ``environ`` (the process environment).

        Raises:
            InvalidArgumentError: a token or PEM file is unreadable or invalid,
                both token variables are set, or only part of the TLS trio is
                given (the message names the variables or flags involved).
        """
        env = settings.environ() if environ is None else environ
        source = ""
        if token is not None:
            source = "the token argument"
        elif token_file is not None:
            source = f"--auth-token-file {token_file!r}"
            token = _token_from_file(token_file, "--auth-token-file")
        else:
            env_token, env_file = env.get(ENV_TOKEN), env.get(ENV_TOKEN_FILE)
            if env_token and env_file:
                raise InvalidArgumentError(
                    f"both {ENV_TOKEN} and {ENV_TOKEN_FILE} are set; set only one"
                )
            if env_token:
                token, source = env_token, ENV_TOKEN
            elif env_file:
                token = _token_from_file(env_file, ENV_TOKEN_FILE)
                source = f"{ENV_TOKEN_FILE}={env_file!r}"
        tls = None
        explicit = {"--tls-cert": tls_cert, "--tls-key": tls_key, "--tls-ca": tls_ca}
        if any(v is not None for v in explicit.values()):
            names, values, where = explicit, explicit, ""
        else:
            names = {ENV_TLS_CERT: None, ENV_TLS_KEY: None, ENV_TLS_CA: None}
            values = {k: env.get(k) or None for k in names}
            where = " (environment)"
        given = [k for k, v in values.items() if v is not None]
        if given and len(given) != 3:
            missing = [k for k in names if values[k] is None]
            raise InvalidArgumentError(
                f"mutual TLS needs a certificate, a key and a CA: {', '.join(given)} given "
                f"without {', '.join(missing)}"
            )
        if given:
            cert, key, ca = (values[k] for k in names)
            name = tls_server_name or env.get(ENV_TLS_SERVER_NAME) or None
            tls = TLSConfig.load(cert, key, ca, name, source=where)
        return cls(token=token, tls=tls, token_source=source)


_default_security = PerEnvironment(
    (ENV_TOKEN, ENV_TOKEN_FILE, ENV_TLS_CERT, ENV_TLS_KEY, ENV_TLS_CA, ENV_TLS_SERVER_NAME),
    SecurityConfig.from_environment,
)


def default_security(environ: Mapping[str, str] | None = None) -> SecurityConfig:
    """The configuration ``environ`` (the process environment) describes, parsed once per distinct value.

    Clients (``PSClient``, ``GrpcWorker``, ``psflow health``) use it when they
    are given none.

    Raises:
        InvalidArgumentError: see :meth:`SecurityConfig.from_environment`.
    """
    return _default_security(environ)


def generate_token() -> str:
    """A fresh random token (256 bits, URL-safe characters)."""
    return secrets.token_urlsafe(32)


def with_generated_token(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` plus a generated ``PSFLOW_AUTH_TOKEN``, unless it already configures auth.

    What ``psflow local`` gives every role of its cluster.

    Example:
        >>> env = with_generated_token({})
        >>> len(env["PSFLOW_AUTH_TOKEN"]) >= MIN_TOKEN_CHARS
        True
        >>> with_generated_token({"PSFLOW_TLS_CA": "/ca.pem"})
        {'PSFLOW_TLS_CA': '/ca.pem'}
    """
    env = dict(environ)
    configured = (ENV_TOKEN, ENV_TOKEN_FILE, ENV_TLS_CERT, ENV_TLS_KEY, ENV_TLS_CA)
    if not any(env.get(name) for name in configured):
        env[ENV_TOKEN] = generate_token()
    return env


def is_loopback(host: str) -> bool:
    """Whether a bind address is loopback only (``127.0.0.0/8``, ``::1``, ``localhost``).

    Example:
        >>> is_loopback("127.0.0.1"), is_loopback("[::1]"), is_loopback("0.0.0.0")
        (True, True, False)
    """
    host = host.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(bind: str, security: SecurityConfig, insecure: bool = False) -> None:
    """Refuses to serve a non-loopback address without authentication.

    Raises:
        FailedPreconditionError: ``bind`` is reachable from other machines,
            ``security`` authenticates nobody and ``insecure`` is False.
    """
    if insecure or security.authenticated or is_loopback(bind):
        return
    raise FailedPreconditionError(
        f"refusing to serve on {bind!r} without authentication: anyone who can reach it could "
        f"read and change variables or run code. Set {ENV_TOKEN} (or {ENV_TOKEN_FILE}, or "
        "--auth-token-file) and/or --tls-cert/--tls-key/--tls-ca, bind 127.0.0.1, or pass "
        "--insecure to serve without authentication anyway"
    )

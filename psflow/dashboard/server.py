"""``DashboardServer``: the page, its script and ``GET /api/cluster`` over HTTP (stdlib).

Routes (GET only):

* ``/`` — the page (``static/index.html``), which polls the API once a second;
* ``/static/<file>`` — its script and style, shipped in this package (no CDN);
* ``/api/cluster`` — the JSON document (schema: ``tests/schemas/cluster_api.schema.json``).

Access: like the gRPC servers, the dashboard serves a non-loopback address
only when authentication is configured; there it demands the cluster's token,
as ``Authorization: Bearer TOKEN`` or once as ``/?token=TOKEN`` (which sets an
HttpOnly, SameSite=Strict cookie for the page's own requests).  TLS is not
offered here: beyond loopback put it behind a TLS proxy or an SSH tunnel.

Example:
    >>> from psflow.observability.events import EventLog
    >>> from psflow.dashboard.probe import ClusterProbe
    >>> from psflow.dashboard.collector import ClusterMonitor
    >>> monitor = ClusterMonitor(ClusterProbe({}), EventLog())
    >>> server = DashboardServer(monitor, "127.0.0.1", 0)
    >>> server.port > 0
    True
    >>> server.close()
"""

from __future__ import annotations

import hmac
import http.server
import importlib.resources
import json
import logging
import urllib.parse
from typing import Any, Protocol

from psflow.errors import FailedPreconditionError
from psflow.http_server import BackgroundHTTPServer
from psflow.security.config import SecurityConfig, check_bind, is_loopback

__all__ = ["DashboardServer", "DocumentSource"]


class DocumentSource(Protocol):
    """Where the ``/api/cluster`` documents come from: the live
    :class:`~psflow.dashboard.collector.ClusterMonitor`, or the finished job's
    :class:`~psflow.dashboard.job_status.FinalDocument`."""

    def snapshot(self) -> dict[str, Any]:
        """The current document."""


log = logging.getLogger(__name__)

_STATIC = {
    "index.html": "text/html; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "chart.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
_COOKIE = "psflow_dashboard_token"


def _static(name: str) -> bytes:
    return importlib.resources.files(__package__).joinpath("static", name).read_bytes()


class _Handler(http.server.BaseHTTPRequestHandler):
    monitor: DocumentSource  # set on the per-server subclass
    token: str | None  # required when set
    server_version = "psflow-dashboard"
    timeout = 10.0  # a stalled browser cannot pin a thread

    def _authorized(self, query: dict[str, list[str]]) -> tuple[bool, bool]:
        """(allowed, set the cookie)."""
        if self.token is None:
            return True, False
        offered = []
        header = self.headers.get("Authorization", "")
        if header.startswith("Bearer "):
            offered.append(header[len("Bearer ") :].strip())
        for part in self.headers.get("Cookie", "").split(";"):
            name, _, value = part.strip().partition("=")
            if name == _COOKIE:
                offered.append(value)
        from_query = query.get("token", [])
        offered += from_query
        ok = any(hmac.compare_digest(t.encode(), self.token.encode()) for t in offered)
        return ok, ok and bool(from_query)

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        allowed, set_cookie = self._authorized(urllib.parse.parse_qs(url.query))
        if not allowed:
            self._send(401, b"psflow dashboard: a token is required (?token= or Bearer)\n")
            return
        path = url.path
        if path == "/api/cluster":
            try:
                body = json.dumps(self.monitor.snapshot(), allow_nan=False).encode()
            except Exception:
                log.exception("building /api/cluster failed")
                self._send(500, b"building the cluster document failed; see the chief's log\n")
                return
            self._send(200, body, "application/json", set_cookie)
        elif path in ("/", "/index.html"):
            self._send(200, _static("index.html"), _STATIC["index.html"], set_cookie)
        elif path.startswith("/static/") and path[len("/static/") :] in _STATIC:
            name = path[len("/static/") :]
            self._send(200, _static(name), _STATIC[name], set_cookie)
        else:
            self._send(404, f"not found: {path!r}; try / or /api/cluster\n".encode())

    def _send(
        self, status: int, body: bytes, content_type: str = "text/plain", cookie: bool = False
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        if cookie and self.token is not None:
            self.send_header(
                "Set-Cookie", f"{_COOKIE}={self.token}; HttpOnly; SameSite=Strict; Path=/"
            )
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        log.debug("dashboard %s: " + format, self.address_string(), *args)


class DashboardServer:
    """Serves ``monitor``'s page and API on ``bind:port`` (0: a free port), started at once.

    Args:
        monitor: where the documents come from (not closed by :meth:`close`).
        bind: the address to listen on.
        port: the port, 0 for any free one (read :attr:`port`).
        security: beyond loopback, its token guards every request.
        require_token: guard requests with ``security``'s token on loopback too
            (None: only beyond loopback).

    Raises:
        FailedPreconditionError: ``bind`` is not loopback (or ``require_token``)
            and ``security`` has no token (TLS client certificates cannot guard a
            browser page here).
        UnavailableError: the address cannot be bound (the message names it).
    """

    def __init__(
        self,
        monitor: DocumentSource,
        bind: str = "127.0.0.1",
        port: int = 0,
        *,
        security: SecurityConfig | None = None,
        require_token: bool | None = None,
    ) -> None:
        security = security or SecurityConfig()
        check_bind(bind, SecurityConfig(token=security.token))
        if require_token is None:
            require_token = not is_loopback(bind)
        if require_token and security.token is None:
            raise FailedPreconditionError(
                "the dashboard cannot require a token: none is configured"
            )
        token = security.token if require_token else None
        if token is not None and not is_loopback(bind):
            log.warning(
                "the dashboard on %s takes the cluster's token over plain HTTP: reach it "
                "through an SSH tunnel or a TLS proxy",
                bind,
            )
        handler = type("DashboardHandler", (_Handler,), {"monitor": monitor, "token": token})
        self._http = BackgroundHTTPServer(handler, bind, port, "the dashboard")
        self.bind = bind
        self.port: int = self._http.port

    @property
    def url(self) -> str:
        """``http://HOST:PORT/``."""
        host = f"[{self.bind}]" if ":" in self.bind and not self.bind.startswith("[") else self.bind
        return f"http://{host}:{self.port}/"

    def close(self) -> None:
        """Stops serving (in-flight requests finish on their daemon threads)."""
        self._http.close()

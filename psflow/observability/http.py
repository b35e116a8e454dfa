"""Serving ``/metrics`` over HTTP from a daemon thread (stdlib ``http.server``).

The metrics port is separate from the gRPC port and answers only ``GET
/metrics`` (and ``GET /`` with a pointer to it); scraping renders the registry
once per request.  It carries counters and variable names, no tensor values.

Example:
    >>> from psflow.observability.metrics import Registry
    >>> server = MetricsServer(Registry(), "127.0.0.1", 0)
    >>> server.port > 0
    True
    >>> server.close()
"""

from __future__ import annotations

import http.server
import logging

from psflow.http_server import BackgroundHTTPServer

from .metrics import CONTENT_TYPE, Registry

__all__ = ["MetricsServer"]

log = logging.getLogger(__name__)


class _Handler(http.server.BaseHTTPRequestHandler):
    registry: Registry  # set on the per-server subclass
    server_version = "psflow-metrics"
    timeout = 10.0  # seconds a connection may idle: a stalled scraper cannot pin a thread

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            try:
                body = self.registry.exposition().encode("utf-8")
            except Exception:
                log.exception("rendering metrics failed")
                self.send_error(500, "rendering metrics failed")
                return
            content_type = CONTENT_TYPE
            status = 200
        elif path == "/":
            body, content_type, status = b"psflow metrics: GET /metrics\n", "text/plain", 200
        else:
            body, content_type, status = b"not found; GET /metrics\n", "text/plain", 404
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        log.debug("metrics %s: " + format, self.address_string(), *args)


class MetricsServer:
    """An HTTP server exposing ``registry`` on ``bind:port`` (0: any free port), started at once.

    Raises:
        UnavailableError: the address cannot be bound (the message names it).
    """

    def __init__(self, registry: Registry, bind: str = "127.0.0.1", port: int = 0) -> None:
        handler = type("MetricsHandler", (_Handler,), {"registry": registry})
        self._http = BackgroundHTTPServer(handler, bind, port, "metrics")
        self.port = self._http.port
        log.info("metrics on http://%s:%d/metrics", bind, self.port)

    def close(self) -> None:
        """Stops serving and releases the port (bounded: waits at most 5 s)."""
        self._http.close()

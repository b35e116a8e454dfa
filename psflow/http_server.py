"""A stdlib HTTP server on its own daemon thread: bound at once, closed in bounded time.

The metrics endpoint and the dashboard each serve a handler class this way;
binding (IPv4 or a bracketed IPv6 literal), the typed error for an address
that cannot be bound, the serving thread and its shutdown live here once.

Example:
    >>> import http.server
    >>> server = BackgroundHTTPServer(http.server.BaseHTTPRequestHandler, "127.0.0.1", 0, "demo")
    >>> server.port > 0
    True
    >>> server.close()
"""

from __future__ import annotations

import http.server
import socket
import threading

from psflow.errors import UnavailableError

__all__ = ["BackgroundHTTPServer"]


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class BackgroundHTTPServer:
    """Serves ``handler`` on ``bind:port`` (0: any free port) from a daemon thread, started at once.

    Args:
        handler: the request handler class (one instance per request).
        bind: the address; an IPv6 literal may be bracketed (``[::1]``).
        port: the port, 0 for a free one (read :attr:`port`).
        what: what is served, for the error message and the thread's name.

    Raises:
        UnavailableError: the address cannot be bound (the message names it).
    """

    def __init__(
        self,
        handler: type[http.server.BaseHTTPRequestHandler],
        bind: str,
        port: int,
        what: str,
    ) -> None:
        host = bind[1:-1] if bind.startswith("[") and bind.endswith("]") else bind
        server_cls = _Server6 if ":" in host else _Server
        try:
            self._server = server_cls((host, port), handler)
        except OSError as e:
            raise UnavailableError(f"cannot serve {what} on {bind}:{port}: {e}") from None
        self.bind = bind
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.5},
            name=f"{what.replace(' ', '-')}-http-{self.port}",
            daemon=True,
        )
        self._thread.start()

    def close(self) -> None:
        """Stops serving and releases the port (bounded: waits at most 5 s for the thread)."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5.0)

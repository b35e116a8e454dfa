"""Command-line flags for metrics and logs, shared by ``python -m ps_server`` and ``python -m worker``.

Example:
    >>> import argparse
    >>> p = argparse.ArgumentParser()
    >>> add_observability_flags(p)
    >>> [p.parse_args(a).metrics_port for a in ([], ["--metrics-port", "auto"], ["--metrics-port", "9100"])]
    [None, 0, 9100]
"""

from __future__ import annotations

import argparse

__all__ = ["add_observability_flags", "metrics_port"]


def metrics_port(text: str) -> int | None:
    """argparse type: ``0`` disables metrics (None), ``auto`` picks a free port (0), else a port."""
    if text == "auto":
        return 0
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number or 'auto'") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is outside 0..65535")
    return port or None


def add_observability_flags(parser: argparse.ArgumentParser) -> None:
    """``--metrics-port``, ``--metrics-bind``, ``--log-format`` and ``--log-level``."""
    g = parser.add_argument_group("observability")
    g.add_argument(
        "--metrics-port",
        type=metrics_port,
        default=None,
        metavar="PORT|auto",
        help="serve Prometheus metrics at http://BIND:PORT/metrics (0: off, the default; "
        "auto: a free port, announced as metrics_port= on the ready line)",
    )
    g.add_argument(
        "--metrics-bind", metavar="ADDR", help="address of the metrics port (default: --bind)"
    )
    g.add_argument(
        "--log-format", choices=["text", "json"], default="text", help="log line format (stderr)"
    )
    g.add_argument("--log-level", default="INFO")

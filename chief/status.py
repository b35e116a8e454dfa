"""``psflow local --status``: the launcher's view of its cluster, probed like the dashboard's.

The launcher probes its own PS and worker tasks (``GetStats``, ``GetStatus``,
with the cluster's token) from a daemon thread and shows them with
:class:`psflow.dashboard.terminal.StatusView`: a table redrawn in place when
stderr is a terminal, one ``[local] status:`` line per interval otherwise.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TextIO

from psflow.dashboard.collector import ClusterMonitor
from psflow.dashboard.probe import ClusterProbe
from psflow.dashboard.terminal import EraseBeforeWrite, StatusView
from psflow.observability.events import EventLog
from psflow.security.config import SecurityConfig

__all__ = ["LauncherStatus"]


class LauncherStatus:
    """Probes ``cluster`` and shows it on ``stream`` every ``interval`` seconds.

    Args:
        cluster: job -> addresses (only ``ps`` and ``worker`` are probed).
        environ: the roles' environment (its token authenticates the probes).
        stream: where the table or the lines go.
        processes: role -> process state, for roles no probe covers (the chief).
        interval: seconds between refreshes.
        tty: draw in place (default: whether ``stream`` is a terminal).
        ps_view: the PS addresses listed now (``psflow scale`` changes them);
            None: ``cluster``'s, fixed.

    Raises:
        OpError: the environment's credentials cannot be read.
    """

    def __init__(
        self,
        cluster: Mapping[str, Sequence[str]],
        environ: Mapping[str, str],
        stream: TextIO,
        processes: Callable[[], Mapping[str, str]],
        *,
        interval: float = 2.0,
        tty: bool | None = None,
        ps_view: Callable[[], Sequence[str]] | None = None,
    ) -> None:
        security = SecurityConfig.from_environment(environ)
        probe = ClusterProbe(cluster, security=security)
        self.monitor = ClusterMonitor(
            probe, EventLog(), interval=min(interval, 1.0), ps_view=ps_view
        ).start()
        self.view = StatusView(stream, self.monitor.snapshot, processes, interval=interval, tty=tty)

    def wrap(self, stream: TextIO | None) -> TextIO | None:
        """``stream`` made to erase the table before each write (unchanged when not a TTY)."""
        if stream is None or not self.view.tty:
            return stream
        return EraseBeforeWrite(stream, self.view)  # type: ignore[return-value]

    @contextlib.contextmanager
    def around_logging(self) -> Iterator[None]:
        """While inside, the root logger's stream handlers also erase the table before writing."""
        if not self.view.tty:
            yield
            return
        handlers = [h for h in logging.getLogger().handlers if isinstance(h, logging.StreamHandler)]
        previous = [h.setStream(self.wrap(h.stream)) for h in handlers]
        try:
            yield
        finally:
            for handler, stream in zip(handlers, previous):
                handler.setStream(stream)

    def refresh(self) -> None:
        """Redraws or logs when due."""
        self.view.refresh()

    def close(self) -> None:
        """Erases the table and stops probing."""
        self.view.erase()
        self.monitor.close()

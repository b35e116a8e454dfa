"""Bounded, visible waits for lost parameter servers: how long, how often to say so.

Every wait for a task to come back has a finite default, logs a progress line
every few seconds naming the task it waits for, and ends with a typed error
naming that task when it gives up.  The deadline holds: every probe inside the
wait gets ``min(probe timeout, time left)`` as its own deadline, so no single
RPC can carry the wait past it.

The knobs (read once, at the caller's entry point, with :meth:`RecoveryConfig.from_environ`):

=================================  =======  ==================================================
variable                           default  meaning
=================================  =======  ==================================================
``PSFLOW_PS_RECOVERY_TIMEOUT``     300      seconds the chief waits for a lost PS task to
                                            answer again before it gives up (exit 138)
``PSFLOW_PS_PROBE_TIMEOUT``        5        deadline of one health probe of a PS task; a PS
                                            that does not answer in time (frozen,
                                            partitioned) counts as unavailable for that probe
``PSFLOW_WAIT_PROGRESS_INTERVAL``  5        seconds between progress lines of a long wait
=================================  =======  ==================================================

Example:
    >>> cfg = RecoveryConfig.from_environ({"PSFLOW_PS_RECOVERY_TIMEOUT": "120"})
    >>> cfg.ps_timeout, cfg.probe_timeout
    (120.0, 5.0)
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping

from psflow import errors, settings

ENV_PS_TIMEOUT = "PSFLOW_PS_RECOVERY_TIMEOUT"
ENV_PROBE_TIMEOUT = "PSFLOW_PS_PROBE_TIMEOUT"
ENV_PROGRESS_INTERVAL = "PSFLOW_WAIT_PROGRESS_INTERVAL"

DEFAULT_PS_TIMEOUT = 300.0
DEFAULT_PROBE_TIMEOUT = 5.0
DEFAULT_PROGRESS_INTERVAL = 5.0

_RETRY_PAUSE = 0.2
"""Seconds between two probes of a task that did not answer (bounded by the deadline)."""


@dataclasses.dataclass(frozen=True)
class RecoveryConfig:
    """How long recovery waits last and how often they report.

    Attributes:
        ps_timeout: seconds to wait for a lost PS task to answer again.
        probe_timeout: deadline of one probe; also how long a PS may be silent
            (frozen, partitioned) before that probe counts as a failure.
        progress_every: seconds between progress lines.

    Raises:
        InvalidArgumentError: a value is not a positive number (the message names it).
    """

    ps_timeout: float = DEFAULT_PS_TIMEOUT
    probe_timeout: float = DEFAULT_PROBE_TIMEOUT
    progress_every: float = DEFAULT_PROGRESS_INTERVAL

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise errors.InvalidArgumentError(
                    f"{field.name} {value!r} must be a number of seconds > 0"
                )
            if value == float("inf"):
                raise errors.InvalidArgumentError(f"{field.name} {value!r} must be finite")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> RecoveryConfig:
        """The configuration the environment asks for (defaults for what it does not set).

        Raises:
            InvalidArgumentError: a variable is not a positive finite number (names it).
        """
        env = settings.environ() if environ is None else environ
        values = {}
        for name, field in (
            (ENV_PS_TIMEOUT, "ps_timeout"),
            (ENV_PROBE_TIMEOUT, "probe_timeout"),
            (ENV_PROGRESS_INTERVAL, "progress_every"),
        ):
            raw = env.get(name)
            if raw is None or not raw.strip():
                continue
            try:
                value = float(raw)
            except ValueError:
                raise errors.InvalidArgumentError(
                    f"{name} must be a number of seconds, got {raw!r}"
                ) from None
            if not 0 < value < float("inf"):
                raise errors.InvalidArgumentError(
                    f"{name} must be a finite number of seconds > 0, got {raw!r}"
                )
            values[field] = value
        return cls(**values)


class Progress:
    """Says, at most every ``every`` seconds, what a wait is waiting for.

    Args:
        what: the wait, e.g. ``"the chief waits for ps:1 to come back"``.
        timeout: the wait's limit in seconds (quoted in each line).
        every: seconds between lines.
        logger: where lines go (warnings: a stalled job is worth noticing).
        clock: monotonic seconds (injectable in tests).
    """

    def __init__(
        self,
        what: str,
        timeout: float,
        every: float,
        logger: logging.Logger,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what = what
        self.timeout = timeout
        self.every = every
        self._log = logger
        self._clock = clock
        self.started = clock()
        self._next = self.started  # the first line comes at once: the user learns of the wait
        self.lines = 0

    def elapsed(self) -> float:
        """Seconds since the wait started."""
        return self._clock() - self.started

    def tick(self, detail: str = "") -> None:
        """Logs a progress line if one is due; ``detail`` says what the last attempt saw."""
        now = self._clock()
        if now < self._next:
            return
        self._next = now + self.every
        self.lines += 1
        self._log.warning(
            "%s: %.0fs of %.0fs%s",
            self.what,
            now - self.started,
            self.timeout,
            f" ({detail})" if detail else "",
        )


def wait_until(
    task: str,
    probe: Callable[[float], None],
    deadline: float,
    progress: Progress,
    probe_timeout: float,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Calls ``probe(time_allowed)`` until it returns, or gives up at ``deadline``.

    ``probe`` gets the seconds it may take, ``min(probe_timeout, time left)``
    (so it never runs past ``deadline``), and raises
    ``UnavailableError`` or ``DeadlineExceededError`` while ``task`` does not
    answer; any other error ends the wait at once.

    Raises:
        PSUnavailableError: ``task`` did not answer before ``deadline``; names it,
            how long the wait took and what the last probe saw.
    """
    last = "no probe finished yet"
    while True:
        left = deadline - clock()
        if left <= 0:
            raise errors.PSUnavailableError(
                f"{task} did not come back within {progress.timeout:.0f}s "
                f"(waited {progress.elapsed():.1f}s; last probe: {last})",
                task=task,
            )
        try:
            probe(min(probe_timeout, left))
            return
        except (errors.UnavailableError, errors.DeadlineExceededError) as e:
            last = f"{type(e).__name__}: {e.message}"
        progress.tick(last)
        pause = min(_RETRY_PAUSE, deadline - clock())
        if pause > 0:
            time.sleep(pause)


class WaitWatch:
    """Reports blocking calls that last long: one thread, started on first use.

    A call that cannot report progress itself (a synchronous push held at the
    PS's barrier until every worker contributed) runs inside :meth:`waiting`;
    while it lasts longer than ``every`` seconds, a line saying what it waits
    for and for how long is logged every ``every`` seconds.  Entering and
    leaving costs a lock and a dict update; the reporting thread wakes at most
    once a second and ends with :meth:`close`.

    Args:
        every: seconds between lines about one wait.
        logger: where lines go.
    """

    def __init__(self, every: float, logger: logging.Logger) -> None:
        if not every > 0:
            raise errors.InvalidArgumentError(f"every {every!r} must be a number of seconds > 0")
        self.every = every
        self._log = logger
        self._lock = threading.Lock()
        self._waits: dict[int, list] = {}  # id -> [what, timeout, started, next line]
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()
        self.lines = 0

    @contextlib.contextmanager
    def waiting(self, what: str, timeout: float | None) -> Iterator[None]:
        """Reports the body as waiting for ``what`` (limited to ``timeout`` seconds) while it lasts."""
        now = time.monotonic()
        key = next(self._ids)
        with self._lock:
            self._waits[key] = [what, timeout, now, now + self.every]
            if self._thread is None and not self._closed.is_set():
                self._thread = threading.Thread(
                    target=self._report, name="psflow-wait-watch", daemon=True
                )
                self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                del self._waits[key]

    def _report(self) -> None:
        while not self._closed.wait(min(1.0, self.every)):
            now = time.monotonic()
            with self._lock:
                due = [w for w in self._waits.values() if w[3] <= now]
                for w in due:
                    w[3] = now + self.every
            for what, timeout, started, _ in due:
                self.lines += 1
                limit = f" of {timeout:.0f}s" if timeout is not None else ""
                self._log.warning("%s: %.0fs%s", what, now - started, limit)

    def close(self) -> None:
        """Stops the reporting thread (bounded join)."""
        self._closed.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2.0)

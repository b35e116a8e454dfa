"""The coordinator's knobs, read once from the environment into a frozen dataclass.

Every knob has a default that suits a local cluster; bad values raise
:class:`psflow.errors.InvalidArgumentError` naming the variable and the value
when the coordinator is built, never later.

Example:
    >>> cfg = CoordinatorConfig.from_environ({"PSFLOW_HEALTH_GRACE": "3"})
    >>> cfg.health_grace
    3.0
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from psflow import errors, settings
from psflow.transport.options import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS


def _number(environ: Mapping[str, str], name: str, default: float, minimum: float) -> float:
    raw = environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise errors.InvalidArgumentError(f"{name} must be a number, got {raw!r}") from None
    if not value >= minimum or value == float("inf"):
        raise errors.InvalidArgumentError(
            f"{name} must be a finite number >= {minimum}, got {raw!r}"
        )
    return value


def _integer(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise errors.InvalidArgumentError(f"{name} must be an integer, got {raw!r}") from None
    if value < 1:
        raise errors.InvalidArgumentError(f"{name} must be >= 1, got {raw!r}")
    return value


@dataclasses.dataclass(frozen=True)
class CoordinatorConfig:
    """How the coordinator dispatches, detects lost or slow workers and bounds its queue.

    Attributes:
        closures_in_flight: closures sent to one remote worker at once in async
            mode (``PSFLOW_CLOSURES_IN_FLIGHT``); one beyond the first only while
            no other worker is idle.
        worker_unavailable_timeout: seconds with no worker reachable before the
            queued closures fail with a ``WorkerUnavailableError`` naming the lost
            workers (``PSFLOW_WORKER_UNAVAILABLE_TIMEOUT``).
        health_interval: seconds between two health probes (GetStatus) of a
            worker (``PSFLOW_HEALTH_INTERVAL``).
        health_grace: seconds a worker may leave probes unanswered before it is
            treated as unavailable, its closures re-run elsewhere
            (``PSFLOW_HEALTH_GRACE``).
        straggler_factor: a closure running longer than this many times the
            recent typical (90th percentile) closure time is late and re-run on an
            idle worker, first result wins; 0 turns speculation off
            (``PSFLOW_STRAGGLER_FACTOR``).
        straggler_min_seconds: a closure is never late before this many seconds
            (``PSFLOW_STRAGGLER_MIN_SECONDS``).
        queued_per_worker: ``schedule`` blocks while more than this many closures
            per worker wait in the queue (``PSFLOW_MAX_QUEUED_PER_WORKER``).
        schedule_timeout: seconds ``schedule`` blocks on a full queue before it
            raises ``ResourceExhaustedError`` (``PSFLOW_SCHEDULE_TIMEOUT``).
        keepalive_time: seconds between two keepalive pings the chief sends each
            worker on its channel (``PSFLOW_WORKER_KEEPALIVE_TIME``; as on the PS
            channels by default).
        keepalive_timeout: seconds a ping may go unanswered before the channel
            is dropped and the closures in flight on it fail as a lost worker's
            (re-queued), even with no socket reset to tell
            (``PSFLOW_WORKER_KEEPALIVE_TIMEOUT``).
    """

    closures_in_flight: int = 2
    worker_unavailable_timeout: float = 600.0
    health_interval: float = 1.0
    health_grace: float = 10.0
    straggler_factor: float = 4.0
    straggler_min_seconds: float = 2.0
    queued_per_worker: int = 256
    schedule_timeout: float = 600.0
    keepalive_time: float = KEEPALIVE_TIME_MS / 1000
    keepalive_timeout: float = KEEPALIVE_TIMEOUT_MS / 1000

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> CoordinatorConfig:
        """The configuration the environment sets (defaults for what it does not).

        Raises:
            InvalidArgumentError: a variable is set to a value out of its range.
        """
        env = settings.environ() if environ is None else environ
        d = cls()
        factor = _number(env, "PSFLOW_STRAGGLER_FACTOR", d.straggler_factor, 0.0)
        if 0 < factor < 1:
            raise errors.InvalidArgumentError(
                "PSFLOW_STRAGGLER_FACTOR must be 0 (off) or >= 1 (a multiple of the typical "
                f"closure time), got {env['PSFLOW_STRAGGLER_FACTOR']!r}"
            )
        return cls(
            closures_in_flight=_integer(env, "PSFLOW_CLOSURES_IN_FLIGHT", d.closures_in_flight),
            worker_unavailable_timeout=_number(
                env, "PSFLOW_WORKER_UNAVAILABLE_TIMEOUT", d.worker_unavailable_timeout, 0.0
            ),
            health_interval=_number(env, "PSFLOW_HEALTH_INTERVAL", d.health_interval, 0.05),
            health_grace=_number(env, "PSFLOW_HEALTH_GRACE", d.health_grace, 0.1),
            straggler_factor=factor,
            straggler_min_seconds=_number(
                env, "PSFLOW_STRAGGLER_MIN_SECONDS", d.straggler_min_seconds, 0.0
            ),
            queued_per_worker=_integer(env, "PSFLOW_MAX_QUEUED_PER_WORKER", d.queued_per_worker),
            schedule_timeout=_number(env, "PSFLOW_SCHEDULE_TIMEOUT", d.schedule_timeout, 0.0),
            # gRPC counts in whole milliseconds; below 0.1 s a loaded host misses pings
            keepalive_time=_number(env, "PSFLOW_WORKER_KEEPALIVE_TIME", d.keepalive_time, 0.1),
            keepalive_timeout=_number(
                env, "PSFLOW_WORKER_KEEPALIVE_TIMEOUT", d.keepalive_timeout, 0.1
            ),
        )

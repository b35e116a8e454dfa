"""Process-wide settings that come from the environment, parsed in one place.

Library code never reads ``os.environ`` itself: it asks :func:`current` for a
frozen :class:`ProcessSettings`, parsed once per distinct environment (so a
test that changes a variable sees the change), and tests may pass their own
``environ`` mapping.  Security settings live in :mod:`psflow.security.config`,
the coordinator's in :mod:`psflow.distribute.coordinator.config`.

Variables:

* ``PSFLOW_NUM_CPU_DEVICES`` — logical CPU devices (default 1);
* ``PSFLOW_MALLOC_TUNING`` — ``0`` keeps glibc's malloc defaults;
* ``PSFLOW_SHM`` — ``0`` turns the shared-memory data path off;
* ``PSFLOW_PROGBAR`` — ``plain``: progress bars print lines, never redraw;
* ``PSFLOW_CLOSURE_TIMEOUT`` — seconds one closure may run on a worker (3600).

Example:
    >>> s = ProcessSettings.from_environment({"PSFLOW_NUM_CPU_DEVICES": "4", "PSFLOW_SHM": "off"})
    >>> (s.num_cpu_devices, s.shm, s.closure_timeout)
    (4, False, 3600.0)
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from psflow.errors import InvalidArgumentError

__all__ = [
    "ENV_CLOSURE_TIMEOUT",
    "ENV_MALLOC_TUNING",
    "ENV_NUM_CPU_DEVICES",
    "ENV_PROGBAR",
    "ENV_SHM",
    "ProcessSettings",
    "current",
]

ENV_NUM_CPU_DEVICES = "PSFLOW_NUM_CPU_DEVICES"
ENV_MALLOC_TUNING = "PSFLOW_MALLOC_TUNING"
ENV_SHM = "PSFLOW_SHM"
ENV_PROGBAR = "PSFLOW_PROGBAR"
ENV_CLOSURE_TIMEOUT = "PSFLOW_CLOSURE_TIMEOUT"
_NAMES = (ENV_NUM_CPU_DEVICES, ENV_MALLOC_TUNING, ENV_SHM, ENV_PROGBAR, ENV_CLOSURE_TIMEOUT)
_OFF = ("0", "false", "no", "off")


def _switch(env: Mapping[str, str], name: str) -> bool:
    """On unless the variable says off (``0``, ``false``, ``no``, ``off``)."""
    return env.get(name, "1").strip().lower() not in _OFF


@dataclasses.dataclass(frozen=True)
class ProcessSettings:
    """What the ``PSFLOW_*`` process variables say (see the module doc)."""

    num_cpu_devices: int = 1
    malloc_tuning: bool = True
    shm: bool = True
    plain_progbar: bool = False
    closure_timeout: float = 3600.0

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> ProcessSettings:
        """Parses ``environ`` (``os.environ`` by default).

        Raises:
            InvalidArgumentError: a variable holds a value it cannot (quoted, with its name).
        """
        env = os.environ if environ is None else environ
        raw = env.get(ENV_NUM_CPU_DEVICES, "1")
        try:
            cpus = int(raw)
        except ValueError:
            raise InvalidArgumentError(
                f"{ENV_NUM_CPU_DEVICES} must be an integer, got {raw!r}"
            ) from None
        if cpus < 1:
            raise InvalidArgumentError(f"{ENV_NUM_CPU_DEVICES} must be >= 1, got {cpus}")
        raw = env.get(ENV_CLOSURE_TIMEOUT, "3600")
        try:
            timeout = float(raw)
        except ValueError:
            raise InvalidArgumentError(
                f"{ENV_CLOSURE_TIMEOUT} must be a number, got {raw!r}"
            ) from None
        if not timeout > 0:
            raise InvalidArgumentError(f"{ENV_CLOSURE_TIMEOUT} must be > 0, got {raw!r}")
        return cls(
            num_cpu_devices=cpus,
            malloc_tuning=_switch(env, ENV_MALLOC_TUNING),
            shm=_switch(env, ENV_SHM),
            plain_progbar=env.get(ENV_PROGBAR) == "plain",
            closure_timeout=timeout,
        )


_CACHE: dict[tuple[str | None, ...], ProcessSettings] = {}


def current(environ: Mapping[str, str] | None = None) -> ProcessSettings:
    """The settings ``environ`` (``os.environ``) describes, parsed once per distinct value.

    Raises:
        InvalidArgumentError: see :meth:`ProcessSettings.from_environment`.
    """
    env = os.environ if environ is None else environ
    key = tuple(env.get(n) for n in _NAMES)
    settings = _CACHE.get(key)
    if settings is None:
        settings = ProcessSettings.from_environment(env)
        if len(_CACHE) > 64:  # a long test session may go through many environments
            _CACHE.clear()
        _CACHE[key] = settings
    return settings

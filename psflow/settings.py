"""Process-wide settings that come from the environment, parsed in one place.

Library code never reads ``os.environ`` itself: it asks :func:`current` for a
frozen :class:`ProcessSettings`, parsed once per distinct environment (so a
test that changes a variable sees the change), and tests may pass their own
``environ`` mapping.  Library functions that take an ``environ`` mapping
default to :func:`environ`, the one place below the entrypoints where the
process environment is read.  Security settings live in :mod:`psflow.security.config`,
the coordinator's in :mod:`psflow.distribute.coordinator.config`.

Variables:

* ``PSFLOW_NUM_CPU_DEVICES`` — logical CPU devices (default 1);
* ``PSFLOW_MALLOC_TUNING`` — ``0`` keeps glibc's malloc defaults;
* ``PSFLOW_SHM`` — ``0`` turns the shared-memory paths off (the PS's mirrors and
  push segments, the same-host workers' all-reduce);
* ``PSFLOW_PROGBAR`` — ``plain``: progress bars print lines, never redraw;
* ``PSFLOW_CLOSURE_TIMEOUT`` — seconds one closure may run on a worker (3600);
* ``PSFLOW_DATA_PLANE`` — ``off``: clients push and pull over gRPC even where a
  PS announces a raw TCP data plane;
* ``PSFLOW_PUSH_BEHIND`` — ``on``: a worker's next async closure computes while
  this one's pushes are on the wire (one step more staleness; see
  ``psflow.distribute.ps.push_behind``); off by default: a closure's pushes
  are applied before the next starts;
* ``PSFLOW_DATA_PLANE_ROUTES`` — ``GRPC=DATA[,...]`` (``host:port`` each): a PS
  (or a worker) reached at ``GRPC`` has its data plane dialled at ``DATA``,
  whatever it announces (a client behind its own relay or tunnel to that task);
* ``PSFLOW_CLOSURE_PLANE`` — ``off``: a worker serves no data plane for closures
  and the chief sends every closure over gRPC's ``RunClosure`` (on by default: a
  worker serves ``RunClosure`` on a raw TCP port too, which costs both processes
  less CPU per closure, and the chief uses it where the worker announces one);
* ``PSFLOW_HOST_ID`` — the host this worker counts as for the workers' all-reduce
  (as NCCL's ``NCCL_HOSTID``): workers of one id share memory, one id with another
  talks TCP (``psflow.collective.shm_hier``); unset, the boot id, network namespace
  and ``/dev/shm`` say it;
* ``PSFLOW_CUDNN`` — ``0`` keeps convolutions on CuPy arrays on the im2col path
  where CuPy has cuDNN (``psflow.ops.conv_gpu``);
* ``PSFLOW_COMPILED_KERNELS`` — ``0`` keeps max pooling and the ReLU's gradient on
  NumPy arrays on NumPy's calls where Numba is installed (``psflow.ops.compiled``).

Example:
    >>> s = ProcessSettings.from_environment({"PSFLOW_NUM_CPU_DEVICES": "4", "PSFLOW_SHM": "off"})
    >>> (s.num_cpu_devices, s.shm, s.closure_timeout)
    (4, False, 3600.0)
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

from psflow.errors import InvalidArgumentError

__all__ = [
    "ENV_CLOSURE_PLANE",
    "ENV_CLOSURE_TIMEOUT",
    "ENV_COMPILED_KERNELS",
    "ENV_CUDNN",
    "ENV_DATA_PLANE",
    "ENV_DATA_PLANE_ROUTES",
    "ENV_HOST_ID",
    "ENV_MALLOC_TUNING",
    "ENV_NUM_CPU_DEVICES",
    "ENV_PROGBAR",
    "ENV_PUSH_BEHIND",
    "ENV_SHM",
    "PerEnvironment",
    "ProcessSettings",
    "current",
    "environ",
]

ENV_NUM_CPU_DEVICES = "PSFLOW_NUM_CPU_DEVICES"
ENV_MALLOC_TUNING = "PSFLOW_MALLOC_TUNING"
ENV_SHM = "PSFLOW_SHM"
ENV_PROGBAR = "PSFLOW_PROGBAR"
ENV_CLOSURE_TIMEOUT = "PSFLOW_CLOSURE_TIMEOUT"
ENV_DATA_PLANE = "PSFLOW_DATA_PLANE"
ENV_DATA_PLANE_ROUTES = "PSFLOW_DATA_PLANE_ROUTES"
ENV_PUSH_BEHIND = "PSFLOW_PUSH_BEHIND"
ENV_CLOSURE_PLANE = "PSFLOW_CLOSURE_PLANE"
ENV_HOST_ID = "PSFLOW_HOST_ID"
ENV_CUDNN = "PSFLOW_CUDNN"
ENV_COMPILED_KERNELS = "PSFLOW_COMPILED_KERNELS"
_NAMES = (
    ENV_NUM_CPU_DEVICES,
    ENV_MALLOC_TUNING,
    ENV_SHM,
    ENV_PROGBAR,
    ENV_CLOSURE_TIMEOUT,
    ENV_DATA_PLANE,
    ENV_DATA_PLANE_ROUTES,
    ENV_PUSH_BEHIND,
    ENV_CLOSURE_PLANE,
    ENV_HOST_ID,
    ENV_CUDNN,
    ENV_COMPILED_KERNELS,
)
_OFF = ("0", "false", "no", "off")
T = TypeVar("T")


def environ() -> Mapping[str, str]:
    """The process environment (``os.environ``, live: later changes are seen).

    The default of every library function that takes an ``environ`` mapping,
    so that the environment is read in one place (and the entrypoints).
    """
    return os.environ


_process_environ = environ  # the name ``environ`` is the parameter's in the functions below


def _number(
    env: Mapping[str, str], name: str, default: str, kind: type, what: str, rule: str
) -> Any:
    """``kind(env[name])``, which must satisfy ``rule`` (``">= 1"`` or ``"> 0"``).

    Raises:
        InvalidArgumentError: not a number of ``kind``, or breaking ``rule`` (quoted).
    """
    raw = env.get(name, default)
    try:
        value = kind(raw)
    except ValueError:
        raise InvalidArgumentError(f"{name} must be {what}, got {raw!r}") from None
    bound = float(rule.split()[1])
    if not (value >= bound if rule.startswith(">=") else value > bound):
        raise InvalidArgumentError(f"{name} must be {rule}, got {value!r}")
    return value


def _switch(env: Mapping[str, str], name: str, default: str = "1") -> bool:
    """On unless the variable (or, unset, ``default``) says off (``0``, ``false``, ``no``,
    ``off``)."""
    return env.get(name, default).strip().lower() not in _OFF


def _routes(raw: str) -> tuple[tuple[str, str], ...]:
    """``GRPC=DATA`` pairs of ``host:port`` addresses, comma-separated.

    Raises:
        InvalidArgumentError: a pair that is not two ``host:port`` addresses (quoted).
    """
    pairs = []
    for item in filter(None, (part.strip() for part in raw.split(","))):
        grpc_address, sep, data_address = item.partition("=")
        if not sep or not all(_is_host_port(a) for a in (grpc_address, data_address)):
            raise InvalidArgumentError(
                f"{ENV_DATA_PLANE_ROUTES} holds {item!r}; expected GRPC_HOST:PORT=DATA_HOST:PORT"
            )
        pairs.append((grpc_address.strip(), data_address.strip()))
    return tuple(pairs)


def _is_host_port(address: str) -> bool:
    host, sep, port = address.strip().rpartition(":")
    return bool(host) and bool(sep) and port.isdigit() and 0 < int(port) <= 65535


@dataclasses.dataclass(frozen=True)
class ProcessSettings:
    """What the ``PSFLOW_*`` process variables say (see the module doc)."""

    num_cpu_devices: int = 1
    malloc_tuning: bool = True
    shm: bool = True
    plain_progbar: bool = False
    closure_timeout: float = 3600.0
    data_plane: bool = True
    data_plane_routes: tuple[tuple[str, str], ...] = ()
    push_behind: bool = False
    closure_plane: bool = True
    host_id: str = ""
    cudnn: bool = True
    compiled_kernels: bool = True

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> ProcessSettings:
        """Parses ``environ`` (``os.environ`` by default).

        Raises:
            InvalidArgumentError: a variable holds a value it cannot (quoted, with its name).
        """
        env = _process_environ() if environ is None else environ
        cpus = _number(env, ENV_NUM_CPU_DEVICES, "1", int, "an integer", ">= 1")
        timeout = _number(env, ENV_CLOSURE_TIMEOUT, "3600", float, "a number", "> 0")
        return cls(
            num_cpu_devices=cpus,
            malloc_tuning=_switch(env, ENV_MALLOC_TUNING),
            shm=_switch(env, ENV_SHM),
            plain_progbar=env.get(ENV_PROGBAR) == "plain",
            closure_timeout=timeout,
            data_plane=_switch(env, ENV_DATA_PLANE),
            data_plane_routes=_routes(env.get(ENV_DATA_PLANE_ROUTES, "")),
            push_behind=_switch(env, ENV_PUSH_BEHIND, default="0"),
            closure_plane=_switch(env, ENV_CLOSURE_PLANE),
            host_id=env.get(ENV_HOST_ID, "").strip(),
            cudnn=_switch(env, ENV_CUDNN),
            compiled_kernels=_switch(env, ENV_COMPILED_KERNELS),
        )


class PerEnvironment(Generic[T]):
    """``parse(environ)``, computed once per distinct value of the variables ``names``.

    Library code asks for its configuration often; the environment changes
    rarely (tests change it), so the parsed object is kept per set of values.
    """

    def __init__(self, names: Sequence[str], parse: Callable[[Mapping[str, str]], T]) -> None:
        self._names = tuple(names)
        self._parse = parse
        self._cache: dict[tuple[str | None, ...], T] = {}

    def __call__(self, environ: Mapping[str, str] | None = None) -> T:
        """The parsed configuration of ``environ`` (``os.environ`` by default)."""
        env = _process_environ() if environ is None else environ
        key = tuple(env.get(n) for n in self._names)
        value = self._cache.get(key)
        if value is None:
            value = self._parse(env)
            if len(self._cache) > 64:  # a long test session may go through many environments
                self._cache.clear()
            self._cache[key] = value
        return value


_current = PerEnvironment(_NAMES, ProcessSettings.from_environment)
_compiled_kernels = PerEnvironment(
    (ENV_COMPILED_KERNELS,), lambda env: _switch(env, ENV_COMPILED_KERNELS)
)


def current(environ: Mapping[str, str] | None = None) -> ProcessSettings:
    """The settings ``environ`` (``os.environ``) describes, parsed once per distinct value.

    Raises:
        InvalidArgumentError: see :meth:`ProcessSettings.from_environment`.
    """
    return _current(environ)


def compiled_kernels(environ: Mapping[str, str] | None = None) -> bool:
    """``current().compiled_kernels``, reading only its own variable: the kernels ask before
    every large elementwise op (a dozen times a training step, and a PS's every apply), where
    ``current`` reads all of psflow's variables each time."""
    return _compiled_kernels(environ)

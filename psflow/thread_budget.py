"""How many BLAS/OpenMP threads each psflow process runs with.

NumPy's OpenBLAS starts a pool as wide as the machine in every process. Two
processes training on one 2-core host then run four busy threads on two cores,
and OpenBLAS's spinning threads lose most of their time to each other (a
worker pair measured 217 / 38 steps/s at batch 64 / 256 against 510 / 174 with
one thread each). So every process psflow starts gets a budget:

* ``psflow local`` knows the processes it starts on this host and the cores
  there (:func:`available_cores`); :func:`share_cores` gives each parameter
  server 1 thread (its work, optimizer updates and (de)serialization, is
  element-wise NumPy: no BLAS call in ``psflow/ps``, ``ps_server`` or the
  update rules, so BLAS threads cannot speed it up) and splits the
  cores left among the workers and the chief, at least 1 each. It passes the
  result to each child as ``PSFLOW_BLAS_THREADS``.
* an entrypoint started alone (``python -m ps_server|worker|chief``: a
  Kubernetes pod, a compose service) without ``PSFLOW_BLAS_THREADS`` budgets
  itself: 1 thread for a parameter server, the cores of its container for a
  worker or the chief.

Precedence, first that applies (:func:`resolve_budget`):

1. ``OPENBLAS_NUM_THREADS``, ``MKL_NUM_THREADS`` or ``OMP_NUM_THREADS`` set
   by the user: psflow leaves the libraries alone (they read these
   themselves) and only reports the count they use;
2. ``PSFLOW_BLAS_THREADS=N`` (``psflow local --threads-per-process N`` sets
   it for every role): N threads;
3. otherwise (``PSFLOW_BLAS_THREADS`` unset, ``0`` or ``auto``): psflow's
   choice above.

The budget is applied at process start with ``threadpoolctl``
(:func:`apply_budget`, process-wide: BLAS and OpenMP pools). MirroredStrategy's
replicas on CPU devices split it (:func:`process_threads`) with their own
per-thread setter (:mod:`psflow.distribute.replica_pool`).

Example:
    >>> share_cores(cores=2, num_ps=1, num_compute=2)
    (1, 1)
    >>> share_cores(cores=16, num_ps=2, num_compute=3)
    (1, 4)
    >>> resolve_budget("worker", {"PSFLOW_BLAS_THREADS": "3"}, cores=8)
    ThreadBudget(threads=3, source='PSFLOW_BLAS_THREADS', cores=8)
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping

from psflow.errors import InvalidArgumentError

__all__ = [
    "BLAS_THREADS_ENV",
    "LIBRARY_THREAD_VARIABLES",
    "ThreadBudget",
    "apply_budget",
    "available_cores",
    "current_blas_threads",
    "library_threads",
    "parse_threads",
    "process_threads",
    "ready_field",
    "resolve_budget",
    "role_threads",
    "share_cores",
    "start_process_budget",
]

log = logging.getLogger("psflow.thread_budget")

BLAS_THREADS_ENV = "PSFLOW_BLAS_THREADS"
"""The BLAS/OpenMP threads of this process: a positive integer, or ``0``/``auto``."""

LIBRARY_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS")
"""The libraries' own variables: one set by the user wins over any psflow budget."""

AUTO = "auto"
CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"
PS_ROLES = frozenset({"ps"})
MAX_THREADS = 4096
"""The most threads a budget may ask for (a guard against typos)."""


@dataclasses.dataclass(frozen=True)
class ThreadBudget:
    """The BLAS/OpenMP threads one process runs with, and why.

    Attributes:
        threads: the thread count (for a library variable: its value, 0 when
            it asks for the library's default).
        source: ``"auto"`` (psflow's choice), ``"PSFLOW_BLAS_THREADS"``, or the
            library variable the user set (``"OPENBLAS_NUM_THREADS"``...).
        cores: the cores this process may use (:func:`available_cores`).
    """

    threads: int
    source: str
    cores: int

    @property
    def user_library_setting(self) -> bool:
        """True when a library variable decides: psflow leaves the libraries alone."""
        return self.source in LIBRARY_THREAD_VARIABLES


def parse_threads(value: object, name: str) -> int | None:
    """A thread count from text: a positive integer, or None for ``0``/``auto``/empty.

    Raises:
        InvalidArgumentError: ``value`` is anything else (the message names
            ``name`` and the value).

    Example:
        >>> parse_threads("4", "--threads-per-process"), parse_threads("auto", "X")
        (4, None)
    """
    text = str(value).strip().lower()
    if text in ("", "0", AUTO):
        return None
    if not text.isdigit() or not 1 <= int(text) <= MAX_THREADS:
        raise InvalidArgumentError(
            f"{name} {value!r} must be a number of threads in 1..{MAX_THREADS}, "
            f"or 0 / {AUTO!r} for psflow's choice"
        )
    return int(text)


def library_threads(name: str, value: str) -> int:
    """The count library variable ``name`` set to ``value`` asks for (0: the library's default).

    ``OMP_NUM_THREADS`` may list one count per nesting level (``"4,2"``): the
    first is the outer pool's.

    Raises:
        InvalidArgumentError: the value is not a non-negative integer.
    """
    first = value.split(",", 1)[0].strip() if name == "OMP_NUM_THREADS" else value.strip()
    if not first.isdigit():
        raise InvalidArgumentError(
            f"{name}={value!r} in the environment is not a number of threads; "
            f"unset it to let psflow choose, or set {BLAS_THREADS_ENV}"
        )
    return int(first)


def _cgroup_cores(path: str) -> int | None:
    """Whole cores of a cgroup v2 CPU quota (``"200000 100000"`` -> 2), None if unlimited."""
    try:
        with open(path, encoding="ascii") as f:
            quota, _, period = f.read().strip().partition(" ")
    except OSError:
        return None
    if quota == "max" or not quota.isdigit() or not period.isdigit() or int(period) == 0:
        return None
    # Rounded down: threads above the quota only get the container throttled.
    return max(1, int(quota) // int(period))


def available_cores(cpu_max_path: str = CGROUP_CPU_MAX) -> int:
    """The cores this process may use: its CPU affinity, capped by a cgroup v2 quota.

    Affinity from ``os.sched_getaffinity`` where the platform has it, else
    ``os.cpu_count()``; the quota from ``cpu.max`` (a container's CPU limit,
    rounded down, at least 1). cgroup v1 quotas are not read.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = _cgroup_cores(cpu_max_path)
    return max(1, min(cores, quota) if quota is not None else cores)


def share_cores(cores: int, num_ps: int, num_compute: int) -> tuple[int, int]:
    """``(threads per parameter server, threads per worker or chief)`` on ``cores`` cores.

    A parameter server gets 1 thread and, while cores allow it, a core of its
    own; the workers and the chief split the rest evenly, at least 1 each.

    Raises:
        InvalidArgumentError: a count is negative, or there are no cores.
    """
    if cores < 1 or num_ps < 0 or num_compute < 0:
        raise InvalidArgumentError(
            f"cannot share {cores} cores among {num_ps} ps and {num_compute} other processes"
        )
    left = cores - num_ps if cores > num_ps else cores
    return 1, max(1, left // max(num_compute, 1))


def role_threads(role: str, cores: int) -> int:
    """psflow's choice for a ``role`` process alone in its container of ``cores`` cores."""
    return 1 if role in PS_ROLES else max(1, cores)


def resolve_budget(
    role: str, environ: Mapping[str, str] | None = None, *, cores: int | None = None
) -> ThreadBudget:
    """This process's budget from ``environ`` (default ``os.environ``); see the module doc.

    Args:
        role: ``"ps"``, ``"worker"`` or ``"chief"``.
        environ: the environment to read.
        cores: the cores available (default :func:`available_cores`).

    Raises:
        InvalidArgumentError: ``PSFLOW_BLAS_THREADS`` or a library variable
            holds something other than a thread count (the message names it).
    """
    env = os.environ if environ is None else environ
    cores = available_cores() if cores is None else cores
    for name in LIBRARY_THREAD_VARIABLES:
        value = env.get(name, "")
        if value.strip():
            return ThreadBudget(library_threads(name, value), name, cores)
    threads = parse_threads(env.get(BLAS_THREADS_ENV, ""), BLAS_THREADS_ENV)
    if threads is not None:
        return ThreadBudget(threads, BLAS_THREADS_ENV, cores)
    return ThreadBudget(role_threads(role, cores), AUTO, cores)


def process_threads(environ: Mapping[str, str] | None = None) -> int:
    """The BLAS threads this process may use in all, for sharing among its own threads.

    The count its environment budgets (as a worker would resolve it), or its
    cores where that is psflow's choice, the library's default, or unreadable.
    Read from the environment, not the library: MirroredStrategy's replica
    threads change OpenBLAS's process-wide count as they narrow their share.
    """
    try:
        budget = resolve_budget("worker", environ)
    except InvalidArgumentError:
        return available_cores()
    return budget.threads if budget.threads > 0 else budget.cores


def apply_budget(budget: ThreadBudget) -> None:
    """Sets the BLAS and OpenMP pools of this process to ``budget.threads`` (threadpoolctl).

    Loads NumPy first, so that its BLAS is there to be limited. With a user's
    library variable in charge it changes nothing.
    """
    if budget.user_library_setting:
        return
    import numpy  # noqa: F401  # loads the BLAS the limits apply to
    from threadpoolctl import threadpool_limits

    # Called, not entered: the limits stay for the life of the process.
    threadpool_limits(limits=budget.threads, user_api="blas")
    threadpool_limits(limits=budget.threads, user_api="openmp")


def current_blas_threads() -> int | None:
    """The threads this process's BLAS runs with now (the widest pool), None without a BLAS."""
    import numpy  # noqa: F401  # the BLAS is NumPy's
    from threadpoolctl import threadpool_info

    counts = [int(p["num_threads"]) for p in threadpool_info() if p.get("user_api") == "blas"]
    return max(counts) if counts else None


def ready_field() -> str:
    """``blas_threads=N`` for a ready line (``blas_threads=none`` without a BLAS)."""
    threads = current_blas_threads()
    return f"blas_threads={'none' if threads is None else threads}"


def start_process_budget(
    role: str, environ: Mapping[str, str] | None = None, logger: logging.Logger | None = None
) -> ThreadBudget:
    """Resolves and applies this process's budget at its start, and logs it (on ``logger``).

    Raises:
        InvalidArgumentError: as :func:`resolve_budget`.
    """
    budget = resolve_budget(role, environ)
    apply_budget(budget)
    (logger or log).info(
        "blas_threads=%s (%s; %d cores available)",
        current_blas_threads(),
        f"{budget.source}={budget.threads}" if budget.source != AUTO else "psflow's choice",
        budget.cores,
    )
    return budget

"""The BLAS thread budget ``psflow local`` gives each role it starts on this host.

Every role process applies its budget itself at start
(:mod:`psflow.thread_budget`); the launcher only decides the number and hands
it over as ``PSFLOW_BLAS_THREADS``. Precedence, first that applies:

1. a library variable (``OPENBLAS_NUM_THREADS``, ``MKL_NUM_THREADS``,
   ``OMP_NUM_THREADS``) in the launcher's environment: every role inherits it
   and psflow sets nothing;
2. ``--threads-per-process N``: N threads in every role;
3. ``PSFLOW_BLAS_THREADS=N`` in the launcher's environment: the same;
4. psflow's choice: :func:`psflow.thread_budget.share_cores` over the
   parameter-server slots and the workers plus the chief.

Example:
    >>> plan = plan_threads(1, 2, None, {}, cores=8)
    >>> plan.env("ps"), plan.env("worker")
    ({'PSFLOW_BLAS_THREADS': '1'}, {'PSFLOW_BLAS_THREADS': '2'})
    >>> print(plan.describe())
    ps 1, worker 2, chief 2 (psflow's choice: 8 cores for 4 processes)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from psflow.thread_budget import (
    AUTO,
    BLAS_THREADS_ENV,
    LIBRARY_THREAD_VARIABLES,
    library_threads,
    parse_threads,
    share_cores,
)

__all__ = ["FLAG", "ThreadPlan", "plan_threads"]

FLAG = "--threads-per-process"
ROLES = ("ps", "worker", "chief")


@dataclasses.dataclass(frozen=True)
class ThreadPlan:
    """The threads of each role type, where they come from, and the cores shared.

    Attributes:
        threads: role type (``"ps"``, ``"worker"``, ``"chief"``) -> threads.
        source: ``"auto"``, ``"--threads-per-process"``, ``"PSFLOW_BLAS_THREADS"``
            or the library variable that decides.
        cores: the cores on this host the launcher may use.
        processes: the processes sharing them (every PS slot, workers, the chief).
    """

    threads: Mapping[str, int]
    source: str
    cores: int
    processes: int

    @property
    def inherited(self) -> bool:
        """True when a library variable decides: the roles inherit it, psflow sets nothing."""
        return self.source in LIBRARY_THREAD_VARIABLES

    def env(self, role: str) -> dict[str, str]:
        """The environment additions of a ``role`` process."""
        return {} if self.inherited else {BLAS_THREADS_ENV: str(self.threads[role])}

    def describe(self) -> str:
        """One line for the launcher's startup output."""
        counts = ", ".join(f"{r} {self.threads[r]}" for r in ROLES)
        why = {AUTO: "psflow's choice"}.get(self.source, f"from {self.source}")
        return f"{counts} ({why}: {self.cores} cores for {self.processes} processes)"


def plan_threads(
    num_ps: int,
    num_workers: int,
    threads_per_process: int | None,
    environ: Mapping[str, str],
    *,
    cores: int,
) -> ThreadPlan:
    """Each role type's BLAS threads for a local cluster (see the module doc).

    Args:
        num_ps: parameter-server slots (``--ps-max`` when elastic).
        num_workers: worker tasks.
        threads_per_process: ``--threads-per-process`` (None: not given or ``auto``).
        environ: the launcher's environment.
        cores: the cores available (:func:`psflow.thread_budget.available_cores`).

    Raises:
        InvalidArgumentError: ``PSFLOW_BLAS_THREADS`` or a library variable in
            ``environ`` is not a thread count (the message names the value).
    """
    processes = num_ps + num_workers + 1
    for name in LIBRARY_THREAD_VARIABLES:
        value = environ.get(name, "").strip()
        if value:
            threads = library_threads(name, value)
            return ThreadPlan(dict.fromkeys(ROLES, threads), name, cores, processes)
    from_env = parse_threads(environ.get(BLAS_THREADS_ENV, ""), BLAS_THREADS_ENV)
    for given, source in ((threads_per_process, FLAG), (from_env, BLAS_THREADS_ENV)):
        if given is not None:
            return ThreadPlan(dict.fromkeys(ROLES, given), source, cores, processes)
    ps, compute = share_cores(cores, num_ps, num_workers + 1)
    return ThreadPlan({"ps": ps, "worker": compute, "chief": compute}, AUTO, cores, processes)

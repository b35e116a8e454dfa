"""What ``psflow local`` tells the chief's dashboard, and what the dashboard leaves behind.

A probe sees a killed worker only as a task that stopped answering; the
launcher, which started it, knows its exit status. With ``--dashboard`` the
launcher makes a directory, names it to the chief in ``PSFLOW_LAUNCHER_DIR``,
and two files pass through it, each replaced whole (write, then rename):

* ``roles.json``, written by the launcher whenever a role starts or exits::

      {"restart": "never", "finished": false,
       "roles": {"worker:1": {"pid": 4242, "running": false, "status": 137, "restarts": 0}}}

  ``status`` is the shell's: 128 + N for a death by signal N. ``finished``
  turns true once the chief exited and the launcher stopped the others.
* ``dashboard.json``, written by the chief's dashboard after every probe
  round and when it closes: its latest ``/api/cluster`` document. When the
  chief has exited, the launcher serves that final state on the same port
  (:class:`FinalDocument`) until it exits itself.

Example:
    >>> job = JobStatus.from_json(
    ...     {"restart": "never", "finished": False,
    ...      "roles": {"worker:1": {"pid": 7, "running": False, "status": 137, "restarts": 0}}})
    >>> job.roles["worker:1"].describe()
    'killed by SIGKILL (exit 137)'
    >>> job.hint().partition(": run")[0]
    'worker:1 killed by SIGKILL (exit 137) and restarts are off'
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import time
from collections.abc import Mapping
from typing import Any

from psflow.io.files import atomic_write

__all__ = [
    "DOCUMENT_FILE",
    "LAUNCHER_DIR_ENV",
    "ROLES_FILE",
    "FinalDocument",
    "JobStatus",
    "RoleStatus",
    "apply_job_status",
    "read_json",
    "write_json",
]

log = logging.getLogger(__name__)

LAUNCHER_DIR_ENV = "PSFLOW_LAUNCHER_DIR"
"""The environment variable naming the launcher's directory (set for the chief only)."""

ROLES_FILE = "roles.json"
DOCUMENT_FILE = "dashboard.json"


def write_json(path: str, data: Any) -> None:
    """Replaces ``path`` with ``data`` as JSON at once: a reader sees the old file or the new."""
    with atomic_write(path, durable=False) as f:
        f.write(json.dumps(data, allow_nan=False).encode())


def read_json(path: str) -> Any:
    """``path``'s JSON, or None when it is missing or unreadable (being replaced: next time)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _signal_name(status: int) -> str | None:
    """``SIGKILL`` for the shell status 137; None when ``status`` is no death by signal."""
    if 128 < status < 128 + 65:
        try:
            return signal.Signals(status - 128).name
        except ValueError:
            return f"signal {status - 128}"
    return None


@dataclasses.dataclass(frozen=True)
class RoleStatus:
    """One task slot's latest process as the launcher saw it."""

    task: str
    pid: int | None
    running: bool
    status: int | None = None
    restarts: int = 0

    @property
    def signal(self) -> str | None:
        """The signal that ended it (``"SIGKILL"``), or None."""
        return None if self.running or self.status is None else _signal_name(self.status)

    @property
    def failed(self) -> bool:
        """It exited with a non-zero status."""
        return not self.running and bool(self.status)

    def describe(self) -> str:
        """``running``, ``exited 0``, ``exited with status 1`` or ``killed by SIGKILL (exit 137)``."""
        if self.running:
            return "running"
        if self.signal is not None:
            return f"killed by {self.signal} (exit {self.status})"
        return "exited 0" if not self.status else f"exited with status {self.status}"

    def as_json(self) -> dict[str, Any]:
        """The ``exit`` object of a task in ``/api/cluster``."""
        return {
            "pid": self.pid,
            "running": self.running,
            "status": self.status,
            "signal": self.signal,
            "restarts": self.restarts,
            "description": self.describe(),
        }


@dataclasses.dataclass(frozen=True)
class JobStatus:
    """The launcher's view: the restart policy, every slot, whether the job is over."""

    restart: str
    roles: Mapping[str, RoleStatus]
    finished: bool = False

    @classmethod
    def from_json(cls, data: Any) -> JobStatus | None:
        """Parses ``roles.json``'s content; None for anything else (a file half-understood
        must not break the page)."""
        try:
            roles = {
                str(task): RoleStatus(
                    str(task),
                    None if r.get("pid") is None else int(r["pid"]),
                    bool(r["running"]),
                    None if r.get("status") is None else int(r["status"]),
                    int(r.get("restarts", 0)),
                )
                for task, r in data["roles"].items()
            }
            return cls(str(data["restart"]), roles, bool(data.get("finished", False)))
        except (KeyError, TypeError, ValueError, AttributeError):
            return None

    def to_json(self) -> dict[str, Any]:
        """``roles.json``'s content."""
        return {
            "restart": self.restart,
            "finished": self.finished,
            "roles": {
                t: {"pid": r.pid, "running": r.running, "status": r.status, "restarts": r.restarts}
                for t, r in self.roles.items()
            },
        }

    def hint(self) -> str | None:
        """What to do about tasks that died while restarts are off; None when nothing to say."""
        if self.restart != "never":
            return None
        dead = [r for t, r in sorted(self.roles.items()) if r.failed and t != "chief"]
        if not dead:
            return None
        who = ", ".join(f"{r.task} {r.describe()}" for r in dead)
        return (
            f"{who} and restarts are off: run psflow local with --restart on-failure "
            "to start a failed task again in its slot"
        )

    def as_json(self) -> dict[str, Any]:
        """The ``job`` object of ``/api/cluster``."""
        return {
            "restart": self.restart,
            "finished": self.finished,
            "exit_codes": {t: r.status for t, r in sorted(self.roles.items()) if not r.running},
            "hint": self.hint(),
        }


def apply_job_status(
    document: dict[str, Any], job: JobStatus | None, *, final: bool = False
) -> dict[str, Any]:
    """``document`` (an ``/api/cluster`` one) with the launcher's knowledge folded in.

    Every task gets its slot's ``exit`` (None without a launcher); a task whose
    process the launcher saw die, and that does not answer, is ``killed`` (by a
    signal) or ``exited`` rather than merely ``lost``. ``final``: nothing
    probes any more, so every task whose process ended shows how it ended.
    """
    document["job"] = None if job is None else job.as_json()
    for key in ("ps", "workers"):
        for task in document.get(key, []):
            role = None if job is None else job.roles.get(task["task"])
            task["exit"] = None if role is None or role.running else role.as_json()
            silent = final or task["state"] in ("lost", "unknown")
            if role is not None and not role.running and silent:
                task["state"] = "killed" if role.signal is not None else "exited"
    return document


class FinalDocument:
    """The chief's last document plus the launcher's final word: served after the chief exits.

    Args:
        directory: the launcher's directory (``dashboard.json``, ``roles.json``).
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def snapshot(self) -> dict[str, Any]:
        """The ``/api/cluster`` document of the finished job."""
        document = read_json(os.path.join(self.directory, DOCUMENT_FILE))
        if not isinstance(document, dict):  # the chief never wrote one (killed at start)
            now = time.time()
            document = {
                "version": 1,
                "time": now,
                "uptime_seconds": 0.0,
                "probe_rounds": 0,
                "probe_interval_seconds": 1.0,
                "ps": [],
                "workers": [],
                "training": {
                    "state": "idle",
                    "epoch": 0,
                    "epochs": None,
                    "step_in_epoch": 0,
                    "steps_per_epoch": None,
                    "global_step": 0,
                    "steps_per_second": None,
                    "eta_seconds": None,
                    "elapsed_seconds": 0.0,
                    "steps": [],
                    "epoch_logs": [],
                },
                "events": [],
            }
        now = time.time()
        for worker in document.get("workers", []):  # ages grow on after the chief's last round
            if worker.get("last_heartbeat") is not None:
                worker["heartbeat_age_seconds"] = max(0.0, now - worker["last_heartbeat"])
        # The chief no longer probes: what the launcher saw exit is the tasks' last state.
        # "finished" is the launcher's to say, once it stopped every task.
        job = JobStatus.from_json(read_json(os.path.join(self.directory, ROLES_FILE)))
        return apply_job_status(document, job, final=True)

"""The control directory of an elastic ``psflow local`` run (``--ps-max``, ``--workers-max``).

``psflow local --ps-max N`` (or ``--mode multi-worker --elastic --workers-max
N``) keeps, in one directory (``--cluster-dir``, by default
``<tmp>/psflow-<uid>/local``, so that ``psflow scale`` finds it without
options, as ``tmux`` finds its server):

* ``state.json`` - the launcher's pid, ``ps_max``, the current number of
  parameter servers and the cluster file's path (a multi-worker launcher:
  ``workers_max`` and ``num_workers`` instead); written atomically after
  every change, removed when the launcher exits;
* ``cluster.json`` - the cluster view the chief's resolver reads
  (:class:`psflow.distribute.cluster_resolver.ClusterFileResolver`);
* ``requests/<id>.json`` - one per ``psflow scale`` call (``{"id", "num_ps"}``
  or ``{"id", "num_workers"}``), taken by the launcher in the order they were
  written;
* ``results/<id>.json`` - the launcher's answer (``{"id", "ok", "message",
  "num_ps"}``, or ``"num_workers"``), read and removed by the caller who wrote
  the request.

Every file is written to a temporary name and renamed, so a reader never sees
half of one.  The directory is the user's own (mode 0700): whoever can write
requests there can resize the cluster.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
from typing import Any

from psflow.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError
from psflow.io.files import atomic_write

STATE, CLUSTER, REQUESTS, RESULTS = "state.json", "cluster.json", "requests", "results"
MAX_CONTROL_FILE_BYTES = 64 * 1024


def default_cluster_dir() -> str:
    """``<tmp>/psflow-<uid>/local``: where a launcher and ``psflow scale`` meet by default."""
    return os.path.join(tempfile.gettempdir(), f"psflow-{os.getuid()}", "local")


def write_json(path: str, data: Any) -> None:
    """Writes ``data`` as JSON to ``path`` atomically (temporary file in the same directory, rename)."""
    with atomic_write(path, durable=False) as f:
        f.write((json.dumps(data) + "\n").encode("utf-8"))


def read_json(path: str) -> Any:
    """The JSON in ``path``.

    Raises:
        NotFoundError: it does not exist or cannot be read.
        InvalidArgumentError: it is not JSON, or too large.
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(MAX_CONTROL_FILE_BYTES + 1)
    except OSError as e:
        raise NotFoundError(f"{path} cannot be read: {e}") from None
    if len(text) > MAX_CONTROL_FILE_BYTES:
        raise InvalidArgumentError(f"{path} is larger than {MAX_CONTROL_FILE_BYTES} bytes")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidArgumentError(f"{path} is not JSON: {e}") from None


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (it may be another user's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclasses.dataclass(frozen=True)
class LauncherState:
    """What ``state.json`` says about a running elastic launcher."""

    pid: int
    ps_max: int
    num_ps: int
    cluster_file: str
    workers_max: int = 0
    num_workers: int = 0

    @property
    def role(self) -> str:
        """``"worker"`` for a multi-worker launcher (it scales workers), else ``"ps"``."""
        return "worker" if self.workers_max else "ps"

    @classmethod
    def from_json(cls, data: Any, path: str) -> LauncherState:
        """Parses ``state.json``'s content.

        Raises:
            InvalidArgumentError: a field is missing or has the wrong type (naming it).
        """
        if not isinstance(data, dict):
            raise InvalidArgumentError(f"{path} must hold a JSON object, not {data!r}")
        values = {}
        for field in dataclasses.fields(cls):
            value = data.get(field.name, field.default)
            expected = str if field.name == "cluster_file" else int
            if isinstance(value, bool) or not isinstance(value, expected):
                raise InvalidArgumentError(f"{path}: {field.name} {value!r} is not a {expected}")
            values[field.name] = value
        return cls(**values)


class ControlDir:
    """The files of one elastic launcher's control directory (see the module docstring)."""

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)

    def file(self, name: str) -> str:
        """The path of ``name`` in the directory."""
        return os.path.join(self.path, name)

    @property
    def cluster_file(self) -> str:
        """``cluster.json``: the chief's cluster view."""
        return self.file(CLUSTER)

    def create(self) -> None:
        """Creates the directory (0700) and its request and result folders; clears stale ones.

        Raises:
            FailedPreconditionError: another live launcher uses the directory.
            OSError: it cannot be created.
        """
        state = self.state(missing_ok=True, check_alive=False)
        if state is not None and pid_alive(state.pid) and state.pid != os.getpid():
            raise FailedPreconditionError(
                f"{self.path} is the control directory of a running launcher (pid {state.pid}); "
                "stop it or give another --cluster-dir"
            )
        os.makedirs(self.path, mode=0o700, exist_ok=True)
        for sub in (REQUESTS, RESULTS):
            os.makedirs(self.file(sub), mode=0o700, exist_ok=True)
            for name in os.listdir(self.file(sub)):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.file(sub), name))

    def write_state(self, state: LauncherState) -> None:
        """Publishes the launcher's state atomically."""
        write_json(self.file(STATE), dataclasses.asdict(state))

    def state(self, *, missing_ok: bool = False, check_alive: bool = True) -> LauncherState | None:
        """The running launcher's state.

        Raises:
            NotFoundError: no launcher uses the directory (no state, or its
                pid is gone) and not ``missing_ok``.
            InvalidArgumentError: the state file is malformed.
        """
        path = self.file(STATE)
        if not os.path.exists(path):
            if missing_ok:
                return None
            raise NotFoundError(
                f"no running local cluster at {self.path} (no {STATE}); start one with "
                "psflow local --ps-max N ... or give its --cluster-dir"
            )
        state = LauncherState.from_json(read_json(path), path)
        if check_alive and not pid_alive(state.pid):
            if missing_ok:
                return None
            raise NotFoundError(
                f"no running local cluster at {self.path}: launcher pid {state.pid} has exited"
            )
        return state

    def remove(self) -> None:
        """Removes the state, the cluster view and every request and result (the launcher ends)."""
        for name in (STATE, CLUSTER):
            with contextlib.suppress(OSError):
                os.unlink(self.file(name))
        for sub in (REQUESTS, RESULTS):
            folder = self.file(sub)
            with contextlib.suppress(OSError):
                for name in os.listdir(folder):
                    os.unlink(os.path.join(folder, name))
                os.rmdir(folder)
        with contextlib.suppress(OSError):
            os.rmdir(self.path)

    # -- requests and results -----------------------------------------------------------
    def put_request(self, request_id: str, count: int, key: str = "num_ps") -> None:
        """Writes a scale request (``key``: ``num_ps`` or ``num_workers``)."""
        write_json(self.file(f"{REQUESTS}/{request_id}.json"), {"id": request_id, key: count})

    def next_request(self, key: str = "num_ps") -> tuple[str, Any] | None:
        """The oldest request as ``(id, count)``, removed from the folder; None when there is none.

        A malformed request (or one for another ``key``) comes with count None:
        the launcher answers it with an error.
        """
        folder = self.file(REQUESTS)
        try:
            names = [n for n in os.listdir(folder) if n.endswith(".json") and not n.startswith(".")]
        except OSError:
            return None
        if not names:
            return None

        def mtime(name: str) -> float:
            try:
                return os.stat(os.path.join(folder, name)).st_mtime
            except OSError:
                return 0.0

        name = min(names, key=lambda n: (mtime(n), n))
        path = os.path.join(folder, name)
        request_id = name[: -len(".json")]
        try:
            data = read_json(path)
        except (NotFoundError, InvalidArgumentError) as e:
            data = {"error": str(e)}
        with contextlib.suppress(OSError):
            os.unlink(path)
        count = data.get(key) if isinstance(data, dict) else None
        return request_id, count

    def put_result(
        self, request_id: str, ok: bool, message: str, count: int, key: str = "num_ps"
    ) -> None:
        """Answers request ``request_id``."""
        write_json(
            self.file(f"{RESULTS}/{request_id}.json"),
            {"id": request_id, "ok": ok, "message": message, key: count},
        )

    def take_result(self, request_id: str) -> dict | None:
        """The answer to ``request_id`` (removed once read), or None when there is none yet."""
        path = self.file(f"{RESULTS}/{request_id}.json")
        if not os.path.exists(path):
            return None
        data = read_json(path)
        with contextlib.suppress(OSError):
            os.unlink(path)
        return data if isinstance(data, dict) else None

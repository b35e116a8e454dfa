"""Starting a psflow role as a process and knowing when it is ready.

Every server process (``python -m ps_server``, ``python -m worker``) prints
one line once bound::

    PSFLOW_READY <role> port=<port> task=<task> pid=<pid> [key=value ...]

:data:`READY_FORMAT` writes it (:mod:`psflow.serving`), :func:`parse_ready`
reads it (``psflow local``'s supervisor, tests, benchmarks), and
:func:`start_role` starts a role and waits, bounded, for that line
(:func:`start_process`: any command and any ready line, e.g. a benchmark's
TensorFlow server).

Example:
    >>> ready = parse_ready("PSFLOW_READY ps port=4711 task=ps:0 pid=42 metrics_port=9")
    >>> (ready.role, ready.port, ready.task, ready.fields["metrics_port"])
    ('ps', 4711, 'ps:0', '9')
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import selectors
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any, TypeVar

from psflow.errors import DeadlineExceededError, FailedPreconditionError

__all__ = ["READY_FORMAT", "READY_PREFIX", "Ready", "parse_ready", "start_process", "start_role"]

READY_PREFIX = "PSFLOW_READY "
READY_FORMAT = READY_PREFIX + "{role} port={port} task={task} pid={pid}"
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Ready:
    """A parsed ready line: the role, its port and task, and every ``key=value`` field."""

    role: str
    port: int
    task: str
    fields: Mapping[str, str]
    line: str


def parse_ready(line: str) -> Ready | None:
    """The ready line's fields, or None when ``line`` is not a well-formed ready line."""
    line = line.strip()
    if not line.startswith(READY_PREFIX):
        return None
    words = line.split()
    fields = dict(w.split("=", 1) for w in words[2:] if "=" in w)
    if len(words) < 2 or not fields.get("port", "").isdigit():
        return None
    return Ready(words[1], int(fields["port"]), fields.get("task", ""), fields, line)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)
    if proc.stdout is not None:
        proc.stdout.close()


def start_process(
    argv: Sequence[str],
    accept: Callable[[str], T | None],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    stderr: IO[Any] | int | None = None,
    timeout: float = 60.0,
    what: str = "a ready line",
    label: str | None = None,
) -> tuple[subprocess.Popen, T]:
    """Runs ``argv`` and waits, bounded, for the first stdout line ``accept`` takes.

    ``accept(line)`` returns what the caller wants from a ready line (None: not
    that line yet). The process's stdout stays a pipe (the caller may keep
    reading it); on any failure the process is killed and reaped before the
    error is raised.

    Raises:
        FailedPreconditionError: the process exited before it was ready.
        DeadlineExceededError: no accepted line within ``timeout``.  Messages
            name the process by ``label`` (default: the start of ``argv``)
            and the line by ``what``.
    """
    proc = subprocess.Popen(
        list(argv),
        stdout=subprocess.PIPE,
        stderr=stderr,
        env=None if env is None else dict(env),
        cwd=cwd,
    )
    assert proc.stdout is not None  # stdout=PIPE
    deadline = time.monotonic() + timeout
    buffer = b""
    shown = label if label is not None else " ".join(map(str, argv[:4]))
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if proc.poll() is not None:
                    raise FailedPreconditionError(
                        f"{shown} exited with status {proc.returncode} before it was ready"
                    )
                if left <= 0:
                    raise DeadlineExceededError(f"{shown} not ready within {timeout}s (no {what})")
                if not sel.select(min(left, 0.5)):
                    continue
                chunk = os.read(proc.stdout.fileno(), 4096)
                buffer += chunk
                *complete, buffer = buffer.split(b"\n")
                for raw in complete:
                    accepted = accept(raw.decode(errors="replace"))
                    if accepted is not None:
                        return proc, accepted
                if not chunk:  # stdout closed: the process is exiting; the poll above sees it
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(min(max(left, 0.01), 0.5))
    except BaseException:
        _stop(proc)
        raise


def start_role(
    module: str,
    args: Sequence[str] = (),
    *,
    role: str | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    stderr: IO[Any] | int | None = None,
    timeout: float = 60.0,
    prefix: Sequence[str] = (),
) -> tuple[subprocess.Popen, Ready]:
    """Runs ``python -m module args`` and waits for its ready line (see :func:`start_process`).

    Args:
        module: the role's module (``"ps_server"``, ``"worker"``).
        args: its command-line arguments.
        role: accept only a ready line of this role (None: any).
        env: the child's environment (None: this process's).
        cwd: the child's working directory.
        stderr: where the child's stderr goes (a file, ``subprocess.DEVNULL``...).
        timeout: seconds to wait for the ready line.
        prefix: a command that runs the interpreter (``ip netns exec NAME``).

    Raises:
        FailedPreconditionError: the process exited before it was ready.
        DeadlineExceededError: no ready line within ``timeout``.
    """

    def accept(line: str) -> Ready | None:
        ready = parse_ready(line)
        return ready if ready is not None and (role is None or ready.role == role) else None

    return start_process(
        [*prefix, sys.executable, "-m", module, *args],
        accept,
        env=env,
        cwd=cwd,
        stderr=stderr,
        timeout=timeout,
        what=f"{READY_PREFIX.strip()} line",
        label=f"{module} {list(args)}",
    )

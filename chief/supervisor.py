"""Supervising role processes: own process groups, prefixed output, bounded teardown.

A :class:`Supervisor` starts each role (``ps:0``, ``worker:1``, ``chief``) as a
child in its own session and process group, through :mod:`chief.pdeathsig` so
the kernel kills it if the supervisor dies without tearing down.  Its stdout and
stderr are read in the supervisor's thread with a selector (no threads: nothing
runs between ``fork`` and ``exec``) and copied, line by line and prefixed with
the role (``[ps:0] ...``), to the supervisor's stdout and stderr.

Teardown (:meth:`Supervisor.stop`) sends SIGTERM to every group, waits a
bounded grace period while still copying output, then sends SIGKILL and reaps.
Whenever a role's main process is reaped, whatever it left in its group is
SIGKILLed at once, so no grandchild outlives it.

Example:
    >>> import sys
    >>> sup = Supervisor()
    >>> role = sup.start("hello", [sys.executable, "-c", "print('hi')"])
    >>> sup.wait(role, timeout=30)
    [hello] hi
    0
    >>> sup.stop(grace=5)
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TextIO

from chief import pdeathsig
from psflow.errors import DeadlineExceededError

log = logging.getLogger("chief.supervisor")

MAX_LINE_BYTES = 64 * 1024
"""Output without a newline is passed on in pieces of this size (bounded memory)."""

LineCallback = Callable[["RoleProcess", str, bool], None]
"""``(role, line, from_stdout)``: called for every line a role writes."""


@dataclasses.dataclass
class RoleProcess:
    """One started role: its name, process, and exit status once reaped."""

    name: str
    proc: subprocess.Popen
    started_at: float
    returncode: int | None = None

    @property
    def pid(self) -> int:
        """The role's pid; also its process group and session id."""
        return self.proc.pid

    @property
    def running(self) -> bool:
        """Whether the main process has not been reaped yet."""
        return self.returncode is None

    def signal_group(self, sig: int) -> None:
        """Sends ``sig`` to the role's process group (ignored when it is empty)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)


def shell_status(returncode: int) -> int:
    """``subprocess``'s ``-N`` (killed by signal N) as the shell's ``128 + N``; others as is."""
    return 128 - returncode if returncode < 0 else returncode


class Supervisor:
    """Starts roles, copies their output with a prefix, notices exits, tears them all down.

    Args:
        stdout: where roles' stdout lines go (``sys.stdout`` by default).
        stderr: where roles' stderr lines go (``sys.stderr`` by default).
        on_line: called with every complete line (after it is copied).

    Use from one thread (the one that started the roles: the kernel's
    parent-death signal is tied to it).
    """

    def __init__(
        self,
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
        on_line: LineCallback | None = None,
    ) -> None:
        self._out = stdout
        self._err = stderr
        self._on_line = on_line
        self._selector = selectors.DefaultSelector()
        self._partial: dict[int, bytes] = {}
        self._closed = False
        self.roles: list[RoleProcess] = []

    # -- starting -----------------------------------------------------------------------
    def start(
        self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None
    ) -> RoleProcess:
        """Starts ``argv`` as role ``name`` in a new session; returns it.

        Raises:
            OSError: the process cannot be started.
        """
        child_env = dict(os.environ if env is None else env)
        child_env.setdefault("PYTHONUNBUFFERED", "1")
        proc = subprocess.Popen(
            pdeathsig.wrap(list(argv)),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=child_env,
            start_new_session=True,
        )
        role = RoleProcess(name, proc, time.monotonic())
        for pipe, is_stdout in ((proc.stdout, True), (proc.stderr, False)):
            assert pipe is not None  # PIPE was asked for
            self._selector.register(pipe, selectors.EVENT_READ, (role, is_stdout))
            self._partial[pipe.fileno()] = b""
        self.roles.append(role)
        log.debug("started %s: pid %d: %s", name, proc.pid, " ".join(argv))
        return role

    # -- output -------------------------------------------------------------------------
    def _emit(self, role: RoleProcess, data: bytes, is_stdout: bool) -> None:
        line = data.decode(errors="replace").rstrip("\r")
        stream = (self._out or sys.stdout) if is_stdout else (self._err or sys.stderr)
        stream.write(f"[{role.name}] {line}\n")
        if self._on_line is not None:
            self._on_line(role, line, is_stdout)

    def _read(self, key: selectors.SelectorKey) -> None:
        role, is_stdout = key.data
        fd = key.fd
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            chunk = b""
        buffer = self._partial.get(fd, b"") + chunk
        if not chunk:  # EOF: pass on the unterminated rest
            self._selector.unregister(key.fileobj)
            self._partial.pop(fd, None)
            if buffer:
                self._emit(role, buffer, is_stdout)
            return
        *lines, rest = buffer.split(b"\n")
        while len(rest) > MAX_LINE_BYTES:
            lines.append(rest[:MAX_LINE_BYTES])
            rest = rest[MAX_LINE_BYTES:]
        self._partial[fd] = rest
        for line in lines:
            self._emit(role, line, is_stdout)

    def pump(self, timeout: float) -> None:
        """Copies whatever output is ready, waiting at most ``timeout`` seconds for some."""
        if not self._selector.get_map():
            time.sleep(max(timeout, 0.0))
            return
        events = self._selector.select(max(timeout, 0.0))
        for key, _ in events:
            self._read(key)
        for stream in (self._out or sys.stdout, self._err or sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()

    # -- exits --------------------------------------------------------------------------
    def poll(self) -> list[RoleProcess]:
        """Reaps roles that exited since the last call; returns them.

        Each reaped role's process group is SIGKILLed at once: anything its
        main process left behind would be an orphan.
        """
        exited = []
        for role in self.roles:
            if role.returncode is None and role.proc.poll() is not None:
                role.returncode = role.proc.returncode
                role.signal_group(signal.SIGKILL)
                exited.append(role)
        return exited

    def wait(self, role: RoleProcess, timeout: float) -> int:
        """Copies output until ``role`` exits; returns its (shell-style) status.

        Raises:
            DeadlineExceededError: ``role`` still runs after ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while role.running:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeadlineExceededError(
                    f"{role.name} (pid {role.pid}) still runs after {timeout}s", task=role.name
                )
            self.pump(min(left, 0.1))
            self.poll()
        self._drain(deadline=time.monotonic() + 2.0)
        return shell_status(role.returncode or 0)

    # -- teardown -----------------------------------------------------------------------
    def stop(
        self,
        grace: float,
        escalate: Callable[[], bool] | None = None,
        stages: Sequence[Sequence[RoleProcess]] | None = None,
    ) -> None:
        """Stops every role: SIGTERM, up to ``grace`` seconds to exit, then SIGKILL; reaps all.

        ``stages`` stops roles in that order, each stage with its own grace
        period (e.g. the chief before the workers it uses, the workers before
        the parameter servers they push to); roles in no stage go last.
        ``escalate()`` returning True (e.g. a second Ctrl-C) cuts every grace
        period short.
        """
        staged = [list(stage) for stage in stages or ()]
        listed = {id(r) for stage in staged for r in stage}
        staged.append([r for r in self.roles if id(r) not in listed])
        for stage in staged:
            self._stop_stage(stage, grace, escalate)
        for role in self.roles:
            if role.running:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    role.proc.wait(10.0)  # SIGKILL cannot be ignored; bounded all the same
        self.poll()
        self._drain(deadline=time.monotonic() + 2.0)
        self.close()

    def _stop_stage(
        self, roles: list[RoleProcess], grace: float, escalate: Callable[[], bool] | None
    ) -> None:
        self.poll()
        for role in roles:
            if role.running:
                log.debug("SIGTERM to %s (pid %d)", role.name, role.pid)
                role.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + max(grace, 0.0)
        while any(r.running for r in roles) and time.monotonic() < deadline:
            if escalate is not None and escalate():
                break
            self.pump(0.05)
            self.poll()
        for role in roles:
            if role.running:
                log.warning(
                    "%s (pid %d) did not stop within %.1fs: SIGKILL", role.name, role.pid, grace
                )
                role.signal_group(signal.SIGKILL)

    def _drain(self, deadline: float) -> None:
        """Copies the output left in the pipes of exited roles (bounded by ``deadline``)."""
        while time.monotonic() < deadline:
            keys = [k for k in self._selector.get_map().values() if not k.data[0].running]
            if not keys:
                return
            self.pump(0.05)

    def close(self) -> None:
        """Closes every pipe (roles keep running if not stopped); idempotent."""
        if self._closed:
            return
        self._closed = True
        for key in list(self._selector.get_map().values()):
            self._selector.unregister(key.fileobj)
        for role in self.roles:
            for pipe in (role.proc.stdout, role.proc.stderr):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()
        self._selector.close()

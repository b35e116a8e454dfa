"""Children that die with their launcher: ``PR_SET_PDEATHSIG``, set in the child, then exec.

``python -m chief.pdeathsig PARENT_PID PROGRAM [ARGS...]`` asks the Linux kernel
to send SIGKILL to this process when the thread that started it exits, checks
that ``PARENT_PID`` is still its parent (the parent may have died before the
request was made), then replaces itself with ``PROGRAM ARGS`` (same pid; the
setting survives ``exec``).  The launcher starts every role through it, so that
no role outlives a launcher that was SIGKILLed.

Why a separate exec step and not a ``preexec_fn``: the launcher may run
threads, and Python code between ``fork`` and ``exec`` is unsafe then.  Why
SIGKILL and not SIGTERM: this only fires when the launcher died without tearing
down (a graceful teardown sends SIGTERM first); a child that ignores or stalls on
SIGTERM must not be orphaned.

The kernel ties the signal to the parent *thread*: the launcher starts children
from its main thread, which lives as long as it does.  On systems without
``prctl`` this module only execs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import sys

log = logging.getLogger("chief.pdeathsig")

PR_SET_PDEATHSIG = 1
"""``prctl`` option: the signal to receive when the parent thread dies (``<linux/prctl.h>``)."""

EXIT_PARENT_GONE = 129
"""Exit status when the parent died before the child could ask for the signal (retryable)."""

EXIT_EXEC_FAILED = 127
"""Exit status when ``PROGRAM`` cannot be executed (the shell's code for it)."""


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Asks the kernel to send ``sig`` to this process when its parent thread exits.

    Returns:
        True if set; False where ``prctl`` does not exist (not Linux).

    Raises:
        OSError: ``prctl`` exists but refused (e.g. an invalid signal number).
    """
    if not sys.platform.startswith("linux"):
        return False
    libc_name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        libc = ctypes.CDLL(libc_name, use_errno=True)
    except OSError:
        return False
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG, {int(sig)}) failed: {os.strerror(errno)}")
    return True


def wrap(argv: list[str], parent_pid: int | None = None) -> list[str]:
    """Returns the command that runs ``argv`` through this module for ``parent_pid``.

    ``parent_pid`` defaults to this process.

    Example:
        >>> wrap(["/bin/true"], parent_pid=42)[-3:]
        ['chief.pdeathsig', '42', '/bin/true']
    """
    pid = os.getpid() if parent_pid is None else parent_pid
    return [sys.executable, "-m", "chief.pdeathsig", str(pid), *argv]


def main(argv: list[str] | None = None) -> int:
    """Sets the death signal, checks the parent, execs the program; returns only on failure."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2 or not args[0].isdigit():
        sys.stderr.write("usage: python -m chief.pdeathsig PARENT_PID PROGRAM [ARGS...]\n")
        return 2
    parent, command = int(args[0]), args[1:]
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent:
        sys.stderr.write(f"chief.pdeathsig: parent {parent} is gone; not starting {command[0]}\n")
        return EXIT_PARENT_GONE
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(command[0], command)
    except OSError as e:
        sys.stderr.write(f"chief.pdeathsig: cannot execute {command[0]!r}: {e}\n")
    return EXIT_EXEC_FAILED


if __name__ == "__main__":
    sys.exit(main())

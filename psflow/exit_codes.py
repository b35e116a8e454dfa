"""Process exit codes that tell a supervisor whether restarting can help.

Kubeflow's training operator, with a replica's ``restartPolicy: ExitCode``,
restarts a pod only when its container exited with a *retryable* code:

* ``1``-``127`` are **permanent** errors: the pod is not restarted and the job
  fails (a bug, a bad configuration - running it again gives the same result);
* ``128``-``255`` are **retryable**: the pod is restarted.  ``128 + N`` is
  also how a shell reports death by signal ``N`` (``137``: SIGKILL, e.g. the
  OOM killer or a preempted node; ``143``: SIGTERM), and ``138`` (SIGUSR1,
  which nothing sends by accident) is the conventional code a TensorFlow
  program exits with on purpose to ask for a restart.

psflow's entrypoints exit with :class:`ExitCode` values; :func:`exit_code_for`
picks one for the exception that ended a process, and :func:`is_retryable`
applies Kubeflow's rule to any exit status (also the negative return codes
Python's ``subprocess`` gives for a child killed by a signal).

Example:
    >>> from psflow.errors import UnavailableError
    >>> int(exit_code_for(UnavailableError("ps:0 is gone")))
    138
    >>> is_retryable(exit_code_for(ValueError("bad learning rate")))
    False
"""

from __future__ import annotations

import enum

from psflow.errors import AbortedError, DeadlineExceededError, UnavailableError

RETRYABLE_MIN = 128
"""The smallest exit status Kubeflow's ``ExitCode`` policy restarts."""


class ExitCode(enum.IntEnum):
    """The exit codes psflow processes use."""

    OK = 0
    """Finished successfully."""
    USER_ERROR = 1
    """A permanent failure (bug, bad input or configuration): do not restart."""
    USAGE_ERROR = 2
    """Bad command line: do not restart (the shell's and argparse's code)."""
    RETRYABLE = 138
    """A transient failure (a peer lost, a deadline missed): restart the process."""


_RETRYABLE_ERRORS = (UnavailableError, DeadlineExceededError, AbortedError)


def exit_code_for(error: BaseException) -> ExitCode:
    """Returns the exit code for a process that ended with ``error``.

    ``UnavailableError`` (and its ``PSUnavailableError``/
    ``WorkerUnavailableError``), ``DeadlineExceededError`` and ``AbortedError``
    are transient: ``RETRYABLE``.  Everything else is ``USER_ERROR``.
    """
    return ExitCode.RETRYABLE if isinstance(error, _RETRYABLE_ERRORS) else ExitCode.USER_ERROR


def is_retryable(status: int) -> bool:
    """Returns whether Kubeflow's ``ExitCode`` policy restarts a process exiting with ``status``.

    A negative ``status`` (``subprocess``'s ``-N`` for death by signal ``N``)
    counts as the shell's ``128 + N``.
    """
    if status < 0:
        status = RETRYABLE_MIN - status
    return status >= RETRYABLE_MIN

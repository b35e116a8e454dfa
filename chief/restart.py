"""When ``psflow local`` restarts a role that died: the policy, the cap and the back-off.

With ``--restart on-failure`` the launcher does what a Kubernetes StatefulSet
(or a TFJob with ``restartPolicy: OnFailure``/``ExitCode``) does for a pod: a
process that died is started again *in its slot* - the same task, address,
port and credentials - so its peers reach it where they reached the old one
and the recovery paths that exist run without a human (a worker rejoins the
coordinator; a parameter server comes back empty and the chief's
``BackupAndRestore`` rolls every PS back to the last backup).

Which exits count as failures:

* a ps or worker: any status but 0 (a signal too: ``137`` after SIGKILL);
* the chief: a *retryable* status (128-255, e.g. ``138`` for a lost peer, see
  :mod:`psflow.exit_codes`); a permanent one (1-127) would fail the same way
  again, so the run ends with it.

Each slot is restarted at most ``max_restarts`` times, the n-th time after
``min(base_delay * 2**(n-1), max_delay)`` seconds.

Example:
    >>> policy = RestartPolicy(RestartMode.ON_FAILURE, max_restarts=2)
    >>> book = RestartBook(policy)
    >>> book.next_delay("ps:1", 137, is_chief=False)
    0.5
    >>> book.next_delay("ps:1", 137, is_chief=False)
    1.0
    >>> book.next_delay("ps:1", 137, is_chief=False) is None  # the cap
    True
    >>> book.next_delay("chief", 1, is_chief=True) is None  # a permanent error: not again
    True
    >>> book.next_delay("worker:0", 0, is_chief=False) is None  # finished: not a failure
    True
"""

from __future__ import annotations

import dataclasses
import enum

from psflow.errors import InvalidArgumentError
from psflow.exit_codes import is_retryable

DEFAULT_MAX_RESTARTS = 3
"""Restarts per task slot unless ``--max-restarts`` says otherwise."""


class RestartMode(enum.Enum):
    """Whether the launcher restarts roles that died."""

    NEVER = "never"
    """A role that dies stays dead (the default, as before)."""
    ON_FAILURE = "on-failure"
    """A role that failed is started again in its slot, up to the cap."""

    @classmethod
    def parse(cls, text: str) -> RestartMode:
        """The mode named ``text``.

        Raises:
            InvalidArgumentError: no such mode (the message lists the choices).
        """
        for mode in cls:
            if mode.value == text:
                return mode
        choices = ", ".join(m.value for m in cls)
        raise InvalidArgumentError(f"restart mode {text!r} is not one of: {choices}")


@dataclasses.dataclass(frozen=True)
class RestartPolicy:
    """The restart mode, the cap per slot and the back-off.

    Raises:
        InvalidArgumentError: a value out of range (the message names it).
    """

    mode: RestartMode = RestartMode.NEVER
    max_restarts: int = DEFAULT_MAX_RESTARTS
    base_delay: float = 0.5
    max_delay: float = 8.0

    def __post_init__(self) -> None:
        if not isinstance(self.mode, RestartMode):
            raise InvalidArgumentError(f"restart mode {self.mode!r} must be a RestartMode")
        n = self.max_restarts
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= 1000:
            raise InvalidArgumentError(f"max_restarts {n!r} must be an integer in 0..1000")
        if not 0 <= self.base_delay <= self.max_delay:
            raise InvalidArgumentError(
                f"base_delay {self.base_delay!r} must lie in 0..max_delay ({self.max_delay!r})"
            )

    @property
    def enabled(self) -> bool:
        """Whether anything is ever restarted."""
        return self.mode is RestartMode.ON_FAILURE and self.max_restarts > 0


class RestartBook:
    """Counts restarts per slot and says whether, and after how long, to restart a role."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self.counts: dict[str, int] = {}

    def failed(self, status: int, *, is_chief: bool) -> bool:
        """Whether exit ``status`` (shell style) is a failure the policy restarts."""
        if status == 0:
            return False
        return is_retryable(status) if is_chief else True

    def next_delay(self, name: str, status: int, *, is_chief: bool) -> float | None:
        """Seconds to wait before restarting ``name``, or None: do not restart it.

        Counts the restart when it returns a delay.
        """
        policy = self.policy
        if not policy.enabled or not self.failed(status, is_chief=is_chief):
            return None
        n = self.counts.get(name, 0)
        if n >= policy.max_restarts:
            return None
        self.counts[name] = n + 1
        return min(policy.base_delay * 2**n, policy.max_delay)

    def used(self, name: str) -> int:
        """Restarts of ``name`` so far."""
        return self.counts.get(name, 0)

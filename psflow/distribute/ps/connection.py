"""A connection to one parameter-server task: over gRPC, or to a store in this process.

The session talks to PS tasks only through this small interface, so the
embedded mode (a PS inside the chief) and a real cluster run the same code.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from psflow import errors
from psflow.ps.push_types import Gradient, PushContext, PushReply
from psflow.transport.started import Started


@dataclasses.dataclass(frozen=True)
class VarSpec:
    """What a PS needs to create a variable."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    trainable: bool


# The session builds its gradients in the store's own type: one shape end to end.
Grad = Gradient


class PSConnection(abc.ABC):
    """The operations a session needs from one PS task."""

    task: str

    @abc.abstractmethod
    def create(self, specs: Sequence[VarSpec], values: Sequence[np.ndarray]) -> list[int]:
        """Creates variables (idempotent for identical specs); returns their versions."""

    @abc.abstractmethod
    def configure_optimizer(self, names: Sequence[str], config: dict[str, Any]) -> None:
        """Attaches an update rule (``psflow.update_rules`` config) to variables.

        Training does not need it (every push carries its rule); it is for
        callers that set a rule without pushing.
        """

    @abc.abstractmethod
    def pull(
        self, names: Sequence[str], rows: dict[int, np.ndarray] | None = None
    ) -> list[tuple[np.ndarray, int]]:
        """Values (or rows, for the items in ``rows``) and their versions."""

    def start_pull(self, names: Sequence[str]) -> Started | None:
        """Starts a pull of ``names`` without waiting for it: it is sent (or read)
        now, its ``result()`` gives what :meth:`pull` returns.  None, having done
        nothing, where this backend cannot start it (the caller pulls then).  A
        session starts its calls to every task before it waits for any."""
        return None

    def start_push(self, grads: Sequence[Gradient], context: PushContext) -> Started | None:
        """Starts :meth:`push` without waiting for its reply (``result()`` gives
        its :class:`PushReply`); None, having sent nothing, where this backend
        cannot (the caller pushes then)."""
        return None

    @abc.abstractmethod
    def push(self, grads: Sequence[Gradient], context: PushContext) -> PushReply:
        """Applies gradients with ``context.rule_json``, once per ``context.push_id``.

        ``context`` reaches the PS as given: the rule with the gradients (in
        the same request, so two workers at different steps each apply their
        own rate) and the caller's exactly-once id, never an id of the
        backend's own.
        """

    @abc.abstractmethod
    def write(
        self,
        op: str,
        names: Sequence[str],
        values: Sequence[np.ndarray],
        request_id: tuple[str, int] | None = None,
    ) -> list[int]:
        """``assign``, ``assign_add`` or ``assign_sub``; returns the new versions.

        With ``request_id`` (a closure's, stable across its re-runs) the write is
        applied once per id: a repeat is answered from the PS's record.  Every
        backend must send the caller's id as given, never one of its own.
        """

    @abc.abstractmethod
    def list_variables(self) -> list[dict[str, Any]]:
        """Every variable: name, dtype, shape, trainable, version, optimizer step."""

    @abc.abstractmethod
    def save(self, directory: str, step: int = 0, prefix: str = "") -> str:
        """Writes this task's shard; returns the path of its manifest."""

    @abc.abstractmethod
    def restore(self, directory: str, prefix: str = "", names: Sequence[str] | None = None) -> int:
        """Replaces this task's shard by a checkpoint's; returns the recorded step.

        With ``names``: exactly those variables, gathered from any shard of the
        checkpoint (a checkpoint written by another number of PS tasks).
        """

    @abc.abstractmethod
    def stats(self, include_log: bool = False) -> dict[str, Any]:
        """Counters of the task (bytes, pushes, staleness; the push log on request)."""

    # -- resizing (see psflow.distribute.ps.resize) --------------------------------------
    address: str = ""

    def export_shard(self, names: Sequence[str], timeout: float | None = None) -> bytes:
        """A copy of variables with slots, versions and push records (changes nothing)."""
        raise errors.UnimplementedError(f"{type(self).__name__} cannot move variables")

    def import_shard(
        self, state: bytes, placement_version: int, timeout: float | None = None
    ) -> list[str]:
        """Installs variables exported by another task; returns their names."""
        raise errors.UnimplementedError(f"{type(self).__name__} cannot move variables")

    def release_shard(
        self,
        names: Sequence[str],
        owner: int,
        owner_address: str,
        placement_version: int,
        timeout: float | None = None,
    ) -> None:
        """Gives variables up to task ``owner``: later requests get ``MovedError``."""
        raise errors.UnimplementedError(f"{type(self).__name__} cannot move variables")

    def cancel_export(self, names: Sequence[str], timeout: float | None = None) -> None:
        """Serves writes to exported variables again (their move was abandoned)."""
        raise errors.UnimplementedError(f"{type(self).__name__} cannot move variables")

    def drain(self, timeout: float | None = None) -> None:
        """Tells a task that holds nothing to exit (``timeout``: seconds for the call)."""
        raise errors.UnimplementedError(f"{type(self).__name__} cannot be drained")

    def probe(self, timeout: float) -> None:
        """Returns once the task answers and serves, within ``timeout`` seconds.

        Raises:
            UnavailableError: the task cannot be reached or does not serve yet.
            DeadlineExceededError: the task did not answer in ``timeout`` (frozen,
                partitioned).
        """
        self.list_variables()

    def close(self) -> None:
        """Releases the connection."""

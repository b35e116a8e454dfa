"""The one shape of a push: its gradients, its request context and the reply.

The session, both connections (gRPC and in-process), the gRPC client and the
variable store all speak these types, so a gradient is built once by the
session and reaches the store unchanged (the gRPC path encodes it to the wire
and the servicer decodes it back into the same type).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

__all__ = ["Gradient", "PushContext", "PushReply"]


@dataclasses.dataclass(frozen=True)
class Gradient:
    """One gradient of a push.

    ``values`` is dense (the variable's shape; an array or
    :class:`psflow.ps.tensors.Segments`) unless ``indices`` is given, then it
    holds those rows. ``base_version`` is the version it was computed from
    (``-1``: unknown).
    """

    name: str
    values: Any
    indices: np.ndarray | None = None
    base_version: int = -1

    @property
    def sparse(self) -> bool:
        """Whether the gradient is given as rows."""
        return self.indices is not None


@dataclasses.dataclass(frozen=True)
class PushContext:
    """How one push is to be applied; travels unchanged through every backend.

    Attributes:
        push_id: ``(client_id, sequence)``, the exactly-once id: a retry or a
            re-run closure sends the same id and the PS applies it once.
        step: the synchronous step this push contributes to (``None``: async).
        num_required: contributions the PS waits for before applying ``step``.
        wait_applied: answer only once the step is applied.
        timeout: how long the PS may hold the push at a barrier (seconds).
        rule_json: the update rule's config (:mod:`psflow.update_rules`) as
            canonical JSON, learning rate at this step included: the PS
            installs it for these variables and applies the gradients with it
            (``""``: whatever rule the variables have).
        max_staleness: the PS rejects gradients staler than this (None: any).
    """

    push_id: tuple[str, int]
    step: int | None = None
    num_required: int = 0
    wait_applied: bool = False
    timeout: float | None = None
    rule_json: str = ""
    max_staleness: int | None = None


@dataclasses.dataclass(frozen=True)
class PushReply:
    """A PS's answer to a push: each gradient's new version, in push order."""

    versions: tuple[int, ...]
    applied: bool
    duplicate: bool = False
    staleness: tuple[int, ...] = ()

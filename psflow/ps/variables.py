"""One variable held by a parameter server: value, optimizer slots, versions, locks.

Reads are consistent snapshots without holding the lock while bytes travel: a
reader takes a reference to the current value buffer (``acquire_read``), and a
writer that finds readers on the buffer copies it first (copy on write).  Without
concurrent readers nothing is copied.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from typing import Any

import numpy as np

from psflow.update_rules import UpdateRule, rule_from_config

from . import write_ops
from .tensors import Segments, as_segments

__all__ = ["PendingStep", "Variable", "VariableMeta"]


@dataclasses.dataclass(frozen=True)
class VariableMeta:
    """A variable's identity and type (what a create must match)."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    trainable: bool = True

    @property
    def nbytes(self) -> int:
        """Bytes of the value."""
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


@dataclasses.dataclass
class PendingStep:
    """Contributions collected for one synchronous step of one variable."""

    num_required: int
    # (client_id, sequence) -> (dense values or None, indices or None, sparse values or None)
    contributions: dict[tuple[str, int], tuple[Any, Any, Any]] = dataclasses.field(
        default_factory=dict
    )


class Variable:
    """State of one variable; every method expects ``self.lock`` held unless noted."""

    def __init__(self, meta: VariableMeta, value: np.ndarray) -> None:
        self.meta = meta
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # notified on sync applies
        self.value = value
        self._readers = 0  # readers holding self.value (copy on write when > 0)
        self.rule: UpdateRule | None = None
        self.slots: dict[str, np.ndarray] = {}
        self.version = 0
        self.optimizer_step = 0
        self.sync_step = -1
        self.pending: dict[int, PendingStep] = {}
        self.mirror: Any = (
            None  # a shared-memory copy for readers on this host (psflow.transport.shm)
        )

    def _changed(self) -> None:
        """Counts a change of the value and republishes it to the mirror, if any."""
        self.version += 1
        if self.mirror is not None:
            self.mirror.publish(self.value, self.version)

    # -- rule --------------------------------------------------------------
    @property
    def optimizer_json(self) -> str:
        """The rule's config as canonical JSON ("" when none)."""
        return "" if self.rule is None else json.dumps(self.rule.get_config(), sort_keys=True)

    def set_rule(self, rule: UpdateRule) -> None:
        """Attaches ``rule``; keeps slots and step when the slot layout is unchanged."""
        same_layout = (
            self.rule is not None
            and type(self.rule) is type(rule)
            and self.rule.slot_names == rule.slot_names
        )
        if not same_layout:
            self.slots = rule.init_slots(self.value)
            self.optimizer_step = 0
        self.rule = rule

    def set_rule_config(self, config: dict[str, Any] | None) -> None:
        """:meth:`set_rule` from a config dict (``None``: leave as is)."""
        if config is not None:
            self.set_rule(rule_from_config(config))

    # -- reads (copy on write) ----------------------------------------------
    def acquire_read(self) -> tuple[np.ndarray, int]:
        """A snapshot ``(value, version)``; call :meth:`release_read` with it after use."""
        self._readers += 1
        return self.value, self.version

    def release_read(self, value: np.ndarray) -> None:
        """Ends a read begun by :meth:`acquire_read` (lock held)."""
        if value is self.value:
            self._readers -= 1

    def writable(self) -> np.ndarray:
        """The value, copied first if a reader still holds the current buffer."""
        if self._readers:
            self.value = self.value.copy()
            self._readers = 0
        return self.value

    # -- writes ------------------------------------------------------------
    def assign(self, op: str, values: Segments | np.ndarray) -> None:
        """``op`` in ``assign``, ``assign_add``, ``assign_sub``; shapes already checked."""
        flat = self.writable().reshape(-1)
        for offset, part in as_segments(values):
            write_ops.apply(op, flat[offset : offset + part.size], part)
        self._changed()

    def apply_dense(self, grad: Segments | np.ndarray) -> None:
        """One optimizer update with a dense gradient, segment by segment."""
        step = self.optimizer_step + 1
        flat = self.writable().reshape(-1)
        segments = as_segments(grad)
        if len(segments.parts) == 1 and segments.parts[0][1].size == flat.size:
            # the common whole-variable gradient: no slicing of the value or the slots
            self.rule.apply_dense(
                flat, segments.parts[0][1], {k: s.reshape(-1) for k, s in self.slots.items()}, step
            )
        else:
            flat_slots = {k: s.reshape(-1) for k, s in self.slots.items()}
            for offset, part in segments:
                end = offset + part.size
                self.rule.apply_dense(
                    flat[offset:end], part, {k: s[offset:end] for k, s in flat_slots.items()}, step
                )
        self.optimizer_step = step
        self._changed()

    def apply_sparse(self, indices: np.ndarray, values: np.ndarray) -> None:
        """One optimizer update with gradient rows (indices already validated)."""
        step = self.optimizer_step + 1
        self.rule.apply_sparse(self.writable(), indices, values, self.slots, step)
        self.optimizer_step = step
        self._changed()

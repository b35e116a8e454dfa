"""One variable held by a parameter server: value, optimizer slots, versions, locks.

Reads are consistent snapshots without holding the lock while bytes travel: a
reader takes a reference to the current value buffer (``acquire_read``), and a
writer that finds readers on the buffer copies it first (copy on write).  Without
concurrent readers nothing is copied.

A variable with a live shared-memory mirror (:class:`psflow.transport.shm.Mirror`)
keeps its value in the mirror's segment and applies each change there, under
the mirror's seqlock, instead of changing the value and copying it in after;
a reader that takes a reference gets the value copied out of the segment first
(the next change writes the segment while the reader still holds it).
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Callable
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

    def _change(self, write: Callable[[np.ndarray], None]) -> None:
        """Applies ``write`` to the value in place, counts the change and mirrors it.

        With a mirror that takes the change in place, ``write`` runs on the
        segment's array inside the seqlock's odd phase and the value is that
        array afterwards; otherwise on the value (copied first if a reader holds
        it), which the mirror then copies in if a reader asks.  ``write`` failing
        part way leaves the value as it left it, and the mirror dormant.
        """
        mirror = self.mirror
        target = None if mirror is None else mirror.begin_update(self.value, self.version)
        if target is None:
            write(self.writable())
            self.version += 1
            if mirror is not None:
                mirror.publish(self.value, self.version)
            return
        self.value = target  # readers of the buffer it replaces keep theirs
        self._readers = 0
        try:
            write(target)
        except BaseException:
            mirror.abandon_update()
            raise
        self.version += 1
        mirror.end_update(self.version)

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
        if self.mirror is not None and self.mirror.backs(self.value):
            # the segment takes the next change in place, under the reader's feet: the
            # reader gets a buffer of its own (the segment keeps the same bytes, so
            # the change after moves the value back in without a copy)
            self.value = self.value.copy()
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

        def write(value: np.ndarray) -> None:
            flat = value.reshape(-1)
            for offset, part in as_segments(values):
                write_ops.apply(op, flat[offset : offset + part.size], part)

        self._change(write)

    def apply_dense(self, grad: Segments | np.ndarray) -> None:
        """One optimizer update with a dense gradient, segment by segment."""
        step = self.optimizer_step + 1
        segments = as_segments(grad)

        def write(value: np.ndarray) -> None:
            flat = value.reshape(-1)
            flat_slots = {k: s.reshape(-1) for k, s in self.slots.items()}
            if len(segments.parts) == 1 and segments.parts[0][1].size == flat.size:
                # the common whole-variable gradient: no slicing of the value or the slots
                self.rule.apply_dense(flat, segments.parts[0][1], flat_slots, step)
                return
            for offset, part in segments:
                end = offset + part.size
                self.rule.apply_dense(
                    flat[offset:end], part, {k: s[offset:end] for k, s in flat_slots.items()}, step
                )

        self._change(write)
        self.optimizer_step = step

    def apply_sparse(self, indices: np.ndarray, values: np.ndarray) -> None:
        """One optimizer update with gradient rows (indices already validated)."""
        step = self.optimizer_step + 1
        self._change(lambda value: self.rule.apply_sparse(value, indices, values, self.slots, step))
        self.optimizer_step = step

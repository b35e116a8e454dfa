"""Deferred restoration: checkpoint values waiting for objects that do not exist yet.

A Keras layer makes its weights when it is first called, so a checkpoint
restored into a fresh model finds no ``kernel`` to give a value to.  As
TensorFlow does, the restore then remembers the layer and the checkpoint node
it matched; when the layer creates a weight, :func:`child_created` hands it
to that restore, which assigns the saved value before anything reads it.

The registry holds layers weakly: a layer dropped by its program drops its
pending values with it.  A later restore of the same layer replaces an
earlier one's (the newest checkpoint wins, as in TensorFlow).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Protocol


class PendingRestore(Protocol):
    """What a restore offers a layer that creates a weight (see :mod:`psflow.train.restore`)."""

    def child_created(self, owner: Any, node_id: int, name: str, value: Any) -> bool:
        """Restores ``value`` if the checkpoint has ``name`` under ``node_id``;
        returns True once nothing under that node waits any more."""
        ...


_lock = threading.Lock()
_pending: weakref.WeakKeyDictionary[Any, tuple[PendingRestore, int]] = weakref.WeakKeyDictionary()


def defer(owner: Any, restore: PendingRestore, node_id: int) -> None:
    """Remembers that ``owner``'s future weights take their values from ``node_id`` of ``restore``."""
    with _lock:
        _pending[owner] = (restore, node_id)


def forget(owner: Any, restore: PendingRestore) -> None:
    """Drops ``owner``'s entry if it is still ``restore``'s."""
    with _lock:
        entry = _pending.get(owner)
        if entry is not None and entry[0] is restore:
            del _pending[owner]


def child_created(owner: Any, name: str, value: Any) -> None:
    """Called by a layer that just created (and listed) the weight ``name``, or a
    model given its optimizer by ``compile``."""
    if not _pending:  # the usual case: nothing restored waits
        return
    with _lock:
        entry = _pending.get(owner)
    if entry is None:
        return
    restore, node_id = entry
    if restore.child_created(owner, node_id, name, value):
        forget(owner, restore)

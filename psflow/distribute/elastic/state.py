"""The training state of an elastic worker: snapshots at step boundaries, and its hand-over.

The state is every variable created in the strategy's scope (in creation
order, the same on every worker: the same program creates them) and, for
each optimizer that applied gradients, its step count and slot arrays.  A
snapshot is an in-memory copy (no disk): taking one per step costs one copy
of the model and its slots, which is what lets a worker drop a half-done
step.  After a change of membership one member's state is broadcast over the
new ring, so every member continues from the same bits.

Sync-on-read variables (local metric states) are snapshotted and restored
but never broadcast: each worker's own counts stay its own.

A worker that joins a running group receives the state before its program
has created its variables: the arrays wait (``pending``) and each variable,
optimizer step and slot takes its value when it is created, in the order
the program creates them (the same on every worker).

Small JSON values travel with it too (:attr:`TrainingState.extra`, e.g. the
hybrid mode's run id, which names every table push): a joiner reads the
source's in :attr:`TrainingState.received_extra`.
"""

from __future__ import annotations

import json
import weakref
from typing import Any

import numpy as np

from psflow import backend, errors

__all__ = ["TrainingState"]


def _host(value: Any) -> np.ndarray:
    return np.array(backend.to_numpy(value), copy=True)


def _write(copy: Any, value: np.ndarray) -> None:
    """Sets one variable copy's array to ``value``, on its device, in place where it can."""
    current = copy._value
    if isinstance(current, np.ndarray) and current.flags.writeable and current.shape == value.shape:
        np.copyto(current, value)
    else:
        copy._value = backend.place(value.copy(), backend.device_of(current))


class TrainingState:
    """Tracks the variables and optimizers of one strategy; snapshots, restores, broadcasts."""

    def __init__(self) -> None:
        self._variables: list[weakref.ref[Any]] = []
        self._optimizers: list[weakref.ref[Any]] = []
        self._pending_variables: list[np.ndarray] = []
        self._pending_optimizers: list[tuple[int, dict[int, dict[str, np.ndarray]]]] = []
        self._mirrored_seen = 0
        # JSON values this worker hands over with its state; the last source's, received
        self.extra: dict[str, Any] = {}
        self.received_extra: dict[str, Any] = {}

    def track_variable(self, variable: Any) -> bool:
        """Records a variable created in scope; True when it took a received (pending) value."""
        self._variables.append(weakref.ref(variable))
        if not self._mirrored(variable):
            return False
        index = self._mirrored_seen
        self._mirrored_seen += 1
        if index >= len(self._pending_variables):
            return False
        value = self._pending_variables[index]
        for copy in variable.values:
            _write(copy, value)
        return True

    def track_optimizer(self, optimizer: Any) -> None:
        """Records an optimizer when it first applies gradients (a received state applies)."""
        if any(ref() is optimizer for ref in self._optimizers):
            return
        index = len(self._optimizers)
        self._optimizers.append(weakref.ref(optimizer))
        if index < len(self._pending_optimizers):
            iterations, slots = self._pending_optimizers[index]
            optimizer._iterations = iterations
            variables = [v for v in self._live() if self._mirrored(v)]
            for var_index, saved in slots.items():
                # the optimizer fills them in when it creates the slots, at its first update
                optimizer._restore_slots(variables[var_index], saved, lambda: None)

    def _live(self) -> list[Any]:
        return [v for v in (ref() for ref in self._variables) if v is not None]

    def _opts(self) -> list[Any]:
        return [o for o in (ref() for ref in self._optimizers) if o is not None]

    @staticmethod
    def _mirrored(variable: Any) -> bool:
        from psflow.distribute.sync_on_read import SyncOnReadVariable

        return not isinstance(variable, SyncOnReadVariable)

    # -- snapshots ---------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """A copy of the state now (every variable's copies, each optimizer's step and slots)."""
        variables = [(v, [_host(c._value) for c in v.values]) for v in self._live()]
        optimizers = []
        for opt in self._opts():
            # the optimizer keeps its state in plain arrays keyed by (id(variable), replica)
            slots = {
                key: {name: _host(a) for name, a in arrays.items()}
                for key, arrays in opt._slots.items()
            }
            optimizers.append((opt, opt._iterations, slots))
        return {"variables": variables, "optimizers": optimizers}

    def restore(self, snapshot: dict[str, Any]) -> None:
        """Puts the state back as ``snapshot`` had it (slots created since are dropped)."""
        for variable, copies in snapshot["variables"]:
            for copy, value in zip(variable.values, copies):
                _write(copy, value)
        for opt, iterations, slots in snapshot["optimizers"]:
            opt._iterations = iterations
            for key in list(opt._slots):
                if key not in slots:  # created by the dropped step: as if never used
                    del opt._slots[key]
                    opt._slot_owner.pop(key, None)
                    continue
                current = opt._slots[key]
                for name, array in current.items():
                    saved = slots[key][name]
                    if isinstance(array, np.ndarray):
                        np.copyto(array, saved)
                    else:
                        current[name] = backend.place(saved.copy(), backend.device_of(array))

    # -- hand-over -----------------------------------------------------------------------
    def broadcast(self, ring: Any, root: int, *, pending: bool = False) -> None:
        """Every member gets ``root``'s mirrored variables and optimizer state (bit for bit).

        ``pending``: this worker (a joiner) has not created its variables yet; the
        received arrays wait for them.  ``root``'s :attr:`extra` goes with them
        (into every member's :attr:`received_extra`).

        Raises:
            InternalError: the members track different numbers of variables or optimizers.
        """
        variables = [v for v in self._live() if self._mirrored(v)]
        opts = self._opts()
        index = {id(v): i for i, v in enumerate(variables)}
        manifest: dict[str, Any] = {"variables": len(variables), "optimizers": []}
        arrays: list[np.ndarray] = []
        if ring.rank == root:
            manifest["extra"] = self.extra
            arrays = [_host(v.values[0]._value) for v in variables]
            manifest["specs"] = [[str(a.dtype), list(a.shape)] for a in arrays]
            for opt in opts:
                entry: dict[str, Any] = {"iterations": int(opt._iterations), "slots": []}
                for (vid, replica), slots in sorted(opt._slots.items(), key=lambda kv: kv[0][1]):
                    if replica != 0 or vid not in index:
                        continue
                    names = sorted(slots)
                    entry["slots"].append(
                        [
                            index[vid],
                            names,
                            [[str(slots[n].dtype), list(slots[n].shape)] for n in names],
                        ]
                    )
                    arrays.extend(_host(slots[n]) for n in names)
                manifest["optimizers"].append(entry)
        raw = np.frombuffer(json.dumps(manifest).encode(), np.uint8)
        (length,) = ring.broadcast([np.asarray([raw.size], np.int64)], root)
        (raw,) = ring.broadcast(
            [raw if ring.rank == root else np.empty(int(length[0]), np.uint8)], root
        )
        manifest = json.loads(bytes(raw))
        self.received_extra = dict(manifest.get("extra", {}))
        if pending:
            arrays = [np.empty(shape, np.dtype(dt)) for dt, shape in manifest["specs"]]
            for entry in manifest["optimizers"]:
                for _, _names, specs in entry["slots"]:
                    arrays.extend(np.empty(shape, np.dtype(dt)) for dt, shape in specs)
            it = iter(ring.broadcast(arrays, root))
            self._pending_variables = [next(it) for _ in manifest["specs"]]
            self._pending_optimizers = [
                (
                    entry["iterations"],
                    {k: {n: next(it) for n in names} for k, names, _ in entry["slots"]},
                )
                for entry in manifest["optimizers"]
            ]
            return
        if manifest["variables"] != len(variables) or len(manifest["optimizers"]) != len(opts):
            raise errors.InternalError(
                f"elastic hand-over: worker {root} has {manifest['variables']} variables and "
                f"{len(manifest['optimizers'])} optimizers, this one {len(variables)} and {len(opts)}"
            )
        if ring.rank != root:
            arrays = [_host(v.values[0]._value) for v in variables]
            for entry in manifest["optimizers"]:
                for _, _names, specs in entry["slots"]:
                    arrays.extend(np.empty(shape, np.dtype(dt)) for dt, shape in specs)
        arrays = ring.broadcast(arrays, root)
        if ring.rank == root:
            return
        it = iter(arrays)
        for v in variables:
            value = next(it)
            for copy in v.values:
                _write(copy, value)
        for opt, entry in zip(opts, manifest["optimizers"]):
            opt._iterations = entry["iterations"]
            received = {}
            for var_index, names, _ in entry["slots"]:
                received[var_index] = {n: next(it) for n in names}
            for key in list(opt._slots):
                owner = opt._slot_owner.get(key)
                if owner is None or id(owner) not in index or index[id(owner)] not in received:
                    del opt._slots[key]
                    opt._slot_owner.pop(key, None)
            for var_index, values in received.items():
                var = variables[var_index]
                for replica, copy in enumerate(var.values):
                    slots = opt.slot_arrays(var, replica, array=copy._value)
                    for name, value in values.items():
                        target = slots[name]
                        if isinstance(target, np.ndarray):
                            np.copyto(target, value)
                        else:
                            slots[name] = backend.place(value.copy(), backend.device_of(target))

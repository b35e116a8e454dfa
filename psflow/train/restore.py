"""Restoring a checkpoint into live objects, now or when they are created (deferred).

A :class:`Restoration` walks the saved object graph and the live one side by
side from the :class:`~psflow.train.Checkpoint`, matching nodes by edge name.
Phases of :meth:`Restoration.run`:

1. match: pair every live object with its saved node, and check every value
   that will be assigned (shapes), changing nothing;
2. parameter servers: every task restores its variables (renamed or re-split
   where the live names or layout differ from the saved ones);
3. this process: assign the values, restore tables, optimizer steps and
   iterators;
4. slots: optimizer slots go to their variables' slots, or wait for them.

A saved edge a live layer does not have yet (an unbuilt ``Dense`` has no
``kernel``) is left waiting (:mod:`psflow.train.deferred`): the layer hands
the weight over when it makes it, and it gets its value then.  The status
objects report, at the time they are asked, what still waits.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np

from psflow import errors
from psflow.distribute import distribute_lib
from psflow.distribute.protocols import ReplicatedVariable
from psflow.framework.variable import VariableAggregation, VariableSynchronization
from psflow.io.safetensors import load_file
from psflow.train import deferred, object_graph
from psflow.train.object_graph import VALUE_KINDS, Kind
from psflow.train.trackable import Trackable

_SHOWN = 20  # paths listed in a mismatch error


class Restoration:
    """One restore of a checkpoint: the saved graph, what was matched, what still waits."""

    def __init__(self, path: str, manifest: dict[str, Any]) -> None:
        self.path = path
        self.manifest = manifest
        self._nodes: list[dict[str, Any]] = manifest["objects"]
        self._lock = threading.RLock()
        self._arrays: dict[str, np.ndarray] | None = None
        self._ps_entries: Any = None
        self._matched: dict[int, Any] = {}  # node id -> live object
        self._restored: dict[int, Any] = {}  # id -> live object given its value
        self._unconsumed = {i for i, n in enumerate(self._nodes) if Kind(n["kind"]) in VALUE_KINDS}
        self._slots_waiting: dict[tuple[int, int], dict[str, str]] = {
            (i, s["variable"]): s["values"]
            for i, n in enumerate(self._nodes)
            if n["kind"] == Kind.OPTIMIZER.value
            for s in n["slots"]
        }
        self._slots_handed: set[tuple[int, int]] = set()
        self._waiting_owners: list[Any] = []  # layers deferred by the restore in progress

    # -- reading the files -------------------------------------------------------------
    def _array(self, key: str) -> np.ndarray:
        if self._arrays is None:
            local = self.manifest.get("local")
            self._arrays = (
                load_file(os.path.join(self.path, local["file"]), checksums=local["checksums"])
                if local
                else {}
            )
        return self._arrays[key]

    def _saved_value(self, node_id: int) -> np.ndarray:
        """A saved variable's whole value, held here or by the parameter servers."""
        node = self._nodes[node_id]
        if node["kind"] == Kind.VARIABLE.value:
            return self._array(node["key"])
        from psflow.train import reshard

        if self._ps_entries is None:
            self._ps_entries = reshard.read_entries(self.path)
        value = reshard.joined_value(self._ps_entries, node["ps_key"])
        if value is None:
            raise errors.NotFoundError(
                f"{self.path}: no shard file holds {node['ps_key']!r} ({node['path']})"
            )
        return value

    # -- matching ----------------------------------------------------------------------
    def _match(self, obj: Any, node_id: int) -> list[tuple[Any, int]]:
        """Pairs the graph below ``(obj, node_id)``; returns the pairs newly matched.

        Saved edges a live layer lacks are left waiting for it.
        """
        pairs = []
        queue = [(obj, node_id)]
        seen = {id(o) for o in self._matched.values()}
        for live, nid in queue:
            if nid in self._matched or id(live) in seen:
                continue
            saved = self._nodes[nid]
            kind = object_graph.kind_of(live)
            if not _compatible(kind, Kind(saved["kind"])):
                raise errors.InvalidArgumentError(
                    f"{self.path}: {saved['path'] or 'the root'} is a {saved['kind']} in the "
                    f"checkpoint but {type(live).__name__} here"
                )
            self._matched[nid] = live
            seen.add(id(live))
            pairs.append((live, nid))
            edges = object_graph.children(live)
            waiting = False
            for name, child in saved["children"].items():
                if name in edges:
                    queue.append((edges[name], child))
                elif not object_graph.is_model_edge(name):
                    waiting = True
            if waiting and isinstance(live, Trackable) and live.checkpoint_grows:
                deferred.defer(live, self, nid)
                self._waiting_owners.append(live)
        return pairs

    def _checked_value(self, live: Any, nid: int) -> np.ndarray | None:
        """The value to assign to a live variable, shape checked (None: not a variable).

        Raises:
            InvalidArgumentError: another shape.
            UnimplementedError: state restored by name (a dynamic table) under another name.
        """
        node = self._nodes[nid]
        if node["kind"] == Kind.EXTERNAL.value and node.get("name") != live.external_name:
            raise errors.UnimplementedError(
                f"{self.path}: {node['path']} was saved as {node.get('name')!r} and cannot "
                f"restore into {live.external_name!r}: tables are restored by name; give the "
                f"layer table_name={node.get('name')!r}"
            )
        if node["kind"] not in (Kind.VARIABLE.value, Kind.PS_VARIABLE.value):
            return None
        value = self._saved_value(nid)
        if tuple(value.shape) != tuple(live.shape):
            raise errors.InvalidArgumentError(
                f"{self.path}: {node['path']} has shape {list(value.shape)} in the checkpoint, "
                f"{list(live.shape)} here"
            )
        return value

    # -- restoring ---------------------------------------------------------------------
    def run(self, root: Any) -> None:
        """Restores everything that exists now under ``root``; the rest waits."""
        with self._lock:
            try:
                self._run(root)
            except BaseException:  # a failed restore leaves nothing waiting either
                for owner in self._waiting_owners:
                    deferred.forget(owner, self)
                raise
            finally:
                self._waiting_owners = []

    def _run(self, root: Any) -> None:
        from psflow.train.checkpoint import restore_ps
        from psflow.train.writer import ps_base_key, ps_session

        pairs = self._match(root, 0)
        # 1. values checked before anything changes; the PS ones restore by session
        values, sessions = {}, {}
        for live, nid in pairs:
            kind = object_graph.kind_of(live)
            saved_kind = Kind(self._nodes[nid]["kind"])
            if kind is Kind.PS_VARIABLE and saved_kind is Kind.PS_VARIABLE:
                session = ps_session(live)
                sources = sessions.setdefault(id(session), (session, {}))[1]
                sources[ps_base_key(live)] = self._nodes[nid]["ps_key"]
            else:
                value = self._checked_value(live, nid)
                if value is not None:
                    values[nid] = value
        # 2. parameter servers
        for session, sources in sessions.values():
            restore_ps(session, self.path, self.manifest, sources)
        # 3. this process
        for live, nid in pairs:
            self._restore_one(live, nid, values.get(nid))
        self._give_slots()

    def _restore_one(self, live: Any, nid: int, value: np.ndarray | None) -> None:
        """Gives one matched live object its saved state (PS variables: restored already)."""
        node = self._nodes[nid]
        kind = Kind(node["kind"])
        if value is not None:
            assign(live, value)
        elif kind is Kind.EXTERNAL:
            live.restore_external(os.path.join(self.path, node["dir"]))
        elif kind is Kind.OPTIMIZER:
            live.iterations = int(node["iterations"])
            if node.get("learning_rate") is not None and isinstance(
                live.learning_rate_schedule, (int, float)
            ):
                live.learning_rate = float(node["learning_rate"])
        elif kind is Kind.ITERATOR:
            live._restore_position(int(node["position"]))
        elif kind is not Kind.PS_VARIABLE:  # containers and scalars hold no value
            return
        self._consumed(nid, live)

    def _consumed(self, nid: int, live: Any) -> None:
        self._unconsumed.discard(nid)
        self._restored[id(live)] = live
        if not self._unconsumed and not self._slots_waiting:  # nothing waits: free the values
            self._arrays, self._ps_entries = {}, None

    def _give_slots(self) -> None:
        """Hands saved slots to optimizers whose variable and optimizer are both matched."""
        for (opt_node, var_node), keys in list(self._slots_waiting.items()):
            opt, var = self._matched.get(opt_node), self._matched.get(var_node)
            if opt is None or var is None or (opt_node, var_node) in self._slots_handed:
                continue
            self._slots_handed.add((opt_node, var_node))
            if object_graph.kind_of(var) is not Kind.VARIABLE:  # PS slots live on the PS
                self._slot_done(opt_node, var_node)
                continue
            saved = {slot: self._array(key) for slot, key in keys.items()}
            opt._restore_slots(var, saved, lambda o=opt_node, v=var_node: self._slot_done(o, v))

    def _slot_done(self, opt_node: int, var_node: int) -> None:
        with self._lock:
            self._slots_waiting.pop((opt_node, var_node), None)
            if not self._unconsumed and not self._slots_waiting:
                self._arrays, self._ps_entries = {}, None

    # -- deferred (psflow.train.deferred.PendingRestore) ---------------------------------
    def child_created(self, owner: Any, node_id: int, name: str, value: Any) -> bool:
        """Restores a weight a matched layer just made; True once the layer waits for none."""
        with self._lock:
            child = self._nodes[node_id]["children"].get(name)
            if child is not None and child not in self._matched:
                for live, nid in self._match(value, child):
                    self._restore_one(live, nid, self._checked_value(live, nid))
                self._give_slots()
            edges = object_graph.children(owner)
            return all(
                n in edges or object_graph.is_model_edge(n)
                for n in self._nodes[node_id]["children"]
            )

    # -- reporting ---------------------------------------------------------------------
    def unresolved(self) -> list[str]:
        """Saved values no live object took yet, and saved slots still waiting."""
        with self._lock:
            out = [self._nodes[i]["path"] for i in sorted(self._unconsumed)]
            out += [
                f"slot {sorted(keys)} of {self._nodes[v]['path']} for {self._nodes[o]['path']}"
                for (o, v), keys in sorted(self._slots_waiting.items())
            ]
        return out

    def unmatched(self, root: Any) -> list[str]:
        """Live objects with state that got no value from this checkpoint."""
        scalars = self.manifest.get("scalars", {})
        with self._lock:
            return [
                n.path
                for n in object_graph.build(root)
                if (n.kind in VALUE_KINDS and id(n.obj) not in self._restored)
                or (n.kind is Kind.SCALAR and n.path not in scalars)
            ]

    def matched_any(self) -> bool:
        """Whether any object besides the root was matched."""
        return len(self._matched) > 1


def _compatible(live: Kind | None, saved: Kind) -> bool:
    """Whether a live object of kind ``live`` can take a saved node of kind ``saved``."""
    values = {Kind.VARIABLE, Kind.PS_VARIABLE}
    return live is saved or (live in values and saved in values)


def assign(var: Any, value: np.ndarray) -> None:
    """Writes a restored value into any kind of variable, every copy of a replicated one
    (also inside ``strategy.run``, where a layer builds lazily)."""
    from psflow.distribute.ps.values import ShardedVariable

    if isinstance(var, ShardedVariable):
        start = 0
        for shard in var.variables:
            rows = shard.shape_tuple[0]
            shard.assign(value[start : start + rows].astype(shard.dtype.np, copy=False))
            start += rows
        return
    value = value.astype(var.dtype.np, copy=False)
    ctx = distribute_lib.get_replica_context()
    if not isinstance(var, ReplicatedVariable) or ctx is None or ctx.num_replicas_in_sync < 2:
        var.assign(value)  # cross-replica: the variable's own rule (a SUM one gets x / N)
        return
    # inside strategy.run only this replica's thread restores: write the copies directly
    if var.synchronization is VariableSynchronization.ON_READ and (
        var.aggregation is VariableAggregation.SUM
    ):
        value = (value / len(var.values)).astype(value.dtype)
    for copy in var.values:
        copy.assign(value)


class CheckpointLoadStatus:
    """What a restore did, asked when it is asked (TensorFlow's load status).

    Values waiting for objects not created yet count as unresolved until the
    objects appear; ``assert_consumed()`` after the first training step
    checks that the whole checkpoint went somewhere.
    """

    def __init__(self, restoration: Restoration, root: Any) -> None:
        self._restoration = restoration
        self._root = root

    @property
    def path(self) -> str:
        """The checkpoint restored."""
        return self._restoration.path

    @property
    def scalars(self) -> dict[str, Any]:
        """The plain numbers saved with the checkpoint (tracked ones and ``extra``)."""
        return dict(self._restoration.manifest.get("scalars", {}))

    @property
    def step(self) -> int:
        """The step the checkpoint was saved at."""
        return int(self._restoration.manifest.get("step", 0))

    def assert_consumed(self) -> CheckpointLoadStatus:
        """Checks that every saved value found its object and every object its value.

        Raises:
            CheckpointMismatchError: listing what is unresolved (values still
                waiting, for objects not created yet or not in this program)
                and the objects given no value.
        """
        self.assert_existing_objects_matched()
        unresolved = self._restoration.unresolved()
        if unresolved:
            raise errors.CheckpointMismatchError(
                f"Unresolved objects in checkpoint {self.path} ({len(unresolved)}): "
                f"{unresolved[:_SHOWN]}"
            )
        return self

    def assert_existing_objects_matched(self) -> CheckpointLoadStatus:
        """Checks that every object that exists now got a value (saved values may be left).

        Raises:
            CheckpointMismatchError: naming the objects with no value in the checkpoint.
        """
        unmatched = self._restoration.unmatched(self._root)
        if unmatched:
            raise errors.CheckpointMismatchError(
                f"{len(unmatched)} objects were not bound to values of checkpoint {self.path}: "
                f"{unmatched[:_SHOWN]}"
            )
        return self

    def assert_nontrivial_match(self) -> CheckpointLoadStatus:
        """Checks that something besides the root was matched.

        Raises:
            CheckpointMismatchError: nothing was.
        """
        if not self._restoration.matched_any():
            raise errors.CheckpointMismatchError(
                f"Nothing but the root matched checkpoint {self.path}"
            )
        return self

    def expect_partial(self) -> CheckpointLoadStatus:
        """Says a partial restore is intended (this status never warns about one)."""
        return self

    def run_restore_ops(self, session: Any = None) -> None:
        """Nothing to run: values are assigned eagerly."""

    def initialize_or_restore(self, session: Any = None) -> None:
        """Nothing to run: values are assigned eagerly."""


class InitializationOnlyStatus:
    """The status of ``restore(None)``: nothing restored (TensorFlow's)."""

    path = None
    step = 0

    @property
    def scalars(self) -> dict[str, Any]:
        """No checkpoint, no saved numbers."""
        return {}

    def _nothing(self) -> None:
        raise errors.CheckpointMismatchError(
            "No checkpoint specified (save_path=None); nothing is being restored"
        )

    def assert_consumed(self) -> InitializationOnlyStatus:
        """Raises: nothing was restored.

        Raises:
            CheckpointMismatchError: always.
        """
        self._nothing()
        return self

    def assert_existing_objects_matched(self) -> InitializationOnlyStatus:
        """Raises: nothing was restored.

        Raises:
            CheckpointMismatchError: always.
        """
        self._nothing()
        return self

    def assert_nontrivial_match(self) -> InitializationOnlyStatus:
        """Raises: nothing was restored.

        Raises:
            CheckpointMismatchError: always.
        """
        self._nothing()
        return self

    def expect_partial(self) -> InitializationOnlyStatus:
        """Returns itself."""
        return self

    def run_restore_ops(self, session: Any = None) -> None:
        """Nothing to run."""

    def initialize_or_restore(self, session: Any = None) -> None:
        """Nothing to run: variables are initialized when made."""

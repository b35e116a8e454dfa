"""Writing a checkpoint directory: the object graph, then each kind of state where it lives.

The phases, in order:

0. the graph is built and every iterator's position is checked: a position
   that cannot be saved fails here, before anything is written;
1. parameter servers write their own shard files;
2. values held in this process (and local optimizer slots) go to
   ``local.safetensors``, keyed by object path;
3. state kept outside variables (dynamic tables) writes itself;
4. ``checkpoint.json``, written last and atomically, is the commit point.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Any

import numpy as np

from psflow.io.files import atomic_write
from psflow.io.safetensors import save_file
from psflow.train import object_graph
from psflow.train.object_graph import Kind


def file_sha256(path: str) -> str:
    """The hex SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def ps_base_key(obj: Any) -> str:
    """The name a PS variable (or a sharded one's shards, less ``/part_<i>``) has on the PS."""
    from psflow.distribute.ps.values import ShardedVariable
    from psflow.train import reshard

    if isinstance(obj, ShardedVariable):
        return reshard.base_name(obj.variables[0].key)
    return obj.key


def ps_session(obj: Any) -> Any:
    """The PS session holding a PS variable (or a sharded one's shards)."""
    from psflow.distribute.ps.values import ShardedVariable

    return (obj.variables[0] if isinstance(obj, ShardedVariable) else obj)._session


def write(root: Any, path: str, step: int, save_counter: int, extra: dict[str, Any]) -> str:
    """Writes the checkpoint of ``root`` (a Checkpoint) at ``path``; returns ``path``."""
    from psflow.train.checkpoint import FORMAT, MANIFEST

    # 0. the graph; positions first: an iterator that cannot be saved writes nothing
    nodes = object_graph.build(root)
    positions = {
        i: n.obj._checkpoint_position(n.path)
        for i, n in enumerate(nodes)
        if n.kind is Kind.ITERATOR
    }
    if os.path.isdir(path):  # an incomplete one: a crash mid-save
        shutil.rmtree(path)
    os.makedirs(path)
    node_of = {id(n.obj): i for i, n in enumerate(nodes)}
    objects: list[dict[str, Any]] = []
    local: dict[str, np.ndarray] = {}
    scalars: dict[str, Any] = {}
    external: dict[str, str] = {}
    sessions: dict[int, Any] = {}
    for i, n in enumerate(nodes):
        entry: dict[str, Any] = {"path": n.path, "kind": n.kind.value, "children": n.children}
        if n.kind is Kind.VARIABLE:
            entry["key"] = object_graph.value_key(n.path)
            local[entry["key"]] = np.ascontiguousarray(np.asarray(n.obj.numpy()))
        elif n.kind is Kind.PS_VARIABLE:
            entry["ps_key"] = ps_base_key(n.obj)
            session = ps_session(n.obj)
            sessions[id(session)] = session
        elif n.kind is Kind.EXTERNAL:
            entry["dir"] = external[n.path] = f"external-{len(external)}"
            entry["name"] = n.obj.external_name
        elif n.kind is Kind.OPTIMIZER:
            entry.update(_optimizer_entry(n, nodes, node_of, local))
        elif n.kind is Kind.ITERATOR:
            entry["position"] = int(positions[i])
        elif n.kind is Kind.SCALAR:
            scalars[n.path] = n.obj
        objects.append(entry)
    scalars.update(extra)
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "step": step,
        "save_counter": save_counter,
        "scalars": scalars,
        "objects": objects,
        "external": external,
    }
    # 1. parameter servers: every task writes its own shard
    manifest["ps"] = [
        {"manifest": os.path.basename(m), "sha256": file_sha256(m)}
        for session in sessions.values()
        for m in session.save(path, step)
    ]
    # 2. this process's values and local optimizer slots
    if local:
        checksums = save_file(os.path.join(path, "local.safetensors"), local)
        manifest["local"] = {"file": "local.safetensors", "checksums": checksums}
    # 3. state kept outside variables writes itself (before the commit point)
    for i, n in enumerate(nodes):
        if n.kind is Kind.EXTERNAL:
            n.obj.save_external(os.path.join(path, objects[i]["dir"]))
    # 4. the commit point
    with atomic_write(os.path.join(path, MANIFEST)) as f:
        f.write(json.dumps(manifest, indent=1, sort_keys=True).encode())
    return path


def _optimizer_entry(
    node: object_graph.Node,
    nodes: list[object_graph.Node],
    node_of: dict[int, int],
    local: dict[str, np.ndarray],
) -> dict[str, Any]:
    """An optimizer's step, learning rate and the slots of the variables the graph tracks."""
    opt = node.obj
    lr = opt.learning_rate_schedule
    entry: dict[str, Any] = {
        "iterations": int(opt.iterations.numpy()),
        "learning_rate": float(lr) if isinstance(lr, (int, float)) else None,
        "slots": [],
    }
    for var, values in opt._slots_for_checkpoint():
        var_node = node_of.get(id(var))
        if var_node is None or not values:  # untracked (as TensorFlow: not saved), or none
            continue
        keys = {}
        for slot, value in values.items():
            keys[slot] = object_graph.slot_key(nodes[var_node].path, node.path, slot)
            local[keys[slot]] = np.ascontiguousarray(value)
        entry["slots"].append({"variable": var_node, "values": keys})
    return entry

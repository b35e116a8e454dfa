"""Restoring checkpoints of the first format (``psflow.checkpoint.v1``), matched by variable name.

Those checkpoints named each value after its variable (``model/dense/kernel:0``),
so they restore only into objects whose variables have the names they had;
nothing is deferred.  New checkpoints are matched by object path
(:mod:`psflow.train.object_graph`); this module only keeps the old ones readable.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from psflow import errors
from psflow.io.safetensors import load_file

FORMAT_V1 = "psflow.checkpoint.v1"


def _flatten(objects: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``(variables, optimizers, scalars)`` keyed as the first format keyed them."""
    from psflow.distribute.ps.values import ShardedVariable
    from psflow.train.object_graph import Kind, kind_of

    variables: dict[str, Any] = {}
    optimizers: dict[str, Any] = {}
    scalars: dict[str, Any] = {}
    for attr, obj in objects.items():
        kind = kind_of(obj)
        if kind is Kind.OBJECT and obj.checkpoint_grows:  # a layer or model: its weights
            for v in obj.weights:
                variables[f"{attr}/{v.name}"] = v
            opt = getattr(obj, "optimizer", None)
            if kind_of(opt) is Kind.OPTIMIZER:
                optimizers[f"{attr}/optimizer"] = opt
        elif kind is Kind.OPTIMIZER:
            optimizers[attr] = obj
        elif isinstance(obj, ShardedVariable):
            for i, shard in enumerate(obj.variables):
                variables[f"{attr}/part_{i}"] = shard
        elif kind in (Kind.VARIABLE, Kind.PS_VARIABLE):
            variables[attr] = obj
        elif kind is Kind.SCALAR:
            scalars[attr] = obj
    return variables, optimizers, scalars


def _is_ps(v: Any) -> bool:
    from psflow.distribute.ps.values import PSVariable

    return isinstance(v, PSVariable)


class LegacyLoadStatus:
    """What a restore of a first-format checkpoint did."""

    def __init__(self, path: str, missing: list[str], scalars: dict[str, Any], step: int) -> None:
        self.path = path
        self.missing = missing
        self.scalars = scalars
        self.step = step

    def assert_consumed(self) -> LegacyLoadStatus:
        """Raises if some tracked object had nothing to restore from.

        Raises:
            CheckpointMismatchError: naming the objects the checkpoint lacks.
        """
        if self.missing:
            raise errors.CheckpointMismatchError(f"{self.path} has no value for {self.missing}")
        return self

    assert_existing_objects_matched = assert_consumed

    def assert_nontrivial_match(self) -> LegacyLoadStatus:
        """Nothing to check beyond :meth:`assert_consumed` for this format."""
        return self

    def expect_partial(self) -> LegacyLoadStatus:
        """Silences nothing: this status never warns."""
        return self


def restore(
    objects: dict[str, Any], save_path: str, manifest: dict[str, Any], restore_ps: Any
) -> LegacyLoadStatus:
    """Restores a first-format checkpoint into ``objects`` (a Checkpoint's keywords)."""
    from psflow.train.checkpoint import ExternalState

    variables, optimizers, scalars = _flatten(objects)
    arrays: dict[str, np.ndarray] = {}
    if "local" in manifest:
        arrays = load_file(
            os.path.join(save_path, manifest["local"]["file"]),
            checksums=manifest["local"]["checksums"],
        )
    missing = []
    local_values = {}
    for k, v in variables.items():
        if _is_ps(v) or isinstance(v, ExternalState):
            continue
        arr = arrays.get(f"v/{k}")
        if arr is None:
            missing.append(k)
            continue
        if tuple(arr.shape) != tuple(v.shape):
            raise errors.InvalidArgumentError(
                f"{save_path}: {k} has shape {list(arr.shape)} in the checkpoint, {list(v.shape)} here"
            )
        local_values[k] = arr
    for k, arr in local_values.items():
        variables[k].assign(arr.astype(variables[k].dtype.np, copy=False))
    ps_vars = {k: v for k, v in variables.items() if _is_ps(v)}
    if ps_vars:
        session = next(iter(ps_vars.values()))._session
        restore_ps(session, save_path, manifest, {})
    for k, v in variables.items():
        if isinstance(v, ExternalState):
            where = manifest.get("external", {}).get(k)
            if where is None:
                missing.append(k)
                continue
            v.restore_external(os.path.join(save_path, where))
    by_name = {v.name: v for v in variables.values()}
    for k, opt in optimizers.items():
        state = manifest.get("optimizers", {}).get(k)
        if state is None:
            missing.append(k)
            continue
        opt.iterations = int(state["iterations"])
        slots: dict[str, dict[str, np.ndarray]] = {}
        for name, arr in arrays.items():
            if name.startswith(f"o/{k}/"):
                var_name, slot, replica = name[len(f"o/{k}/") :].rsplit("/", 2)
                if int(replica) == 0:
                    slots.setdefault(var_name, {})[slot] = arr
        for var_name, saved in slots.items():
            if var_name in by_name:
                opt._restore_slots(by_name[var_name], saved, lambda: None)
    missing += [k for k in scalars if k not in manifest.get("scalars", {})]
    return LegacyLoadStatus(
        save_path, missing, dict(manifest.get("scalars", {})), int(manifest.get("step", 0))
    )

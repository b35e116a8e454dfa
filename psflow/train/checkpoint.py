"""``psflow.train.Checkpoint``: save and restore models, optimizers and variables.

A checkpoint is a directory (``<prefix>-<n>``):

* variables held by parameter servers are written by their PS tasks, each its
  own shard files (``ps-<i>.manifest.json`` and a safetensors file, values and
  optimizer slots, sha256-checksummed);
* variables held in this process (default or mirrored strategy) and local
  optimizer slots go to ``local.safetensors``;
* state no variable holds (dynamic embedding tables, :class:`ExternalState`)
  is written by its owner into ``external-<i>/``;
* ``checkpoint.json``, written last and atomically, names everything with its
  checksums — a checkpoint exists only once it is there, so a crash while
  saving leaves the previous one as the latest.

Restoring verifies every checksum. When the parameter servers are laid out
differently than at save time (another number of tasks, another number of
shards of a partitioned variable), the shards are rewritten for the current
layout first (see :mod:`psflow.train.reshard`) — TensorFlow cannot do that.

Example:
    >>> import psflow as pf, tempfile, os
    >>> v = pf.Variable([1.0, 2.0])
    >>> ckpt = pf.train.Checkpoint(v=v)
    >>> path = ckpt.save(os.path.join(tempfile.mkdtemp(), "ckpt"))
    >>> _ = v.assign([0.0, 0.0])
    >>> _ = ckpt.restore(path)
    >>> v.numpy().tolist()
    [1.0, 2.0]
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Any

import numpy as np

from psflow import backend, errors
from psflow.io.files import atomic_write
from psflow.io.safetensors import load_file, save_file

FORMAT = "psflow.checkpoint.v1"
MANIFEST = "checkpoint.json"


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class ExternalState:
    """A tracked object whose state is no array this process holds (a dynamic
    embedding table on the parameter servers): it writes and reads its own
    files in the directory a checkpoint gives it, before the checkpoint commits."""

    def save_external(self, directory: str) -> None:
        """Writes the state under ``directory`` (which may not exist yet)."""
        raise NotImplementedError(f"{type(self).__name__} does not define save_external")

    def restore_external(self, directory: str) -> None:
        """Replaces the state with the one :meth:`save_external` wrote there."""
        raise NotImplementedError(f"{type(self).__name__} does not define restore_external")


def _is_ps(v: Any) -> bool:
    return hasattr(v, "ps_index") and hasattr(v, "key")


def _flatten_objects(
    objects: dict[str, Any],
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``(variables, optimizers, scalars)`` keyed by checkpoint path."""
    from psflow.framework.variable import Variable
    from psflow.keras.layers.base import Layer
    from psflow.keras.optimizers.optimizer import Optimizer

    variables: dict[str, Any] = {}
    optimizers: dict[str, Any] = {}
    scalars: dict[str, Any] = {}
    for attr, obj in objects.items():
        if isinstance(obj, Layer):
            for v in obj.weights:
                variables[f"{attr}/{v.name}"] = v
            opt = getattr(obj, "optimizer", None)
            if isinstance(opt, Optimizer):
                optimizers[f"{attr}/optimizer"] = opt
        elif isinstance(obj, Optimizer):
            optimizers[attr] = obj
        elif isinstance(obj, Variable) or _is_ps(obj):
            variables[attr] = obj
        elif hasattr(obj, "_shard_variables"):
            for i, shard in enumerate(obj.variables):
                variables[f"{attr}/part_{i}"] = shard
        elif isinstance(obj, (int, float, str, bool)):
            scalars[attr] = obj
        else:
            raise errors.InvalidArgumentError(
                f"Checkpoint cannot track {attr}={type(obj).__name__}: give models, layers, "
                "optimizers, variables or plain numbers"
            )
    return variables, optimizers, scalars


class CheckpointLoadStatus:
    """What a restore did (TensorFlow's load status, simplified)."""

    def __init__(
        self, path: str, restored: list[str], missing: list[str], scalars: dict[str, Any], step: int
    ) -> None:
        self.path = path
        self.restored = restored
        self.missing = missing
        self.scalars = scalars
        self.step = step

    def assert_consumed(self) -> CheckpointLoadStatus:
        """Raises if some tracked object had nothing to restore from.

        Raises:
            NotFoundError: naming the objects the checkpoint lacks.
        """
        if self.missing:
            raise errors.NotFoundError(f"{self.path} has no value for {self.missing}")
        return self

    def assert_existing_objects_matched(self) -> CheckpointLoadStatus:
        """Same as :meth:`assert_consumed` here."""
        return self.assert_consumed()

    def expect_partial(self) -> CheckpointLoadStatus:
        """Silences the missing-object check."""
        return self


class Checkpoint:
    """Groups objects to save and restore together (TensorFlow's ``tf.train.Checkpoint``).

    Args:
        root: an object saved under ``"root"``.
        **kwargs: models, layers, optimizers, variables or plain numbers, by name.
    """

    def __init__(self, root: Any = None, **kwargs: Any) -> None:
        self._objects = dict(kwargs)
        if root is not None:
            self._objects["root"] = root
        self.save_counter = 0

    # -- saving ------------------------------------------------------------------------
    def save(
        self, file_prefix: str, step: int | None = None, extra: dict[str, Any] | None = None
    ) -> str:
        """Writes ``<file_prefix>-<n>`` (n counts saves); returns its path."""
        self.save_counter += 1
        return self.write(f"{os.fspath(file_prefix)}-{self.save_counter}", step=step, extra=extra)

    def write(self, path: str, step: int | None = None, extra: dict[str, Any] | None = None) -> str:
        """Writes a checkpoint at ``path`` (a new directory); returns ``path``.

        Raises:
            AlreadyExistsError: a complete checkpoint is already at ``path``.
        """
        path = os.fspath(path)
        if os.path.exists(os.path.join(path, MANIFEST)):
            raise errors.AlreadyExistsError(f"A checkpoint already exists at {path}")
        if os.path.isdir(path):  # an incomplete one: a crash mid-save
            shutil.rmtree(path)
        os.makedirs(path)
        variables, optimizers, scalars = _flatten_objects(self._objects)
        scalars.update(extra or {})
        manifest: dict[str, Any] = {"format": FORMAT, "step": int(step or 0), "scalars": scalars}
        # 1. parameter servers: every task writes its own shard
        sessions = {id(v._session): v._session for v in variables.values() if _is_ps(v)}
        ps_entries = []
        for session in sessions.values():
            for m in session.save(path, int(step or 0)):
                ps_entries.append({"manifest": os.path.basename(m), "sha256": _sha256(m)})
        manifest["ps"] = ps_entries
        manifest["ps_variables"] = {k: v.key for k, v in variables.items() if _is_ps(v)}
        # 2. this process's variables and local optimizer slots
        local = {}
        for k, v in variables.items():
            if not _is_ps(v):
                local[f"v/{k}"] = (
                    np.ascontiguousarray(backend.to_numpy(v._array()))
                    if v.shape
                    else np.asarray(v.numpy())
                )
        opt_state = {}
        for k, opt in optimizers.items():
            state = opt._state_for_checkpoint()
            opt_state[k] = {"iterations": int(state.pop("iterations"))}
            for name, arr in state.items():
                local[f"o/{k}/{name}"] = arr
        manifest["optimizers"] = opt_state
        if local:
            checksums = save_file(os.path.join(path, "local.safetensors"), local)
            manifest["local"] = {"file": "local.safetensors", "checksums": checksums}
        # 2b. state kept outside variables writes itself (before the commit point)
        external = sorted(k for k, v in variables.items() if isinstance(v, ExternalState))
        manifest["external"] = {k: f"external-{i}" for i, k in enumerate(external)}
        for k in external:
            variables[k].save_external(os.path.join(path, manifest["external"][k]))
        # 3. the commit point
        with atomic_write(os.path.join(path, MANIFEST)) as f:
            f.write(json.dumps(manifest, indent=1, sort_keys=True).encode())
        return path

    # -- restoring -----------------------------------------------------------------------
    def restore(self, save_path: str) -> CheckpointLoadStatus:
        """Loads every tracked object's state from ``save_path``.

        Raises:
            NotFoundError: no complete checkpoint at ``save_path``.
            DataLossError: a checksum does not match (nothing is half-restored
                on this process's side; the parameter servers verify theirs before
                replacing anything).
        """
        save_path = os.fspath(save_path)
        manifest = read_manifest(save_path)
        for entry in manifest.get("ps", []):
            m = os.path.join(save_path, entry["manifest"])
            if not os.path.exists(m) or _sha256(m) != entry["sha256"]:
                raise errors.DataLossError(f"{m} is missing or does not match its checksum")
        variables, optimizers, scalars = _flatten_objects(self._objects)
        arrays: dict[str, np.ndarray] = {}
        if "local" in manifest:
            arrays = load_file(
                os.path.join(save_path, manifest["local"]["file"]),
                checksums=manifest["local"]["checksums"],
            )
        restored, missing = [], []
        local_values = {}
        for k, v in variables.items():
            if _is_ps(v):
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
            restored.append(k)
        ps_vars = {k: v for k, v in variables.items() if _is_ps(v)}
        if ps_vars:
            restored += _restore_ps(save_path, manifest, ps_vars)
        for k, v in variables.items():
            if isinstance(v, ExternalState):
                where = manifest.get("external", {}).get(k)
                if where is None:
                    missing.append(k)
                    continue
                v.restore_external(os.path.join(save_path, where))
        for k, opt in optimizers.items():
            state = manifest.get("optimizers", {}).get(k)
            if state is None:
                missing.append(k)
                continue
            opt._iterations = int(state["iterations"])
            _restore_slots(
                opt, {n[len(f"o/{k}/") :]: a for n, a in arrays.items() if n.startswith(f"o/{k}/")}
            )
            restored.append(k)
        missing += [k for k in scalars if k not in manifest.get("scalars", {})]
        return CheckpointLoadStatus(
            save_path,
            restored,
            missing,
            dict(manifest.get("scalars", {})),
            int(manifest.get("step", 0)),
        )

    read = restore


def read_manifest(path: str) -> dict[str, Any]:
    """The ``checkpoint.json`` of a checkpoint directory.

    Raises:
        NotFoundError: there is none (no checkpoint, or an incomplete one).
        DataLossError: it is not a psflow checkpoint manifest.
    """
    file = os.path.join(path, MANIFEST)
    try:
        with open(file, "rb") as f:
            manifest = json.loads(f.read())
    except FileNotFoundError:
        raise errors.NotFoundError(f"No complete checkpoint at {path} (no {MANIFEST})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise errors.DataLossError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise errors.DataLossError(f"{file} is not a {FORMAT} manifest")
    return manifest


def _restore_ps(path: str, manifest: dict[str, Any], ps_vars: dict[str, Any]) -> list[str]:
    """Restores parameter-server variables, rewriting shards if the layout changed."""
    from psflow.io import manifest as mf
    from psflow.train import reshard

    session = next(iter(ps_vars.values()))._session
    layout = session.handles_by_ps()
    saved: set[str] = set()
    for entry in manifest.get("ps", []):
        saved |= {
            e["name"] for e in mf.read_manifest(os.path.join(path, entry["manifest"]))["variables"]
        }
    wanted = {h.key: h for hs in layout.values() for h in hs}
    shapes_match = all(name in saved for name in wanted)
    if shapes_match:
        session.restore(path, {ps: [h.key for h in hs] for ps, hs in layout.items()})
    else:
        rewritten = reshard.rewrite(
            path,
            {ps: [(h.key, h.shape_tuple) for h in hs] for ps, hs in layout.items()},
            int(manifest.get("step", 0)),
        )
        try:
            session.restore(rewritten)
        finally:
            shutil.rmtree(rewritten, ignore_errors=True)
    return sorted(ps_vars)


def _restore_slots(optimizer: Any, arrays: dict[str, np.ndarray]) -> None:
    """Puts saved local slot arrays back by ``<variable name>/<slot>/<replica>``."""
    by_name = {}
    for key, var in optimizer._slot_owner.items():
        by_name[(var.name, key[1])] = key
    for name, arr in arrays.items():
        var_name, slot, replica = name.rsplit("/", 2)
        key = by_name.get((var_name, int(replica)))
        if key is None:  # slots not created yet: they take these values when they are
            optimizer._pending_slots.setdefault((var_name, int(replica)), {})[slot] = arr
            continue
        target = optimizer._slots[key].get(slot)
        if target is not None and target.shape == arr.shape:
            backend.xp_of(target).copyto(
                target,
                backend.place(arr, backend.device_of(target))
                if not isinstance(target, np.ndarray)
                else arr,
            )


def latest_checkpoint(checkpoint_dir: str) -> str | None:
    """The newest complete checkpoint recorded in ``checkpoint_dir``, or None.

    Recorded by a :class:`CheckpointManager` (a checkpoint directory) or by
    ``keras.callbacks.ModelCheckpoint`` (a weights file for ``model.load_weights``).
    """
    from psflow.train.manager import read_state

    state = read_state(os.fspath(checkpoint_dir))
    return state["latest"] if state else None

"""Save and restore a parameter-server shard: safetensors + manifest, atomically.

Saving writes the tensors to a new uniquely named file, then the manifest that
names it (atomic rename: the commit point), then deletes the shard's older
tensor files.  A crash at any moment leaves the previous checkpoint intact.
Every variable is locked while the shard is written, so the checkpoint is a
consistent cut of this shard.

Restoring verifies every tensor's sha256 and every entry before replacing the
shard in one step; with ``names`` it gathers those variables from all the
manifests in the directory (a checkpoint written by a different number of PS
tasks).
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import time
import uuid
from collections.abc import Sequence

import numpy as np

from psflow.errors import DataLossError, NotFoundError
from psflow.io import manifest as mf
from psflow.io.safetensors import load_file, save_file
from psflow.update_rules import rule_from_config

from .store import VariableMeta, VariableStore
from .variables import Variable

__all__ = ["RestoreResult", "SaveResult", "restore_shard", "save_shard"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SaveResult:
    """What :func:`save_shard` wrote."""

    manifest_path: str
    bytes_written: int
    names: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class RestoreResult:
    """What :func:`restore_shard` restored."""

    step: int
    names: tuple[str, ...]


def save_shard(
    store: VariableStore, directory: str, prefix: str, step: int | None = None
) -> SaveResult:
    """Writes the store's variables and slots under ``directory/prefix.*``.

    ``step`` (default: the step of the last save or restore) is recorded in the
    manifest and becomes the store's step.
    """
    step = store.step if step is None else int(step)
    store.step = step
    os.makedirs(directory, exist_ok=True)
    tensor_file = f"{prefix}.{uuid.uuid4().hex[:12]}.safetensors"
    start = time.monotonic()
    with store.exporting() as variables:
        tensors = []
        entries = []
        for var in variables:
            name = var.meta.name
            value_key = f"v/{name}"
            tensors.append((value_key, var.value))
            slots = {}
            for slot, arr in var.slots.items():
                slots[slot] = f"s/{slot}/{name}"
                tensors.append((slots[slot], arr))
            entries.append(
                {
                    "name": name,
                    "dtype": var.meta.dtype.name,
                    "shape": list(var.meta.shape),
                    "trainable": var.meta.trainable,
                    "optimizer": var.rule.get_config() if var.rule else None,
                    "value_key": value_key,
                    "slots": slots,
                    "version": var.version,
                    "optimizer_step": var.optimizer_step,
                    "sync_step": var.sync_step,
                }
            )
        checksums = save_file(
            os.path.join(directory, tensor_file),
            tensors,
            metadata={"task": store.task, "step": str(int(step))},
        )
        manifest_file = mf.manifest_path(directory, prefix)
        mf.write_manifest(
            manifest_file,
            {
                "task": store.task,
                "step": int(step),
                "tensor_file": tensor_file,
                "variables": entries,
                "checksums": checksums,
            },
        )
    # The manifest now names the new file: older tensor files of this prefix are garbage.
    for old in glob.glob(
        os.path.join(glob.escape(directory), f"{glob.escape(prefix)}.*.safetensors")
    ):
        if os.path.basename(old) != tensor_file:
            os.unlink(old)
    nbytes = sum(int(arr.nbytes) for _, arr in tensors)
    log.info(
        "saved %d variables (%d bytes) to %s in %.2fs",
        len(entries),
        nbytes,
        manifest_file,
        time.monotonic() - start,
    )
    return SaveResult(manifest_file, nbytes, tuple(e["name"] for e in entries))


def _build(entry: dict, arrays: dict[str, np.ndarray], where: str) -> Variable:
    name = entry["name"]
    try:
        dtype = np.dtype(entry["dtype"])
    except TypeError as e:
        raise DataLossError(f"{where}: variable {name!r} has dtype {entry['dtype']!r}") from e
    meta = VariableMeta(name, dtype, tuple(entry["shape"]), entry["trainable"])
    value = arrays[entry["value_key"]]
    if value.dtype != dtype or value.shape != meta.shape:
        raise DataLossError(f"{where}: value of {name!r} does not match its manifest entry")
    var = Variable(meta, value)
    if entry.get("optimizer"):
        var.set_rule(rule_from_config(entry["optimizer"]))
        if sorted(entry["slots"]) != sorted(var.rule.slot_names):
            raise DataLossError(
                f"{where}: {name!r} has slots {sorted(entry['slots'])}, its optimizer needs "
                f"{sorted(var.rule.slot_names)}"
            )
        for slot, key in entry["slots"].items():
            arr = arrays[key]
            if arr.shape != meta.shape or arr.dtype != dtype:
                raise DataLossError(f"{where}: slot {slot!r} of {name!r} has the wrong shape")
            var.slots[slot] = arr
    var.version = entry["version"]
    var.optimizer_step = entry["optimizer_step"]
    var.sync_step = entry["sync_step"]
    return var


def _load_entries(directory: str, manifest: dict, entries: list[dict], where: str):
    keys = []
    for e in entries:
        keys.append(e["value_key"])
        keys.extend(e["slots"].values())
    path = os.path.join(directory, manifest["tensor_file"])
    try:
        arrays = load_file(path, keys, checksums=manifest["checksums"])
    except FileNotFoundError as e:
        raise DataLossError(f"{where}: tensor file {path} is missing") from e
    except KeyError as e:
        raise DataLossError(f"{where}: {e}") from e
    return [_build(e, arrays, where) for e in entries]


def restore_shard(
    store: VariableStore,
    directory: str,
    prefix: str,
    names: Sequence[str] | None = None,
) -> RestoreResult:
    """Replaces the store's shard by a checkpoint's.

    Args:
        names: restore exactly these variables, found in any manifest of the
            directory; ``None``: everything in ``prefix``'s manifest.

    Raises:
        NotFoundError: no manifest, or a requested variable is in none.
        DataLossError: a checksum mismatch or a malformed file (the shard is unchanged).
    """
    start = time.monotonic()
    if not names:
        path = mf.manifest_path(directory, prefix)
        try:
            manifest = mf.read_manifest(path)
        except FileNotFoundError as e:
            raise NotFoundError(f"no checkpoint manifest at {path}") from e
        variables = _load_entries(directory, manifest, manifest["variables"], path)
        step = int(manifest["step"])
    else:
        wanted = set(names)
        variables, step = [], 0
        for path in sorted(glob.glob(os.path.join(glob.escape(directory), "*.manifest.json"))):
            manifest = mf.read_manifest(path)
            entries = [e for e in manifest["variables"] if e["name"] in wanted]
            if entries:
                variables += _load_entries(directory, manifest, entries, path)
                wanted -= {e["name"] for e in entries}
                step = max(step, int(manifest["step"]))
        if wanted:
            raise NotFoundError(f"variables {sorted(wanted)} are in no manifest under {directory}")
    store.replace_all(variables)
    store.step = step
    log.info(
        "restored %d variables from %s in %.2fs",
        len(variables),
        directory,
        time.monotonic() - start,
    )
    return RestoreResult(step, tuple(v.meta.name for v in variables))

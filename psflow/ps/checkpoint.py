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

import contextlib
import dataclasses
import errno
import glob
import logging
import os
import time
import uuid
from collections.abc import Iterator, Sequence

import numpy as np

from psflow.errors import (
    DataLossError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    OpError,
    PermissionDeniedError,
    ResourceExhaustedError,
)
from psflow.io import manifest as mf
from psflow.io.safetensors import load_file, save_file
from psflow.update_rules import rule_from_config

from .names import quote
from .store import VariableMeta, VariableStore
from .variables import Variable

__all__ = ["RestoreResult", "SaveResult", "restore_shard", "save_shard"]

log = logging.getLogger(__name__)

MAX_PATH_CHARS = 4096  # Linux's PATH_MAX
# a file name is at most 255 bytes; the prefix gets ".<12 hex>.safetensors" and the
# manifest's temporary ".<prefix>.manifest.json.tmp-<pid>-<8 hex>" around it
MAX_PREFIX_BYTES = 200


def check_location(directory: str, prefix: str, *, need_prefix: bool = True) -> None:
    """Refuses a checkpoint directory or shard prefix no file could be written under.

    Raises:
        InvalidArgumentError: an empty directory, a NUL byte, a directory
            longer than :data:`MAX_PATH_CHARS`, or a prefix that is not a plain
            file name of at most :data:`MAX_PREFIX_BYTES` bytes (quoted).
    """
    if not isinstance(directory, str) or not directory:
        raise InvalidArgumentError(
            f"checkpoint directory must be a non-empty string: {quote(directory)}"
        )
    if "\0" in directory or len(directory) > MAX_PATH_CHARS:
        raise InvalidArgumentError(
            f"checkpoint directory {quote(directory)} holds a NUL byte or is longer than "
            f"{MAX_PATH_CHARS} characters"
        )
    if not need_prefix and prefix == "":
        return
    if (
        not isinstance(prefix, str)
        or prefix in ("", ".", "..")
        or "\0" in prefix
        or "/" in prefix
        or os.sep in prefix
        or len(prefix.encode("utf-8", "surrogatepass")) > MAX_PREFIX_BYTES
    ):
        raise InvalidArgumentError(
            f"checkpoint prefix {quote(prefix)} is not a plain file name of at most "
            f"{MAX_PREFIX_BYTES} bytes"
        )


@contextlib.contextmanager
def _os_errors(action: str, path: str) -> Iterator[None]:
    """Turns the file system's refusals into typed errors naming ``path``."""
    try:
        yield
    except OpError:
        raise
    except FileNotFoundError as e:
        raise NotFoundError(f"{action} {quote(path)}: {e.strerror}") from e
    except PermissionError as e:
        raise PermissionDeniedError(f"{action} {quote(path)}: {e.strerror}") from e
    except OSError as e:
        message = f"{action} {quote(path)}: {e.strerror or e}"
        if e.errno == errno.ENAMETOOLONG:
            raise InvalidArgumentError(message) from e
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ResourceExhaustedError(message) from e
        # a directory that is a file, a path below a file, a read-only file system...
        raise FailedPreconditionError(message) from e
    except ValueError as e:  # e.g. a NUL byte the checks above did not see
        raise InvalidArgumentError(f"{action} {quote(path)}: {e}") from e


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
    check_location(directory, prefix)
    step = store.step if step is None else int(step)
    with _os_errors("cannot save a checkpoint to", directory):
        result = _save(store, directory, prefix, step)
    store.step = step  # only once the checkpoint exists
    return result


def _save(store: VariableStore, directory: str, prefix: str, step: int) -> SaveResult:
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
        raise DataLossError(
            f"{where}: variable {quote(name)} has dtype {quote(entry['dtype'])}"
        ) from e
    meta = VariableMeta(name, dtype, tuple(entry["shape"]), entry["trainable"])
    value = arrays[entry["value_key"]]
    if value.dtype != dtype or value.shape != meta.shape:
        raise DataLossError(f"{where}: value of {name!r} does not match its manifest entry")
    var = Variable(meta, value)
    if entry.get("optimizer"):
        try:
            var.set_rule(rule_from_config(entry["optimizer"]))
        except InvalidArgumentError as e:
            raise DataLossError(f"{where}: optimizer of {quote(name)}: {e}") from e
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
    tensor_file = manifest["tensor_file"]
    if tensor_file in ("", ".", "..") or os.path.basename(tensor_file) != tensor_file:
        raise DataLossError(f"{where}: tensor_file {quote(tensor_file)} is not a file name")
    path = os.path.join(directory, tensor_file)
    try:
        arrays = load_file(path, keys, checksums=manifest["checksums"])
    except FileNotFoundError as e:
        raise DataLossError(f"{where}: tensor file {path} is missing") from e
    except KeyError as e:
        raise DataLossError(f"{where}: {e}") from e
    except (OSError, ValueError) as e:  # a directory, unreadable, a NUL byte...
        raise DataLossError(f"{where}: tensor file {quote(path)}: {e}") from e
    return [_build(e, arrays, where) for e in entries]


def _read(path: str) -> dict:
    """A manifest, with every way its content can be malformed as DataLossError."""
    try:
        manifest = mf.read_manifest(path)
    except RecursionError as e:
        raise DataLossError(f"{path}: manifest JSON is nested too deeply") from e
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise DataLossError(f"{path}: manifest is not valid JSON: {e}") from e
    return manifest


def _step(manifest: dict, where: str) -> int:
    step = manifest.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        raise DataLossError(f"{where}: manifest step {quote(step)} is not an integer")
    return step


@contextlib.contextmanager
def _malformed(where: str) -> Iterator[None]:
    """Turns lookups and conversions of manifest entries gone wrong into DataLossError."""
    try:
        yield
    except OpError:
        raise
    except (KeyError, TypeError, ValueError, RecursionError, OverflowError) as e:
        raise DataLossError(
            f"{where}: malformed manifest entry: {type(e).__name__}: {quote(str(e))}"
        ) from e


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
    check_location(directory, prefix, need_prefix=not names)
    with _os_errors("cannot restore a checkpoint from", directory):
        variables, step = _gather(directory, prefix, names)
    store.replace_all(variables)
    store.step = step
    log.info(
        "restored %d variables from %s in %.2fs",
        len(variables),
        directory,
        time.monotonic() - start,
    )
    return RestoreResult(step, tuple(v.meta.name for v in variables))


def _gather(directory: str, prefix: str, names: Sequence[str] | None) -> tuple[list[Variable], int]:
    """The variables (and the step) a restore installs, all read and checked."""
    if not names:
        path = mf.manifest_path(directory, prefix)
        try:
            manifest = _read(path)
        except FileNotFoundError as e:
            raise NotFoundError(f"no checkpoint manifest at {quote(path)}") from e
        step = _step(manifest, path)
        with _malformed(path):
            return _load_entries(directory, manifest, manifest["variables"], path), step
    wanted = set(names)
    variables: list[Variable] = []
    step = 0
    for path in sorted(glob.glob(os.path.join(glob.escape(directory), "*.manifest.json"))):
        manifest = _read(path)
        with _malformed(path):
            entries = [e for e in manifest["variables"] if e["name"] in wanted]
            if entries:
                variables += _load_entries(directory, manifest, entries, path)
                wanted -= {e["name"] for e in entries}
                step = max(step, _step(manifest, path))
    if wanted:
        shown = [quote(n) for n in sorted(wanted)[:10]]
        raise NotFoundError(
            f"variables {shown} ({len(wanted)} in all) are in no manifest under {quote(directory)}"
        )
    return variables, step

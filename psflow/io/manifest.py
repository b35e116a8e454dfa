"""Checkpoint manifests of a parameter-server shard (JSON, written last, atomically).

A shard checkpoint is ``<prefix>.safetensors`` (values and optimizer slots) plus
``<prefix>.manifest.json``, the commit point: a checkpoint exists once its
manifest does.  The manifest records, per variable: name, dtype, shape,
trainability, optimizer config, slot names, the safetensors keys of the value
and of each slot, version, optimizer step and last sync step; for the shard:
the task, the training step and the sha256 of every tensor.

Example manifest::

    {"format": "psflow.shard.v1", "task": "ps:0", "step": 10,
     "tensor_file": "ps-0.safetensors",
     "variables": [{"name": "w", "dtype": "float32", "shape": [2],
                    "trainable": true, "optimizer": {"name": "sgd", ...},
                    "value_key": "v/w", "slots": {"momentum": "s/momentum/w"},
                    "version": 3, "optimizer_step": 3, "sync_step": -1}],
     "checksums": {"v/w": "<sha256>", "s/momentum/w": "<sha256>"}}
"""

from __future__ import annotations

import json
import os
from typing import Any

from psflow.errors import DataLossError

from .files import atomic_write

__all__ = ["FORMAT", "manifest_path", "read_manifest", "tensor_path", "write_manifest"]

FORMAT = "psflow.shard.v1"
_VAR_KEYS = {
    "name": str,
    "dtype": str,
    "shape": list,
    "trainable": bool,
    "value_key": str,
    "slots": dict,
    "version": int,
    "optimizer_step": int,
    "sync_step": int,
}


def manifest_path(directory: str | os.PathLike, prefix: str) -> str:
    """Where the manifest of shard ``prefix`` lives."""
    return os.path.join(directory, f"{prefix}.manifest.json")


def tensor_path(directory: str | os.PathLike, prefix: str) -> str:
    """Where the tensors of shard ``prefix`` live."""
    return os.path.join(directory, f"{prefix}.safetensors")


def write_manifest(path: str | os.PathLike, manifest: dict[str, Any]) -> None:
    """Writes ``manifest`` as JSON, atomically."""
    with atomic_write(path) as f:
        f.write(json.dumps({"format": FORMAT, **manifest}, indent=1, sort_keys=True).encode())


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """Reads and validates a manifest.

    Raises:
        FileNotFoundError: no manifest at ``path``.
        DataLossError: not JSON, another format, or a malformed entry (named).
    """
    with open(path, "rb") as f:
        raw = f.read()
    try:
        manifest = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataLossError(f"{path}: manifest is not valid JSON: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataLossError(f"{path}: not a {FORMAT} manifest")
    for key, kind in (("variables", list), ("checksums", dict), ("tensor_file", str)):
        if not isinstance(manifest.get(key), kind):
            raise DataLossError(f"{path}: manifest field {key!r} is missing or malformed")
    for entry in manifest["variables"]:
        if not isinstance(entry, dict):
            raise DataLossError(f"{path}: malformed variable entry {entry!r}")
        for key, kind in _VAR_KEYS.items():
            if not isinstance(entry.get(key), kind):
                raise DataLossError(
                    f"{path}: variable {entry.get('name')!r} has a missing or malformed {key!r}"
                )
    return manifest

"""Rewriting parameter-server shard files for another layout of tasks and shards.

A checkpoint written with 2 PS tasks and a table in 2 shards can be restored
with 3 tasks and the table in 3 shards: the chief reads every shard file,
joins each partitioned variable's parts (values and optimizer slots) along
their first axis, splits them again as the current variables are split, and
writes one shard file per current task, which that task then restores.
"""

from __future__ import annotations

import glob
import os
import re
import uuid
from collections import defaultdict
from typing import Any

import numpy as np

from psflow import errors
from psflow.io import manifest as mf
from psflow.io.safetensors import load_file, save_file

_PART = re.compile(r"^(?P<base>.*)/part_(?P<index>\d+)$")


def _split_name(name: str) -> tuple[str, int]:
    m = _PART.match(name)
    return (m.group("base"), int(m.group("index"))) if m else (name, 0)


def read_entries(directory: str) -> dict[str, tuple[dict[str, Any], dict[str, np.ndarray]]]:
    """Every variable of every shard manifest under ``directory``: entry and its arrays (checked)."""
    out: dict[str, tuple[dict[str, Any], dict[str, np.ndarray]]] = {}
    for path in sorted(glob.glob(os.path.join(glob.escape(directory), "*.manifest.json"))):
        manifest = mf.read_manifest(path)
        keys = [k for e in manifest["variables"] for k in (e["value_key"], *e["slots"].values())]
        arrays = load_file(
            os.path.join(directory, manifest["tensor_file"]), keys, checksums=manifest["checksums"]
        )
        for e in manifest["variables"]:
            mine = {
                "value": arrays[e["value_key"]],
                **{f"slot:{s}": arrays[k] for s, k in e["slots"].items()},
            }
            out[e["name"]] = (e, mine)
    return out


def joined_value(
    entries: dict[str, tuple[dict[str, Any], dict[str, np.ndarray]]], base: str
) -> np.ndarray | None:
    """The whole value of variable ``base`` (its parts joined along the first axis), or None."""
    if base in entries:
        return entries[base][1]["value"]
    parts = sorted(
        (index, name) for name in entries for b, index in [_split_name(name)] if b == base
    )
    if not parts:
        return None
    return np.concatenate([entries[name][1]["value"] for _, name in parts], axis=0)


def base_name(name: str) -> str:
    """A shard's variable name without its ``/part_<i>`` suffix."""
    return _split_name(name)[0]


def rewrite(
    directory: str,
    layout: dict[int, list[tuple[str, tuple[int, ...]]]],
    step: int = 0,
    sources: dict[str, str] | None = None,
) -> str:
    """Writes shard files for ``layout`` (task -> [(name, shape)]) into a new subdirectory.

    ``sources`` maps a variable's current name (without ``/part_<i>``) to its
    name in the checkpoint, where they differ (another model's variables
    matched by object path).  Returns the subdirectory; task ``i``'s shard
    has prefix ``ps-{i}``.

    Raises:
        NotFoundError: a variable (or every part of it) is missing from the checkpoint.
        InvalidArgumentError: a variable's total shape differs from the checkpoint's.
    """
    sources = sources or {}
    entries = read_entries(directory)
    by_base: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for name in entries:
        base, index = _split_name(name)
        by_base[base].append((index, name))
    wanted_by_base: dict[str, list[tuple[int, str, tuple[int, ...]]]] = defaultdict(list)
    for items in layout.values():
        for name, shape in items:
            base, index = _split_name(name)
            wanted_by_base[base].append((index, name, tuple(shape)))
    arrays_for: dict[str, tuple[dict[str, Any], dict[str, np.ndarray]]] = {}
    for base, wanted in wanted_by_base.items():
        wanted.sort()
        source = sources.get(base, base)
        single = source + wanted[0][1][len(base) :]  # its saved name, if not re-split
        if (
            len(wanted) == 1
            and single in entries
            and tuple(entries[single][0]["shape"]) == wanted[0][2]
        ):
            arrays_for[wanted[0][1]] = (
                {**entries[single][0], "name": wanted[0][1]},
                entries[single][1],
            )
            continue
        parts = sorted(by_base.get(source, []))
        if not parts:
            raise errors.NotFoundError(
                f"variable {source!r} is not in the checkpoint at {directory}"
            )
        first_entry = entries[parts[0][1]][0]
        joined = {
            k: np.concatenate([entries[n][1][k] for _, n in parts], axis=0)
            for k in entries[parts[0][1]][1]
        }
        rows = joined["value"].shape[0]
        if sum(w[2][0] for w in wanted) != rows or any(
            w[2][1:] != joined["value"].shape[1:] for w in wanted
        ):
            raise errors.InvalidArgumentError(
                f"variable {source!r} is {list(joined['value'].shape)} in the checkpoint but "
                f"{[list(w[2]) for w in wanted]} now"
            )
        start = 0
        for _, name, shape in wanted:
            stop = start + shape[0]
            entry = {**first_entry, "name": name, "shape": list(shape)}
            entry["optimizer_step"] = max(entries[n][0]["optimizer_step"] for _, n in parts)
            arrays_for[name] = (
                entry,
                {k: np.ascontiguousarray(a[start:stop]) for k, a in joined.items()},
            )
            start = stop
    out_dir = os.path.join(directory, f".reshard-{uuid.uuid4().hex[:8]}")
    os.makedirs(out_dir)
    for task, items in layout.items():
        tensors, manifest_entries = [], []
        for name, _ in items:
            entry, arrays = arrays_for[name]
            value_key = f"v/{name}"
            slots = {
                k.split(":", 1)[1]: f"s/{k.split(':', 1)[1]}/{name}"
                for k in arrays
                if k.startswith("slot:")
            }
            tensors.append((value_key, arrays["value"]))
            tensors += [
                (slots[k.split(":", 1)[1]], a) for k, a in arrays.items() if k.startswith("slot:")
            ]
            manifest_entries.append({**entry, "value_key": value_key, "slots": slots})
        tensor_file = f"ps-{task}.safetensors"
        checksums = save_file(os.path.join(out_dir, tensor_file), tensors)
        mf.write_manifest(
            mf.manifest_path(out_dir, f"ps-{task}"),
            {
                "task": f"ps:{task}",
                "step": step,
                "tensor_file": tensor_file,
                "variables": manifest_entries,
                "checksums": checksums,
            },
        )
    return out_dir

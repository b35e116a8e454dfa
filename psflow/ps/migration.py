"""A shard in transit: variables with their slots, versions and push records, as bytes.

When parameter servers are resized, the old owner of a variable exports it
(:func:`encode_shard`) and the new owner imports it (:func:`decode_shard`)
exactly as it was: value, optimizer rule and slots, version, optimizer step,
last applied sync step, and the request ids of the pushes that touched it (so
a push retried after the move is recognised as a duplicate at the new owner).

Format: an 8-byte little-endian header length, a JSON header, then the raw
tensor bytes back to back (offsets in the header).  Every field is checked on
decode; a malformed blob is a ``DataLossError`` and installs nothing.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from psflow.errors import DataLossError, InvalidArgumentError
from psflow.update_rules import rule_from_config

from .names import check_name, quote
from .variables import Variable, VariableMeta

__all__ = ["PushRecord", "ShardState", "decode_shard", "encode_shard"]

_LEN = struct.Struct("<Q")
FORMAT = "psflow-shard-v1"


@dataclasses.dataclass(frozen=True)
class PushRecord:
    """A request id and the moved variables its (applied) push touched."""

    client_id: str
    sequence: int
    names: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class ShardState:
    """Decoded variables and push records, ready to install."""

    variables: tuple[Variable, ...]
    records: tuple[PushRecord, ...]


def encode_shard(variables: Sequence[Variable], records: Sequence[PushRecord]) -> bytes:
    """The bytes of ``variables`` (locks held by the caller) and ``records``."""
    entries, blobs, offset = [], [], 0
    tensors: list[dict[str, Any]] = []

    def add(arr: np.ndarray) -> int:
        nonlocal offset
        data = np.ascontiguousarray(arr).tobytes()
        tensors.append({"offset": offset, "nbytes": len(data)})
        blobs.append(data)
        offset += len(data)
        return len(tensors) - 1

    for var in variables:
        entries.append(
            {
                "name": var.meta.name,
                "dtype": var.meta.dtype.name,
                "shape": list(var.meta.shape),
                "trainable": var.meta.trainable,
                "optimizer": var.rule.get_config() if var.rule is not None else None,
                "value": add(var.value),
                "slots": {slot: add(arr) for slot, arr in var.slots.items()},
                "version": var.version,
                "optimizer_step": var.optimizer_step,
                "sync_step": var.sync_step,
            }
        )
    header = json.dumps(
        {
            "format": FORMAT,
            "variables": entries,
            "tensors": tensors,
            "records": [[r.client_id, r.sequence, list(r.names)] for r in records],
        }
    ).encode()
    return b"".join([_LEN.pack(len(header)), header, *blobs])


def decode_shard(blob: bytes, max_tensor_bytes: int) -> ShardState:
    """The shard ``blob`` holds.

    Raises:
        DataLossError: truncated or malformed bytes, or an entry that does not
            describe a valid variable (nothing is installed).
    """
    view = memoryview(blob)
    try:
        (n,) = _LEN.unpack_from(view, 0)
        header = json.loads(bytes(view[_LEN.size : _LEN.size + n]))
        if header.get("format") != FORMAT:
            raise DataLossError(f"shard blob has format {quote(header.get('format'))}")
        data = view[_LEN.size + n :]
        tensors = header["tensors"]
        variables = tuple(_build(e, tensors, data, max_tensor_bytes) for e in header["variables"])
        records = tuple(
            PushRecord(str(c), int(s), tuple(str(x) for x in names))
            for c, s, names in header["records"]
        )
    except DataLossError:
        raise
    except (struct.error, ValueError, KeyError, TypeError, IndexError, InvalidArgumentError) as e:
        raise DataLossError(f"malformed shard blob: {type(e).__name__}: {e}") from e
    return ShardState(variables, records)


def _array(
    tensors: list, index: int, data: memoryview, dtype: np.dtype, shape: tuple
) -> np.ndarray:
    t = tensors[int(index)]
    offset, nbytes = int(t["offset"]), int(t["nbytes"])
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes != expected or offset < 0 or offset + nbytes > len(data):
        raise DataLossError(
            f"tensor {index} of a shard blob has {nbytes} bytes, expected {expected}"
        )
    return np.frombuffer(data[offset : offset + nbytes], dtype=dtype).reshape(shape).copy()


def _build(entry: dict, tensors: list, data: memoryview, max_tensor_bytes: int) -> Variable:
    meta = VariableMeta(
        str(entry["name"]), np.dtype(entry["dtype"]), tuple(int(d) for d in entry["shape"]),
        bool(entry["trainable"]),
    )  # fmt: skip
    check_name(meta.name)
    if meta.nbytes > max_tensor_bytes:
        raise DataLossError(f"variable {quote(meta.name)} of a shard blob is above the limit")
    var = Variable(meta, _array(tensors, entry["value"], data, meta.dtype, meta.shape))
    if entry["optimizer"] is not None:
        var.set_rule(rule_from_config(entry["optimizer"]))
        if sorted(entry["slots"]) != sorted(var.rule.slot_names):
            raise DataLossError(
                f"variable {quote(meta.name)} has slots {sorted(entry['slots'])}, its "
                f"optimizer needs {sorted(var.rule.slot_names)}"
            )
        for slot, index in entry["slots"].items():
            var.slots[slot] = _array(tensors, index, data, meta.dtype, meta.shape)
    var.version = int(entry["version"])
    var.optimizer_step = int(entry["optimizer_step"])
    var.sync_step = int(entry["sync_step"])
    return var

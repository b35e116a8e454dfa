"""A small reader and writer of the safetensors format.

Layout: an unsigned little-endian 64-bit header length ``N``; ``N`` bytes of
UTF-8 JSON mapping each tensor name to ``{"dtype", "shape", "data_offsets":
[begin, end]}`` (plus an optional ``"__metadata__"`` of string pairs), padded
with spaces to a multiple of 8; then the tensors' raw little-endian C-order
bytes, offsets relative to the end of the header, back to back.

The writer streams each array straight to the file (no concatenation in memory)
and returns each tensor's sha256, computed on the way.  The reader reads into
freshly allocated arrays (or a memory map) and validates the header: a bad
length, JSON, dtype, shape, or offsets that do not tile the data exactly raise
:class:`~psflow.errors.DataLossError` naming the file and the tensor.

Example:
    >>> import numpy as np, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "t.safetensors")
    >>> _ = save_file(path, {"w": np.arange(3, dtype=np.float32)})
    >>> load_file(path)["w"]
    array([0., 1., 2.], dtype=float32)
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from psflow.errors import DataLossError, InvalidArgumentError

from .files import atomic_write

__all__ = ["DTYPE_CODES", "load_file", "read_header", "save_file"]

DTYPE_CODES: dict[str, np.dtype] = {
    "F16": np.dtype("<f2"),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "I8": np.dtype("i1"),
    "I16": np.dtype("<i2"),
    "I32": np.dtype("<i4"),
    "I64": np.dtype("<i8"),
    "U8": np.dtype("u1"),
    "U16": np.dtype("<u2"),
    "U32": np.dtype("<u4"),
    "U64": np.dtype("<u8"),
    "BOOL": np.dtype("?"),
}
_CODE_OF = {dt.newbyteorder("="): code for code, dt in DTYPE_CODES.items()}
_MAX_HEADER = 100 << 20
_IO_BLOCK = 64 << 20  # read/hash in blocks so huge tensors need no second buffer


def _code(dtype: np.dtype, name: str) -> str:
    code = _CODE_OF.get(np.dtype(dtype).newbyteorder("="))
    if code is None:
        raise InvalidArgumentError(f"tensor {name!r}: dtype {dtype} has no safetensors code")
    return code


def save_file(
    path: str | os.PathLike,
    tensors: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]],
    metadata: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Writes tensors to ``path`` atomically; returns ``{name: sha256 hex}`` of their bytes.

    Raises:
        InvalidArgumentError: unsupported dtype, duplicate or reserved name,
            non-string metadata.
    """
    items = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
    header: dict[str, Any] = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise InvalidArgumentError("safetensors metadata must map strings to strings")
        header["__metadata__"] = dict(metadata)
    arrays = []
    offset = 0
    for name, value in items:
        if name == "__metadata__" or name in header:
            raise InvalidArgumentError(f"tensor name {name!r} is reserved or repeated")
        arr = np.asarray(value)
        code = _code(arr.dtype, name)
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        if not arr.flags.c_contiguous:
            arr = arr.copy(order="C")
        header[name] = {
            "dtype": code,
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        offset += arr.nbytes
        arrays.append((name, arr))
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    digests = {}
    with atomic_write(path) as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, arr in arrays:
            data = arr.reshape(-1).view(np.uint8)
            h = hashlib.sha256()
            for start in range(0, data.size, _IO_BLOCK):
                block = data[start : start + _IO_BLOCK]
                h.update(block)
                f.write(block)
            digests[name] = h.hexdigest()
    return digests


def read_header(path: str | os.PathLike) -> tuple[dict[str, Any], int]:
    """Parses and validates the header; returns ``(header, data_start)``.

    Raises:
        DataLossError: the file is truncated or its header is malformed.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise DataLossError(f"{path}: {size} bytes, too short for a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER or 8 + n > size:
            raise DataLossError(f"{path}: header length {n} does not fit a {size}-byte file")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DataLossError(f"{path}: header is not valid JSON: {e}") from e
    if not isinstance(header, dict):
        raise DataLossError(f"{path}: header is not a JSON object")
    data_len = size - 8 - n
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict):
                raise DataLossError(f"{path}: __metadata__ is not an object")
            continue
        if not isinstance(info, dict) or info.get("dtype") not in DTYPE_CODES:
            raise DataLossError(f"{path}: tensor {name!r} has an unsupported entry {info!r}")
        try:
            dtype = DTYPE_CODES[info["dtype"]]
            shape = [int(d) for d in info["shape"]]
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise DataLossError(f"{path}: tensor {name!r} has a malformed entry {info!r}") from e
        if any(d < 0 for d in shape) or end - begin != math.prod(shape) * dtype.itemsize:
            raise DataLossError(
                f"{path}: tensor {name!r} offsets {[begin, end]} do not hold {info['dtype']}{shape}"
            )
        spans.append((begin, end, name))
    spans.sort()
    cursor = 0
    for begin, end, name in spans:
        if begin != cursor:
            raise DataLossError(f"{path}: tensor {name!r} starts at {begin}, expected {cursor}")
        cursor = end
    if cursor != data_len:
        raise DataLossError(f"{path}: tensors cover {cursor} bytes, the file holds {data_len}")
    return header, 8 + n


def load_file(
    path: str | os.PathLike,
    names: Iterable[str] | None = None,
    *,
    checksums: Mapping[str, str] | None = None,
    mmap: bool = False,
) -> dict[str, np.ndarray]:
    """Reads tensors (all, or ``names``) into new arrays.

    Args:
        checksums: ``{name: sha256 hex}`` to verify while reading.
        mmap: return read-only memory-mapped arrays instead (no checksum check).

    Raises:
        DataLossError: malformed file, or a checksum mismatch (naming the tensor).
        KeyError: a requested name is not in the file.
    """
    header, start = read_header(path)
    wanted = [k for k in header if k != "__metadata__"] if names is None else list(names)
    for name in wanted:
        if name not in header or name == "__metadata__":
            raise KeyError(f"{path}: no tensor {name!r}")
    out = {}
    if mmap:
        for name in wanted:
            info = header[name]
            dtype = DTYPE_CODES[info["dtype"]]
            begin = start + info["data_offsets"][0]
            if math.prod(info["shape"]) == 0:
                out[name] = np.empty(tuple(info["shape"]), dtype)
            else:
                out[name] = np.memmap(path, dtype, "r", begin, tuple(info["shape"]))
        return out
    with open(path, "rb", buffering=0) as f:
        for name in wanted:
            info = header[name]
            dtype = DTYPE_CODES[info["dtype"]]
            arr = np.empty(tuple(info["shape"]), dtype)
            data = arr.reshape(-1).view(np.uint8)
            f.seek(start + info["data_offsets"][0])
            h = hashlib.sha256()
            for pos in range(0, data.size, _IO_BLOCK):
                block = data[pos : pos + _IO_BLOCK]
                got = f.readinto(block)
                while got < block.size:
                    more = f.readinto(block[got:])
                    if not more:
                        raise DataLossError(f"{path}: tensor {name!r} is truncated")
                    got += more
                if checksums is not None:
                    h.update(block)
            if checksums is not None:
                expected = checksums.get(name)
                if expected is None or h.hexdigest() != expected:
                    raise DataLossError(
                        f"{path}: tensor {name!r} fails its sha256 check "
                        f"(expected {expected}, got {h.hexdigest()})"
                    )
            out[name] = arr
    return out

"""The data plane's frames: a fixed binary header, an opaque header, a raw payload.

Every frame starts with :data:`FIXED` (36 bytes, little-endian):

====== ======= ============================================================
offset  type    field
====== ======= ============================================================
0       4s      magic ``b"PSDP"``
4       u8      version (:data:`VERSION`)
5       u8      kind (:class:`Kind`)
6       u16     flags (0; reserved)
8       u32     method id (:func:`method_id` of the method name; 0 outside calls)
12      u64     call id (a reply repeats its request's)
20      u32     header length
24      u32     the caller's time left in milliseconds (0: none given)
28      u64     payload length
====== ======= ============================================================

then ``header length`` bytes of serialized protobuf (a PushHeader, a
PullRequest, a :class:`DataPlaneStatus`...) and ``payload length`` raw bytes.
A frame whose fixed header is wrong (magic, version, kind, flags) or whose
lengths exceed the receiver's limits is a :class:`FrameError`: the receiver
closes the connection without acting on it.
"""

from __future__ import annotations

import enum
import struct
import zlib
from typing import NamedTuple

from psflow.errors import InvalidArgumentError

__all__ = [
    "FIXED",
    "MAGIC",
    "MAX_HEADER_BYTES",
    "VERSION",
    "FrameError",
    "FrameHead",
    "Kind",
    "method_id",
    "pack",
    "unpack",
]

MAGIC = b"PSDP"
VERSION = 1
FIXED = struct.Struct("<4sBBHIQIIQ")
MAX_HEADER_BYTES = 16 << 20
"""No protobuf header (a PushHeader of many items included) is larger than this."""
_MAX_TIMEOUT_MS = 0xFFFFFFFF


class Kind(enum.IntEnum):
    """What a frame is."""

    HELLO = 1  # client -> server, first frame: DataPlaneHello
    WELCOME = 2  # server -> client: the hello was accepted
    REQUEST = 3  # client -> server: a call
    REPLY = 4  # server -> client: the call's result
    ERROR = 5  # server -> client: DataPlaneStatus; for a HELLO, the connection then closes


class FrameError(InvalidArgumentError):
    """A frame that breaks the format or the receiver's limits (the connection is closed)."""


class FrameHead(NamedTuple):
    """The fixed header of one frame."""

    kind: Kind
    method: int
    call_id: int
    header_len: int
    timeout_ms: int
    payload_len: int


def method_id(name: str) -> int:
    """The 32-bit id of a method name on the wire (its CRC-32; never 0)."""
    return zlib.crc32(name.encode("utf-8")) or 1


def timeout_ms(seconds: float | None) -> int:
    """``seconds`` as the fixed header's millisecond field (0: no deadline)."""
    if seconds is None:
        return 0
    return max(1, min(_MAX_TIMEOUT_MS, int(seconds * 1000)))


def pack(
    kind: Kind,
    method: int = 0,
    call_id: int = 0,
    header_len: int = 0,
    timeout: int = 0,
    payload_len: int = 0,
) -> bytes:
    """The 36-byte fixed header of a frame."""
    return FIXED.pack(MAGIC, VERSION, kind, 0, method, call_id, header_len, timeout, payload_len)


def unpack(raw: bytes | memoryview, *, max_header: int, max_payload: int) -> FrameHead:
    """Parses and checks a fixed header.

    Raises:
        FrameError: a wrong magic, version, kind or flags, or a header or payload
            length above ``max_header`` / ``max_payload`` (the message quotes it).
    """
    magic, version, kind, flags, method, call_id, hlen, tmo, plen = FIXED.unpack(raw)
    if magic != MAGIC:
        raise FrameError(f"not a data-plane frame: magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise FrameError(f"data-plane frame version {version}, this side speaks {VERSION}")
    known = _KINDS.get(kind)
    if known is None:
        raise FrameError(f"unknown data-plane frame kind {kind}")
    if flags:
        raise FrameError(f"data-plane frame flags {flags:#x} set (none are defined)")
    if hlen > max_header:
        raise FrameError(f"frame header of {hlen} bytes, above the limit of {max_header}")
    if plen > max_payload:
        raise FrameError(f"frame payload of {plen} bytes, above the limit of {max_payload}")
    return FrameHead(known, method, call_id, hlen, tmo, plen)


# wire value -> Kind: a dict look-up, where calling the enum costs a microsecond a frame
_KINDS = {int(k): k for k in Kind}

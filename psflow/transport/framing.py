"""Framing of the header + payload messages of ps.proto, without protobuf copies.

``WriteRequest``, ``PullResponse`` and ``PushRequest`` share one layout: field 1
is a header message, field 2 a ``Chunk`` whose field 1 holds payload bytes.  The
hot path builds and splits these messages by hand, because the generated code
would copy every payload chunk once more on parse and on serialize:

* :func:`encode_message` writes the tag/length prefixes and the payload pieces
  with one ``bytes.join`` (one copy, straight from the NumPy arrays);
* :func:`split_message` scans the wire format and returns the header bytes and a
  ``memoryview`` of the payload inside the received buffer (no copy).

Both produce and accept exactly the protobuf encoding, so the generated classes
read what these write and vice versa (tested), and unknown fields are skipped as
protobuf would.  :class:`PayloadAssembler` cuts the concatenated payload of a
stream back into per-tensor pieces, still without copying.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from psflow.errors import InvalidArgumentError

__all__ = [
    "PayloadAssembler",
    "byte_view",
    "encode_message",
    "join_pieces",
    "parse_header",
    "payload_messages",
    "split_message",
]

_HEADER_TAG = b"\x0a"  # field 1, length-delimited
_CHUNK_TAG = b"\x12"  # field 2, length-delimited
_DATA_TAG = b"\x0a"  # Chunk.data: field 1, length-delimited


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _read_varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end:
            raise InvalidArgumentError("malformed message: truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift >= 64:
            raise InvalidArgumentError("malformed message: varint longer than 10 bytes")


def _skip(buf: bytes, pos: int, end: int, wire_type: int) -> int:
    if wire_type == 0:
        return _read_varint(buf, pos, end)[1]
    if wire_type == 1:
        return pos + 8
    if wire_type == 5:
        return pos + 4
    if wire_type == 2:
        n, pos = _read_varint(buf, pos, end)
        return pos + n
    raise InvalidArgumentError(f"malformed message: wire type {wire_type}")


def _fields(buf: bytes, pos: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """Yields ``(field, wire_type, start, stop)``; start/stop bound LEN contents."""
    while pos < end:
        key, pos = _read_varint(buf, pos, end)
        field, wire_type = key >> 3, key & 7
        if field == 0:
            raise InvalidArgumentError("malformed message: field number 0")
        if wire_type == 2:
            n, pos = _read_varint(buf, pos, end)
            start, pos = pos, pos + n
        else:
            start, pos = pos, _skip(buf, pos, end, wire_type)
        if pos > end:
            raise InvalidArgumentError("malformed message: truncated field")
        yield field, wire_type, start, pos


def _split_common(raw: bytes) -> tuple[bytes | None, memoryview | None] | None:
    """The layout this module writes, parsed without the generic scanner; None if not it."""
    n = len(raw)
    pos = 0
    header = payload = None
    if n and raw[0] == 0x0A:
        length, pos = _read_varint(raw, 1, n)
        if pos + length > n:
            return None
        header = raw[pos : pos + length]
        pos += length
    if pos < n and raw[pos] == 0x12:
        length, start = _read_varint(raw, pos + 1, n)
        end = start + length
        if end != n:
            return None
        if length == 0:
            payload = memoryview(raw)[end:end]
        elif raw[start] == 0x0A:
            size, data = _read_varint(raw, start + 1, end)
            if data + size != end:
                return None
            payload = memoryview(raw)[data:end]
        else:
            return None
        pos = end
    return (header, payload) if pos == n else None


def parse_header(raw: bytes, cls: Any) -> Any:
    """The header message ``cls`` of ``raw`` bytes (a framed message's, or a data-plane
    frame's).

    Raises:
        InvalidArgumentError: the bytes do not parse.
    """
    try:
        return cls.FromString(raw)
    except Exception as e:  # protobuf DecodeError and friends
        raise InvalidArgumentError(f"malformed {cls.__name__} header: {e}") from None


def split_message(raw: bytes) -> tuple[bytes | None, memoryview | None]:
    """Splits a header + chunk message into ``(header_bytes, payload_view)``.

    Either part is ``None`` when absent.  The payload view aliases ``raw``.

    Raises:
        InvalidArgumentError: the bytes are not a well-formed message of this layout.
    """
    raw = bytes(raw) if not isinstance(raw, bytes) else raw
    common = _split_common(raw)
    if common is not None:
        return common
    view = memoryview(raw)
    header = payload = None
    for field, wire_type, start, stop in _fields(raw, 0, len(raw)):
        if field in (1, 2) and wire_type != 2:
            raise InvalidArgumentError(
                f"malformed message: field {field} has wire type {wire_type}"
            )
        if field == 1:
            if header is not None:
                raise InvalidArgumentError("malformed message: header given twice")
            header = raw[start:stop]
        elif field == 2:
            if payload is not None:
                raise InvalidArgumentError("malformed message: chunk given twice")
            payload = view[start:start]
            for f, wt, s, e in _fields(raw, start, stop):
                if f == 1:
                    if wt != 2:
                        raise InvalidArgumentError("malformed message: chunk data wire type")
                    payload = view[s:e]
    return header, payload


def serialize(message: Any) -> bytes:
    """A message's bytes; bytes as they are (a request or reply serialized already:
    the data plane sends the same bytes)."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def byte_view(array: np.ndarray) -> np.ndarray:
    """A flat uint8 view of a C-contiguous array (no copy)."""
    return array.reshape(-1).view(np.uint8)


def encode_message(header: bytes | None, pieces: Sequence[Any] = ()) -> bytes:
    """One header + chunk message; ``pieces`` (buffers) are concatenated as its payload."""
    parts: list[Any] = []
    if header is not None:
        parts += [_HEADER_TAG, _varint(len(header)), header]
    if pieces:
        n = sum(memoryview(p).nbytes for p in pieces)
        data_prefix = _DATA_TAG + _varint(n)
        parts += [_CHUNK_TAG, _varint(len(data_prefix) + n), data_prefix, *pieces]
    return b"".join(parts)


def payload_messages(
    header: bytes, arrays: Sequence[np.ndarray], chunk_bytes: int
) -> Iterator[bytes]:
    """The messages of a stream: the header, then the arrays' bytes in chunks.

    A chunk holds at most ``chunk_bytes`` (at least one element); an array is cut
    only at element boundaries, and small arrays share a chunk.  The first
    message carries the header and the first chunk.
    """
    pending: list[np.ndarray] = []
    pending_bytes = 0
    first = True
    for arr in arrays:
        flat = byte_view(arr)
        itemsize = arr.dtype.itemsize
        step = max(itemsize, chunk_bytes // itemsize * itemsize)
        for start in range(0, flat.size, step):
            piece = flat[start : start + step]
            if pending and pending_bytes + piece.size > chunk_bytes:
                yield encode_message(header if first else None, pending)
                first, pending, pending_bytes = False, [], 0
            pending.append(piece)
            pending_bytes += piece.size
    if pending or first:
        yield encode_message(header if first else None, pending)


def split_stream(
    messages: Iterable[tuple[bytes | None, memoryview | None]],
) -> tuple[bytes, Iterator[memoryview]]:
    """The header of a stream of split messages (:func:`split_message`'s, as
    :func:`payload_messages` sends them) and its payload chunks, as they arrive.

    Raises:
        InvalidArgumentError: no message, no header first, or a second one.
    """
    it = iter(messages)
    try:
        header, first_payload = next(it)
    except StopIteration:
        raise InvalidArgumentError("empty request stream: no header") from None
    if header is None:
        raise InvalidArgumentError("the first message of a request carries no header")

    def payloads() -> Iterator[memoryview]:
        if first_payload is not None:
            yield first_payload
        for hdr, payload in it:
            if hdr is not None:
                raise InvalidArgumentError("a header in a message after the first")
            if payload is not None:
                yield payload

    return header, payloads()


def join_pieces(pieces: Sequence[memoryview]) -> memoryview:
    """The pieces as one contiguous buffer (no copy when there is one piece)."""
    if len(pieces) == 1:
        return pieces[0]
    return memoryview(b"".join(pieces))


class PayloadAssembler:
    """Cuts a streamed payload into per-tensor pieces as chunks arrive.

    Args:
        sizes: the byte size of each tensor, in payload order.

    Pieces are views of the received chunks: nothing is copied.
    """

    def __init__(self, sizes: Sequence[int]) -> None:
        self._sizes = list(sizes)
        self._pieces: list[list[memoryview]] = [[] for _ in self._sizes]
        self._index = 0
        self._filled = 0
        self.total = sum(self._sizes)
        self.received = 0
        self._skip_empty()

    def _skip_empty(self) -> None:
        while self._index < len(self._sizes) and self._filled == self._sizes[self._index]:
            self._index += 1
            self._filled = 0

    def feed(self, data: memoryview | None) -> None:
        """Appends the next chunk.

        Raises:
            InvalidArgumentError: more bytes than the header announced.
        """
        if data is None or not len(data):
            return
        if self.received + len(data) > self.total:
            raise InvalidArgumentError(
                f"payload has more than the {self.total} bytes its header announced"
            )
        self.received += len(data)
        pos = 0
        while pos < len(data):
            take = min(len(data) - pos, self._sizes[self._index] - self._filled)
            self._pieces[self._index].append(data[pos : pos + take])
            pos += take
            self._filled += take
            self._skip_empty()

    def finish(self) -> None:
        """Checks that the whole payload arrived.

        Raises:
            InvalidArgumentError: the payload is truncated.
        """
        if self.received != self.total:
            raise InvalidArgumentError(
                f"payload truncated: {self.received} of {self.total} announced bytes arrived"
            )

    def pieces(self, index: int) -> list[memoryview]:
        """The pieces of tensor ``index`` (empty list for an empty tensor)."""
        return self._pieces[index]

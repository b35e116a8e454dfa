"""Dense payloads as the PS receives them: whole arrays or element-aligned segments.

A streamed gradient arrives in chunks; copying them into one array would cost a
pass over memory.  :class:`Segments` keeps them as views and lets elementwise
code (update rules, assignment) run segment by segment on the matching slices
of the variable's flat buffer, which gives the same result as one big array.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from psflow.errors import InvalidArgumentError
from psflow.wire.codec import c_contiguous

__all__ = ["Segments", "as_segments", "check_extent", "segments_from_pieces"]


class Segments:
    """A dense tensor given as consecutive flat pieces.

    Args:
        dtype: element type of every piece.
        shape: the logical shape of the whole tensor.
        parts: ``(element_offset, 1-D array)`` in order, covering every element once.
    """

    __slots__ = ("dtype", "parts", "shape")

    def __init__(
        self, dtype: np.dtype, shape: Sequence[int], parts: list[tuple[int, np.ndarray]]
    ) -> None:
        self.dtype = np.dtype(dtype)
        self.shape = tuple(int(d) for d in shape)
        self.parts = parts

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Number of bytes."""
        return self.size * self.dtype.itemsize

    def __iter__(self) -> Iterator[tuple[int, np.ndarray]]:
        return iter(self.parts)

    def to_array(self) -> np.ndarray:
        """One contiguous array (a view when there is a single piece)."""
        if len(self.parts) == 1:
            return self.parts[0][1].reshape(self.shape)
        out = np.empty(self.size, self.dtype)
        for offset, part in self.parts:
            out[offset : offset + part.size] = part
        return out.reshape(self.shape)


def as_segments(value: Any) -> Segments:
    """Wraps an array (or returns ``Segments`` unchanged)."""
    if isinstance(value, Segments):
        return value
    arr = c_contiguous(value)
    return Segments(arr.dtype, arr.shape, [(0, arr.reshape(-1))])


def check_extent(shape: Sequence[int], itemsize: int, limit: int, *, what: str) -> None:
    """Refuses an empty shape whose non-zero dimensions alone would exceed ``limit`` bytes.

    A zero dimension makes a tensor empty, but NumPy still refuses to build an
    array whose other dimensions overflow its index type (``[0, 2**63 - 1]``),
    so such a shape is bad input however few bytes it holds.

    Raises:
        InvalidArgumentError: the product of the non-zero dimensions times
            ``itemsize`` is above ``limit`` (quoted with the shape).
    """
    if all(shape):
        return  # not empty: its byte count is its extent, checked by the caller
    extent = math.prod(max(int(d), 1) for d in shape) * int(itemsize)
    if extent > limit:
        raise InvalidArgumentError(
            f"{what} has shape {tuple(shape)}: its non-zero dimensions span {extent} bytes, "
            f"above the limit of {limit} even though the tensor is empty"
        )


def segments_from_pieces(
    dtype: np.dtype, shape: Sequence[int], pieces: Sequence[memoryview], *, what: str
) -> Segments:
    """Views received byte pieces as element segments (joining misaligned ones).

    Raises:
        InvalidArgumentError: the byte count does not match shape and dtype, or
            a bool tensor holds a byte other than 0 or 1.
    """
    dtype = np.dtype(dtype)
    shape = tuple(shape)
    expected = math.prod(shape) * dtype.itemsize
    got = sum(len(p) for p in pieces)
    if got != expected:
        raise InvalidArgumentError(
            f"{what} of shape {shape} and dtype {dtype.name} needs {expected} bytes, got {got}"
        )
    if any(len(p) % dtype.itemsize for p in pieces):
        pieces = [memoryview(b"".join(pieces))]
    parts = []
    offset = 0
    for p in pieces:
        arr = np.frombuffer(p, dtype=dtype)
        if dtype == np.bool_ and arr.size and arr.view(np.uint8).max() > 1:
            raise InvalidArgumentError(f"{what} of dtype bool holds a byte other than 0 or 1")
        parts.append((offset, arr))
        offset += arr.size
    if not parts:
        parts = [(0, np.empty(0, dtype))]
    return Segments(dtype, shape, parts)

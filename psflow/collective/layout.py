"""Packing: how a call's tensors become flat buffers, packs, chunks and sub-chunks.

The tensors of one call are grouped by dtype; each group is one flat *buffer*
(the tensors' elements one after the other).  The buffer is never built by
copying large tensors: it is a list of *segments*, each a flattened view of one
tensor, except that runs of small tensors (< ``coalesce_bytes`` each) are
copied into one staging segment, so that a model's many biases cost one
elementwise call, not hundreds.

A group is cut into *packs* of at most ``bytes_per_pack`` bytes (one pack when
0); an algorithm reduces each pack on its own.  Each pack is split into N
*chunks* (one per rank) and each chunk into K *sub-chunks* of about
``subchunk_bytes``: the unit of work and of pipelining.  Splits follow
``numpy.array_split``: ``n`` elements in ``k`` parts give the first ``n % k``
parts one element more than the others.

A :class:`Layout` depends only on the call's shapes and dtypes and the number of
replicas, so it is computed once and cached.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Sequence

import numpy as np

Piece = tuple[int, int, int]
"""``(segment, lo, hi)``: elements ``lo:hi`` of one flat segment."""


def split_sizes(n: int, k: int) -> list[int]:
    """Sizes of ``n`` elements split in ``k`` parts, ``numpy.array_split``'s rule."""
    q, r = divmod(n, k)
    return [q + 1] * r + [q] * (k - r)


def split_range(start: int, stop: int, k: int) -> list[tuple[int, int]]:
    """``[start, stop)`` split in ``k`` consecutive ranges (array_split's rule)."""
    out = []
    pos = start
    for size in split_sizes(stop - start, k):
        out.append((pos, pos + size))
        pos += size
    return out


@dataclasses.dataclass(frozen=True)
class Segment:
    """A contiguous run of a group's buffer backed by one flat array per replica.

    Attributes:
        group: the dtype group it belongs to.
        start: its first element in the group's buffer.
        size: its number of elements.
        tensors: the tensor indices it holds, in order (more than one: a staging copy).
    """

    group: int
    start: int
    size: int
    tensors: tuple[int, ...]

    @property
    def staged(self) -> bool:
        """Whether the segment is a staging copy of several small tensors."""
        return len(self.tensors) > 1


@dataclasses.dataclass(frozen=True)
class Pack:
    """One independently reduced range of a group's buffer.

    Attributes:
        group: the dtype group.
        start, stop: the element range in the group's buffer.
        num_sub: K, sub-chunks per chunk (the same for every chunk of the pack).
        pieces: ``pieces[c][j]``, the segment pieces of sub-chunk ``j`` of chunk ``c``.
        nbytes: ``nbytes[c][j]``, the bytes of that sub-chunk.
        chunk_bytes: bytes of each of the N chunks.
    """

    group: int
    start: int
    stop: int
    num_sub: int
    pieces: tuple[tuple[tuple[Piece, ...], ...], ...]
    nbytes: tuple[tuple[int, ...], ...]
    chunk_bytes: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Group:
    """The tensors of one dtype, in call order, and where each sits in the buffer."""

    dtype: np.dtype
    tensors: tuple[int, ...]
    offsets: tuple[int, ...]
    size: int

    @property
    def nbytes(self) -> int:
        """Bytes of the group's buffer."""
        return self.size * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where every element of a call goes; see the module docstring.

    Attributes:
        num_replicas: N.
        shapes, dtypes: of each tensor index.
        groups: one per dtype, in order of first appearance.
        segments: every segment, all groups, in buffer order.
        packs: every pack, all groups.
        tensor_place: for each tensor, ``(group, offset in group)``; None for empty tensors.
    """

    num_replicas: int
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]
    groups: tuple[Group, ...]
    segments: tuple[Segment, ...]
    packs: tuple[Pack, ...]
    tensor_place: tuple[tuple[int, int] | None, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of one replica's data (the S of algbw = S/t)."""
        return sum(g.nbytes for g in self.groups)


def build_layout(
    shapes: Sequence[tuple[int, ...]],
    dtypes: Sequence[np.dtype],
    num_replicas: int,
    bytes_per_pack: int = 0,
    subchunk_bytes: int = 512 << 10,
    coalesce_bytes: int = 64 << 10,
) -> Layout:
    """Computes the layout of one call (pure: no arrays are touched).

    Args:
        shapes, dtypes: of each tensor, index by index.
        num_replicas: N, the number of chunks per pack.
        bytes_per_pack: pack size limit, 0 for one pack per dtype.
        subchunk_bytes: target size of a sub-chunk.
        coalesce_bytes: tensors smaller than this are staged together.
    """
    sizes = [math.prod(s) for s in shapes]
    order: dict[np.dtype, list[int]] = {}
    for i, dt in enumerate(dtypes):
        if sizes[i]:
            order.setdefault(np.dtype(dt), []).append(i)
    groups: list[Group] = []
    segments: list[Segment] = []
    packs: list[Pack] = []
    place: list[tuple[int, int] | None] = [None] * len(shapes)
    for g, (dtype, idx) in enumerate(order.items()):
        offsets, pos = [], 0
        for i in idx:
            offsets.append(pos)
            place[i] = (g, pos)
            pos += sizes[i]
        groups.append(Group(dtype, tuple(idx), tuple(offsets), pos))
        first_seg = len(segments)
        segments.extend(_segments(g, idx, offsets, sizes, dtype.itemsize, coalesce_bytes))
        group_segs = segments[first_seg:]
        starts = [s.start for s in group_segs]
        itemsize = dtype.itemsize
        per_pack = pos if bytes_per_pack <= 0 else max(1, bytes_per_pack // itemsize)
        sub_elems = max(1, subchunk_bytes // itemsize)
        for p0 in range(0, pos, per_pack):
            p1 = min(pos, p0 + per_pack)
            chunks = split_range(p0, p1, num_replicas)
            k = max(1, -(-max(b - a for a, b in chunks) // sub_elems))
            pieces, nbytes = [], []
            for a, b in chunks:
                subs = split_range(a, b, k)
                pieces.append(
                    tuple(_pieces(lo, hi, starts, group_segs, first_seg) for lo, hi in subs)
                )
                nbytes.append(tuple((hi - lo) * itemsize for lo, hi in subs))
            packs.append(
                Pack(
                    group=g,
                    start=p0,
                    stop=p1,
                    num_sub=k,
                    pieces=tuple(pieces),
                    nbytes=tuple(nbytes),
                    chunk_bytes=tuple((b - a) * itemsize for a, b in chunks),
                )
            )
    return Layout(
        num_replicas=num_replicas,
        shapes=tuple(tuple(s) for s in shapes),
        dtypes=tuple(np.dtype(d) for d in dtypes),
        groups=tuple(groups),
        segments=tuple(segments),
        packs=tuple(packs),
        tensor_place=tuple(place),
    )


def _segments(
    g: int, idx: list[int], offsets: list[int], sizes: list[int], itemsize: int, small: int
) -> list[Segment]:
    """Big tensors get a segment each; consecutive small ones share one."""
    out: list[Segment] = []
    run: list[int] = []  # positions in idx of the current run of small tensors

    def flush() -> None:
        if run:
            start = offsets[run[0]]
            size = sum(sizes[idx[k]] for k in run)
            out.append(Segment(g, start, size, tuple(idx[k] for k in run)))
            run.clear()

    for k, i in enumerate(idx):
        if sizes[i] * itemsize < small:
            run.append(k)
        else:
            flush()
            out.append(Segment(g, offsets[k], sizes[i], (i,)))
    flush()
    return out


def _pieces(
    lo: int, hi: int, starts: list[int], segs: list[Segment], first_seg: int
) -> tuple[Piece, ...]:
    """The segment pieces covering group elements ``[lo, hi)``."""
    out = []
    k = bisect.bisect_right(starts, lo) - 1
    while lo < hi:
        seg = segs[k]
        end = min(hi, seg.start + seg.size)
        if end > lo:
            out.append((first_seg + k, lo - seg.start, end - seg.start))
        lo = end
        k += 1
    return tuple(out)

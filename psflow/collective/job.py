"""A prepared collective: its buffers, and one program per rank.

An algorithm turns a validated call into a :class:`Job`.  ``job.program(s, r)``
is a generator doing rank ``r``'s share of the work, one *unit* per ``yield``;
it waits for other ranks' units through the :class:`~.session.Session` ``s``.
The same job runs from N replica threads (:class:`~.communicator.Communicator`)
or from a few pool threads (a batch call), see :mod:`.executor`.

:class:`ReductionBuffers` binds a :class:`~.layout.Layout` to a call's arrays:
each replica's input and output as flat segment arrays, the result arrays the
caller gets back, and the staging copies made on the way.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from typing import Any

import numpy as np

from psflow.collective.buffers import BufferPool
from psflow.collective.layout import Layout
from psflow.collective.session import Session


class Job(abc.ABC):
    """One collective call, ready to run.

    Attributes:
        num_ranks: number of rank programs.
        kernels: the elementwise kernels (NumPy or CuPy).
        nbytes: bytes of one replica's data (for algbw).
    """

    num_ranks: int
    kernels: Any
    nbytes: int = 0

    @abc.abstractmethod
    def program(self, session: Session, rank: int) -> Iterator[None]:
        """Rank ``rank``'s work, one unit per ``yield``.

        Every dependency on another rank's unit ``u`` is a ``session.wait`` on
        a unit numbered below the waiting unit's own number, so the programs can
        also be interleaved unit by unit on fewer threads than ranks.
        """

    @abc.abstractmethod
    def units(self, rank: int) -> int:
        """How many units rank ``rank``'s program yields."""

    def finish(self, session: Session, rank: int) -> None:
        """Waits until ``rank`` may return: by default, until every rank is done.

        A rank must not return while another rank may still read its inputs or
        write its outputs; algorithms with local dependencies wait for fewer ranks.
        """
        others = [q for q in range(self.num_ranks) if q != rank]
        session.wait_finished(rank, others, [self.units(q) for q in others])
        self.kernels.synchronize(rank)

    @abc.abstractmethod
    def result(self, rank: int) -> Any:
        """What the call returns on rank ``rank``."""


class ReductionBuffers:
    """A layout bound to one call's arrays.

    Attributes:
        inputs: ``inputs[q][s]``, replica ``q``'s flat array for segment ``s``.
        outputs: ``outputs[q][s]``, where the reduced segment goes.
        results: ``results[q]``, the arrays returned to replica ``q``.
        in_place: ``in_place[q][s]``, whether a segment's output is its input (``out``
            passed the input array itself).

    With ``out=None`` each replica's results are views of one new buffer per
    dtype (taken from ``pool`` on NumPy), so no unpacking copy is needed.  With
    ``out`` given the results are written into those arrays; ``out`` may be the
    inputs themselves (in place).  Staged segments (runs of small tensors) are
    copied into a private buffer first, reduced in it in place, and copied back.
    """

    def __init__(
        self,
        layout: Layout,
        rows: list[list[Any]],
        kernels: Any,
        out: list[list[Any]] | None,
        pool: BufferPool | None,
        ranks_needing_results: list[int] | None = None,
    ) -> None:
        self.layout = layout
        n = len(rows)
        keep = set(range(n) if ranks_needing_results is None else ranks_needing_results)
        self.inputs: list[list[Any]] = []
        self.outputs: list[list[Any]] = []
        self.results: list[list[Any]] = []
        self._copy_back: list[list[tuple[Any, Any]]] = []
        self.in_place: list[list[bool]] = []
        for q, row in enumerate(rows):
            ins, outs, back = [], [], []
            group_bufs = None
            if out is None and q in keep:
                group_bufs = [_new_buffer(kernels, q, g.size, g.dtype, pool) for g in layout.groups]
            for seg in layout.segments:
                dtype = layout.groups[seg.group].dtype
                if seg.staged:
                    staged = kernels.concatenate(q, [row[i] for i in seg.tensors], seg.size, dtype)
                    ins.append(staged)
                    if out is not None:
                        outs.append(staged)  # reduced in place in our private copy
                        pos = 0
                        for i in seg.tensors:
                            size = out[q][i].size
                            back.append((out[q][i].reshape(-1), staged[pos : pos + size]))
                            pos += size
                        continue
                else:
                    ins.append(row[seg.tensors[0]].reshape(-1))
                    if out is not None:
                        outs.append(out[q][seg.tensors[0]].reshape(-1))
                        continue
                if group_bufs is not None:
                    outs.append(group_bufs[seg.group][seg.start : seg.start + seg.size])
                else:
                    outs.append(None)
            self.inputs.append(ins)
            self.outputs.append(outs)
            self.in_place.append([_is_input(out, row, q, seg) for seg in layout.segments])
            self._copy_back.append(back)
            if out is not None:
                self.results.append(list(out[q]))
            elif group_bufs is not None:
                self.results.append(tensor_views(layout, group_bufs, kernels, q))
            else:
                self.results.append([])
        kernels.prepared()

    def copy_back(self, kernels: Any, rank: int) -> None:
        """Copies rank ``rank``'s staged results into its ``out`` arrays."""
        for dst, src in self._copy_back[rank]:
            kernels.copy(rank, dst, src)


def _is_input(out: list[list[Any]] | None, row: list[Any], q: int, seg: Any) -> bool:
    return out is not None and not seg.staged and out[q][seg.tensors[0]] is row[seg.tensors[0]]


def _new_buffer(kernels: Any, rank: int, size: int, dtype: np.dtype, pool: BufferPool | None):
    if pool is not None and not kernels.is_gpu:
        return pool.take(size * dtype.itemsize).view(dtype)
    return kernels.empty(rank, size, dtype)


def tensor_views(layout: Layout, bufs: list[Any], kernels: Any, rank: int) -> list[Any]:
    """Each tensor of ``layout`` as a view of its group's flat buffer in ``bufs``."""
    out = []
    for shape, dtype, place in zip(layout.shapes, layout.dtypes, layout.tensor_place, strict=True):
        if place is None:  # an empty tensor
            out.append(kernels.empty(rank, 0, dtype).reshape(shape))
            continue
        g, off = place
        size = 1
        for d in shape:
            size *= d
        out.append(bufs[g][off : off + size].reshape(shape))
    return out

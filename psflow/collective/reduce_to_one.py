"""Reduction to one device: the simple baseline.

Phase 1 sums every replica's input into the destination replica's output
(``out_d = in_d + in_q1 + in_q2 + ...``, the other replicas in rank order, so
the result does not depend on how the work is split).  Phase 2 copies the sum
to every other replica.  The destination receives ``(N-1) * S`` bytes and sends
``(N-1) * S``: no bandwidth optimisation, which is the point of a baseline.

On logical CPU devices the phase-1 sum is split by chunk over the replicas'
threads (chunk c computed by rank c), as the memory is shared; on GPUs the
destination's stream does all of it.  The same job, without phase 2, is every
implementation's :meth:`~psflow.collective.api.CrossDeviceOps.reduce`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from psflow.collective.api import CrossDeviceOps
from psflow.collective.arrays import check_rank, kernels_for
from psflow.collective.job import Job, ReductionBuffers
from psflow.collective.layout import Layout
from psflow.collective.options import CommunicationOptions
from psflow.collective.reduce_op import ReduceOp
from psflow.collective.session import Session


class ReductionToOneDevice(CrossDeviceOps):
    """All-reduce by summing on one replica and broadcasting copies.

    Args:
        destination_replica: the replica that holds the sum (TensorFlow's
            ``reduce_to_device``), 0 by default.
        **kwargs: see :class:`~psflow.collective.api.CrossDeviceOps`.

    Example:
        >>> import numpy as np
        >>> ops = ReductionToOneDevice()
        >>> ops.all_reduce([[np.ones(2)], [np.ones(2)]], "mean")[1][0]
        array([1., 1.])
    """

    name = "reduce_to_one"

    def __init__(self, destination_replica: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        check_rank(destination_replica, destination_replica + 1)
        self.destination_replica = int(destination_replica)

    def _all_reduce_job(
        self,
        layout: Layout,
        rows: list[list[Any]],
        op: ReduceOp,
        out: list[list[Any]] | None,
        options: CommunicationOptions,
    ) -> Job:
        dest = check_rank(self.destination_replica, len(rows))
        return ReduceToOneJob(layout, rows, op, dest, out, self.pool, kernels_for(rows))


class ReduceToOneJob(Job):
    """Sum on ``destination``, then (with ``broadcast``) copy to every replica."""

    def __init__(
        self,
        layout: Layout,
        rows: list[list[Any]],
        op: ReduceOp,
        destination: int,
        out: list[list[Any]] | None,
        pool: Any,
        kernels: Any,
        broadcast: bool = True,
    ) -> None:
        self.num_ranks = n = len(rows)
        self.kernels = kernels
        self.layout = layout
        self.dest = destination
        self.mean = op is ReduceOp.MEAN
        self.broadcast = broadcast
        self.nbytes = layout.nbytes
        self.buffers = ReductionBuffers(
            layout, rows, kernels, out, pool, None if broadcast else [destination]
        )
        # Which rank sums chunk c: its own rank on CPUs, the destination on GPUs.
        self.owner = [destination if kernels.is_gpu else c for c in range(n)]
        self.owned = [[c for c in range(n) if self.owner[c] == r] for r in range(n)]
        # bases[r][p]: rank r's first unit of pack p.
        self.bases: list[list[int]] = []
        for r in range(n):
            pos, row = 0, []
            for pack in layout.packs:
                row.append(pos)
                pos += (len(self.owned[r]) + (n if broadcast else 0)) * pack.num_sub
            row.append(pos)
            self.bases.append(row)

    def units(self, rank: int) -> int:
        """Units of rank ``rank``: its chunks' sub-chunks, then N chunks' to copy."""
        return self.bases[rank][-1]

    def program(self, session: Session, rank: int) -> Iterator[None]:
        """Rank ``rank``'s part: sum its chunks into the destination, then copy the rest."""
        n, r, d, k = self.num_ranks, rank, self.dest, self.kernels
        ins, outs = self.buffers.inputs, self.buffers.outputs
        others = [q for q in range(n) if q != d]
        for p, pack in enumerate(self.layout.packs):
            kk = pack.num_sub
            # Phase 1: out_d[c] = in_d[c] + in_q1[c] + ... for the chunks this rank owns.
            for c in self.owned[r]:
                for j in range(kk):
                    for s, lo, hi in pack.pieces[c][j]:
                        o = outs[d][s][lo:hi]
                        if not others:
                            if not self.buffers.in_place[d][s]:
                                k.copy(r, o, ins[d][s][lo:hi])
                            continue
                        # in_d first: with out == inputs, out_d is in_d, read before written
                        k.add(r, o, ins[d][s][lo:hi], ins[others[0]][s][lo:hi])
                        for q in others[1:]:
                            k.add(r, o, o, ins[q][s][lo:hi])
                        if self.mean:
                            k.divide(r, o, n)
                    for q in others:
                        session.sent(r, q, pack.nbytes[c][j])
                    yield
            if not self.broadcast:
                continue
            # Phase 2: copy each finished sub-chunk from the destination.
            for c in range(n):
                owner = self.owner[c]
                first = self.bases[owner][p] + self.owned[owner].index(c) * kk
                for j in range(kk):
                    if r != d:
                        session.wait(r, owner, first + j)
                        for s, lo, hi in pack.pieces[c][j]:
                            k.copy(r, outs[r][s][lo:hi], outs[d][s][lo:hi])
                        session.sent(r, d, pack.nbytes[c][j])
                    yield

    def finish(self, session: Session, rank: int) -> None:
        """Waits for every rank (all read the inputs; all copy from the destination)."""
        super().finish(session, rank)
        self.buffers.copy_back(self.kernels, rank)
        self.kernels.synchronize(rank)

    def result(self, rank: int) -> list[Any]:
        """Rank ``rank``'s reduced arrays (only the destination's without broadcast)."""
        return self.buffers.results[rank]

"""Ring all-reduce: reduce-scatter then all-gather, chunked and pipelined.

Each pack (see :mod:`.layout`) is split into N chunks, one per rank, and each
chunk into K sub-chunks.  Rank r's left neighbour is r-1, its right r+1 (mod N).

* Phase 1, reduce-scatter (N-1 steps).  At step s rank r *pulls* the partial sum
  of chunk ``(r-1-s) % N`` from its left neighbour and adds its own input into
  its output: ``out_r[c] = partial_{r-1}[c] + in_r[c]``.  At step 0 the
  neighbour's partial is its input itself, so nothing is copied first.  After
  the last step rank r holds the full sum of chunk ``(r+1) % N``; MEAN divides
  it here, once.
* Phase 2, all-gather (N-1 steps).  Rank r *pushes* a finished chunk into its
  right neighbour's output: first its own chunk r+1 (fused into the last
  reduce-scatter step, sub-chunk by sub-chunk, while the sum is still in
  cache), then at step s the chunk ``(r+1-s) % N`` its left neighbour pushed to
  it at step s-1.

Every chunk's sum is computed once and then copied, so all replicas hold
bitwise identical results, and rank r sends exactly the chunks rank r+1 pulls
(all but chunk r+1) plus the chunks it pushes (all but chunk r+2):
``2 * S - chunk(r+1) - chunk(r+2)`` bytes per pack, i.e. ``2(N-1)/N`` of the
buffer S when N divides it.

Work is done in units of one sub-chunk of one step, taken sub-chunk-major
(all 2N-3 steps of sub-chunk j, then sub-chunk j+1), so the ranks move through
the buffer together and a partial sum is read back soon after it is written,
from cache.  Fallback/threshold: below ``parallel_threshold_bytes`` (a batch
call) or ``replica_parallel_threshold_bytes`` (replica threads) one thread runs
every rank's units in turn (handing work between threads would cost more).
Dependencies, all on units of the same sub-chunk index j:

* reduce-scatter step s >= 1 reads the left neighbour's step s-1;
* the fused push of step N-2 overwrites the right neighbour's chunk r+1, which
  rank r+2 reads as *input* at its step 0 (outputs may be the inputs: in place);
* all-gather step s >= 1 reads what the left neighbour pushed at its step s-1
  and overwrites the right neighbour's partial of chunk ``(r+1-s)``, which rank
  r+2 reads at its reduce-scatter step s.

N == 1 is a copy (results never alias inputs unless ``out`` says so).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from psflow.collective.api import CrossDeviceOps
from psflow.collective.arrays import kernels_for
from psflow.collective.job import Job, ReductionBuffers
from psflow.collective.layout import Layout
from psflow.collective.options import CommunicationOptions
from psflow.collective.reduce_op import ReduceOp
from psflow.collective.session import Session


class RingAllReduce(CrossDeviceOps):
    """Bandwidth-optimal ring all-reduce; psflow's default on CPUs.

    Each replica sends ``2(N-1)/N`` of the buffer.  On logical CPU devices the
    "send" is a read of (or write into) the neighbour's memory, done by NumPy
    ufuncs that release the GIL, so replica threads run on all cores.  CuPy
    arrays on several GPUs run the same ring with one stream per device.

    Example:
        >>> import numpy as np
        >>> ops = RingAllReduce()
        >>> xs = [[np.arange(4.0)], [np.arange(4.0)]]
        >>> ops.all_reduce(xs)[0][0]
        array([0., 2., 4., 6.])
    """

    name = "ring"
    fuses_updates = True  # the reduce-scatter half is what reduce_and_update runs

    def _all_reduce_job(
        self,
        layout: Layout,
        rows: list[list[Any]],
        op: ReduceOp,
        out: list[list[Any]] | None,
        options: CommunicationOptions,
    ) -> Job:
        return RingAllReduceJob(layout, rows, op, out, self.pool)


class RingAllReduceJob(Job):
    """One ring all-reduce call; see the module docstring for the algorithm."""

    def __init__(
        self,
        layout: Layout,
        rows: list[list[Any]],
        op: ReduceOp,
        out: list[list[Any]] | None,
        pool: Any,
    ) -> None:
        self.num_ranks = n = len(rows)
        self.kernels = kernels_for(rows)
        self.layout = layout
        self.mean = op is ReduceOp.MEAN
        self.nbytes = layout.nbytes
        self.buffers = ReductionBuffers(layout, rows, self.kernels, out, pool)
        steps = 1 if n == 1 else 2 * n - 3  # unit steps: N-1 reduce-scatter, N-2 more gather
        self._units = sum(steps * p.num_sub for p in layout.packs)

    def units(self, rank: int) -> int:
        """Units per rank: ``(2N-3) * K`` per pack (``K`` for N == 1)."""
        return self._units

    def program(self, session: Session, rank: int) -> Iterator[None]:
        """Rank ``rank``'s share of the ring; one sub-chunk step per ``yield``."""
        n, r = self.num_ranks, rank
        add, copy, wait = self.kernels.add, self.kernels.copy, session.wait
        ins, outs = self.buffers.inputs, self.buffers.outputs
        left, right, right2 = (r - 1) % n, (r + 1) % n, (r + 2) % n
        mine, mine_in, lefts, rights = outs[r], ins[r], outs[left], outs[right]
        pulled = pushed = 0  # bytes the left neighbour sent us / we sent the right one
        base = 0  # first unit of the current pack
        for pack in self.layout.packs:
            kk = pack.num_sub
            if n == 1:  # nothing to reduce: a copy, unless in place
                for j in range(kk):
                    for s, lo, hi in pack.pieces[0][j]:
                        if not self.buffers.in_place[0][s]:
                            copy(r, mine[s][lo:hi], mine_in[s][lo:hi])
                    yield
                base += kk
                continue

            # Sub-chunk by sub-chunk (slice-major): all ranks work on sub-chunk j's ring
            # at about the same time, so partial sums are read back while still in cache.
            steps = 2 * n - 3
            for j in range(kk):
                first = base + j * steps  # unit of (sub-chunk j, step 0)

                # Phase 1: reduce-scatter; its last step also starts phase 2 (push chunk r+1).
                for step in range(n - 1):
                    c = (r - 1 - step) % n
                    src = ins[left] if step == 0 else lefts
                    if step:
                        wait(r, left, first + step - 1)
                    pieces = pack.pieces[c][j]
                    for s, lo, hi in pieces:
                        add(r, mine[s][lo:hi], src[s][lo:hi], mine_in[s][lo:hi])
                    pulled += pack.nbytes[c][j]
                    if step == n - 2:  # chunk c == r+1 is complete on this rank
                        if self.mean:
                            for s, lo, hi in pieces:
                                self.kernels.divide(r, mine[s][lo:hi], n)
                        if n > 2:
                            wait(r, right2, first)
                        for s, lo, hi in pieces:
                            copy(r, rights[s][lo:hi], mine[s][lo:hi])
                        pushed += pack.nbytes[c][j]
                    yield

                # Phase 2: all-gather, forwarding what the left neighbour pushed one step earlier.
                for step in range(1, n - 1):
                    c = (r + 1 - step) % n
                    wait(r, left, first + n - 3 + step)
                    wait(r, right2, first + step)
                    for s, lo, hi in pack.pieces[c][j]:
                        copy(r, rights[s][lo:hi], mine[s][lo:hi])
                    pushed += pack.nbytes[c][j]
                    yield
            base += steps * kk
        session.sent(r, left, pulled)
        session.sent(r, r, pushed)

    def finish(self, session: Session, rank: int) -> None:
        """Returns once the left neighbour's last push arrived and the right one is done.

        Only neighbours touch rank r's buffers: r-1 writes its outputs, r+1 reads
        its inputs and partial sums.
        """
        n = self.num_ranks
        if n > 1:
            others = sorted({(rank - 1) % n, (rank + 1) % n})
            session.wait_finished(rank, others, [self._units] * len(others))
        self.kernels.synchronize(rank)
        self.buffers.copy_back(self.kernels, rank)
        self.kernels.synchronize(rank)

    def result(self, rank: int) -> list[Any]:
        """Rank ``rank``'s reduced arrays."""
        return self.buffers.results[rank]

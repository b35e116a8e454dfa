"""Arrays some replicas do not contribute: agreeing on them inside the rendezvous.

A replica may have nothing to add for one of a collective's arrays (its batch
touched no row of an embedding shard: its gradient is ``None``). It still
passes an array there (zeros, so that every replica passes the same list) and
says with ``present[i] = False`` that it has nothing for array ``i``.  The
last replica to arrive sees every replica's flags at no extra cost and drops
the arrays no replica has: the collective works on the others, and returns
``None`` in the dropped places on every rank (TensorFlow's "no gradient").
An array present on some replicas only is reduced as usual, the zeros adding
nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from psflow import errors
from psflow.collective.job import Job
from psflow.collective.session import Session


def check_present(present: Any, count: int, where: str) -> list[bool] | None:
    """Validates one rank's flags: None (all present) or ``count`` booleans.

    Raises:
        InvalidArgumentError: not a sequence of ``count`` booleans.
    """
    if present is None:
        return None
    if not isinstance(present, (list, tuple)) or len(present) != count:
        raise errors.InvalidArgumentError(
            f"{where}: present must be a list of {count} booleans, got {present!r:.80}"
        )
    return [bool(p) for p in present]


def agreed(flags: Sequence[list[bool] | None], count: int) -> list[int]:
    """The indices of the arrays at least one rank has (all when no rank sent flags)."""
    given = [f for f in flags if f is not None]
    if len(given) < len(flags):  # a rank without flags has every array
        return list(range(count))
    return [i for i in range(count) if any(f[i] for f in given)]


class SubsetJob(Job):
    """A job over the agreed arrays, whose result has ``None`` at the dropped places.

    Args:
        inner: the job built for the arrays at ``kept``.
        kept: the original indices of the inner job's arrays.
        count: how many arrays the callers passed.
    """

    def __init__(self, inner: Job, kept: list[int], count: int) -> None:
        self.inner = inner
        self.kept = kept
        self.count = count
        self.num_ranks = inner.num_ranks
        self.kernels = inner.kernels
        self.nbytes = inner.nbytes

    def program(self, session: Session, rank: int) -> Iterator[None]:
        """The inner job's program."""
        return self.inner.program(session, rank)

    def units(self, rank: int) -> int:
        """The inner job's units."""
        return self.inner.units(rank)

    def finish(self, session: Session, rank: int) -> None:
        """The inner job's finish."""
        self.inner.finish(session, rank)

    def result(self, rank: int) -> list[Any]:
        """The inner result in the agreed places, ``None`` in the others."""
        out: list[Any] = [None] * self.count
        inner = self.inner.result(rank)
        if inner is None:  # a job whose effect is the result (reduce_and_update)
            inner = [True] * len(self.kept)
        for i, value in zip(self.kept, inner):
            out[i] = value
        return out

"""Input of an elastic group: each step cut from an example offset, re-sharded on a change.

Every worker reads the same dataset of global batches (``AutoShardPolicy.DATA``,
what ``AUTO`` means here), so where an epoch stands is one number every
worker agrees on: the examples taken so far.  Step ``k`` takes the next
global batch from there and gives global replica ``r`` of the current group
its slice (:func:`~psflow.distribute.input_lib.split_sizes`).  While the
group is as it started, the steps are the dataset's own batches.  After a
change the rest of the epoch is cut over the new members from the offset of
the step training resumes at, so every example is trained exactly once per
epoch:

* ``KEEP_PER_REPLICA``: global batches of ``per-replica batch x replicas now``
  examples, taken across the dataset's batch boundaries;
* ``KEEP_GLOBAL``: the dataset's batches, whole.

Every step boundary is a one-vector all-reduce (the group's barrier, which
also says who drains); the controller snapshots the state just before it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from psflow import backend, errors
from psflow.collective.membership import Position
from psflow.data.dataset import Dataset
from psflow.data.options import AutoShardPolicy
from psflow.distribute import input_lib
from psflow.distribute.elastic.options import BatchPolicy
from psflow.distribute.input_lib import DistributedIterator, split_sizes
from psflow.framework.tensor import to_array
from psflow.util import nest

__all__ = ["ElasticDataset"]


def _rows_from(element: Any, lo: int, hi: int | None) -> Any:
    """Rows ``lo:hi`` of every array of ``element``."""
    return nest.map_structure(lambda x: None if x is None else x[lo:hi], element)


class _Rows:
    """The epoch's examples as one stream, taken in runs of any length."""

    def __init__(self, dataset: Any) -> None:
        self._dataset = dataset
        self._it = iter(dataset)
        self._buffer: list[Any] = []  # elements (nests of arrays) not yet taken, the first partly
        self.offset = 0

    def _fill(self) -> bool:
        try:
            element = next(self._it)
        except StopIteration:
            return False
        self._buffer.append(
            nest.map_structure(lambda x: None if x is None else to_array(x), element)
        )
        return True

    @staticmethod
    def _rows(element: Any) -> int:
        return input_lib._leading(element)

    def seek(self, offset: int) -> None:
        """Moves to ``offset`` examples into the epoch (re-reading from the start if behind)."""
        if offset < self.offset:
            self._it, self._buffer, self.offset = iter(self._dataset), [], 0
        skip = offset - self.offset
        while skip > 0:
            if not self._buffer and not self._fill():
                raise errors.OutOfRangeError(f"the epoch has fewer than {offset} examples")
            first = self._buffer[0]
            n = self._rows(first)
            if n <= skip:
                self._buffer.pop(0)
                skip -= n
                self.offset += n
            else:
                self._buffer[0] = _rows_from(first, skip, None)
                self.offset += skip
                skip = 0

    def next_batch_rows(self) -> int:
        """Examples in the dataset batch the stream is at (0: the epoch is over)."""
        if not self._buffer and not self._fill():
            return 0
        return self._rows(self._buffer[0])

    def take(self, n: int) -> Any:
        """The next ``n`` examples (fewer at the end of the epoch; None when none are left)."""
        parts: list[Any] = []
        need = n
        while need > 0:
            if not self._buffer and not self._fill():
                break
            first = self._buffer[0]
            rows = self._rows(first)
            if rows <= need:
                parts.append(self._buffer.pop(0))
                need -= rows
            else:
                parts.append(_rows_from(first, 0, need))
                self._buffer[0] = _rows_from(first, need, None)
                need = 0
        if not parts:
            return None
        self.offset += n - need
        if len(parts) == 1:
            return parts[0]
        return nest.map_structure(
            lambda *xs: None if xs[0] is None else np.concatenate([np.asarray(x) for x in xs]),
            *parts,
        )


class _ElasticIterator:
    """One epoch's steps; the controller may move it (after a change) between two of them."""

    def __init__(self, dataset: ElasticDataset, epoch: int) -> None:
        self._ds = dataset
        self.epoch = epoch
        self._rows = _Rows(dataset._dataset)
        self._done = False
        self._batch: Any = None  # what the last step yielded, and where it started
        self._start = 0
        self._taken = 0

    # -- called by the controller -------------------------------------------------------
    def resume_at(self, position: Position) -> bool:
        """Moves to ``position``; False when it names the end of this epoch (no step left)."""
        offset = position.offset
        if position.epoch == self.epoch - 1:  # the previous epoch's end is this one's start
            offset = 0
        elif position.epoch == self.epoch + 1 and offset == 0:  # ... and this one's end
            return False
        elif position.epoch != self.epoch:
            raise errors.InternalError(
                f"elastic input: this worker is in epoch {self.epoch}, the group resumes in "
                f"epoch {position.epoch}"
            )
        self._rows.seek(offset)
        return self._rows.next_batch_rows() > 0

    def recut(self, position: Position) -> list[tuple[Any, Any]]:
        """The current step again, cut for the new group: ``[(old, new)]`` for substitution."""
        old = self._batch
        self.resume_at(position)
        new = self._step()
        if new is None:
            raise errors.InternalError("elastic input: the resumed step has no examples")
        return [(old, new)]

    def has_step(self) -> bool:
        """Whether this epoch has a step left from where the iterator stands."""
        return self._rows.next_batch_rows() > 0

    # -- steps -----------------------------------------------------------------------
    def _size(self) -> int:
        ctl = self._ds._controller
        natural = self._rows.next_batch_rows()
        if natural == 0:
            return 0
        if ctl.batch_policy is BatchPolicy.KEEP_GLOBAL or ctl.unchanged:
            return natural
        if ctl.per_replica_batch == 0:  # the dataset's first batch over the starting replicas
            first = _Rows(self._ds._dataset).next_batch_rows()
            ctl.per_replica_batch = math.ceil(first / ctl.initial_replicas)
        return ctl.per_replica_batch * ctl.num_replicas

    def _step(self) -> Any:
        ctl = self._ds._controller
        self._start = self._rows.offset
        size = self._size()
        element = self._rows.take(size) if size else None
        if element is None:
            return None
        rows = input_lib._leading(element)
        self._ds.global_batch_size = rows
        n_local = len(self._ds._devices)
        sizes = split_sizes(rows, ctl.num_replicas)
        parts = _slices(element, sizes, ctl.rank * n_local, n_local)
        placed = [
            nest.map_structure(
                lambda x, _d=dev: None if x is None else _tensor(backend.place(x, _d)), part
            )
            for part, dev in zip(parts, self._ds._devices)
        ]
        from psflow.distribute.values import PerReplica

        self._batch = input_lib._unwrap_single(PerReplica(placed))
        return self._batch

    def __call__(self) -> Any:
        if self._done:
            raise StopIteration
        ctl = self._ds._controller
        ctl.boundary(self, Position(ctl.completed, self.epoch, self._rows.offset))
        if not ctl.barrier(self):  # this worker drained, or the epoch ended at a re-form
            self._done = True
            raise StopIteration
        batch = self._step()
        if batch is None:
            self._done = True
            raise StopIteration
        ctl.stepped()
        return batch


def _tensor(x: Any) -> Any:
    from psflow.framework.tensor import Tensor

    return Tensor._wrap(x)


def _slices(element: Any, sizes: list[int], first: int, count: int) -> list[Any]:
    starts = np.cumsum([0, *sizes])
    return [
        nest.map_structure(
            lambda x, k=k: None if x is None else x[starts[k] : starts[k + 1]], element
        )
        for k in range(first, first + count)
    ]


class ElasticDataset:
    """A dataset of global batches, stepped by an elastic group (see the module docstring).

    Args:
        dataset: the global batches (the same on every worker).
        devices: this worker's local devices.
        controller: the strategy's elastic controller.
        policy_of: the dataset whose options give the sharding policy (Keras's sources).

    Raises:
        UnimplementedError: a sharding policy other than DATA / AUTO.
    """

    def __init__(
        self, dataset: Any, devices: list[backend.Device], controller: Any, policy_of: Any = None
    ) -> None:
        source = dataset if policy_of is None else policy_of
        if isinstance(source, Dataset):
            policy = AutoShardPolicy(source.options().experimental_distribute.auto_shard_policy)
            if policy not in (AutoShardPolicy.AUTO, AutoShardPolicy.DATA):
                raise errors.UnimplementedError(
                    f"elastic training shards by DATA only (every worker reads the same global "
                    f"batches); the dataset asks for {policy.name}"
                )
        self._dataset = dataset
        self._devices = devices
        self._controller = controller
        self._epochs = 0
        self.global_batch_size: int | None = None

    def __iter__(self) -> Iterator[Any]:
        start = self._controller.take_start()  # a worker that joined: the group's epoch, offset
        if start is not None and start.epoch >= 0:
            self._epochs = start.epoch
        self._epochs += 1
        iterator = _ElasticIterator(self, self._epochs - 1)
        if start is not None and start.epoch >= 0:
            iterator.resume_at(start)
        return DistributedIterator(iterator)

    @property
    def steps(self) -> int | None:
        """Unknown: the number of steps changes with the group."""
        return None

    @property
    def element_spec(self) -> Any:
        """The underlying dataset's element spec."""
        return getattr(self._dataset, "element_spec", None)

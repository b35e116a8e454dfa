"""Which batch each step closure of a PS ``fit`` trains: the chief hands out data.

Every step closure carries a :class:`BatchTicket`, its batch of the epoch, so
each batch is trained once per epoch whatever fails: a closure re-run on another
worker (its first worker died, froze, or is late) trains the same batch, and its
pushes carry the same request ids, so the parameter servers apply the batch once.
The epoch ends when all its batches are done, wherever they ran.

* Arrays (:class:`ArrayPlan`): batch ``i`` is the ``i``-th slice of the epoch's
  permutation (one seeded permutation per epoch, the same on every worker);
  tickets are bound when scheduled.
* Datasets (:class:`DatasetPlan`): the dataset is split into one shard per
  worker; a ticket is bound when a worker takes the closure, to the next
  position of that worker's own shard (so a worker reads its shard in order),
  or, once its shard is done, of the least advanced unfinished shard (a lost
  worker's shard is finished by the others). A worker reading a position out of
  order (a re-run, a returning worker) resumes from the recorded position.
* Dataset functions (``DatasetCreator``, ``dataset_fn``): as datasets, but
  shard ``s`` is the pipeline the function builds for ``InputContext(workers, s)``
  (:class:`FunctionReader`). They come with ``steps_per_epoch`` and their
  datasets usually ``repeat()`` forever, so there is no epoch to visit once:
  one plan runs on across epochs (each step trains the next unread position,
  once, re-run or not), and an example is seen once per pass over a shard
  only as far as the user's pipeline makes it so.

The worker side of both is a *reader* (:class:`ArrayReader`,
:class:`DatasetReader`) sent once to every worker.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Any

import numpy as np

from psflow import errors
from psflow.distribute.coordinator.remote_value import PerWorkerArgument
from psflow.framework.tensor import Tensor
from psflow.util import nest


@dataclasses.dataclass(frozen=True)
class Batch:
    """One batch of one epoch: ``index`` of the epoch (arrays) or ``position`` in ``shard``."""

    epoch: int
    index: int
    shard: int = 0


class BatchTicket(PerWorkerArgument):
    """A step closure's batch; bound once (when scheduled, or by the first worker to take it)."""

    def __init__(self, plan: Any, batch: Batch | None = None) -> None:
        self._plan = plan
        self._batch = batch
        self._bound = batch is not None
        self._lock = threading.Lock()

    def for_worker(self, worker_index: int) -> Batch | None:
        """The batch to train (the same for every attempt); None: the epoch has no more."""
        with self._lock:
            if not self._bound:
                self._batch = self._plan.bind(worker_index)
                self._bound = True
            return self._batch


class ArrayReader:
    """Worker side for arrays: batch ``i`` of an epoch is a slice of its seeded permutation."""

    def __init__(self, x: Any, y: Any, sw: Any, batch_size: int, shuffle: bool, seed: int) -> None:
        self.x, self.y, self.sw = x, y, sw
        self.n = int(nest.flatten(x)[0].shape[0])
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self._order: tuple[int, np.ndarray] | None = None

    def __getstate__(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["_order"] = None
        return d

    @property
    def num_batches(self) -> int:
        """Batches per epoch (the last one may be short)."""
        return math.ceil(self.n / self.batch_size)

    def order(self, epoch: int) -> np.ndarray:
        """The examples of ``epoch`` in training order."""
        cached = self._order
        if cached is not None and cached[0] == epoch:
            return cached[1]
        order = (
            np.random.default_rng([self.seed, epoch]).permutation(self.n)
            if self.shuffle
            else np.arange(self.n)
        )
        self._order = (epoch, order)
        return order

    def read(self, batch: Batch) -> Any:
        """The batch's ``(x, y[, sample_weight])``."""
        bs = self.batch_size
        sel = self.order(batch.epoch)[batch.index * bs : (batch.index + 1) * bs]

        def take(a: Any) -> Tensor:
            return Tensor._wrap(a[sel])

        parts = [nest.map_structure(take, self.x)]
        if self.y is not None:
            parts.append(nest.map_structure(take, self.y))
        if self.sw is not None:
            parts.append(nest.map_structure(take, self.sw))
        return tuple(parts) if len(parts) > 1 else (parts[0],)


class DatasetReader:
    """Worker side for datasets: position ``p`` of shard ``s``, reading each shard in order.

    Keeps one open iterator per shard with the position it is at; a request for
    another position re-opens (earlier position) or skips ahead (later one).
    """

    def __init__(self, dataset: Any, num_shards: int) -> None:
        self.dataset = dataset
        self.num_shards = num_shards
        self._open: dict[int, tuple[int, Any, int]] = {}  # shard -> (epoch, iterator, position)

    def __getstate__(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["_open"] = {}
        return d

    def _shard(self, shard: int) -> Any:
        if self.num_shards > 1:
            return self.dataset.shard(self.num_shards, shard)
        return self.dataset

    def read(self, batch: Batch) -> Any:
        """The batch at ``batch.index`` of its shard; None past the shard's end."""
        epoch, iterator, position = self._open.get(batch.shard, (-1, None, 0))
        if epoch != batch.epoch or position > batch.index or iterator is None:
            iterator, position = iter(self._shard(batch.shard)), 0
        try:
            while position < batch.index:  # read by another worker: skip, do not train
                next(iterator)
                position += 1
            element = next(iterator)
        except (StopIteration, errors.OutOfRangeError):
            self._open.pop(batch.shard, None)
            return None
        self._open[batch.shard] = (batch.epoch, iterator, position + 1)
        return element


class FunctionReader(DatasetReader):
    """Worker side for dataset functions: shard ``s`` is the pipeline ``dataset_fn`` builds for it.

    Pipeline ``s`` gets ``InputContext(num_shards, s, num_replicas)``, so a
    ``dataset_fn`` that shards by ``input_pipeline_id`` reads worker ``s``'s part;
    a worker finishing another's shard builds that pipeline itself. Positions
    are the same batches on every worker only when ``dataset_fn`` is
    deterministic for its context (a seeded shuffle): that is what exactly-once
    per step rests on here.
    """

    def __init__(self, dataset_fn: Any, num_shards: int, num_replicas: int) -> None:
        super().__init__(None, num_shards)
        self.dataset_fn = dataset_fn
        self.num_replicas = num_replicas

    def _shard(self, shard: int) -> Any:
        from psflow.distribute.distribute_lib import InputContext

        return self.dataset_fn(InputContext(self.num_shards, shard, self.num_replicas))


class ArrayPlan:
    """Chief side for arrays: hands out batch ``0, 1, ...`` of the epoch, bound when scheduled."""

    def __init__(self, epoch: int, num_batches: int, first: int = 0) -> None:
        self.epoch = epoch
        self.num_batches = num_batches
        self._next = max(0, int(first))  # batches before it are done (a resumed epoch)

    def exhausted(self) -> bool:
        """Whether every batch has been handed out."""
        return self._next >= self.num_batches

    def ticket(self) -> BatchTicket:
        """The next batch's ticket."""
        batch = Batch(self.epoch, self._next)
        self._next += 1
        return BatchTicket(self, batch)

    def bind(self, worker_index: int) -> Batch | None:  # tickets come bound
        raise errors.InternalError("array batches are bound when scheduled")

    def ended(self, batch: Batch) -> None:
        """Arrays know their end: nothing to record."""


class DatasetPlan:
    """Chief side for datasets: positions of per-worker shards, bound when a worker takes a step."""

    def __init__(self, epoch: int, num_shards: int, first: int = 0) -> None:
        self.epoch = epoch
        self.num_shards = num_shards
        # a resumed epoch: ``first`` positions were done, spread over the shards as the
        # workers took them (exact with one shard; with several, which were done is not
        # known, and each shard resumes at its share)
        self._next = [max(0, int(first)) // num_shards] * num_shards
        self._end: list[int | None] = [None] * num_shards
        self._lock = threading.Lock()

    def _open_shards(self) -> list[int]:
        return [s for s in range(self.num_shards) if self._end[s] is None]

    def exhausted(self) -> bool:
        """Whether every shard's end has been found."""
        with self._lock:
            return not self._open_shards()

    def ticket(self) -> BatchTicket:
        """An unbound ticket: the worker that takes it decides which shard it reads."""
        return BatchTicket(self)

    def bind(self, worker_index: int) -> Batch | None:
        """The next position of the worker's own shard, or of the least advanced open one."""
        with self._lock:
            shards = self._open_shards()
            if not shards:
                return None
            own = worker_index % self.num_shards
            shard = own if own in shards else min(shards, key=lambda s: self._next[s])
            position = self._next[shard]
            self._next[shard] += 1
            return Batch(self.epoch, position, shard)

    def ended(self, batch: Batch) -> None:
        """A reader found ``batch``'s shard ends before ``batch.index``."""
        with self._lock:
            end = self._end[batch.shard]
            self._end[batch.shard] = batch.index if end is None else min(end, batch.index)

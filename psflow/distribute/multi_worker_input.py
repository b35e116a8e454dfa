"""Distributed input across workers: auto-sharding, rebatching, and an agreed epoch end.

``experimental_distribute_dataset(dataset)`` takes a dataset of *global*
batches.  With ``W`` workers of ``L`` local replicas (``N = W * L``), each
global batch of ``b`` examples is cut as one process would cut it for ``N``
replicas (:func:`~psflow.distribute.input_lib.split_sizes`: ``ceil(b / N)``
each, the last ones what remains), and global replica ``w * L + i`` is
worker ``w``'s local replica ``i``.  The dataset's
``options().experimental_distribute.auto_shard_policy`` says what each
worker reads (TensorFlow's policies):

* ``AUTO``: ``FILE`` when the pipeline reads files (a ``TextLineDataset``,
  or one made per element by ``flat_map`` / ``interleave``) and has at least
  as many as there are workers, else ``DATA``;
* ``DATA``: every worker reads the whole dataset and keeps its replicas'
  slices of each global batch, so step ``k`` of the ``N`` replicas covers
  global batch ``k`` exactly, as one process training on it;
* ``OFF``: no sharding: every worker reads every example.  The global
  batches are still cut into ``N`` per-replica pieces, and each worker's
  replicas take the next ``L`` pieces in turn, so every worker sees the whole
  dataset (``W`` times as many steps per epoch);
* ``FILE``: each worker reads every ``W``-th file (worker ``w``: files
  ``w, w + W, ...`` of each reader's list, :func:`psflow.data.files.shard_by_files`),
  and its batches are cut into ``N`` per-replica pieces taken ``L`` at a time,
  as with ``HINT``; ``NotFoundError`` when the pipeline reads no files, and
  ``InvalidArgumentError`` with fewer files than workers (as TensorFlow);
* ``HINT``: every ``shard(SHARD_HINT, SHARD_HINT)`` in the pipeline becomes
  ``shard(num_workers, worker_index)`` (none: no sharding); each worker's
  batches are then cut into ``N`` per-replica pieces taken ``L`` at a time,
  as with ``OFF`` (TensorFlow's rebatching after a file-level shard).

Each step the workers agree, with a one-integer all-reduce, whether any of
them still has data: the epoch ends on every worker at once; a worker that
ran out earlier (``distribute_datasets_from_function`` with uneven shards)
feeds empty batches until the others are done, never a hang.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from psflow import backend, errors
from psflow.collective.cross_host import CrossHostRing
from psflow.data import files
from psflow.data.dataset import Dataset
from psflow.data.options import AutoShardPolicy
from psflow.data.ordering import replace_shard_hints
from psflow.distribute import input_lib
from psflow.distribute.input_lib import DistributedIterator, split_sizes
from psflow.distribute.values import PerReplica
from psflow.framework.tensor import Tensor, to_array
from psflow.util import nest

__all__ = ["MultiWorkerDataset", "MultiWorkerDatasetsFromFunction", "shard_policy"]

log = logging.getLogger(__name__)


def shard_policy(dataset: Any, num_workers: int = 1) -> AutoShardPolicy:
    """The policy ``dataset`` asks for, resolved: AUTO is FILE when the pipeline reads
    at least ``num_workers`` files, else DATA.

    Raises:
        NotFoundError: FILE, and the pipeline reads no files (as TensorFlow).
    """
    policy = AutoShardPolicy.AUTO  # a plain iterable of batches: as a dataset without options
    if isinstance(dataset, Dataset):
        policy = AutoShardPolicy(dataset.options().experimental_distribute.auto_shard_policy)
    if policy is AutoShardPolicy.AUTO:
        if isinstance(dataset, Dataset) and files.reads_files(dataset):
            try:
                files.shard_by_files(dataset, num_workers, 0)
            except errors.InvalidArgumentError as e:  # fewer files than workers
                log.info("auto-sharding by DATA: %s", e)
                return AutoShardPolicy.DATA
            return AutoShardPolicy.FILE
        return AutoShardPolicy.DATA
    if policy is AutoShardPolicy.FILE and not (
        isinstance(dataset, Dataset) and files.reads_files(dataset)
    ):
        files.shard_by_files(dataset, num_workers, 0)  # raises the typed error
    return policy


def _slices(element: Any, sizes: list[int], first: int, count: int) -> list[Any]:
    """Pieces ``first .. first+count-1`` of ``element`` cut by ``sizes`` along axis 0."""
    starts = np.cumsum([0, *sizes])

    def take(x: Any, lo: int, hi: int) -> Any:
        if x is None:
            return None
        arr = to_array(x)
        if arr.ndim == 0:
            raise errors.InvalidArgumentError(
                "experimental_distribute_dataset needs batched elements (a leading batch "
                f"dimension), got a scalar {x!r}"
            )
        return arr[lo:hi]

    return [
        nest.map_structure(lambda x, k=k: take(x, starts[k], starts[k + 1]), element)
        for k in range(first, first + count)
    ]


def _empty_like(element: Any) -> Any:
    return nest.map_structure(lambda x: None if x is None else to_array(x)[:0], element)


def _placed(parts: list[Any], devices: list[backend.Device]) -> Any:
    placed = [
        nest.map_structure(
            lambda x, _d=dev: None if x is None else Tensor._wrap(backend.place(to_array(x), _d)),
            part,
        )
        for part, dev in zip(parts, devices)
    ]
    return input_lib._unwrap_single(PerReplica(placed))


class _AgreedIterator:
    """Turns a worker's local step source into steps every worker takes together.

    ``local_step()`` gives this worker's per-replica parts for the next step,
    or None when it has no more.  The workers all-reduce how many still have
    data; none: the epoch is over everywhere; some: those without data feed
    empty batches shaped like their last one.
    """

    def __init__(
        self,
        local_step: Callable[[], list[Any] | None],
        devices: list[backend.Device],
        ring: CrossHostRing,
    ) -> None:
        self._local_step = local_step
        self._devices = devices
        self._ring = ring
        self._template: list[Any] | None = None
        self._done = False

    def __call__(self) -> Any:
        if self._done:
            raise StopIteration
        parts = self._local_step()
        if self._ring.size > 1:
            (busy,) = self._ring.all_reduce([np.asarray([parts is not None], np.int64)])
            if int(busy[0]) == 0:
                parts = None
            elif parts is None:
                if self._template is None:
                    raise errors.OutOfRangeError(
                        "this worker's input pipeline produced no element at all, so it cannot "
                        "feed empty batches while the other workers finish their epoch"
                    )
                parts = [_empty_like(p) for p in self._template]
        if parts is None:
            self._done = True
            raise StopIteration
        self._template = parts
        return _placed(parts, self._devices)


class MultiWorkerDataset:
    """A dataset of global batches, each cut across every worker's replicas.

    Args:
        dataset: the dataset of global batches (the same on every worker).
        devices: this worker's local devices.
        num_workers, worker: the group's size and this worker's rank.
        ring: the workers' collectives (for the epoch agreement).
        policy_of: the dataset whose options give the sharding policy, when
            ``dataset`` is a plain iterable of batches built from it (Keras's).

    Attributes:
        global_batch_size: the size of the global batch of the last step.
    """

    def __init__(
        self,
        dataset: Any,
        devices: list[backend.Device],
        num_workers: int,
        worker: int,
        ring: CrossHostRing,
        policy_of: Any = None,
    ) -> None:
        self._dataset = dataset
        self._devices = devices
        self._num_workers = num_workers
        self._worker = worker
        self._ring = ring
        self._policy = shard_policy(dataset if policy_of is None else policy_of, num_workers)
        self.global_batch_size: int | None = None

    def _worker_part(self) -> Any:
        """What this worker iterates: the dataset, with its shard hints made this
        worker's (HINT) or its files cut to this worker's (FILE)."""
        source = self._dataset
        dataset = source if isinstance(source, Dataset) else getattr(source, "dataset", None)
        if not isinstance(dataset, Dataset):
            return source
        if self._policy is AutoShardPolicy.HINT:
            dataset, _ = replace_shard_hints(dataset, self._num_workers, self._worker)
        elif self._policy is AutoShardPolicy.FILE:
            dataset = files.shard_by_files(dataset, self._num_workers, self._worker)
        else:
            return source
        rebuild = None if isinstance(source, Dataset) else getattr(source, "with_dataset", None)
        return dataset if rebuild is None else rebuild(dataset)  # Keras's batches of a dataset

    def _local_steps(self) -> Callable[[], list[Any] | None]:
        it = iter(self._worker_part())
        n_local = len(self._devices)
        n = n_local * self._num_workers
        if self._policy is AutoShardPolicy.DATA:

            def step() -> list[Any] | None:
                try:
                    element = next(it)
                except StopIteration:
                    return None
                self.global_batch_size = input_lib._leading(element)
                sizes = split_sizes(self.global_batch_size, n)
                return _slices(element, sizes, self._worker * n_local, n_local)

            return step

        pieces: list[Any] = []  # OFF, HINT, FILE: per-replica pieces, taken L at a time

        def step_off() -> list[Any] | None:
            while len(pieces) < n_local:
                try:
                    element = next(it)
                except StopIteration:
                    break
                self.global_batch_size = input_lib._leading(element)
                pieces.extend(_slices(element, split_sizes(self.global_batch_size, n), 0, n))
            if not pieces:
                return None
            taken = pieces[:n_local]
            del pieces[:n_local]
            while len(taken) < n_local:  # the last step: replicas without data get empty batches
                taken.append(_empty_like(taken[0]))
            return taken

        return step_off

    def __iter__(self) -> Iterator[Any]:
        return DistributedIterator(_AgreedIterator(self._local_steps(), self._devices, self._ring))

    @property
    def steps(self) -> int | None:
        """Steps of an epoch when the underlying source knows its length (DATA: its batches)."""
        steps = getattr(self._dataset, "steps", None)  # Keras's batch sources have it
        if steps is None or self._policy is not AutoShardPolicy.DATA:
            return None
        return steps

    @property
    def element_spec(self) -> Any:
        """The underlying dataset's element spec."""
        return getattr(self._dataset, "element_spec", None)


class MultiWorkerDatasetsFromFunction:
    """This worker's pipeline from ``dataset_fn(input_context)``; its replicas take consecutive elements."""

    def __init__(
        self,
        dataset_fn: Callable[[Any], Any],
        input_context: Any,
        devices: list[backend.Device],
        ring: CrossHostRing,
    ) -> None:
        self._dataset = dataset_fn(input_context)
        self._devices = devices
        self._ring = ring

    def __iter__(self) -> Iterator[Any]:
        it = iter(self._dataset)
        n_local = len(self._devices)

        def step() -> list[Any] | None:
            parts: list[Any] = []
            for _ in range(n_local):
                try:
                    parts.append(next(it))
                except StopIteration:
                    break
            if not parts:
                return None
            while len(parts) < n_local:
                parts.append(_empty_like(parts[0]))
            return parts

        return DistributedIterator(_AgreedIterator(step, self._devices, self._ring))

    @property
    def element_spec(self) -> Any:
        """The dataset's element spec."""
        return getattr(self._dataset, "element_spec", None)

"""Distributed datasets: global batches split across a strategy's replicas.

``experimental_distribute_dataset`` takes a dataset of *global* batches and
gives each replica its share of every batch, TensorFlow's way: every replica
but the last gets ``ceil(b / N)`` examples of a batch of ``b``, the rest get
what remains (possibly nothing). ``distribute_datasets_from_function`` instead
calls the function for the input pipeline and hands consecutive elements
(already per-replica batches) to the replicas in turn.

Example:
    ``range(6).batch(4)`` over 2 replicas yields ``[0, 1], [2, 3]`` then ``[4], [5]``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from psflow import backend, errors
from psflow.distribute.values import PerReplica
from psflow.framework.tensor import Tensor, to_array
from psflow.util import nest


def split_sizes(batch: int, num_replicas: int) -> list[int]:
    """Examples each replica gets from a global batch of ``batch`` (TF's rebatching)."""
    per = math.ceil(batch / num_replicas) if batch else 0
    return [max(0, min(per, batch - i * per)) for i in range(num_replicas)]


def _leading(element: Any) -> int:
    leaves = [x for x in nest.flatten(element) if x is not None]
    if not leaves:
        raise errors.InvalidArgumentError("Cannot distribute an element with no tensors")
    return int(to_array(leaves[0]).shape[0]) if to_array(leaves[0]).ndim else 1


def split_element(element: Any, devices: list[backend.Device]) -> PerReplica:
    """Splits one global batch into one slice per device, each placed on its device."""
    n = len(devices)
    sizes = split_sizes(_leading(element), n)
    parts = []
    start = 0
    for size, dev in zip(sizes, devices):
        sl = slice(start, start + size)
        start += size

        def take(x: Any, _sl: slice = sl, _dev: backend.Device = dev) -> Any:
            if x is None:
                return None
            arr = to_array(x)
            if arr.ndim == 0:
                raise errors.InvalidArgumentError(
                    "experimental_distribute_dataset needs batched elements (a leading batch "
                    f"dimension), got a scalar {x!r}"
                )
            # on its replica's device: a GPU batch slice for a CPU replica comes to the host
            return Tensor._wrap(backend.place(arr[_sl], _dev))

        parts.append(nest.map_structure(take, element))
    return PerReplica(parts)


def _on_device(x: Any, dev: backend.Device) -> Any:
    """``x`` as a tensor on ``dev`` (unchanged when it is there already)."""
    if x is None:
        return None
    arr = to_array(x)
    placed = backend.place(arr, dev)
    return x if placed is arr and isinstance(x, Tensor) else Tensor._wrap(placed)


class DistributedIterator:
    """Yields one :class:`PerReplica` batch per step."""

    def __init__(self, next_fn: Callable[[], PerReplica]) -> None:
        self._next = next_fn

    def __iter__(self) -> DistributedIterator:
        return self

    def __next__(self) -> Any:
        return self._next()

    def get_next(self) -> Any:
        """The next per-replica batch.

        Raises:
            OutOfRangeError: the dataset is exhausted.
        """
        try:
            return self._next()
        except StopIteration:
            raise errors.OutOfRangeError("End of sequence") from None


def _unwrap_single(value: PerReplica) -> Any:
    """One replica: the bare element; several: the element's structure with PerReplica leaves.

    ``x, y = next(iterator)`` then unpacks as in TensorFlow, and ``strategy.run``
    gives each replica its own component.
    """
    from psflow.distribute.values import regroup

    return value.values[0] if len(value.values) == 1 else regroup(list(value.values))


class DistributedDataset:
    """A dataset of global batches, split across replicas at each step."""

    def __init__(self, dataset: Any, devices: list[backend.Device]) -> None:
        self._dataset = dataset
        self._devices = devices

    def __iter__(self) -> DistributedIterator:
        it = iter(self._dataset)
        devices = self._devices

        def next_fn() -> Any:
            return _unwrap_single(split_element(next(it), devices))

        return DistributedIterator(next_fn)

    def cardinality(self) -> Any:
        """The underlying dataset's cardinality (steps)."""
        return self._dataset.cardinality()

    @property
    def element_spec(self) -> Any:
        """The underlying dataset's element spec."""
        return getattr(self._dataset, "element_spec", None)


class DistributedDatasetsFromFunction:
    """A per-replica-batched dataset from ``dataset_fn``; replicas take consecutive elements."""

    def __init__(
        self, dataset_fn: Callable[[Any], Any], input_context: Any, devices: list[backend.Device]
    ) -> None:
        self._dataset = dataset_fn(input_context)
        self._devices = devices

    def __iter__(self) -> DistributedIterator:
        it = iter(self._dataset)
        devices = self._devices

        def next_fn() -> Any:
            parts = []
            for dev in devices:
                try:
                    element = next(it)
                except StopIteration:
                    if not parts:
                        raise
                    # the last step: replicas without data get empty batches
                    element = nest.map_structure(lambda x: Tensor._wrap(to_array(x)[:0]), parts[0])
                parts.append(
                    nest.map_structure(
                        lambda x, _d=dev: _on_device(x, _d),
                        element,
                    )
                )
            return _unwrap_single(PerReplica(parts))

        return DistributedIterator(next_fn)

    def cardinality(self) -> Any:
        """Steps: the dataset's elements divided by the replicas (rounded up)."""
        import numpy as np

        card = int(self._dataset.cardinality())
        if card < 0:
            return Tensor._wrap(np.asarray(card, dtype=np.int64))
        return Tensor._wrap(np.asarray(math.ceil(card / len(self._devices)), dtype=np.int64))


class DatasetFunction:
    """A function that builds an input pipeline from an :class:`InputContext`.

    The common type of what ``fit`` accepts as "a dataset function": Keras's
    ``DatasetCreator`` and what ``ParameterServerStrategy.distribute_datasets_from_function``
    returns. Each input pipeline (each worker, under ParameterServerStrategy)
    calls it with its own context and reads the dataset it returns.

    Args:
        dataset_fn: ``dataset_fn(input_context) -> dataset``.

    Raises:
        TypeError: ``dataset_fn`` is not callable (names what it is).
    """

    def __init__(self, dataset_fn: Callable[[Any], Any]) -> None:
        if not callable(dataset_fn):
            raise TypeError(
                f"dataset_fn must be a callable taking an InputContext, got "
                f"{type(dataset_fn).__name__}: {dataset_fn!r}"
            )
        self.dataset_fn = dataset_fn

    def __call__(self, input_context: Any) -> Any:
        """The dataset for ``input_context``'s pipeline."""
        return self.dataset_fn(input_context)

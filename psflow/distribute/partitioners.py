"""Variable partitioners (``tf.distribute.experimental.partitioners``), TensorFlow's formulas.

A partitioner maps a variable's shape and dtype to the number of shards along
axis 0 (returned as a list with 1 for the other axes). The shards split the
rows TensorFlow's "div" way: the first ``rows % n`` shards get one extra row,
so 13 rows in 5 shards are ``[3, 3, 3, 2, 2]``.

Example:
    >>> from psflow.distribute.partitioners import FixedShardsPartitioner, shard_sizes
    >>> FixedShardsPartitioner(num_shards=2)(shape=(10, 3), dtype="float32")
    [2, 1]
    >>> shard_sizes(13, 5)
    [3, 3, 3, 2, 2]
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from psflow import dtypes, errors


def _shape(shape: Any) -> tuple[int, ...]:
    dims = tuple(int(d) for d in shape)
    if not dims:
        raise errors.InvalidArgumentError("A scalar variable cannot be partitioned")
    if any(d < 0 for d in dims):
        raise errors.InvalidArgumentError(f"Cannot partition a variable of shape {list(dims)}")
    return dims


def _bytes_per_element(dtype: Any, bytes_per_string: int) -> int:
    if isinstance(dtype, str) and dtype == "string":
        return bytes_per_string
    return dtypes.as_dtype(dtype).size


def shard_sizes(rows: int, num_shards: int) -> list[int]:
    """Rows per shard under the "div" split: the first ``rows % n`` shards get one more."""
    if num_shards < 1:
        raise errors.InvalidArgumentError(f"num_shards must be >= 1, got {num_shards}")
    base, extra = divmod(rows, num_shards)
    return [base + (1 if i < extra else 0) for i in range(num_shards)]


class Partitioner:
    """Base class: ``partitioner(shape, dtype, axis=0) -> [num_shards, 1, ...]``."""

    def __call__(self, shape: Any, dtype: Any, axis: int = 0) -> list[int]:
        raise NotImplementedError


class FixedShardsPartitioner(Partitioner):
    """A fixed number of shards (at most one per row).

    Raises:
        InvalidArgumentError: ``num_shards`` < 1.
    """

    def __init__(self, num_shards: int) -> None:
        if int(num_shards) < 1:
            raise errors.InvalidArgumentError(f"num_shards must be >= 1, got {num_shards}")
        self._num_shards = int(num_shards)

    def __call__(self, shape: Any, dtype: Any, axis: int = 0) -> list[int]:
        dims = _shape(shape)
        out = [1] * len(dims)
        out[axis] = min(self._num_shards, dims[axis])
        return out


class MinSizePartitioner(Partitioner):
    """As many shards as keep each at least ``min_shard_bytes``, at most ``max_shards``.

    Shards: ``max(1, min(rows, max_shards, ceil(total_bytes / min_shard_bytes)))``.
    """

    def __init__(
        self, min_shard_bytes: int = 256 << 10, max_shards: int = 1, bytes_per_string: int = 16
    ) -> None:
        if min_shard_bytes < 1:
            raise errors.InvalidArgumentError(
                f"min_shard_bytes must be >= 1, got {min_shard_bytes}"
            )
        if max_shards < 1:
            raise errors.InvalidArgumentError(f"max_shards must be >= 1, got {max_shards}")
        if bytes_per_string < 1:
            raise errors.InvalidArgumentError(
                f"bytes_per_string must be >= 1, got {bytes_per_string}"
            )
        self._min_shard_bytes = min_shard_bytes
        self._max_shards = max_shards
        self._bytes_per_string = bytes_per_string

    def __call__(self, shape: Any, dtype: Any, axis: int = 0) -> list[int]:
        dims = _shape(shape)
        total = int(np.prod(dims, dtype=np.int64)) * _bytes_per_element(
            dtype, self._bytes_per_string
        )
        out = [1] * len(dims)
        out[axis] = max(
            1, min(dims[axis], self._max_shards, int(math.ceil(total / self._min_shard_bytes)))
        )
        return out


class MaxSizePartitioner(Partitioner):
    """As few shards as keep each at most ``max_shard_bytes`` (rows are not split), capped by ``max_shards``.

    Rows per shard: ``max(1, floor(max_shard_bytes / bytes_per_row))``;
    shards: ``ceil(rows / rows_per_shard)``.
    """

    def __init__(
        self, max_shard_bytes: int, max_shards: int | None = None, bytes_per_string: int = 16
    ) -> None:
        if max_shard_bytes < 1:
            raise errors.InvalidArgumentError(
                f"max_shard_bytes must be >= 1, got {max_shard_bytes}"
            )
        if max_shards is not None and max_shards < 1:
            raise errors.InvalidArgumentError(f"max_shards must be >= 1, got {max_shards}")
        if bytes_per_string < 1:
            raise errors.InvalidArgumentError(
                f"bytes_per_string must be >= 1, got {bytes_per_string}"
            )
        self._max_shard_bytes = max_shard_bytes
        self._max_shards = max_shards
        self._bytes_per_string = bytes_per_string

    def __call__(self, shape: Any, dtype: Any, axis: int = 0) -> list[int]:
        dims = _shape(shape)
        rows = dims[axis]
        per_row = (int(np.prod(dims, dtype=np.int64)) // rows if rows else 0) * _bytes_per_element(
            dtype, self._bytes_per_string
        )
        rows_per_shard = (
            max(1, math.floor(self._max_shard_bytes / per_row)) if per_row else max(rows, 1)
        )
        shards = int(math.ceil(rows / rows_per_shard)) if rows else 1
        if self._max_shards:
            shards = min(self._max_shards, shards)
        out = [1] * len(dims)
        out[axis] = max(shards, 1)
        return out

"""``psflow.data.experimental``: TensorFlow's ``tf.data.experimental`` names psflow supports.

Example:
    >>> import psflow as pf
    >>> ds = pf.data.Dataset.range(10).filter(lambda x: x < 5)
    >>> int(pf.data.experimental.cardinality(ds)) == pf.data.experimental.UNKNOWN_CARDINALITY
    True
    >>> int(ds.apply(pf.data.experimental.assert_cardinality(5)).cardinality())
    5
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from psflow.data.dataset import AUTOTUNE, INFINITE_CARDINALITY, UNKNOWN_CARDINALITY, Dataset
from psflow.data.iterator import Optional
from psflow.data.options import (
    AutoShardPolicy,
    AutotuneOptions,
    DistributeOptions,
    OptimizationOptions,
    ThreadingOptions,
)
from psflow.data.ordering import SHARD_HINT
from psflow.framework.tensor import Tensor


def cardinality(dataset: Dataset) -> Tensor:
    """``dataset.cardinality()``: a scalar int64 tensor (-1 infinite, -2 unknown)."""
    if not isinstance(dataset, Dataset):
        raise TypeError(f"cardinality needs a Dataset, got {dataset!r}")
    return dataset.cardinality()


def assert_cardinality(expected_cardinality: Any) -> Callable[[Dataset], Dataset]:
    """A transformation for ``Dataset.apply`` declaring the number of elements.

    The resulting dataset reports ``expected_cardinality`` and raises
    ``FailedPreconditionError`` while iterating if the count turns out different.
    """
    from psflow.data.ordering import AssertCardinalityDataset

    return lambda dataset: AssertCardinalityDataset(dataset, expected_cardinality)


__all__ = [
    "AUTOTUNE",
    "INFINITE_CARDINALITY",
    "SHARD_HINT",
    "UNKNOWN_CARDINALITY",
    "AutoShardPolicy",
    "AutotuneOptions",
    "DistributeOptions",
    "OptimizationOptions",
    "Optional",
    "ThreadingOptions",
    "assert_cardinality",
    "cardinality",
]

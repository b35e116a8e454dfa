"""``psflow.data``: tf.data-style input pipelines (``Dataset``, ``Options``, ``TensorSpec``).

Example:
    >>> import psflow as pf
    >>> ds = pf.data.Dataset.from_tensor_slices(([1, 2, 3, 4], [0, 1, 0, 1]))
    >>> ds = ds.shuffle(4, seed=7).batch(2)
    >>> [x.shape.as_list() for x, y in ds]
    [[2], [2]]
"""

from psflow.data import experimental
from psflow.data.dataset import AUTOTUNE, INFINITE_CARDINALITY, UNKNOWN_CARDINALITY, Dataset
from psflow.data.files import TextLineDataset
from psflow.data.iterator import Iterator
from psflow.data.options import Options, ThreadingOptions
from psflow.data.structure import TensorSpec

__all__ = [
    "AUTOTUNE",
    "INFINITE_CARDINALITY",
    "UNKNOWN_CARDINALITY",
    "Dataset",
    "Iterator",
    "Options",
    "TensorSpec",
    "TextLineDataset",
    "ThreadingOptions",
    "experimental",
]

"""Sparse row gradients (TensorFlow's ``tf.IndexedSlices``).

The gradient of a ``gather`` or ``embedding_lookup`` touches only the rows the
batch used; keeping it as (indices, values) lets a parameter server receive
just those rows.
"""

from __future__ import annotations

from typing import Any

from psflow import backend, dtypes


class IndexedSlices:
    """Rows ``values[i]`` of a dense tensor of ``dense_shape`` at ``indices[i]``.

    Duplicate indices mean their rows add up. Attributes hold raw arrays
    wrapped as tensors on access.

    Example:
        >>> import psflow as pf
        >>> s = pf.IndexedSlices(pf.constant([[1.0], [2.0]]), pf.constant([0, 0]), (3, 1))
        >>> pf.convert_to_tensor(s).numpy().ravel().tolist()
        [3.0, 0.0, 0.0]
    """

    __slots__ = ("_dense_shape", "_indices", "_values")

    def __init__(self, values: Any, indices: Any, dense_shape: Any) -> None:
        from psflow.framework.tensor import to_array

        self._values = to_array(values)
        self._indices = to_array(indices)
        self._dense_shape = tuple(int(d) for d in backend.to_numpy(to_array(dense_shape)).ravel())

    @classmethod
    def _raw(cls, values: Any, indices: Any, dense_shape: tuple[int, ...]) -> IndexedSlices:
        obj = cls.__new__(cls)
        obj._values, obj._indices, obj._dense_shape = values, indices, dense_shape
        return obj

    @property
    def values(self):
        """The rows, a tensor of shape ``(len(indices),) + dense_shape[1:]``."""
        from psflow.framework.tensor import Tensor

        return Tensor._wrap(self._values)

    @property
    def indices(self):
        """Row indices into the first dimension, a 1-D integer tensor."""
        from psflow.framework.tensor import Tensor

        return Tensor._wrap(self._indices)

    @property
    def dense_shape(self):
        """Shape of the dense tensor these rows belong to, a 1-D int64 tensor."""
        from psflow.framework.tensor import constant

        return constant(list(self._dense_shape), dtype=dtypes.int64)

    @property
    def dtype(self) -> dtypes.DType:
        """Element type of the values."""
        return dtypes.from_numpy(self._values.dtype)

    @property
    def shape(self):
        """The dense shape."""
        from psflow.framework.tensor import TensorShape

        return TensorShape(self._dense_shape)

    def dense_array(self) -> Any:
        """The dense array: zeros with every row of ``values`` added at its index."""
        out = backend.xp_of(self._values).zeros(self._dense_shape, dtype=self._values.dtype)
        if self._indices.size:
            backend.scatter_add(out, self._indices, self._values)
        return out

    def __repr__(self) -> str:
        return (
            f"IndexedSlices(indices={backend.to_numpy(self._indices)!r}, "
            f"values=<shape {self._values.shape}>, dense_shape={self._dense_shape})"
        )

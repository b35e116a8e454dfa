"""``Discretization``: numbers to the index of the bin they fall in."""

from __future__ import annotations

from typing import Any

import numpy as np

from psflow import errors
from psflow.framework.tensor import Tensor, TensorShape
from psflow.keras.layers.base import Layer
from psflow.keras.layers.preprocessing import _common


class Discretization(Layer):
    """Buckets numbers by ``bin_boundaries`` (Keras's ``Discretization``).

    Value ``x`` gets index ``i`` with ``boundaries[i-1] <= x < boundaries[i]``
    (0 below the first boundary, ``len(boundaries)`` from the last). ``adapt``
    with ``num_bins`` puts the boundaries at the empirical quantiles ``i/num_bins``:
    the points where the cumulative fraction ``k/N`` of the sorted data, linearly
    interpolated, reaches them. That is Keras's result exactly for data of up to
    ``1/epsilon`` values; on more, Keras subsamples first and its boundaries are
    approximate, while these are exact.

    Example:
        >>> import psflow as pf
        >>> layer = pf.keras.layers.Discretization(bin_boundaries=[0.0, 1.0, 2.0])
        >>> layer(pf.constant([[-1.5, 1.0, 3.4, 0.5]])).numpy().tolist()
        [[0, 2, 3, 1]]
    """

    def __init__(
        self,
        bin_boundaries: Any = None,
        num_bins: int | None = None,
        epsilon: float = 0.01,
        output_mode: str = "int",
        sparse: bool = False,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("dtype", "int64" if output_mode == "int" else "float32")
        super().__init__(**kwargs)
        if (bin_boundaries is None) == (num_bins is None):
            raise errors.InvalidArgumentError(
                "Discretization: pass exactly one of bin_boundaries and num_bins, got "
                f"bin_boundaries={bin_boundaries!r}, num_bins={num_bins!r}"
            )
        if num_bins is not None and (not isinstance(num_bins, (int, np.integer)) or num_bins < 1):
            raise errors.InvalidArgumentError(
                f"Discretization: num_bins must be a positive integer, got {num_bins!r}"
            )
        if sparse:
            raise errors.UnimplementedError("Discretization: sparse outputs are not implemented")
        self.output_mode = _common.check_output_mode(
            output_mode, _common.OUTPUT_MODES, "Discretization"
        )
        self.bin_boundaries = None if bin_boundaries is None else [float(b) for b in bin_boundaries]
        if self.bin_boundaries is not None and any(
            b >= c for b, c in zip(self.bin_boundaries, self.bin_boundaries[1:])
        ):
            raise errors.InvalidArgumentError(
                f"Discretization: bin_boundaries must increase, got {bin_boundaries!r}"
            )
        self.num_bins = None if num_bins is None else int(num_bins)
        self.epsilon = float(epsilon)
        self.sparse = False
        self.built = True

    def adapt(self, data: Any, batch_size: int | None = None, steps: int | None = None) -> None:
        """Sets the boundaries to the ``num_bins`` quantiles of ``data``.

        Raises:
            InvalidArgumentError: the layer was made with ``bin_boundaries``, or the
                data is empty or not numeric.
        """
        if self.num_bins is None:
            raise errors.InvalidArgumentError(
                f"{self.name}: adapt needs num_bins; this layer was given bin_boundaries"
            )
        parts = []
        for arr in _common.batches(data, steps, self.name):
            if arr.dtype.kind not in "fiu":
                raise errors.InvalidArgumentError(
                    f"{self.name}: adapt needs numbers, got elements of type {arr.dtype}"
                )
            parts.append(arr.reshape(-1).astype(np.float64))
        values = np.sort(np.concatenate(parts)) if parts else np.empty(0)
        if values.size == 0:
            raise errors.InvalidArgumentError(f"{self.name}: adapt got no data")
        cdf = np.arange(1, values.size + 1) / values.size
        targets = np.arange(1, self.num_bins) / self.num_bins
        self.bin_boundaries = np.interp(targets, cdf, values).astype(np.float32).tolist()

    def call(self, inputs: Any) -> Tensor:
        if self.bin_boundaries is None:
            raise errors.FailedPreconditionError(
                f"{self.name}: no bin boundaries; pass bin_boundaries= or call adapt first"
            )
        arr = _common.host_array(inputs, self.name)
        if arr.dtype.kind not in "fiu":
            raise errors.InvalidArgumentError(
                f"{self.name}: expected numbers, got elements of type {arr.dtype}"
            )
        edges = np.asarray(self.bin_boundaries, dtype=np.float64)
        indices = np.searchsorted(edges, arr.astype(np.float64), side="right")
        depth = len(self.bin_boundaries) + 1
        return _common.encode(indices, self.output_mode, depth, self.dtype, self.name)

    def compute_output_shape(self, input_shape: Any) -> TensorShape:
        shape = tuple(input_shape)
        if self.output_mode == "int":
            return TensorShape(shape)
        depth = (len(self.bin_boundaries) + 1) if self.bin_boundaries is not None else self.num_bins
        if (self.output_mode == "one_hot" and shape and shape[-1] == 1) or (
            self.output_mode != "one_hot" and len(shape) > 1
        ):
            shape = shape[:-1]
        return TensorShape((*shape, depth))

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "bin_boundaries": self.bin_boundaries if self.num_bins is None else None,
            "num_bins": self.num_bins,
            "epsilon": self.epsilon,
            "output_mode": self.output_mode,
            "sparse": self.sparse,
        }

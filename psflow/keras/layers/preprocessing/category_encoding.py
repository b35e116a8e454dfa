"""``CategoryEncoding``: integer ids to one-hot, multi-hot or count vectors."""

from __future__ import annotations

from typing import Any

import numpy as np

from psflow import errors
from psflow.framework.tensor import Tensor, TensorShape
from psflow.keras.layers.base import Layer
from psflow.keras.layers.preprocessing import _common


class CategoryEncoding(Layer):
    """Encodes integer ids in ``[0, num_tokens)`` (Keras's ``CategoryEncoding``).

    Example:
        >>> import psflow as pf
        >>> layer = pf.keras.layers.CategoryEncoding(num_tokens=4, output_mode="multi_hot")
        >>> layer(pf.constant([[0, 1], [0, 0], [1, 2], [3, 1]])).numpy().tolist()[0]
        [1.0, 1.0, 0.0, 0.0]
    """

    def __init__(
        self,
        num_tokens: int | None = None,
        output_mode: str = "multi_hot",
        sparse: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if not isinstance(num_tokens, (int, np.integer)) or num_tokens <= 0:
            raise errors.InvalidArgumentError(
                f"CategoryEncoding: num_tokens must be a positive integer, got {num_tokens!r}"
            )
        if sparse:
            raise errors.UnimplementedError("CategoryEncoding: sparse outputs are not implemented")
        self.num_tokens = int(num_tokens)
        output_mode = _common.LEGACY_OUTPUT_MODES.get(output_mode, output_mode)
        self.output_mode = _common.check_output_mode(
            output_mode, ("one_hot", "multi_hot", "count"), "CategoryEncoding"
        )
        self.sparse = False
        self.built = True

    def call(self, inputs: Any, count_weights: Any = None) -> Tensor:
        arr = _common.host_array(inputs, self.name)
        if arr.dtype.kind not in "iu":
            raise errors.InvalidArgumentError(
                f"{self.name}: expected integer ids, got elements of type {arr.dtype}"
            )
        weights = None
        if count_weights is not None:
            if self.output_mode != "count":
                raise errors.InvalidArgumentError(
                    f"{self.name}: count_weights needs output_mode='count', not "
                    f"{self.output_mode!r}"
                )
            weights = _common.host_array(count_weights, self.name)
            if weights.shape != arr.shape:
                raise errors.InvalidArgumentError(
                    f"{self.name}: count_weights shape {list(weights.shape)} differs from the "
                    f"inputs' {list(arr.shape)}"
                )
        return _common.encode(
            arr, self.output_mode, self.num_tokens, self.dtype, self.name, count_weights=weights
        )

    def compute_output_shape(self, input_shape: Any) -> TensorShape:
        shape = tuple(input_shape)
        if (self.output_mode == "one_hot" and shape and shape[-1] == 1) or (
            self.output_mode != "one_hot" and len(shape) > 1
        ):
            shape = shape[:-1]
        return TensorShape((*shape, self.num_tokens))

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "num_tokens": self.num_tokens,
            "output_mode": self.output_mode,
            "sparse": self.sparse,
        }

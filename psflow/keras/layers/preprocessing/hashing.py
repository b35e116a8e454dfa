"""``Hashing``: values to ``num_bins`` buckets by TensorFlow's string hashes, bit for bit.

Every value is hashed as text, as TensorFlow does: integers as their decimal
digits, floats first truncated to int64. Without a salt the hash is FarmHash
Fingerprint64 (``to_hash_bucket_fast``); with one, SipHash-2-4 keyed by it
(``to_hash_bucket_strong``). With ``mask_value``, that value goes to bin 0 and
the others to ``1 + hash % (num_bins - 1)``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from psflow import errors
from psflow.framework.tensor import Tensor, TensorShape
from psflow.keras.layers.base import Layer
from psflow.keras.layers.preprocessing import _common
from psflow.keras.layers.preprocessing.hash_functions import fingerprint64, siphash24


class Hashing(Layer):
    """Hashes strings or integers into ``num_bins`` bins (Keras's ``Hashing``).

    Example:
        >>> import psflow as pf
        >>> pf.keras.layers.Hashing(num_bins=3)(pf.constant([["A"], ["B"], ["C"]])).numpy().ravel().tolist()
        [1, 0, 1]
    """

    def __init__(
        self,
        num_bins: int,
        mask_value: Any = None,
        salt: Any = None,
        output_mode: str = "int",
        sparse: bool = False,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("dtype", "int64" if output_mode == "int" else "float32")
        super().__init__(**kwargs)
        if not isinstance(num_bins, (int, np.integer)) or num_bins <= 0:
            raise errors.InvalidArgumentError(
                f"Hashing: num_bins must be a positive integer, got {num_bins!r}"
            )
        if salt is not None and not (
            isinstance(salt, (int, np.integer))
            or (isinstance(salt, (list, tuple)) and len(salt) == 2)
        ):
            raise errors.InvalidArgumentError(
                f"Hashing: salt must be an integer or two integers, got {salt!r}"
            )
        if sparse:
            raise errors.UnimplementedError("Hashing: sparse outputs are not implemented")
        self.output_mode = _common.check_output_mode(output_mode, _common.OUTPUT_MODES, "Hashing")
        self.num_bins = int(num_bins)
        self.mask_value = mask_value
        self.salt = (
            None
            if salt is None
            else [int(salt), int(salt)]
            if isinstance(salt, (int, np.integer))
            else [int(s) for s in salt]
        )
        self.sparse = False
        self.built = True

    def _bucket(self, value: Any, bins: int) -> int:
        data = value.encode("utf-8") if isinstance(value, str) else str(int(value)).encode()
        h = fingerprint64(data) if self.salt is None else siphash24(tuple(self.salt), data)
        return h % bins

    def call(self, inputs: Any) -> Tensor:
        arr = _common.host_array(inputs, self.name)
        if arr.dtype.kind == "f":
            arr = arr.astype(np.int64)  # TensorFlow truncates floats to int64 before hashing
        elif arr.dtype.kind not in "iuO":
            raise errors.InvalidArgumentError(
                f"{self.name}: expected text or numbers, got elements of type {arr.dtype}"
            )
        masked = self.mask_value is not None and self.num_bins > 1
        bins = self.num_bins - 1 if masked else self.num_bins
        uniq, inverse = np.unique(arr.reshape(-1), return_inverse=True)
        mapped = np.empty(len(uniq), dtype=np.int64)
        for i, value in enumerate(uniq.tolist()):
            if masked and value == self.mask_value:
                mapped[i] = 0
            else:
                mapped[i] = self._bucket(value, bins) + masked
        indices = mapped[inverse].reshape(arr.shape)
        return _common.encode(indices, self.output_mode, self.num_bins, self.dtype, self.name)

    def compute_output_shape(self, input_shape: Any) -> TensorShape:
        shape = tuple(input_shape)
        if self.output_mode == "int":
            return TensorShape(shape)
        if self.output_mode == "one_hot" and shape and shape[-1] == 1:
            return TensorShape((*shape[:-1], self.num_bins))
        return TensorShape((*shape[:-1], self.num_bins))

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "num_bins": self.num_bins,
            "mask_value": self.mask_value,
            "salt": self.salt,
            "output_mode": self.output_mode,
            "sparse": self.sparse,
        }

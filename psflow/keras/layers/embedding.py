"""``Embedding``: a trainable lookup table whose gradients are sparse rows."""

from __future__ import annotations

from typing import Any

from psflow import errors
from psflow.framework.tensor import TensorShape
from psflow.keras import initializers, regularizers
from psflow.keras.layers.base import Layer
from psflow.ops import math_ops, nn_ops
from psflow.ops._core import node


class Embedding(Layer):
    """Maps integer ids in ``[0, input_dim)`` to vectors of ``output_dim``.

    Under a parameter-server strategy only the rows a batch uses are pulled,
    and only their gradients are pushed.
    """

    def __init__(
        self,
        input_dim: int,
        output_dim: int,
        embeddings_initializer: Any = "uniform",
        embeddings_regularizer: Any = None,
        embeddings_constraint: Any = None,
        mask_zero: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if int(input_dim) <= 0 or int(output_dim) <= 0:
            raise errors.InvalidArgumentError(
                f"Embedding: input_dim and output_dim must be > 0, got {input_dim} and {output_dim}"
            )
        self.input_dim, self.output_dim = int(input_dim), int(output_dim)
        init = "random_uniform" if embeddings_initializer == "uniform" else embeddings_initializer
        self.embeddings_initializer = initializers.get(init)
        self.embeddings_regularizer = (
            regularizers.get(embeddings_regularizer) if embeddings_regularizer else None
        )
        self.embeddings_constraint = embeddings_constraint
        self.mask_zero = mask_zero
        if self._batch_input_shape is not None:
            self._maybe_build(self._batch_input_shape)

    def build(self, input_shape: Any = None) -> None:
        self.embeddings = self.add_weight(
            "embeddings",
            (self.input_dim, self.output_dim),
            initializer=self.embeddings_initializer,
            regularizer=self.embeddings_regularizer,
            constraint=self.embeddings_constraint,
        )
        # On parameter servers, a table is read and updated by the rows a batch uses.
        for table in getattr(self.embeddings, "_shard_variables", None) or [self.embeddings]:
            mark = getattr(table, "_mark_sparse_access", None)
            if mark is not None:
                mark()
        self.built = True

    def call(self, inputs: Any) -> Any:
        ids = node(inputs)
        if ids._array().dtype.kind == "f":
            ids = math_ops.cast(ids, "int32")
        elif ids._array().dtype.kind not in "iu":
            raise errors.InvalidArgumentError(
                f"{self.name}: ids must be integers, got {ids.dtype.name}"
            )
        return nn_ops.embedding_lookup(self.embeddings, ids)

    def compute_output_shape(self, input_shape: Any) -> TensorShape:
        return TensorShape((*tuple(input_shape), self.output_dim))

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "input_dim": self.input_dim, "output_dim": self.output_dim}

"""A weight's gradient kept as its two factors, multiplied out where it is applied.

A matrix weight's gradient in a dense layer (or any ``x @ w``) is ``x.T @ g``:
the layer's input times the gradient of its output. Written out, the product
is a weight-sized array that the optimizer then streams through memory once
more beside the weight. :class:`ProductGradient` keeps ``x`` and ``g`` instead,
so that an optimizer can multiply them out a block of the weight's rows at a
time and update that block while its gradient is still in cache: one pass over
the weight where there were three (the product's write, then the update's reads
of the weight and the gradient), and the same numbers (each block is the
product's own rows; the update is elementwise).

Only ``Model.train_step`` and ``Optimizer.minimize`` ask for them, through
:meth:`psflow.framework.tape.GradientTape._gradient_for_update`, and only for an
optimizer that takes them (a local update, or MirroredStrategy's fused
reduce-and-update of CPU replicas); a user's ``tape.gradient`` always gets arrays.
"""

from __future__ import annotations

from typing import Any

from psflow import backend


class ProductGradient:
    """The gradient ``left.T @ right`` of a ``(left.shape[1], right.shape[1])`` weight.

    Args:
        left: the layer's input, ``(batch, fan_in)``.
        right: the gradient of the layer's output, ``(batch, fan_out)``.
    """

    __slots__ = ("left", "right")

    def __init__(self, left: Any, right: Any) -> None:
        self.left = left
        self.right = right

    @property
    def shape(self) -> tuple[int, int]:
        """The weight's (and the product's) shape."""
        return (self.left.shape[1], self.right.shape[1])

    @property
    def dtype(self) -> Any:
        """The product's dtype."""
        return self.right.dtype

    def rows(self, lo: int, hi: int, out: Any = None) -> Any:
        """Rows ``[lo, hi)`` of the product, into ``out`` if given (on NumPy arrays the caller
        holds the BLAS to one thread): the product's own values there, bitwise."""
        xp = backend.xp_of(self.right)
        return xp.matmul(self.left[:, lo:hi].T, self.right, out=out)

    def dense_array(self) -> Any:
        """The whole product, as the tape would have returned it: on NumPy arrays through
        the kernel threads (:func:`psflow.ops.kernel_pool.matmul`)."""
        import numpy as np

        if type(self.left) is np.ndarray and type(self.right) is np.ndarray:
            from psflow.ops import kernel_pool

            return kernel_pool.matmul(self.left.T, self.right)
        return self.left.T @ self.right


def multiplied_out(g: Any) -> Any:
    """``g`` as an array where it is a :class:`ProductGradient`; any other gradient as it is."""
    return g.dense_array() if type(g) is ProductGradient else g

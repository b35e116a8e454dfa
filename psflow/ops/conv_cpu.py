"""Convolution on NumPy arrays: im2col built slab by slab, the bias inside the GEMM.

Measured on the tutorial CNN's first layer (3x3, 1 -> 32 channels, batch 256)
the whole-batch form of :mod:`psflow.ops.conv_ops` spent its time outside the
matrix product: copying the patch view (an innermost loop of ``C`` elements,
one for a grey image), adding the bias, and summing the bias gradient, each a
pass over the whole output. Here:

- **im2col by slab.** The ``KH*KW`` window positions each copy one
  ``(N, OH, OW, C)`` slab of the padded input. With few channels the block is
  kept *position-major* (``(KH*KW*C, N*OH*OW)``, so each slab lands in
  contiguous memory, about 7x faster than the patch view's copy for ``C = 1``);
  otherwise row-major (``(N*OH*OW, KH*KW*C)``, each slab a ``C``-wide column
  band). The product reads either layout through a transposed view.
- **The bias as a column of ones.** The block carries one more column of ones
  and the kernel matrix one more row, the bias, so ``cols @ [W; b]`` adds the
  bias inside the GEMM (no pass over the output), and ``cols.T @ g`` gives the
  kernel gradient and, in its last row, the bias gradient (no separate sum).
- **Element-wise passes on every core.** The ReLU and its mask run on chunks of
  rows spread over :mod:`psflow.ops.kernel_pool`'s threads; the GEMMs are
  BLAS's, which already uses every core.

Shapes: ``padded`` is the padded NHWC input, ``z2`` the output as
``(N*OH*OW, F)`` rows.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from psflow.ops.kernel_pool import chunk_bounds, run_chunks
from psflow.ops.window_geometry import window_slabs

POSITION_MAJOR_MAX_CHANNELS = 4
"""Up to this many input channels the im2col block is position-major (see the module)."""


def im2col(
    padded: np.ndarray,
    kernel: tuple[int, int],
    strides: tuple[int, int],
    dilations: tuple[int, int],
    out_hw: tuple[int, int],
    ones: bool,
) -> np.ndarray:
    """The ``(N*OH*OW, KH*KW*C [+ 1])`` im2col matrix of ``padded`` (a view of either layout).

    With ``ones``, a last column of ones (for a bias row in the kernel matrix).
    """
    n, c = padded.shape[0], padded.shape[3]
    k = kernel[0] * kernel[1] * c
    width = k + 1 if ones else k
    slabs = window_slabs(out_hw, kernel, strides, dilations)
    if c <= POSITION_MAJOR_MAX_CHANNELS:
        block = np.empty((width, n, *out_hw), dtype=padded.dtype)
        for p, (_, _, rows, cols) in enumerate(slabs):
            for ch in range(c):  # a (N, OH, OW) slab per position and channel: contiguous writes
                block[p * c + ch] = padded[:, rows, cols, ch]
        if ones:
            block[k] = 1
        return block.reshape(width, -1).T
    block = np.empty((n, *out_hw, width), dtype=padded.dtype)
    for p, (_, _, rows, cols) in enumerate(slabs):
        block[..., p * c : (p + 1) * c] = padded[:, rows, cols, :]
    if ones:
        block[..., k] = 1
    return block.reshape(-1, width)


def kernel_matrix(wm: np.ndarray, bias: Any) -> np.ndarray:
    """``wm`` (``(KH*KW*C, F)``) with the bias as one more row, or ``wm`` without a bias."""
    return wm if bias is None else np.concatenate([wm, bias.reshape(1, -1)], axis=0)


def relu_in_place(z2: np.ndarray) -> None:
    """``z2 = max(z2, 0)`` on chunks of rows spread over the kernel threads."""

    def chunk(lo: int, hi: int) -> None:
        part = z2[lo:hi]
        np.maximum(part, 0, out=part)

    run_chunks(chunk, chunk_bounds(z2.shape[0], z2.strides[0]))


def relu_mask(g2: np.ndarray, z2: np.ndarray) -> np.ndarray:
    """``g2 * (z2 > 0)`` (a new array) on chunks of rows spread over the kernel threads."""
    masked = np.empty_like(g2)

    def chunk(lo: int, hi: int) -> None:
        # an explicit dtype: NumPy's mixed float-by-bool loop is several times slower
        np.multiply(g2[lo:hi], z2[lo:hi] > 0, out=masked[lo:hi], dtype=g2.dtype)

    run_chunks(chunk, chunk_bounds(g2.shape[0], 2 * g2.strides[0]))
    return masked

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
- **Chunks of whole images.** Where a batch makes several chunks
  (:func:`image_chunks`), each chunk of images runs its im2col, product and ReLU
  forward, and its ReLU mask, products and col2im backward, one after the other
  while its rows are in cache, on :mod:`psflow.ops.kernel_pool`'s threads. The
  whole-batch form made a pass through memory per step instead (the block, the
  product's output, the ReLU, the mask, the masked gradient read back by the
  kernel's product): on the tutorial CNN's first layer at batch 256 the
  chunked form took about a third less CPU for the layer's forward and backward.
  Backward rebuilds each chunk's block rather than keeping the whole batch's.
  The kernel's gradient is the chunks' partial products added in chunk order;
  the chunks are a function of the shapes only (never of the thread count), so
  the bits are too.
- **Element-wise passes on every core** where the batch is one chunk: the ReLU
  and its mask run on chunks of rows spread over the kernel threads.
- **A max pool after the convolution** (:meth:`ChunkedConv.forward_max_pool`, for
  :func:`psflow.ops.conv_ops.conv_layer_max_pool`): each chunk's output is pooled
  (and its ReLU applied) by one compiled loop while the chunk is in cache, which
  notes each window's first maximum in a byte; backward, each chunk's output
  gradient is routed from the pooled gradient through those bytes and the ReLU
  straight into the chunk's products. The whole output and its gradient are never
  made: on the tutorial CNN at batch 256 the layer pair's forward and backward took
  about 40% less wall time than the convolution and the pool apart.

Shapes: ``padded`` is the padded NHWC input, ``z2`` the output as
``(N*OH*OW, F)`` rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from psflow.ops import compiled
from psflow.ops.kernel_pool import chunk_bounds, run_chunks, run_gemm_chunks
from psflow.ops.window_geometry import add_patches, window_slabs

POSITION_MAJOR_MAX_CHANNELS = 4
"""Up to this many input channels the im2col block is position-major (see the module)."""

IMAGE_CHUNK_BYTES = 1 << 20
"""Bytes of working set (a chunk's im2col block, its output rows and their gradient)
a chunk of images aims for: about half of a recent core's L2 cache. On the tutorial
CNN's first layer at batch 256 (5 images a chunk), chunks of 2 images were slower
(more calls) and of 16 no faster."""


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
        compiled.relu_grad(g2[lo:hi], z2[lo:hi], masked[lo:hi])

    run_chunks(chunk, chunk_bounds(g2.shape[0], 2 * g2.strides[0]))
    return masked


def image_chunks(
    images: int, out_rows: int, block_width: int, out_channels: int, itemsize: int
) -> list[tuple[int, int]]:
    """``[lo, hi)`` ranges of images, each about :data:`IMAGE_CHUNK_BYTES` of working set.

    ``out_rows`` output positions per image, ``block_width`` columns of the im2col
    block. A function of the shapes only: the same chunks, and so the same bits,
    on every run and with any number of threads.
    """
    per_image = out_rows * (block_width + 2 * out_channels) * itemsize
    return chunk_bounds(images, per_image, IMAGE_CHUNK_BYTES)


class ChunkedConv:
    """``relu?(im2col(padded) @ kmat)`` and its VJP, chunk by chunk of whole images.

    Args:
        padded: the padded NHWC input (NumPy).
        kmat: the ``(KH*KW*C [+ 1], F)`` kernel matrix (:func:`kernel_matrix`);
            its extra row, if any, is the bias.
        kernel, strides, dilations, out_hw: the window geometry.
        relu: whether a ReLU follows the sum.
        bounds: the chunks of images (:func:`image_chunks`).
    """

    def __init__(
        self,
        padded: np.ndarray,
        kmat: np.ndarray,
        kernel: tuple[int, int],
        strides: tuple[int, int],
        dilations: tuple[int, int],
        out_hw: tuple[int, int],
        relu: bool,
        bounds: list[tuple[int, int]],
    ) -> None:
        self.padded, self.kmat, self.relu, self.bounds = padded, kmat, relu, bounds
        self.kernel, self.strides, self.dilations, self.out_hw = kernel, strides, dilations, out_hw
        self.k = kernel[0] * kernel[1] * padded.shape[3]
        self.ones = kmat.shape[0] == self.k + 1
        self.rows = out_hw[0] * out_hw[1]
        # a chunk's im2col block, kept from the forward pass for the kernel's gradient where
        # it is no larger than the chunk's output (few input channels: a grey image's block
        # is 10 columns against 32 outputs), else built again there
        self.keep = self.k + self.ones <= kmat.shape[1]
        self.kept: dict[int, np.ndarray] = {}

    def _block(self, lo: int, hi: int) -> np.ndarray:
        kept = self.kept.get(lo)
        if kept is not None:
            return kept
        return im2col(
            self.padded[lo:hi], self.kernel, self.strides, self.dilations, self.out_hw, self.ones
        )

    def _product(self, lo: int, hi: int, part: np.ndarray, relu: bool) -> None:
        """Chunk ``[lo, hi)``'s output rows into ``part``: its block times the kernel matrix,
        then (with ``relu``) the ReLU."""
        block = self._block(lo, hi)
        if self.keep:
            self.kept[lo] = block
        np.matmul(block, self.kmat, out=part)
        if relu:
            np.maximum(part, 0, out=part)

    def forward(self) -> np.ndarray:
        """The output as ``(N*OH*OW, F)`` rows."""
        n, rows = self.padded.shape[0], self.rows
        z2 = np.empty((n * rows, self.kmat.shape[1]), dtype=self.kmat.dtype)

        def chunk(lo: int, hi: int) -> None:
            self._product(lo, hi, z2[lo * rows : hi * rows], self.relu)

        run_gemm_chunks(chunk, self.bounds)
        return z2

    def forward_max_pool(
        self,
        fast: compiled.Kernels,
        k: tuple[int, int],
        s: tuple[int, int],
        pooled_hw: tuple[int, int],
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(pooled, idx)``: the max pool (windows ``k`` that do not overlap, strides ``s``,
        no padding) of the output, NHWC, and each window's first maximum
        (:meth:`compiled.Kernels.max_pool`). Each chunk's output is pooled while
        it is in cache; the whole output is never kept."""
        n, rows, f = self.padded.shape[0], self.rows, self.kmat.shape[1]
        pooled = np.empty((n, *pooled_hw, f), dtype=self.kmat.dtype)
        idx = np.empty(pooled.shape, dtype=np.uint8)

        def chunk(lo: int, hi: int) -> None:
            part = np.empty(((hi - lo) * rows, f), dtype=self.kmat.dtype)
            self._product(lo, hi, part, relu=False)  # the pool's loop applies the ReLU
            z = part.reshape(hi - lo, *self.out_hw, f)
            fast.max_pool(z, k, s, self.relu, pooled[lo:hi], idx[lo:hi])

        run_gemm_chunks(chunk, self.bounds)
        return pooled, idx

    def backward(
        self, g2: np.ndarray, z2: np.ndarray, need_input: bool, need_kernel: bool
    ) -> tuple[np.ndarray | None, np.ndarray | None]:
        """``(d padded, d kmat)`` for the output gradient ``g2`` (rows, as :meth:`forward`),
        None where not needed; ``z2`` is :meth:`forward`'s output (for the ReLU's mask)."""
        rows = self.rows

        def output_grad(lo: int, hi: int) -> np.ndarray:
            part = g2[lo * rows : hi * rows]
            return compiled.relu_grad(part, z2[lo * rows : hi * rows]) if self.relu else part

        return self._backward(output_grad, g2.dtype, need_input, need_kernel)

    def backward_max_pool(
        self,
        fast: compiled.Kernels,
        g: np.ndarray,
        pooled: np.ndarray,
        idx: np.ndarray,
        k: tuple[int, int],
        s: tuple[int, int],
        need_input: bool,
        need_kernel: bool,
    ) -> tuple[np.ndarray | None, np.ndarray | None]:
        """:meth:`backward` for :meth:`forward_max_pool`'s outputs and the pooled gradient
        ``g``: each chunk's output gradient is routed from ``g`` (through the ReLU) while
        the chunk's products use it."""
        f = self.kmat.shape[1]
        oh, ow = self.out_hw
        tiled = oh == pooled.shape[1] * s[0] == pooled.shape[1] * k[0]
        tiled = tiled and ow == pooled.shape[2] * s[1] == pooled.shape[2] * k[1]
        g = np.ascontiguousarray(g, dtype=pooled.dtype)
        if not g.flags.writeable:  # the compiled loops take one array type, not a second
            g = g.copy()

        def output_grad(lo: int, hi: int) -> np.ndarray:
            shape = (hi - lo, oh, ow, f)
            dz = np.empty(shape, pooled.dtype) if tiled else np.zeros(shape, pooled.dtype)
            fast.max_pool_grad(g[lo:hi], pooled[lo:hi], idx[lo:hi], k, s, self.relu, dz)
            return dz.reshape(-1, f)

        return self._backward(output_grad, pooled.dtype, need_input, need_kernel)

    def _backward(
        self,
        output_grad: Callable[[int, int], np.ndarray],
        dtype: Any,
        need_input: bool,
        need_kernel: bool,
    ) -> tuple[np.ndarray | None, np.ndarray | None]:
        """``(d padded, d kmat)`` from ``output_grad(lo, hi)``, a chunk's gradient with respect
        to its ``(rows, F)`` product (through the ReLU), of ``dtype``."""
        dx = np.zeros(self.padded.shape, dtype=dtype) if need_input else None
        wm_t = self.kmat[: self.k].T
        oh, ow = self.out_hw
        kh, kw = self.kernel
        cin = self.padded.shape[3]

        def chunk(lo: int, hi: int) -> np.ndarray | None:
            part = output_grad(lo, hi)
            if dx is not None:
                dcols = np.matmul(part, wm_t).reshape(hi - lo, oh, ow, kh, kw, cin)
                add_patches(dcols, dx[lo:hi], self.strides, self.dilations)
            return self._block(lo, hi).T @ part if need_kernel else None

        parts = run_gemm_chunks(chunk, self.bounds)
        if not need_kernel:
            return dx, None
        total = parts[0]
        for p in parts[1:]:  # in chunk order: the bits do not depend on which thread ran what
            total += p
        return dx, total

"""Pooling ops over channels-last tensors: max and average over windows.

Pooling combines, elementwise, the ``KH*KW`` slabs ``(N, OH, OW, C)`` that the
window positions read (:mod:`psflow.ops.window_geometry`), so the channel axis
stays contiguous. Max pooling pads with ``-inf`` and sends each window's
gradient to its first maximum; average pooling divides by the number of real
(unpadded) elements in each window, as TensorFlow does.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from psflow import errors
from psflow.framework.tensor import Tensor
from psflow.ops import compiled
from psflow.ops._core import node, out, xp
from psflow.ops.kernel_pool import chunk_bounds, run_chunks
from psflow.ops.window_geometry import (
    Pads,
    check_format,
    crop_padding,
    float_input,
    out_sizes,
    pad_input,
    padding_amounts,
    spatial_values,
    window_slabs,
)

POOL_CHUNK_BYTES = 1 << 20
"""Bytes of input and output a chunk of the disjoint max pool aims for. Its backward
pass makes 16 NumPy calls a chunk for a 2x2 window: at the kernel pool's 256 kB (two
images of the tutorial CNN) the calls' overhead showed; at batch 256 the pool's forward
and backward took 24 ms of CPU in chunks of 0.5-2 MB against 35 ms at 256 kB. The
chunks change no bits (a maximum and its routing are exact)."""


# -- pooling -----------------------------------------------------------------------------


def _pool_args(
    input: Any, ksize: Any, strides: Any, padding: Any, rank: int, op_name: str
) -> tuple[Any, tuple[int, int], tuple[int, int], Pads]:
    x = float_input(input, rank + 2, op_name)
    k = spatial_values(ksize, rank, "ksize", op_name)
    s = spatial_values(strides, rank, "strides", op_name)
    if rank == 1:
        k, s = (1, *k), (1, *s)
    sizes = x._array().shape[1:-1] if rank == 2 else (1, x._array().shape[1])
    if not (isinstance(padding, str) and padding.upper() in ("SAME", "VALID")):
        raise errors.InvalidArgumentError(
            f"{op_name}: padding must be 'SAME' or 'VALID', got {padding!r}"
        )
    pads = padding_amounts(padding, sizes, k, s, op_name)
    return x, (k[0], k[1]), (s[0], s[1]), pads


def _max_pool(x: Any, k: tuple[int, int], s: tuple[int, int], pads: Pads, op_name: str) -> Tensor:
    a = x._array()
    if xp(a) is np and s[0] >= k[0] and s[1] >= k[1]:
        return _max_pool_disjoint_cpu(x, k, s, pads, op_name)
    # one elementwise maximum per window position over whole (N, OH, OW, C) slabs: the channel
    # axis stays contiguous, which a reduction over the patch view's window axes would not keep
    m = xp(a)
    oh, ow = out_sizes(a.shape[1:3], pads, k, s, op_name)
    padded = pad_input(a, pads, -np.inf)
    windows = window_slabs((oh, ow), k, s, (1, 1))
    z = padded[:, windows[0][2], windows[0][3], :].copy()
    for _, _, rows, cols in windows[1:]:
        m.maximum(z, padded[:, rows, cols, :], out=z)

    # windows that do not overlap write disjoint slabs: assign instead of accumulate
    disjoint = s[0] >= k[0] and s[1] >= k[1]

    def backward(g: Any, needs: tuple[bool, ...]) -> tuple[Any]:
        # each window's gradient goes to its first maximum, in row-major window order: what is
        # routed at one position is subtracted (exactly, to zero) from what later ones may take
        dx = m.zeros(padded.shape, dtype=g.dtype)
        remaining = g.copy()
        routed = m.empty_like(g)
        for _, _, rows, cols in windows:
            # an explicit dtype: NumPy's mixed float-by-bool loop is ~5x slower than this one
            m.multiply(remaining, padded[:, rows, cols, :] == z, out=routed, dtype=g.dtype)
            if disjoint:
                dx[:, rows, cols, :] = routed
            else:
                dx[:, rows, cols, :] += routed
            remaining -= routed
        return (crop_padding(dx, pads),)

    return out(z, (x,), backward)


def _max_pool_disjoint_cpu(
    x: Any, k: tuple[int, int], s: tuple[int, int], pads: Pads, op_name: str
) -> Tensor:
    """Max pooling of NumPy input whose windows do not overlap (stride >= window: Keras's
    default), chunk by chunk of the batch on the kernel threads (:mod:`psflow.ops.kernel_pool`).

    The backward pass routes each window's gradient to its first maximum as the general
    path does, but with one byte per element of bookkeeping instead of a float remainder
    subtracted at every position, and no zero fill where the windows tile the input: with
    the compiled loops (:mod:`psflow.ops.compiled`), the forward pass notes each window's
    first maximum (a byte per output) and the backward pass routes from it, without
    reading the input again; on NumPy, a byte per output notes which windows are routed
    already (two float passes per window position instead of four).
    """
    a = x._array()
    oh, ow = out_sizes(a.shape[1:3], pads, k, s, op_name)
    padded = np.ascontiguousarray(pad_input(a, pads, -np.inf))
    windows = window_slabs((oh, ow), k, s, (1, 1))
    z = np.empty((a.shape[0], oh, ow, a.shape[3]), dtype=a.dtype)
    bounds = chunk_bounds(a.shape[0], padded[0].nbytes + z[0].nbytes, POOL_CHUNK_BYTES)

    fast = compiled.kernels(a.dtype, padded.size)
    # where the compiled loops run, each window's first maximum (one byte) for the backward pass
    idx = None if fast is None else np.empty(z.shape, dtype=np.uint8)

    def forward_chunk(lo: int, hi: int) -> None:
        zc, pc = z[lo:hi], padded[lo:hi]
        if fast is not None:
            fast.max_pool(pc, k, s, False, zc, idx[lo:hi])
            return
        np.copyto(zc, pc[:, windows[0][2], windows[0][3], :])
        for _, _, rows, cols in windows[1:]:
            np.maximum(zc, pc[:, rows, cols, :], out=zc)

    run_chunks(forward_chunk, bounds)
    # every padded element in some window (stride == window, nothing left over): no zero fill
    tiled = padded.shape[1] == oh * s[0] == oh * k[0] and padded.shape[2] == ow * s[1] == ow * k[1]

    def backward(g: Any, needs: tuple[bool, ...]) -> tuple[Any]:
        dx = np.empty(padded.shape, dtype=g.dtype) if tiled else np.zeros(padded.shape, g.dtype)
        routed = idx is not None and g.dtype == a.dtype and g.flags.c_contiguous
        routed = routed and g.flags.writeable  # the one array type the loops are compiled for

        def backward_chunk(lo: int, hi: int) -> None:
            gc, zc, pc, dc = g[lo:hi], z[lo:hi], padded[lo:hi], dx[lo:hi]
            if routed:
                fast.max_pool_grad(gc, zc, idx[lo:hi], k, s, False, dc)
                return
            taken = np.zeros(zc.shape, dtype=bool)  # windows whose maximum was routed already
            hit = np.empty(zc.shape, dtype=bool)
            last = len(windows) - 1
            for i, (_, _, rows, cols) in enumerate(windows):
                np.equal(pc[:, rows, cols, :], zc, out=hit)
                if i:
                    np.greater(hit, taken, out=hit)  # hit and not taken: the first maximum only
                if i < last:
                    np.logical_or(taken, hit, out=taken)
                # an explicit dtype: NumPy's mixed float-by-bool loop is ~5x slower than this one
                np.multiply(gc, hit, out=dc[:, rows, cols, :], dtype=g.dtype)

        run_chunks(backward_chunk, bounds)
        return (crop_padding(dx, pads),)

    return out(z, (x,), backward)


def _window_counts(size: int, k: int, s: int, pad: tuple[int, int], n_out: int) -> np.ndarray:
    """How many real (unpadded) elements each output window covers along one dimension."""
    start = np.arange(n_out) * s - pad[0]
    return np.minimum(start + k, size) - np.maximum(start, 0)


def _avg_pool(x: Any, k: tuple[int, int], s: tuple[int, int], pads: Pads, op_name: str) -> Tensor:
    a = x._array()
    m = xp(a)
    oh, ow = out_sizes(a.shape[1:3], pads, k, s, op_name)
    padded = pad_input(a, pads, 0.0)
    windows = window_slabs((oh, ow), k, s, (1, 1))
    counts = np.outer(
        _window_counts(a.shape[1], k[0], s[0], pads[0], oh),
        _window_counts(a.shape[2], k[1], s[1], pads[1], ow),
    )
    inv = m.asarray((1.0 / counts).astype(a.dtype))[None, :, :, None]
    z = padded[:, windows[0][2], windows[0][3], :].copy()
    for _, _, rows, cols in windows[1:]:
        z += padded[:, rows, cols, :]
    z *= inv

    def backward(g: Any, needs: tuple[bool, ...]) -> tuple[Any]:
        share = g * inv
        dx = m.zeros(padded.shape, dtype=g.dtype)
        for _, _, rows, cols in windows:
            dx[:, rows, cols, :] += share
        return (crop_padding(dx, pads),)

    return out(z, (x,), backward)


def max_pool2d(
    input: Any,
    ksize: Any,
    strides: Any,
    padding: Any,
    data_format: str | None = "NHWC",
    name: str | None = None,
) -> Tensor:
    """Max pooling over ``[batch, height, width, channels]`` (TensorFlow's ``tf.nn.max_pool2d``).

    Example:
        >>> import psflow as pf
        >>> pf.nn.max_pool2d(pf.ones([1, 4, 4, 3]), 2, 2, "VALID").shape
        TensorShape([1, 2, 2, 3])

    Raises:
        InvalidArgumentError: a rank other than 4, a non-float input, a non-positive
            window or stride, or a window larger than the input with ``VALID``.
    """
    check_format(data_format, ("NHWC",), "max_pool2d")
    x, k, s, pads = _pool_args(input, ksize, strides, padding, 2, "max_pool2d")
    return _max_pool(x, k, s, pads, "max_pool2d")


def avg_pool2d(
    input: Any,
    ksize: Any,
    strides: Any,
    padding: Any,
    data_format: str | None = "NHWC",
    name: str | None = None,
) -> Tensor:
    """Average pooling over ``[batch, height, width, channels]`` (``tf.nn.avg_pool2d``);
    with ``SAME`` each window averages its real elements only.

    Raises:
        InvalidArgumentError: as :func:`max_pool2d`.
    """
    check_format(data_format, ("NHWC",), "avg_pool2d")
    x, k, s, pads = _pool_args(input, ksize, strides, padding, 2, "avg_pool2d")
    return _avg_pool(x, k, s, pads, "avg_pool2d")


def _pool1d(pool: Any, input: Any, ksize: Any, strides: Any, padding: Any, op_name: str) -> Tensor:
    from psflow.ops import array_ops

    x, k, s, pads = _pool_args(input, ksize, strides, padding, 1, op_name)
    y = pool(array_ops.expand_dims(x, 1), k, s, pads, op_name)
    return array_ops.squeeze(y, axis=1)


def max_pool1d(
    input: Any,
    ksize: Any,
    strides: Any,
    padding: Any,
    data_format: str | None = "NWC",
    name: str | None = None,
) -> Tensor:
    """Max pooling over ``[batch, width, channels]`` (``tf.nn.max_pool1d``).

    Raises:
        InvalidArgumentError: as :func:`max_pool2d`, for rank 3.
    """
    check_format(data_format, ("NWC",), "max_pool1d")
    return _pool1d(_max_pool, input, ksize, strides, padding, "max_pool1d")


def avg_pool1d(
    input: Any,
    ksize: Any,
    strides: Any,
    padding: Any,
    data_format: str | None = "NWC",
    name: str | None = None,
) -> Tensor:
    """Average pooling over ``[batch, width, channels]`` (``tf.nn.avg_pool1d``).

    Raises:
        InvalidArgumentError: as :func:`max_pool2d`, for rank 3.
    """
    check_format(data_format, ("NWC",), "avg_pool1d")
    return _pool1d(_avg_pool, input, ksize, strides, padding, "avg_pool1d")


def _by_rank(input: Any, one: Any, two: Any, op_name: str) -> Any:
    rank = node(input)._array().ndim
    if rank == 3:
        return one
    if rank == 4:
        return two
    raise errors.InvalidArgumentError(
        f"{op_name}: input must have rank 3 or 4 (channels last), got rank {rank}"
    )


def max_pool(
    input: Any,
    ksize: Any,
    strides: Any,
    padding: Any,
    data_format: str | None = None,
    name: str | None = None,
) -> Tensor:
    """Max pooling of rank-3 or rank-4 input (``tf.nn.max_pool``), channels last."""
    fn = _by_rank(input, max_pool1d, max_pool2d, "max_pool")
    return fn(input, ksize, strides, padding, data_format=data_format)


def avg_pool(
    input: Any,
    ksize: Any,
    strides: Any,
    padding: Any,
    data_format: str | None = None,
    name: str | None = None,
) -> Tensor:
    """Average pooling of rank-3 or rank-4 input (``tf.nn.avg_pool``), channels last."""
    fn = _by_rank(input, avg_pool1d, avg_pool2d, "avg_pool")
    return fn(input, ksize, strides, padding, data_format=data_format)

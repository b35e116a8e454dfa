"""Convolution ops over channels-last tensors, as BLAS matmuls.

Every op works on two spatial dimensions (``NHWC``); the 1-D variants add a
height of one. The input's patch view (:mod:`psflow.ops.window_geometry`) is
copied once into an im2col matrix and multiplied by the kernel reshaped to
``(KH*KW*C, F)``: one GEMM forward, two backward (kernel: ``cols.T @ g``;
input: ``g @ kernel.T``, folded back by col2im).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from psflow import errors
from psflow.framework.tensor import Tensor
from psflow.ops import compiled, conv_cpu, conv_gpu, kernel_pool
from psflow.ops._core import node, out, xp
from psflow.ops.window_geometry import (
    Pads,
    check_format,
    col2im,
    crop_padding,
    float_input,
    out_sizes,
    pad_input,
    padding_amounts,
    patch_view,
    spatial_values,
)

# -- convolution ------------------------------------------------------------------------


def _out_hw(
    a: Any,
    k: Any,
    strides: tuple[int, int],
    pads: Pads,
    dilations: tuple[int, int],
    op_name: str,
) -> tuple[int, int]:
    """The output's ``(OH, OW)`` for input array ``a`` and filters ``k``, checked."""
    if k.dtype != a.dtype:
        raise errors.InvalidArgumentError(
            f"{op_name}: filters dtype {k.dtype.name} differs from input dtype {a.dtype.name}"
        )
    if k.shape[2] != a.shape[3]:
        raise errors.InvalidArgumentError(
            f"{op_name}: input has {a.shape[3]} channels but filters expect {k.shape[2]} "
            f"(filters shape {list(k.shape)})"
        )
    extents = ((k.shape[0] - 1) * dilations[0] + 1, (k.shape[1] - 1) * dilations[1] + 1)
    return out_sizes(a.shape[1:3], pads, extents, strides, op_name)


def _conv(
    x: Any,
    w: Any,
    strides: tuple[int, int],
    pads: Pads,
    dilations: tuple[int, int],
    op_name: str,
    bias: Any = None,
    relu: bool = False,
) -> Tensor:
    """The 2-D convolution of nodes ``x`` (NHWC) and ``w`` (HWIO) with its VJP.

    With ``bias`` (a node of ``out_channels``) and ``relu``, ``relu(conv + bias)`` is
    one op: the sum and the activation run in place in the product's buffer.
    """
    a, k = x._array(), w._array()
    oh, ow = _out_hw(a, k, strides, pads, dilations, op_name)
    kh, kw, cin, cout = k.shape
    n = a.shape[0]
    wm = k.reshape(kh * kw * cin, cout)
    inputs: tuple[Any, ...] = (x, w) if bias is None else (x, w, bias)
    b = None if bias is None else bias._array()
    if xp(a) is np:
        return _conv_cpu(
            x,
            pad_input(a, pads, 0.0),
            wm,
            k.shape,
            pads,
            strides,
            dilations,
            (oh, ow),
            b,
            relu,
            inputs,
        )
    cudnn = conv_gpu.cudnn_or_none(a.dtype)
    if cudnn is not None:
        try:
            z, backward = conv_gpu.conv2d(cudnn, a, k, b, pads, strides, dilations, relu)
        except Exception as e:  # a cuDNN that imports but cannot run: the im2col path below
            conv_gpu.give_up(e)
        else:
            return out(z, inputs, backward)
    padded = pad_input(a, pads, 0.0)
    cols = patch_view(padded, (oh, ow), (kh, kw), strides, dilations).reshape(
        n * oh * ow, kh * kw * cin
    )
    z2 = cols @ wm
    if b is not None:
        z2 += b
    if relu:
        xp(z2).maximum(z2, 0, out=z2)
    z = z2.reshape(n, oh, ow, cout)
    padded_shape = padded.shape

    def backward(g: Any, needs: tuple[bool, ...]) -> tuple[Any, ...]:
        g2 = g.reshape(n * oh * ow, cout)
        if relu:  # an explicit dtype: NumPy's mixed float-by-bool loop is several times slower
            g2 = xp(g2).multiply(g2, z2 > 0, dtype=g2.dtype)
        dx = dw = None
        if needs[0]:
            dcols = (g2 @ wm.T).reshape(n, oh, ow, kh, kw, cin)
            dx = col2im(dcols, padded_shape, pads, strides, dilations)
        if needs[1]:
            dw = (cols.T @ g2).reshape(k.shape)
        if len(needs) == 3:
            return dx, dw, g2.sum(axis=0) if needs[2] else None
        return dx, dw

    return out(z, inputs, backward)


def _conv_cpu(
    x: Any,
    padded: Any,
    wm: Any,
    kshape: tuple[int, ...],
    pads: Pads,
    strides: tuple[int, int],
    dilations: tuple[int, int],
    out_hw: tuple[int, int],
    b: Any,
    relu: bool,
    inputs: tuple[Any, ...],
) -> Tensor:
    """:func:`_conv` on NumPy arrays (:mod:`psflow.ops.conv_cpu`): the bias rides in the GEMM;
    a batch of several chunks of images runs chunk by chunk."""
    kh, kw, cin, cout = kshape
    n = padded.shape[0]
    kmat = conv_cpu.kernel_matrix(wm, b)
    bounds = conv_cpu.image_chunks(
        n, out_hw[0] * out_hw[1], kmat.shape[0], cout, padded.dtype.itemsize
    )
    if len(bounds) > 1:
        return _conv_cpu_chunked(
            conv_cpu.ChunkedConv(padded, kmat, (kh, kw), strides, dilations, out_hw, relu, bounds),
            kshape,
            pads,
            inputs,
        )
    cols = conv_cpu.im2col(padded, (kh, kw), strides, dilations, out_hw, ones=b is not None)
    z2 = kernel_pool.matmul(cols, kmat)
    if relu:
        conv_cpu.relu_in_place(z2)
    padded_shape = padded.shape

    def backward(g: Any, needs: tuple[bool, ...]) -> tuple[Any, ...]:
        g2 = g.reshape(n * out_hw[0] * out_hw[1], cout)
        if relu:
            g2 = conv_cpu.relu_mask(g2, z2)
        dx = dwb = None
        if needs[0]:
            dcols = kernel_pool.matmul(g2, wm.T).reshape(n, *out_hw, kh, kw, cin)
            dx = col2im(dcols, padded_shape, pads, strides, dilations)
        if needs[1] or (len(needs) == 3 and needs[2]):
            dwb = kernel_pool.matmul(cols.T, g2)
        return _conv_grads(dx, dwb, kshape, needs)

    return out(z2.reshape(n, *out_hw, cout), inputs, backward)


def _conv_cpu_chunked(
    conv: conv_cpu.ChunkedConv,
    kshape: tuple[int, ...],
    pads: Pads,
    inputs: tuple[Any, ...],
) -> Tensor:
    """:func:`_conv_cpu` for a batch of several chunks of images (:class:`conv_cpu.ChunkedConv`)."""
    n, (oh, ow), cout = conv.padded.shape[0], conv.out_hw, kshape[3]
    z2 = conv.forward()

    def backward(g: Any, needs: tuple[bool, ...]) -> tuple[Any, ...]:
        want_dwb = needs[1] or (len(needs) == 3 and needs[2])
        dpadded, dwb = conv.backward(g.reshape(n * oh * ow, cout), z2, needs[0], want_dwb)
        dx = None if dpadded is None else crop_padding(dpadded, pads)
        return _conv_grads(dx, dwb, kshape, needs)

    return out(z2.reshape(n, oh, ow, cout), inputs, backward)


def _conv_grads(
    dx: Any, dwb: Any, kshape: tuple[int, ...], needs: tuple[bool, ...]
) -> tuple[Any, ...]:
    """The VJP's tuple from the kernel matrix's gradient ``dwb``: the kernel's rows, then
    (with a bias, whose column of ones rides in the block) the bias's row."""
    k = kshape[0] * kshape[1] * kshape[2]
    dw = dwb[:k].reshape(kshape) if needs[1] else None
    if len(needs) == 3:
        return dx, dw, dwb[k].copy() if needs[2] else None
    return dx, dw


def conv_layer(
    x: Any,
    kernel: Any,
    bias: Any,
    rank: int,
    strides: tuple[int, ...],
    padding: str,
    dilations: tuple[int, ...],
    relu: bool,
) -> Tensor:
    """``relu?(conv(x, kernel) + bias)`` for the Keras convolution layers, as one op.

    ``rank`` is 1 (NWC input, ``padding`` may be ``"CAUSAL"``) or 2 (NHWC); ``bias``
    may be None. The same values as :func:`conv2d`/:func:`conv1d`, then ``add`` and
    ``relu``, with the bias and activation fused into the product's buffer.

    Raises:
        InvalidArgumentError: as :func:`conv2d`; a bias whose dtype or length differs.
    """
    from psflow.ops import array_ops

    x, w, b, s, pads, d = _layer_inputs(x, kernel, bias, rank, strides, padding, dilations)
    y = _conv(x, w, s, pads, d, "conv", b, relu)
    return array_ops.squeeze(y, axis=1) if rank == 1 else y


def _layer_inputs(
    x: Any,
    kernel: Any,
    bias: Any,
    rank: int,
    strides: tuple[int, ...],
    padding: str,
    dilations: tuple[int, ...],
) -> tuple[Tensor, Tensor, Tensor | None, tuple[int, int], Pads, tuple[int, int]]:
    """:func:`conv_layer`'s arguments checked, as 2-D: ``(x, w, b, strides, pads, dilations)``."""
    from psflow.ops import array_ops

    x = float_input(x, rank + 2, "conv")
    w = float_input(kernel, rank + 2, "conv", "filters")
    b = None
    if bias is not None:
        b = node(bias)
        if b._array().dtype != w._array().dtype or b._array().shape != w._array().shape[-1:]:
            raise errors.InvalidArgumentError(
                f"conv: bias of shape {list(b._array().shape)} and dtype {b._array().dtype} "
                f"does not fit filters {list(w._array().shape)}"
            )
    if rank == 1:
        x, w = array_ops.expand_dims(x, 1), array_ops.expand_dims(w, 0)
        strides, dilations = (1, *strides), (1, *dilations)
    k = w._array().shape
    extents = ((k[0] - 1) * dilations[0] + 1, (k[1] - 1) * dilations[1] + 1)
    if padding.upper() == "CAUSAL":
        pads: Pads = ((0, 0), (extents[1] - 1, 0))
    else:
        pads = padding_amounts(padding, x._array().shape[1:3], extents, strides, "conv")
    return x, w, b, (strides[0], strides[1]), pads, (dilations[0], dilations[1])


def conv_layer_max_pool(
    x: Any,
    kernel: Any,
    bias: Any,
    strides: tuple[int, ...],
    padding: str,
    dilations: tuple[int, ...],
    relu: bool,
    pool_size: tuple[int, int],
    pool_strides: tuple[int, int],
    pool_padding: str,
) -> Tensor:
    """``max_pool2d(conv_layer(x, ...), pool_size, pool_strides, pool_padding)`` (2-D), as
    one op where it can be: the values and gradients of the two ops, bit for bit.

    Where the input is a NumPy batch of several chunks of images
    (:class:`conv_cpu.ChunkedConv`), the pool's windows do not overlap and need no
    padding, and the compiled loops are ready (:mod:`psflow.ops.compiled`), each chunk's
    output is pooled while it is in cache, and the backward pass routes the pooled
    gradient through the pool and the ReLU into the chunk's products from one byte per
    pooled value (which window position was the maximum). The whole output and its
    gradient, two passes through memory each way, are never made: on the tutorial CNN
    at batch 256 that is about 22 MB each. Elsewhere the two ops run as they are.

    Raises:
        InvalidArgumentError: as :func:`conv_layer` and :func:`pool_ops.max_pool2d`.
    """
    from psflow.ops import pool_ops

    x, w, b, s, pads, d = _layer_inputs(x, kernel, bias, 2, strides, padding, dilations)
    fused = _conv_max_pool_cpu(x, w, b, s, pads, d, relu, pool_size, pool_strides, pool_padding)
    if fused is not None:
        return fused
    y = _conv(x, w, s, pads, d, "conv", b, relu)
    return pool_ops.max_pool2d(y, pool_size, pool_strides, pool_padding)


def _conv_max_pool_cpu(
    x: Tensor,
    w: Tensor,
    b: Tensor | None,
    strides: tuple[int, int],
    pads: Pads,
    dilations: tuple[int, int],
    relu: bool,
    pool_size: tuple[int, int],
    pool_strides: tuple[int, int],
    pool_padding: str,
) -> Tensor | None:
    """:func:`conv_layer_max_pool` as one op, or None where it cannot be (see there)."""
    a, k = x._array(), w._array()
    if xp(a) is not np or not isinstance(pool_padding, str):
        return None
    pk = spatial_values(pool_size, 2, "ksize", "max_pool2d")
    ps = spatial_values(pool_strides, 2, "strides", "max_pool2d")
    if ps[0] < pk[0] or ps[1] < pk[1] or pk[0] * pk[1] > 255:
        return None  # overlapping windows; or more positions than a byte counts
    out_hw = _out_hw(a, k, strides, pads, dilations, "conv")
    pool_pads = padding_amounts(pool_padding, out_hw, pk, ps, "max_pool2d")
    if pool_pads != ((0, 0), (0, 0)):
        return None
    pooled_hw = out_sizes(out_hw, pool_pads, pk, ps, "max_pool2d")
    kh, kw, cin, cout = k.shape
    n = a.shape[0]
    fast = compiled.kernels(a.dtype, n * out_hw[0] * out_hw[1] * cout)
    width = kh * kw * cin + (b is not None)  # the kernel matrix's rows
    bounds = conv_cpu.image_chunks(n, out_hw[0] * out_hw[1], width, cout, a.dtype.itemsize)
    if fast is None or len(bounds) < 2:
        return None
    kmat = conv_cpu.kernel_matrix(k.reshape(kh * kw * cin, cout), None if b is None else b._array())
    padded = pad_input(a, pads, 0.0)
    conv = conv_cpu.ChunkedConv(padded, kmat, (kh, kw), strides, dilations, out_hw, relu, bounds)
    pooled, idx = conv.forward_max_pool(fast, (pk[0], pk[1]), (ps[0], ps[1]), pooled_hw)

    def backward(g: Any, needs: tuple[bool, ...]) -> tuple[Any, ...]:
        want_dwb = needs[1] or (len(needs) == 3 and needs[2])
        dpadded, dwb = conv.backward_max_pool(
            fast, g, pooled, idx, (pk[0], pk[1]), (ps[0], ps[1]), needs[0], want_dwb
        )
        dx = None if dpadded is None else crop_padding(dpadded, pads)
        return _conv_grads(dx, dwb, k.shape, needs)

    return out(pooled, (x, w) if b is None else (x, w, b), backward)


def conv2d(
    input: Any,
    filters: Any,
    strides: Any,
    padding: Any,
    data_format: str | None = "NHWC",
    dilations: Any = None,
    name: str | None = None,
) -> Tensor:
    """2-D convolution (TensorFlow's ``tf.nn.conv2d``), channels last.

    Args:
        input: ``[batch, height, width, in_channels]``.
        filters: ``[filter_height, filter_width, in_channels, out_channels]``.
        strides: an int, or 1, 2 or 4 ints (``[1, s_h, s_w, 1]``).
        padding: ``"SAME"``, ``"VALID"`` or explicit ``[[0, 0], [t, b], [l, r], [0, 0]]``.
        data_format: only ``"NHWC"``.
        dilations: like ``strides`` (1 by default).

    Example:
        >>> import psflow as pf
        >>> pf.nn.conv2d(pf.ones([1, 5, 5, 1]), pf.ones([3, 3, 1, 2]), 1, "VALID").shape
        TensorShape([1, 3, 3, 2])

    Raises:
        InvalidArgumentError: ranks, channel counts or dtypes that do not match, a
            non-positive stride or dilation, or a window larger than the padded input.
    """
    check_format(data_format, ("NHWC",), "conv2d")
    x = float_input(input, 4, "conv2d")
    w = float_input(filters, 4, "conv2d", "filters")
    s = spatial_values(strides, 2, "strides", "conv2d")
    d = spatial_values(1 if dilations is None else dilations, 2, "dilations", "conv2d")
    kshape = w._array().shape
    extents = ((kshape[0] - 1) * d[0] + 1, (kshape[1] - 1) * d[1] + 1)
    pads = padding_amounts(padding, x._array().shape[1:3], extents, s, "conv2d")
    return _conv(x, w, (s[0], s[1]), pads, (d[0], d[1]), "conv2d")


def conv1d(
    input: Any,
    filters: Any,
    stride: Any,
    padding: Any,
    data_format: str | None = "NWC",
    dilations: Any = None,
    name: str | None = None,
) -> Tensor:
    """1-D convolution (TensorFlow's ``tf.nn.conv1d``): ``[batch, width, channels]`` input,
    ``[filter_width, in_channels, out_channels]`` filters.

    ``padding`` may also be ``"CAUSAL"`` (Keras's causal padding: all of it before).

    Raises:
        InvalidArgumentError: as :func:`conv2d`.
    """
    from psflow.ops import array_ops

    check_format(data_format, ("NWC",), "conv1d")
    x = float_input(input, 3, "conv1d")
    w = float_input(filters, 3, "conv1d", "filters")
    (s,) = spatial_values(stride, 1, "stride", "conv1d")
    (d,) = spatial_values(1 if dilations is None else dilations, 1, "dilations", "conv1d")
    k = w._array().shape[0]
    extent = (k - 1) * d + 1
    if isinstance(padding, str) and padding.upper() == "CAUSAL":
        pads: Pads = ((0, 0), (extent - 1, 0))
    elif isinstance(padding, str):
        pads = padding_amounts(padding, (1, x._array().shape[1]), (1, extent), (1, s), "conv1d")
    else:  # explicit: [[l, r]] or TF's [[0, 0], [l, r], [0, 0]]
        pairs = [list(p) for p in padding]
        if len(pairs) not in (1, 3) or (len(pairs) == 3 and pairs[0] + pairs[2] != [0] * 4):
            raise errors.InvalidArgumentError(
                f"conv1d: explicit padding must be [[l, r]] or [[0, 0], [l, r], [0, 0]], got "
                f"{padding!r}"
            )
        pads = padding_amounts([(0, 0), pairs[len(pairs) // 2]], (), (), (), "conv1d")
    x4 = array_ops.expand_dims(x, 1)
    w4 = array_ops.expand_dims(w, 0)
    y = _conv(x4, w4, (1, s), pads, (1, d), "conv1d")
    return array_ops.squeeze(y, axis=1)

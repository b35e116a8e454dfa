"""Convolution and pooling ops over channels-last tensors, as BLAS matmuls.

Every op works on two spatial dimensions (``NHWC``); the 1-D variants add a
height of one. A window op reads its input through a strided *patch view*
``(N, OH, OW, KH, KW, C)`` of the padded input (``as_strided``: no copy), so:

- convolution copies the view once into an im2col matrix and multiplies it by
  the kernel reshaped to ``(KH*KW*C, F)``: one GEMM forward, two backward
  (kernel: ``cols.T @ g``; input: ``g @ kernel.T``, folded back by col2im);
- pooling combines, elementwise, the ``KH*KW`` slabs ``(N, OH, OW, C)`` that
  the window positions read (the channel axis stays contiguous).

col2im (the adjoint of the patch view) adds each kernel position's slab of
gradient into the padded input gradient: ``KH*KW`` strided adds, each over
the whole batch, then the padding is cropped off.

Padding follows TensorFlow: ``VALID`` uses no padding; ``SAME`` gives
``ceil(size / stride)`` outputs and pads ``total // 2`` before and the rest
after. Max pooling pads with ``-inf``; average pooling divides by the number
of real (unpadded) elements in each window, as TensorFlow does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from psflow import errors
from psflow.framework.tensor import Tensor
from psflow.ops._core import node, out, xp

Pads = tuple[tuple[int, int], tuple[int, int]]


# -- shapes and padding ----------------------------------------------------------------


def _spatial(value: Any, rank: int, name: str, op_name: str) -> tuple[int, ...]:
    """An int or a sequence of ints as ``rank`` spatial values (TF's N+2 form accepted)."""
    if isinstance(value, (int, np.integer)):
        vals: tuple[int, ...] = (int(value),) * rank
    else:
        vals = tuple(int(v) for v in value)
        if len(vals) == rank + 2:  # [1, s_h, s_w, 1]: batch and channel entries must be 1
            if vals[0] != 1 or vals[-1] != 1:
                raise errors.InvalidArgumentError(
                    f"{op_name}: {name} {list(vals)} must be 1 in the batch and channel dimensions"
                )
            vals = vals[1:-1]
        elif len(vals) == 1:
            vals = vals * rank
        elif len(vals) != rank:
            raise errors.InvalidArgumentError(
                f"{op_name}: {name} must have 1, {rank} or {rank + 2} entries, got {list(vals)}"
            )
    if any(v <= 0 for v in vals):
        raise errors.InvalidArgumentError(f"{op_name}: {name} must be positive, got {list(vals)}")
    return vals


def _pads(
    padding: Any,
    sizes: Sequence[int],
    windows: Sequence[int],
    strides: Sequence[int],
    op_name: str,
) -> Pads:
    """(before, after) padding per spatial dimension for ``SAME``/``VALID`` or explicit pairs.

    ``windows`` are the effective (dilated) window extents.
    """
    if isinstance(padding, str):
        mode = padding.upper()
        if mode == "VALID":
            return ((0, 0), (0, 0))
        if mode == "SAME":
            pairs = []
            for size, k, s in zip(sizes, windows, strides):
                n_out = -(-size // s)
                total = max((n_out - 1) * s + k - size, 0)
                pairs.append((total // 2, total - total // 2))
            return (pairs[0], pairs[1])
        raise errors.InvalidArgumentError(
            f"{op_name}: padding must be 'SAME', 'VALID' or explicit pairs, got {padding!r}"
        )
    try:
        pairs = [(int(p[0]), int(p[1])) for p in padding]
    except (TypeError, ValueError, IndexError):
        raise errors.InvalidArgumentError(
            f"{op_name}: padding must be 'SAME', 'VALID' or explicit pairs, got {padding!r}"
        ) from None
    if len(pairs) == 4:  # TF's explicit form lists the batch and channel dimensions too
        if pairs[0] != (0, 0) or pairs[3] != (0, 0):
            raise errors.InvalidArgumentError(
                f"{op_name}: explicit padding {padding!r} must be 0 in the batch and channel "
                "dimensions"
            )
        pairs = pairs[1:3]
    if len(pairs) != 2 or any(p < 0 for pair in pairs for p in pair):
        raise errors.InvalidArgumentError(
            f"{op_name}: explicit padding needs 2 (or 4) non-negative pairs, got {padding!r}"
        )
    return (pairs[0], pairs[1])


def _out_sizes(
    sizes: Sequence[int], pads: Pads, windows: Sequence[int], strides: Sequence[int], op_name: str
) -> tuple[int, int]:
    outs = []
    for size, (lo, hi), k, s in zip(sizes, pads, windows, strides):
        n = (size + lo + hi - k) // s + 1
        if n <= 0:
            raise errors.InvalidArgumentError(
                f"{op_name}: a window of extent {k} does not fit an input of size {size} with "
                f"padding {(lo, hi)}"
            )
        outs.append(n)
    return (outs[0], outs[1])


def _float_input(x: Any, rank: int, op_name: str, what: str = "input") -> Any:
    n = node(x)
    a = n._array()
    if a.ndim != rank:
        raise errors.InvalidArgumentError(
            f"{op_name}: {what} must have rank {rank}, got shape {list(a.shape)}"
        )
    if a.dtype.kind != "f":
        raise errors.InvalidArgumentError(
            f"{op_name}: {what} must be floating point, got {a.dtype.name}"
        )
    return n


def _check_format(data_format: Any, allowed: tuple[str, ...], op_name: str) -> None:
    if data_format is not None and str(data_format).upper() not in allowed:
        raise errors.InvalidArgumentError(
            f"{op_name}: data_format {data_format!r} is not supported; use {allowed[0]} "
            "(channels last)"
        )


# -- patch views -----------------------------------------------------------------------


def _pad(a: Any, pads: Pads, value: float) -> Any:
    if pads == ((0, 0), (0, 0)):
        return a
    m = xp(a)
    return m.pad(a, ((0, 0), pads[0], pads[1], (0, 0)), constant_values=value)


def _patches(
    a: Any,
    out_hw: tuple[int, int],
    kernel: tuple[int, int],
    strides: tuple[int, int],
    dilations: tuple[int, int],
) -> Any:
    """The ``(N, OH, OW, KH, KW, C)`` read-only view of the windows of padded ``a``."""
    m = xp(a)
    a = m.ascontiguousarray(a)
    sn, sh, sw, sc = a.strides
    shape = (a.shape[0], *out_hw, *kernel, a.shape[3])
    view_strides = (
        sn,
        sh * strides[0],
        sw * strides[1],
        sh * dilations[0],
        sw * dilations[1],
        sc,
    )
    return m.lib.stride_tricks.as_strided(a, shape=shape, strides=view_strides)


def _windows(
    out_hw: tuple[int, int],
    kernel: tuple[int, int],
    strides: tuple[int, int],
    dilations: tuple[int, int],
) -> list[tuple[int, int, slice, slice]]:
    """For each kernel position ``(i, j)``, the rows and columns of the padded input it reads
    across all output positions (so ``padded[:, rows, cols]`` is an ``(N, OH, OW, C)`` slab)."""
    (oh, ow), (kh, kw) = out_hw, kernel
    windows = []
    for i in range(kh):
        r0 = i * dilations[0]
        rows = slice(r0, r0 + strides[0] * (oh - 1) + 1, strides[0])
        for j in range(kw):
            c0 = j * dilations[1]
            windows.append((i, j, rows, slice(c0, c0 + strides[1] * (ow - 1) + 1, strides[1])))
    return windows


def _col2im(
    dpatches: Any,
    padded_shape: tuple[int, ...],
    pads: Pads,
    strides: tuple[int, int],
    dilations: tuple[int, int],
) -> Any:
    """The adjoint of :func:`_patches` followed by the crop of the padding."""
    m = xp(dpatches)
    _, oh, ow, kh, kw, _ = dpatches.shape
    dx = m.zeros(padded_shape, dtype=dpatches.dtype)
    for i, j, rows, cols in _windows((oh, ow), (kh, kw), strides, dilations):
        dx[:, rows, cols, :] += dpatches[:, :, :, i, j, :]
    return _crop(dx, pads)


def _crop(dx: Any, pads: Pads) -> Any:
    (t, b), (left, r) = pads
    if t or b or left or r:
        dx = dx[:, t : dx.shape[1] - b, left : dx.shape[2] - r, :]
    return dx


# -- convolution ------------------------------------------------------------------------


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
    if k.dtype != a.dtype:
        raise errors.InvalidArgumentError(
            f"{op_name}: filters dtype {k.dtype.name} differs from input dtype {a.dtype.name}"
        )
    if k.shape[2] != a.shape[3]:
        raise errors.InvalidArgumentError(
            f"{op_name}: input has {a.shape[3]} channels but filters expect {k.shape[2]} "
            f"(filters shape {list(k.shape)})"
        )
    kh, kw, cin, cout = k.shape
    extents = ((kh - 1) * dilations[0] + 1, (kw - 1) * dilations[1] + 1)
    oh, ow = _out_sizes(a.shape[1:3], pads, extents, strides, op_name)
    padded = _pad(a, pads, 0.0)
    n = a.shape[0]
    cols = _patches(padded, (oh, ow), (kh, kw), strides, dilations).reshape(
        n * oh * ow, kh * kw * cin
    )
    wm = k.reshape(kh * kw * cin, cout)
    z2 = cols @ wm
    inputs: tuple[Any, ...] = (x, w)
    if bias is not None:
        z2 += bias._array()
        inputs = (x, w, bias)
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
            dx = _col2im(dcols, padded_shape, pads, strides, dilations)
        if needs[1]:
            dw = (cols.T @ g2).reshape(k.shape)
        if len(needs) == 3:
            return dx, dw, g2.sum(axis=0) if needs[2] else None
        return dx, dw

    return out(z, inputs, backward)


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

    x = _float_input(x, rank + 2, "conv")
    w = _float_input(kernel, rank + 2, "conv", "filters")
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
        pads = _pads(padding, x._array().shape[1:3], extents, strides, "conv")
    y = _conv(x, w, (strides[0], strides[1]), pads, (dilations[0], dilations[1]), "conv", b, relu)
    return array_ops.squeeze(y, axis=1) if rank == 1 else y


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
    _check_format(data_format, ("NHWC",), "conv2d")
    x = _float_input(input, 4, "conv2d")
    w = _float_input(filters, 4, "conv2d", "filters")
    s = _spatial(strides, 2, "strides", "conv2d")
    d = _spatial(1 if dilations is None else dilations, 2, "dilations", "conv2d")
    kshape = w._array().shape
    extents = ((kshape[0] - 1) * d[0] + 1, (kshape[1] - 1) * d[1] + 1)
    pads = _pads(padding, x._array().shape[1:3], extents, s, "conv2d")
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

    _check_format(data_format, ("NWC",), "conv1d")
    x = _float_input(input, 3, "conv1d")
    w = _float_input(filters, 3, "conv1d", "filters")
    (s,) = _spatial(stride, 1, "stride", "conv1d")
    (d,) = _spatial(1 if dilations is None else dilations, 1, "dilations", "conv1d")
    k = w._array().shape[0]
    extent = (k - 1) * d + 1
    if isinstance(padding, str) and padding.upper() == "CAUSAL":
        pads: Pads = ((0, 0), (extent - 1, 0))
    elif isinstance(padding, str):
        pads = _pads(padding, (1, x._array().shape[1]), (1, extent), (1, s), "conv1d")
    else:  # explicit: [[l, r]] or TF's [[0, 0], [l, r], [0, 0]]
        pairs = [list(p) for p in padding]
        if len(pairs) not in (1, 3) or (len(pairs) == 3 and pairs[0] + pairs[2] != [0] * 4):
            raise errors.InvalidArgumentError(
                f"conv1d: explicit padding must be [[l, r]] or [[0, 0], [l, r], [0, 0]], got "
                f"{padding!r}"
            )
        pads = _pads([(0, 0), pairs[len(pairs) // 2]], (), (), (), "conv1d")
    x4 = array_ops.expand_dims(x, 1)
    w4 = array_ops.expand_dims(w, 0)
    y = _conv(x4, w4, (1, s), pads, (1, d), "conv1d")
    return array_ops.squeeze(y, axis=1)


# -- pooling -----------------------------------------------------------------------------


def _pool_args(
    input: Any, ksize: Any, strides: Any, padding: Any, rank: int, op_name: str
) -> tuple[Any, tuple[int, int], tuple[int, int], Pads]:
    x = _float_input(input, rank + 2, op_name)
    k = _spatial(ksize, rank, "ksize", op_name)
    s = _spatial(strides, rank, "strides", op_name)
    if rank == 1:
        k, s = (1, *k), (1, *s)
    sizes = x._array().shape[1:-1] if rank == 2 else (1, x._array().shape[1])
    if not (isinstance(padding, str) and padding.upper() in ("SAME", "VALID")):
        raise errors.InvalidArgumentError(
            f"{op_name}: padding must be 'SAME' or 'VALID', got {padding!r}"
        )
    pads = _pads(padding, sizes, k, s, op_name)
    return x, (k[0], k[1]), (s[0], s[1]), pads


def _max_pool(x: Any, k: tuple[int, int], s: tuple[int, int], pads: Pads, op_name: str) -> Tensor:
    # one elementwise maximum per window position over whole (N, OH, OW, C) slabs: the channel
    # axis stays contiguous, which a reduction over the patch view's window axes would not keep
    a = x._array()
    m = xp(a)
    oh, ow = _out_sizes(a.shape[1:3], pads, k, s, op_name)
    padded = _pad(a, pads, -np.inf)
    windows = _windows((oh, ow), k, s, (1, 1))
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
        return (_crop(dx, pads),)

    return out(z, (x,), backward)


def _window_counts(size: int, k: int, s: int, pad: tuple[int, int], n_out: int) -> np.ndarray:
    """How many real (unpadded) elements each output window covers along one dimension."""
    start = np.arange(n_out) * s - pad[0]
    return np.minimum(start + k, size) - np.maximum(start, 0)


def _avg_pool(x: Any, k: tuple[int, int], s: tuple[int, int], pads: Pads, op_name: str) -> Tensor:
    a = x._array()
    m = xp(a)
    oh, ow = _out_sizes(a.shape[1:3], pads, k, s, op_name)
    padded = _pad(a, pads, 0.0)
    windows = _windows((oh, ow), k, s, (1, 1))
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
        return (_crop(dx, pads),)

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
    _check_format(data_format, ("NHWC",), "max_pool2d")
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
    _check_format(data_format, ("NHWC",), "avg_pool2d")
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
    _check_format(data_format, ("NWC",), "max_pool1d")
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
    _check_format(data_format, ("NWC",), "avg_pool1d")
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

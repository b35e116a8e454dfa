"""Window geometry shared by convolution and pooling (channels last, two spatial dims).

Padding follows TensorFlow: ``VALID`` uses no padding; ``SAME`` gives
``ceil(size / stride)`` outputs and pads ``total // 2`` before and the rest
after. A window op reads its padded input through a strided *patch view*
``(N, OH, OW, KH, KW, C)`` (``as_strided``: no copy) or through its ``KH*KW``
*slabs* ``(N, OH, OW, C)``, one per kernel position; ``col2im`` is the adjoint
of the patch view (a strided add per kernel position, then the padding cropped).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from psflow import errors
from psflow.ops._core import node, xp

Pads = tuple[tuple[int, int], tuple[int, int]]


# -- shapes and padding ----------------------------------------------------------------


def spatial_values(value: Any, rank: int, name: str, op_name: str) -> tuple[int, ...]:
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


def padding_amounts(
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


def out_sizes(
    sizes: Sequence[int], pads: Pads, windows: Sequence[int], strides: Sequence[int], op_name: str
) -> tuple[int, int]:
    """Output sizes ``(OH, OW)`` for padded sizes, effective window extents and strides.

    Raises:
        InvalidArgumentError: a window larger than the padded input, naming the sizes.
    """
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


def float_input(x: Any, rank: int, op_name: str, what: str = "input") -> Any:
    """``x`` as a node of rank ``rank`` and a floating dtype.

    Raises:
        InvalidArgumentError: another rank or dtype, naming the shape or dtype.
    """
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


def check_format(data_format: Any, allowed: tuple[str, ...], op_name: str) -> None:
    """Raises InvalidArgumentError unless ``data_format`` is None or one of ``allowed``."""
    if data_format is not None and str(data_format).upper() not in allowed:
        raise errors.InvalidArgumentError(
            f"{op_name}: data_format {data_format!r} is not supported; use {allowed[0]} "
            "(channels last)"
        )


# -- patch views -----------------------------------------------------------------------


def pad_input(a: Any, pads: Pads, value: float) -> Any:
    """``a`` (NHWC) padded along height and width with ``value``; ``a`` itself without padding."""
    if pads == ((0, 0), (0, 0)):
        return a
    m = xp(a)
    return m.pad(a, ((0, 0), pads[0], pads[1], (0, 0)), constant_values=value)


def patch_view(
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


def window_slabs(
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


def col2im(
    dpatches: Any,
    padded_shape: tuple[int, ...],
    pads: Pads,
    strides: tuple[int, int],
    dilations: tuple[int, int],
) -> Any:
    """The adjoint of :func:`patch_view` followed by the crop of the padding."""
    dx = xp(dpatches).zeros(padded_shape, dtype=dpatches.dtype)
    add_patches(dpatches, dx, strides, dilations)
    return crop_padding(dx, pads)


def add_patches(
    dpatches: Any, dx: Any, strides: tuple[int, int], dilations: tuple[int, int]
) -> None:
    """Adds the ``(N, OH, OW, KH, KW, C)`` patches into the padded ``dx`` (NHWC) where the
    patch view reads them (:func:`col2im` without the allocation and the crop)."""
    _, oh, ow, kh, kw, _ = dpatches.shape
    for i, j, rows, cols in window_slabs((oh, ow), (kh, kw), strides, dilations):
        dx[:, rows, cols, :] += dpatches[:, :, :, i, j, :]


def crop_padding(dx: Any, pads: Pads) -> Any:
    """``dx`` (NHWC, padded) without its padding."""
    (t, b), (left, r) = pads
    if t or b or left or r:
        dx = dx[:, t : dx.shape[1] - b, left : dx.shape[2] - r, :]
    return dx

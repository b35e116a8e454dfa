"""Convolution on CuPy arrays through cuDNN (CuPy's ``cupyx.cudnn``), where CuPy has it.

cuDNN picks a convolution algorithm for the shapes (implicit GEMM, FFT,
Winograd) where the im2col path of :mod:`psflow.ops.conv_ops` builds the whole
patch matrix in device memory first. CuPy's functions take NCHW arrays with
OIHW filters and one symmetric padding per spatial dimension, so:

- the NHWC input and the HWIO kernel are transposed into those layouts (a copy
  each on the device) and the output back;
- TensorFlow's ``SAME`` padding, which puts the odd pixel after, is symmetric
  or not: an asymmetric one is applied to the input first (and cut from its
  gradient), a symmetric one is left to cuDNN;
- the backward passes use cuDNN's deterministic algorithms, so a seeded run
  gives the same bits every time, as on the CPU; Tensor Cores are not used
  (``tensor_core="never"``): their TF32 mode, TensorFlow's default on recent
  GPUs, rounds float32 operands to 10 bits of mantissa, where psflow keeps
  float32 products float32 on every device.

Without ``cupyx.cudnn`` (a CuPy without cuDNN's libraries), with a dtype
cuDNN does not take, or with ``PSFLOW_CUDNN=0`` (:mod:`psflow.settings`),
:func:`cudnn_or_none` says None and the ops keep the im2col path. A cuDNN that
imports but fails its first convolution (a library of another version, say) is
given up for the process with one warning naming the error (:func:`give_up`),
and that convolution runs on the im2col path.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from psflow import backend, settings

logger = logging.getLogger(__name__)

_DTYPES = ("float16", "float32", "float64")
_lock = threading.Lock()
_checked: tuple[Any, Any] | None = None  # (the cupy module checked, its cudnn or None)


def cudnn_or_none(dtype: Any = None) -> Any:
    """CuPy's ``cupyx.cudnn`` when it imports and may be used (for ``dtype``), else None."""
    if not settings.current().cudnn:
        return None
    if dtype is not None and str(dtype) not in _DTYPES:
        return None
    global _checked
    cp = backend.cupy_or_none()
    if cp is None:
        return None
    checked = _checked
    if checked is None or checked[0] is not cp:  # a new CuPy (tests swap in doubles)
        with _lock:
            try:
                from cupyx import cudnn
            except Exception:  # no cuDNN libraries: the im2col path
                cudnn = None
            _checked = checked = (cp, cudnn)
    return checked[1]


def give_up(error: BaseException) -> None:
    """Stops using cuDNN in this process (the im2col path from now on), saying why once."""
    global _checked
    cp = backend.cupy_or_none()
    with _lock:
        if _checked is not None and _checked[0] is cp and _checked[1] is None:
            return
        _checked = (cp, None)
    logger.warning(
        "cuDNN's convolution failed (%s: %s): convolutions on GPUs use the im2col path "
        "from now on in this process",
        type(error).__name__,
        error,
    )


def conv2d(
    cudnn: Any,
    a: Any,
    kernel: Any,
    bias: Any,
    pads: tuple[tuple[int, int], tuple[int, int]],
    strides: tuple[int, int],
    dilations: tuple[int, int],
    relu: bool,
) -> tuple[Any, Any]:
    """``relu?(conv(a, kernel) + bias)`` of NHWC ``a`` and HWIO ``kernel`` on the device.

    Returns the NHWC output and its VJP, ``backward(g, needs)`` with ``needs`` for
    (input, kernel[, bias]) as :func:`psflow.ops.conv_ops._conv`'s backward takes them.
    """
    cp = backend.xp_of(a)
    (top, bottom), (left, right) = pads
    explicit = top != bottom or left != right
    if explicit:  # cuDNN pads both sides alike: the asymmetric rest goes on the input
        a = cp.pad(a, ((0, 0), (top, bottom), (left, right), (0, 0)))
        pad = (0, 0)
    else:
        pad = (top, left)
    x = cp.ascontiguousarray(a.transpose(0, 3, 1, 2))
    w = cp.ascontiguousarray(kernel.transpose(3, 2, 0, 1))
    n, _, h, wd = x.shape
    out_hw = tuple(
        (size + 2 * p - ((k - 1) * d + 1)) // s + 1
        for size, p, k, d, s in zip((h, wd), pad, w.shape[2:], dilations, strides)
    )
    y = cp.empty((n, w.shape[0], *out_hw), dtype=x.dtype)
    options = {"auto_tune": False, "tensor_core": "never"}
    geometry = (pad, tuple(strides), tuple(dilations), 1)
    cudnn.convolution_forward(x, w, bias, y, *geometry, **options)
    z = cp.ascontiguousarray(y.transpose(0, 2, 3, 1))
    del y
    if relu:
        cp.maximum(z, 0, out=z)

    def backward(g: Any, needs: tuple[bool, ...]) -> tuple[Any, ...]:
        if relu:  # an explicit dtype: a mixed float-by-bool product is slower
            g = cp.multiply(g, z > 0, dtype=g.dtype)
        gy = cp.ascontiguousarray(g.transpose(0, 3, 1, 2))
        exact = {**options, "deterministic": True}
        dx = dw = db = None
        if needs[0]:
            gx = cp.empty(x.shape, dtype=x.dtype)
            cudnn.convolution_backward_data(w, gy, None, gx, *geometry, **exact)
            dx = cp.ascontiguousarray(gx.transpose(0, 2, 3, 1))
            if explicit:
                dx = dx[:, top : dx.shape[1] - bottom, left : dx.shape[2] - right, :]
        if needs[1]:
            gw = cp.empty(w.shape, dtype=w.dtype)
            cudnn.convolution_backward_filter(x, gy, gw, *geometry, **exact)
            dw = cp.ascontiguousarray(gw.transpose(2, 3, 1, 0))
        if len(needs) == 3:
            if needs[2]:
                db = gy.sum(axis=(0, 2, 3))
            return dx, dw, db
        return dx, dw

    return z, backward

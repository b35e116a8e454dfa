"""A strict double of ``cupyx.cudnn``'s convolutions, on the strict CuPy double's arrays.

CuPy exposes cuDNN's convolutions as three functions on NCHW arrays with OIHW
filters (cross-correlation, one symmetric padding per spatial dimension, no
implicit layout change):

* ``convolution_forward(x, W, b, y, pad, stride, dilation, groups, *, auto_tune,
  tensor_core)`` writes ``y`` (and adds ``b`` per output channel when given);
* ``convolution_backward_filter(x, gy, gW, pad, stride, dilation, groups, *,
  deterministic, auto_tune, tensor_core)`` writes ``gW``;
* ``convolution_backward_data(W, gy, b, gx, pad, stride, dilation, groups, *,
  deterministic, auto_tune, tensor_core)`` writes ``gx``.

This double computes each from its definition on the NumPy arrays underneath
(a sum over the kernel positions of the padded input's strided slices, written
independently of psflow's NHWC im2col), and is strict where a caller can go
wrong: every operand must be a device array on the current GPU (host arrays
are refused, as the CuPy double refuses them), all of one floating dtype, the
output of exactly the shape the geometry gives and C-contiguous (cuDNN writes
through a descriptor of that shape), ``groups`` 1, ``tensor_core`` one of
CuPy's three words. The calls are counted, so a test can tell that the cuDNN
path ran.
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np

CALLS = {"forward": 0, "backward_filter": 0, "backward_data": 0}


def reset_counts() -> None:
    """Sets every call count back to zero."""
    for name in CALLS:
        CALLS[name] = 0


def _arrays(*named: tuple[str, Any]) -> list[np.ndarray]:
    from tests import strict_cupy

    dev = strict_cupy._st().current()
    out = []
    for name, value in named:
        if not isinstance(value, strict_cupy.ndarray):
            raise TypeError(f"cudnn: {name} must be a cupy.ndarray, got {type(value).__name__}")
        out.append(strict_cupy._unwrap(value, dev))
    dtypes = {a.dtype for a in out}
    if len(dtypes) != 1 or out[0].dtype.kind != "f":
        raise TypeError(
            f"cudnn: operands of one floating dtype expected, got {sorted(map(str, dtypes))}"
        )
    return out


def _geometry(pad: Any, stride: Any, dilation: Any, groups: int, tensor_core: str) -> None:
    for name, value in (("pad", pad), ("stride", stride), ("dilation", dilation)):
        if not (isinstance(value, tuple) and len(value) == 2):
            raise TypeError(f"cudnn: {name} must be a tuple of 2 ints, got {value!r}")
    if groups != 1:
        raise ValueError(f"cudnn double: groups={groups} is not modelled")
    if tensor_core not in ("auto", "always", "never"):
        raise ValueError('tensor_code_mode must be either of "always", "auto", or "never".')


def _out_hw(x_hw: tuple[int, int], k_hw: tuple[int, int], pad, stride, dilation) -> tuple:
    return tuple(
        (x_hw[i] + 2 * pad[i] - ((k_hw[i] - 1) * dilation[i] + 1)) // stride[i] + 1 for i in (0, 1)
    )


def _output_gradient(ga, x_shape, w_shape, pad, stride, dilation) -> tuple:
    """The output size the geometry gives, which ``gy`` must have (else ValueError)."""
    out_hw = _out_hw(x_shape[2:], w_shape[2:], pad, stride, dilation)
    if tuple(ga.shape) != (x_shape[0], w_shape[0], *out_hw):
        raise ValueError(f"cudnn: gy has shape {ga.shape}; the geometry gives {out_hw}")
    return out_hw


def _writable(a: np.ndarray, shape: tuple, name: str) -> None:
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"cudnn: {name} has shape {a.shape}; the geometry gives {shape}")
    if not a.flags.c_contiguous:
        raise ValueError(f"cudnn: {name} must be C-contiguous")


def _slices(k: tuple[int, int], out_hw: tuple, stride, dilation):
    """For each kernel position (p, q): the rows and columns of the padded input it reads."""
    for p in range(k[0]):
        rows = slice(p * dilation[0], p * dilation[0] + stride[0] * (out_hw[0] - 1) + 1, stride[0])
        for q in range(k[1]):
            c0 = q * dilation[1]
            yield p, q, rows, slice(c0, c0 + stride[1] * (out_hw[1] - 1) + 1, stride[1])


def _padded(x: np.ndarray, pad) -> np.ndarray:
    return np.pad(x, ((0, 0), (0, 0), (pad[0], pad[0]), (pad[1], pad[1])))


def convolution_forward(
    x, W, b, y, pad, stride, dilation, groups, *, auto_tune: bool, tensor_core: str
) -> None:
    """``y = conv(x, W) (+ b)``: NCHW input and output, OIHW filters."""
    _geometry(pad, stride, dilation, groups, tensor_core)
    xa, wa, ya = _arrays(("x", x), ("W", W), ("y", y))
    if wa.shape[1] != xa.shape[1]:
        raise ValueError(f"cudnn: W has {wa.shape[1]} input channels, x {xa.shape[1]}")
    out_hw = _out_hw(xa.shape[2:], wa.shape[2:], pad, stride, dilation)
    _writable(ya, (xa.shape[0], wa.shape[0], *out_hw), "y")
    xp = _padded(xa, pad)
    total = np.zeros(ya.shape, dtype=ya.dtype)
    for p, q, rows, cols in _slices(wa.shape[2:], out_hw, stride, dilation):
        total += np.einsum("ncij,oc->noij", xp[:, :, rows, cols], wa[:, :, p, q])
    if b is not None:
        (ba,) = _arrays(("b", b))
        total += ba.reshape(1, -1, 1, 1)
    ya[...] = total
    CALLS["forward"] += 1


def convolution_backward_filter(
    x,
    gy,
    gW,
    pad,
    stride,
    dilation,
    groups,
    *,
    deterministic: bool,
    auto_tune: bool,
    tensor_core: str,
) -> None:
    """``gW[o, c, p, q] = sum over n, i, j of gy[n, o, i, j] * padded x[n, c, ...]``."""
    _geometry(pad, stride, dilation, groups, tensor_core)
    xa, ga, wa = _arrays(("x", x), ("gy", gy), ("gW", gW))
    out_hw = _output_gradient(ga, xa.shape, wa.shape, pad, stride, dilation)
    _writable(wa, (ga.shape[1], xa.shape[1], *wa.shape[2:]), "gW")
    xp = _padded(xa, pad)
    for p, q, rows, cols in _slices(wa.shape[2:], out_hw, stride, dilation):
        wa[:, :, p, q] = np.einsum("noij,ncij->oc", ga, xp[:, :, rows, cols])
    CALLS["backward_filter"] += 1


def convolution_backward_data(
    W,
    gy,
    b,
    gx,
    pad,
    stride,
    dilation,
    groups,
    *,
    deterministic: bool,
    auto_tune: bool,
    tensor_core: str,
) -> None:
    """``gx``: each kernel position's ``W``-weighted ``gy`` added where it read, the padding cut."""
    _geometry(pad, stride, dilation, groups, tensor_core)
    wa, ga, xa = _arrays(("W", W), ("gy", gy), ("gx", gx))
    out_hw = _output_gradient(ga, xa.shape, wa.shape, pad, stride, dilation)
    _writable(xa, xa.shape, "gx")
    if b is not None:
        raise ValueError("cudnn double: a bias on backward data is not modelled")
    full = np.zeros(_padded(xa, pad).shape, dtype=xa.dtype)
    for p, q, rows, cols in _slices(wa.shape[2:], out_hw, stride, dilation):
        full[:, :, rows, cols] += np.einsum("noij,oc->ncij", ga, wa[:, :, p, q])
    xa[...] = full[:, :, pad[0] : full.shape[2] - pad[0], pad[1] : full.shape[3] - pad[1]]
    CALLS["backward_data"] += 1


def build_module() -> types.ModuleType:
    """The ``cupyx.cudnn`` module of the double."""
    mod = types.ModuleType("cupyx.cudnn")
    mod.convolution_forward = convolution_forward
    mod.convolution_backward_filter = convolution_backward_filter
    mod.convolution_backward_data = convolution_backward_data
    return mod

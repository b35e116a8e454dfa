"""Plain loops over NumPy arrays that :mod:`psflow.ops.compiled` compiles with Numba.

Each function is valid Python and valid Numba (nopython mode): what it computes
does not depend on which runs it, only how fast. Each gives the same bits as
the NumPy calls it replaces (see the callers): a maximum is exact, and a
gradient kept or dropped is ``g * 1`` or ``g * 0`` in the gradient's dtype (so
``-0.0`` and NaN come out as NumPy's multiply gives them). ``w`` is
``np.array([0, 1], dtype)``: the two factors, in the gradient's dtype.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def max_pool_forward(padded: Any, kh: int, kw: int, sh: int, sw: int, z: Any) -> None:
    """``z[b, i, j] =`` the maximum of ``padded``'s window ``(i, j)``, windows that do not
    overlap (stride >= window); a NaN in a window gives NaN, as ``np.maximum`` does, and of
    two equal values the later (the sign of a zero maximum is the later zero's, as x86's
    ``np.maximum`` gives it; on other CPUs NumPy's may differ in that sign only)."""
    n, oh, ow, c = z.shape
    for b in range(n):
        for i in range(oh):
            for j in range(ow):
                zz = z[b, i, j]
                first = padded[b, i * sh, j * sw]
                for ch in range(c):
                    zz[ch] = first[ch]
                for p in range(kh):
                    for q in range(kw):
                        if p == 0 and q == 0:
                            continue
                        src = padded[b, i * sh + p, j * sw + q]
                        for ch in range(c):
                            v = src[ch]
                            m = zz[ch]
                            zz[ch] = v if (v >= m or v != v) else m


def max_pool_backward(
    padded: Any, z: Any, g: Any, kh: int, kw: int, sh: int, sw: int, w: Any, dx: Any
) -> None:
    """Routes ``g[b, i, j]`` to the first position (row-major in the window) of window
    ``(i, j)`` that equals its maximum ``z``, and ``g * 0`` to the window's other positions;
    ``dx`` positions in no window are left as they are."""
    n, oh, ow, c = z.shape
    zero, one = w[0], w[1]
    taken = np.zeros(c, dtype=np.bool_)  # per channel: its window's maximum is routed
    for b in range(n):
        for i in range(oh):
            for j in range(ow):
                zz = z[b, i, j]
                gg = g[b, i, j]
                for ch in range(c):
                    taken[ch] = False
                for p in range(kh):
                    for q in range(kw):
                        src = padded[b, i * sh + p, j * sw + q]
                        dst = dx[b, i * sh + p, j * sw + q]
                        for ch in range(c):
                            hit = src[ch] == zz[ch] and not taken[ch]
                            dst[ch] = gg[ch] * (one if hit else zero)
                            taken[ch] = taken[ch] or hit


def max_pool_forward_2x2(padded: Any, sh: int, sw: int, z: Any) -> None:
    """:func:`max_pool_forward` for 2x2 windows (Keras's default), the window unrolled: the
    channel loop then runs in vector registers."""
    n, oh, ow, c = z.shape
    for b in range(n):
        for i in range(oh):
            r = i * sh
            for j in range(ow):
                col = j * sw
                zz = z[b, i, j]
                a0, a1 = padded[b, r, col], padded[b, r, col + 1]
                a2, a3 = padded[b, r + 1, col], padded[b, r + 1, col + 1]
                for ch in range(c):
                    m = a0[ch]
                    v = a1[ch]
                    m = v if (v >= m or v != v) else m
                    v = a2[ch]
                    m = v if (v >= m or v != v) else m
                    v = a3[ch]
                    zz[ch] = v if (v >= m or v != v) else m


def max_pool_backward_2x2(padded: Any, z: Any, g: Any, sh: int, sw: int, w: Any, dx: Any) -> None:
    """:func:`max_pool_backward` for 2x2 windows, the window unrolled."""
    n, oh, ow, c = z.shape
    zero, one = w[0], w[1]
    for b in range(n):
        for i in range(oh):
            r = i * sh
            for j in range(ow):
                col = j * sw
                zz, gg = z[b, i, j], g[b, i, j]
                a0, a1 = padded[b, r, col], padded[b, r, col + 1]
                a2, a3 = padded[b, r + 1, col], padded[b, r + 1, col + 1]
                d0, d1 = dx[b, r, col], dx[b, r, col + 1]
                d2, d3 = dx[b, r + 1, col], dx[b, r + 1, col + 1]
                for ch in range(c):
                    m, gc = zz[ch], gg[ch]
                    h0 = a0[ch] == m
                    h1 = a1[ch] == m and not h0
                    taken = h0 or h1
                    h2 = a2[ch] == m and not taken
                    h3 = a3[ch] == m and not (taken or h2)
                    d0[ch] = gc * (one if h0 else zero)
                    d1[ch] = gc * (one if h1 else zero)
                    d2[ch] = gc * (one if h2 else zero)
                    d3[ch] = gc * (one if h3 else zero)


def relu_grad(g: Any, z: Any, w: Any, out: Any) -> None:
    """``out = g * (z > 0)`` over 1-D arrays: the ReLU's input gradient from its output ``z``."""
    zero, one = w[0], w[1]
    for i in range(g.size):
        out[i] = g[i] * (one if z[i] > 0 else zero)


def sgd(var: Any, grad: Any, lr: Any) -> None:
    """``var -= grad * lr`` over 1-D arrays (``SGD`` without momentum)."""
    for i in range(var.size):
        var[i] -= grad[i] * lr


def sgd_momentum(var: Any, grad: Any, m: Any, lr: Any, mom: Any, nesterov: bool) -> None:
    """``m = m * mom - grad * lr``, then ``var += m`` (or, Nesterov's,
    ``var += m * mom - grad * lr``) over 1-D arrays, each step rounded as NumPy's."""
    for i in range(var.size):
        mi = m[i] * mom
        mi = mi - grad[i] * lr
        m[i] = mi
        if nesterov:
            var[i] += mi * mom - grad[i] * lr
        else:
            var[i] += mi


def adam(var: Any, grad: Any, m: Any, v: Any, alpha: Any, b1c: Any, b2c: Any, eps: Any) -> None:
    """Adam's step over 1-D arrays (``b1c = 1 - beta_1``, ``b2c = 1 - beta_2``, ``alpha`` the
    bias-corrected rate), each operation rounded as NumPy's sequence of whole-array ones."""
    for i in range(var.size):
        g = grad[i]
        mi = m[i] + (g - m[i]) * b1c
        m[i] = mi
        vi = v[i] + (g * g - v[i]) * b2c
        v[i] = vi
        var[i] -= (mi * alpha) / (np.sqrt(vi) + eps)

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


def max_pool_argmax(
    z: Any, kh: int, kw: int, sh: int, sw: int, relu: bool, pooled: Any, idx: Any
) -> None:
    """The max pool of ``relu(z)`` (or of ``z`` without ``relu``) over windows that do not
    overlap (stride >= window) into ``pooled``, and in ``idx`` which position of each
    window (``p * kw + q``, row-major) is the first equal to its maximum, or ``kh * kw``
    where none is (a NaN maximum): where the gradient goes, so ``z`` need not be kept.

    The maximum is ``np.maximum``'s, folded over the window in row-major order: a NaN in
    the window gives NaN, and of two equal values the later (the sign of a zero maximum
    is the later zero's, as x86's ``np.maximum`` gives it; other CPUs' NumPy may differ in
    that sign only). The ReLU comes after the pool: the maximum of ``relu(z)`` is ``relu``
    of the maximum of ``z``; where that maximum is zero no gradient passes the ReLU, so
    which position ``idx`` names does not matter."""
    n, oh, ow, c = pooled.shape
    none = kh * kw
    for b in range(n):
        for i in range(oh):
            for j in range(ow):
                zz, ii = pooled[b, i, j], idx[b, i, j]
                first = z[b, i * sh, j * sw]
                for ch in range(c):
                    zz[ch] = first[ch]
                    ii[ch] = none
                for p in range(kh):
                    for q in range(kw):
                        if p == 0 and q == 0:
                            continue
                        src = z[b, i * sh + p, j * sw + q]
                        for ch in range(c):
                            v = src[ch]
                            m = zz[ch]
                            zz[ch] = v if (v >= m or v != v) else m
                for pos in range(none - 1, -1, -1):  # backwards: the first equal one writes last
                    src = z[b, i * sh + pos // kw, j * sw + pos % kw]
                    for ch in range(c):
                        ii[ch] = pos if src[ch] == zz[ch] else ii[ch]
                if relu:
                    for ch in range(c):
                        m = zz[ch]
                        zz[ch] = m if (m > 0 or m != m) else 0


def max_pool_argmax_2x2(z: Any, sh: int, sw: int, relu: bool, pooled: Any, idx: Any) -> None:
    """:func:`max_pool_argmax` for 2x2 windows, the window unrolled."""
    n, oh, ow, c = pooled.shape
    for b in range(n):
        for i in range(oh):
            r = i * sh
            for j in range(ow):
                col = j * sw
                zz, ii = pooled[b, i, j], idx[b, i, j]
                a0, a1 = z[b, r, col], z[b, r, col + 1]
                a2, a3 = z[b, r + 1, col], z[b, r + 1, col + 1]
                for ch in range(c):
                    v0, v1, v2, v3 = a0[ch], a1[ch], a2[ch], a3[ch]
                    m = v1 if (v1 >= v0 or v1 != v1) else v0
                    m = v2 if (v2 >= m or v2 != v2) else m
                    m = v3 if (v3 >= m or v3 != v3) else m
                    at = 4 if v3 != m else 3
                    at = 2 if v2 == m else at
                    at = 1 if v1 == m else at
                    ii[ch] = 0 if v0 == m else at
                    zz[ch] = m if (m > 0 or m != m or not relu) else 0


def max_pool_argmax_grad(
    g: Any, pooled: Any, idx: Any, kh: int, kw: int, sh: int, sw: int, relu: bool, w: Any, dz: Any
) -> None:
    """The gradient, into ``dz``, of ``max_pool(relu(z))`` (or of ``max_pool(z)`` without
    ``relu``) from :func:`max_pool_argmax`'s ``pooled`` and ``idx``: ``g`` at each window's
    first maximum where (with ``relu``) that maximum is above zero, ``g * 0`` at the rest
    of the window; positions in no window are left as they are. The bits of the pool's
    routing (``g * 1`` or ``g * 0``) followed by :func:`relu_grad`: ``(g * a) * b`` is
    ``g * (a * b)`` for factors of 0 and 1. One store per loop over the channels (the
    loops vectorize)."""
    n, oh, ow, c = pooled.shape
    zero, one = w[0], w[1]
    at = np.empty(c, dtype=np.uint8)
    none = kh * kw
    for b in range(n):
        for i in range(oh):
            for j in range(ow):
                gg, mm, ii = g[b, i, j], pooled[b, i, j], idx[b, i, j]
                for ch in range(c):
                    at[ch] = ii[ch] if (mm[ch] > 0 or not relu) else none
                for p in range(kh):
                    for q in range(kw):
                        dst = dz[b, i * sh + p, j * sw + q]
                        pos = p * kw + q
                        for ch in range(c):
                            dst[ch] = gg[ch] * (one if at[ch] == pos else zero)


def max_pool_argmax_grad_2x2(
    g: Any, pooled: Any, idx: Any, sh: int, sw: int, relu: bool, w: Any, dz: Any
) -> None:
    """:func:`max_pool_argmax_grad` for 2x2 windows, the window unrolled."""
    n, oh, ow, c = pooled.shape
    zero, one = w[0], w[1]
    at = np.empty(c, dtype=np.uint8)
    for b in range(n):
        for i in range(oh):
            r = i * sh
            for j in range(ow):
                col = j * sw
                gg, mm, ii = g[b, i, j], pooled[b, i, j], idx[b, i, j]
                for ch in range(c):
                    at[ch] = ii[ch] if (mm[ch] > 0 or not relu) else 4
                for pos in range(4):
                    dst = dz[b, r + pos // 2, col + pos % 2]
                    for ch in range(c):
                        dst[ch] = gg[ch] * (one if at[ch] == pos else zero)


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

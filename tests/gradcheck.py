"""Finite-difference gradient checks: tape gradients against central differences.

A check evaluates ``f`` (psflow tensors in, a tensor or a list of tensors out)
at float64 points, draws a random upstream gradient ``u`` for every output,
and compares the tape's vector-Jacobian product ``tape.gradient(f(xs), xs,
output_gradients=u)`` with the central difference of the scalar
``L(xs) = sum_i sum(u_i * f(xs)_i)``, one input element at a time:

    dL/dx_k ~= (L(x + h e_k) - L(x - h e_k)) / (2 h)

The error is norm-wise relative, ``|a - n| / max(|a|, |n|)`` (0 when both
are zero), so elements that are tiny do not dominate; with float64 and
``h = 1e-6`` the truncation error is ~1e-12 and rounding ~1e-10 of the scale.

Example:
    >>> import psflow as pf
    >>> import numpy as np
    >>> err = check_gradients(lambda x: pf.exp(x), np.array([0.5, 1.0]))
    >>> err < 1e-6
    True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import psflow as pf

Fn = Callable[..., Any]


def _outputs(y: Any) -> list[Any]:
    return list(y) if isinstance(y, (list, tuple)) else [y]


def _as_array(g: Any) -> np.ndarray | None:
    """A gradient as a dense NumPy array (``IndexedSlices`` densified), or ``None``."""
    if g is None:
        return None
    if isinstance(g, pf.IndexedSlices):
        return np.asarray(pf.convert_to_tensor(g).numpy())
    return np.asarray(g.numpy())


def upstreams(f: Fn, xs: Sequence[np.ndarray], seed: int = 0) -> list[np.ndarray]:
    """One random float64 upstream gradient per output of ``f`` at ``xs``."""
    rng = np.random.default_rng(seed)
    outs = _outputs(f(*(pf.constant(x) for x in xs)))
    return [rng.standard_normal(np.shape(o.numpy())) for o in outs]


def tape_vjp(f: Fn, xs: Sequence[np.ndarray], us: Sequence[np.ndarray]) -> list[np.ndarray | None]:
    """The tape's gradients of ``sum(u_i * f(xs)_i)`` w.r.t. each of ``xs``.

    Every input is a constant watched by the tape; sparse gradients come back
    densified, unconnected ones as ``None``.
    """
    ts = [pf.constant(x) for x in xs]
    with pf.GradientTape() as tape:
        tape.watch(ts)
        outs = _outputs(f(*ts))
    grads = tape.gradient(outs, ts, output_gradients=[pf.constant(u) for u in us])
    return [_as_array(g) for g in grads]


def numeric_vjp(
    f: Fn, xs: Sequence[np.ndarray], us: Sequence[np.ndarray], eps: float = 1e-6
) -> list[np.ndarray]:
    """Central differences of ``sum(u_i * f(xs)_i)`` w.r.t. each element of each of ``xs``."""

    def loss(points: list[np.ndarray]) -> float:
        outs = _outputs(f(*(pf.constant(p) for p in points)))
        return float(sum(np.sum(u * np.asarray(o.numpy(), np.float64)) for u, o in zip(us, outs)))

    points = [np.array(x, dtype=np.float64, copy=True) for x in xs]
    grads = []
    for p in points:
        g = np.zeros_like(p)
        flat, gflat = p.reshape(-1), g.reshape(-1)
        for k in range(flat.size):
            orig = flat[k]
            flat[k] = orig + eps
            up = loss(points)
            flat[k] = orig - eps
            down = loss(points)
            flat[k] = orig
            gflat[k] = (up - down) / (2 * eps)
        grads.append(g)
    return grads


def relative_error(a: np.ndarray, b: np.ndarray) -> float:
    """``|a - b| / max(|a|, |b|)`` in the 2-norm; 0 when both are zero."""
    scale = max(float(np.linalg.norm(a)), float(np.linalg.norm(b)))
    return 0.0 if scale == 0 else float(np.linalg.norm(a - b)) / scale


def check_gradients(
    f: Fn,
    *xs: np.ndarray,
    tol: float = 1e-6,
    eps: float = 1e-6,
    seed: int = 0,
    allow_zero: bool = False,
) -> float:
    """Asserts that the tape's gradients of ``f`` at ``xs`` match central differences.

    Inputs must be float64 arrays; gradients must come back float64, with the
    inputs' shapes. Unless ``allow_zero``, numeric gradients that are all zero
    for every input fail the check (it would compare nothing). Returns the largest relative error.

    Raises:
        AssertionError: a gradient is missing, of the wrong dtype or shape, or off
            by more than ``tol``.
    """
    xs = tuple(np.asarray(x, dtype=np.float64) for x in xs)
    us = upstreams(f, xs, seed)
    analytic = tape_vjp(f, xs, us)
    numeric = numeric_vjp(f, xs, us, eps)
    assert allow_zero or any(n.any() for n in numeric), "every numeric gradient is all zero"
    worst = 0.0
    for i, (a, n, x) in enumerate(zip(analytic, numeric, xs)):
        if a is None:
            assert allow_zero and not n.any(), f"input {i}: tape gave None, numeric {n}"
            continue
        assert a.dtype == np.float64, f"input {i}: gradient dtype {a.dtype}, want float64"
        assert a.shape == x.shape, f"input {i}: gradient shape {a.shape}, want {x.shape}"
        err = relative_error(a, n)
        assert err < tol, (
            f"input {i}: relative error {err:.3g} >= {tol}\nanalytic:\n{a}\nnumeric:\n{n}"
        )
        worst = max(worst, err)
    return worst

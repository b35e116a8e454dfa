"""How closely float32 results must agree when the arithmetic is not the same operation.

Bit equality holds only where two results come from the same operations on
the same shapes in the same order: a save/load round trip predicting the same
batch, a seeded rerun in one process, the copies of a mirrored variable.  Where
the batch is split differently (replicas, workers), or the BLAS runs another
kernel (another CPU, core type or thread count), each GEMM may block its
k-long sums differently: every output is then the same sum reassociated, off
by at most about ``k * eps * sum(|terms|)``.  The models these tests compare
are small (k of tens, a few layers, values of order one), so a few ulps of
float32 per layer bound the difference; :data:`SPLIT_ULPS` allows 16.
"""

from __future__ import annotations

from typing import Any

import numpy as np

F32_EPS = float(np.finfo(np.float32).eps)
"""float32's machine epsilon, 2**-23 (about 1.19e-07)."""

SPLIT_ULPS = 16
"""float32 ulps two results computed over different splits may differ by."""


def assert_close_across_splits(actual: Any, desired: Any, ulps: int = SPLIT_ULPS) -> None:
    """Asserts ``actual`` equals ``desired`` within ``ulps`` float32 ulps of the larger values.

    The absolute part scales with the largest magnitude in ``desired`` (at least
    one), since a reassociated sum errs relative to its terms, not its result:
    an output near zero may come from terms of order one.
    """
    desired = np.asarray(desired)
    scale = max(1.0, float(np.max(np.abs(desired)))) if desired.size else 1.0
    np.testing.assert_allclose(
        np.asarray(actual), desired, rtol=ulps * F32_EPS, atol=ulps * F32_EPS * scale
    )

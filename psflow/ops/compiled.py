"""Compiled CPU kernels for loops NumPy runs as many small calls: Numba, where installed.

A 2x2 max pool's backward pass in NumPy is 16 calls a chunk over strided runs
of a few dozen floats (compare, mask, route, multiply per window position);
the ReLU's gradient is two passes (a mask, then a product); Adam's update
eight passes over four arrays. Compiled, each is one pass over its arrays.
The loops live in :mod:`psflow.ops._loops`; each rounds every operation as the
NumPy calls it replaces, so a run's results do not depend on whether Numba is
installed, or on when its compile ended.

:func:`kernels` returns the compiled functions for a dtype (float32 and
float64), or None, and the callers keep their NumPy path, where:

- Numba is not installed (it is a dependency on the platforms it has wheels
  for; elsewhere this is said once in the log);
- ``PSFLOW_COMPILED_KERNELS=0`` (:mod:`psflow.settings`);
- the array is small (:data:`MIN_ELEMENTS`);
- the kernels are still compiling: the first call starts the compile in a
  background thread and never waits for it;
- compiling failed (said once, with the error; NumPy from then on).

Compiled code is cached on disk by Numba (``cache=True``: beside the module,
or in Numba's user cache where the package is read-only), so a process pays
the compile (a few seconds of a background thread) only when no earlier
process left the cache, and otherwise loads it (about half a second, Numba's
import included). The functions release the GIL (``nogil=True``): the kernel
threads run them on chunks of a batch at once (:mod:`psflow.ops.kernel_pool`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from psflow import settings
from psflow.ops import _loops

logger = logging.getLogger(__name__)

_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
_lock = threading.Lock()
_built: Kernels | None = None
_failed = False  # Numba missing or its compile failed: NumPy for the process, said once
_building: threading.Thread | None = None  # the compile's thread, once started


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The compiled loops of :mod:`psflow.ops._loops` (same names, same arguments)."""

    max_pool_argmax: Callable[..., None]
    max_pool_argmax_2x2: Callable[..., None]
    max_pool_argmax_grad: Callable[..., None]
    max_pool_argmax_grad_2x2: Callable[..., None]
    relu_grad: Callable[..., None]
    sgd: Callable[..., None]
    sgd_momentum: Callable[..., None]
    adam: Callable[..., None]

    def factors(self, dtype: Any) -> np.ndarray:
        """``[0, 1]`` in ``dtype``: the ``w`` argument of the gradient loops."""
        return np.array([0, 1], dtype=dtype)

    def max_pool(
        self,
        z: Any,
        k: tuple[int, int],
        s: tuple[int, int],
        relu: bool,
        pooled: Any,
        idx: Any,
    ) -> None:
        """``pooled`` = the max pool of ``relu?(z)`` over windows ``k`` that do not overlap
        (strides ``s``); ``idx`` (uint8) = each window's first maximum, the position its
        gradient goes to (:func:`_loops.max_pool_argmax`); the unrolled loop for 2x2."""
        if k == (2, 2):
            self.max_pool_argmax_2x2(z, s[0], s[1], relu, pooled, idx)
        else:
            self.max_pool_argmax(z, k[0], k[1], s[0], s[1], relu, pooled, idx)

    def max_pool_grad(
        self,
        g: Any,
        pooled: Any,
        idx: Any,
        k: tuple[int, int],
        s: tuple[int, int],
        relu: bool,
        dz: Any,
    ) -> None:
        """The gradient of ``max_pool(relu?(z))`` with respect to ``z``, into ``dz``, from
        :meth:`max_pool`'s outputs (positions in no window are left as they are)."""
        w = self.factors(g.dtype)
        if k == (2, 2):
            self.max_pool_argmax_grad_2x2(g, pooled, idx, s[0], s[1], relu, w, dz)
        else:
            self.max_pool_argmax_grad(g, pooled, idx, k[0], k[1], s[0], s[1], relu, w, dz)


_FIELDS = dataclasses.fields(Kernels)


MIN_ELEMENTS = 1 << 16
"""Arrays smaller than this stay on NumPy: a compiled call costs about 10 us more to start
(a (64, 512) ReLU gradient took 37 us compiled, 26 us in NumPy; (256, 512): 87 against
150), and a process that never sees a large array never imports Numba (half a second)."""


def kernels(dtype: Any, size: int) -> Kernels | None:
    """The compiled kernels for ``size`` elements of ``dtype``, or None: the caller's NumPy
    path (Numba missing or off, another dtype, fewer than :data:`MIN_ELEMENTS`, or the
    kernels still compiling). Never waits: the first call starts the compile in a
    background thread and the caller, like every caller until it ends, takes NumPy's
    path, which gives the same bits (a PS applying a push under its mirror's seqlock,
    a collective under its deadline, never stall for Numba)."""
    if size < MIN_ELEMENTS or _failed or np.dtype(dtype) not in _DTYPES:
        return None
    if not settings.compiled_kernels():
        return None
    built = _built
    if built is None:
        _start_build()
    return built


def wait_ready(timeout: float) -> Kernels | None:
    """Starts the compile if no call has, and waits up to ``timeout`` seconds for it: the
    kernels, or None (Numba missing or failing, or not done in time)."""
    _start_build()
    thread = _building
    if thread is not None:
        thread.join(timeout)
    return _built


def _start_build() -> None:
    global _building
    with _lock:
        if _building is not None or _built is not None or _failed:
            return
        _building = threading.Thread(target=_build, name="psflow-compile", daemon=True)
        _building.start()


def _forget_build_in_child() -> None:
    # a forked child has the flag but not the thread: it compiles (or loads) on its own
    global _building
    if _built is None:
        _building = None


if hasattr(os, "register_at_fork"):  # not on Windows
    os.register_at_fork(after_in_child=_forget_build_in_child)


def _build() -> None:
    """The background thread's work: import Numba, compile (or load) the kernels, publish."""
    global _built, _failed
    try:
        import numba
    except ImportError:
        _failed = True
        logger.info(
            "Numba is not installed: max pooling, the ReLU's gradient and the SGD and Adam "
            "updates use NumPy's calls"
        )
        return
    try:
        try:
            built = _jit(numba, cache=True)
        except RuntimeError as e:  # nowhere to keep a cache: a read-only package, no home
            logger.info("Numba cannot cache psflow's CPU kernels (%s): compiled per process", e)
            built = _jit(numba, cache=False)
        _compile(built)
    except Exception as e:  # an unusable LLVM, say: NumPy's calls give the same results
        _failed = True
        logger.warning(
            "compiling psflow's CPU kernels with Numba failed (%s: %s): max pooling, the "
            "ReLU's gradient and the SGD and Adam updates use NumPy from now on in this process",
            type(e).__name__,
            e,
        )
        return
    _built = built


def _jit(numba: Any, cache: bool) -> Kernels:
    jit = numba.njit(cache=cache, nogil=True)
    return Kernels(**{f.name: jit(getattr(_loops, f.name)) for f in _FIELDS})


def _compile(k: Kernels) -> None:
    """Runs each kernel once on small arrays of each dtype: the compile happens here, in the
    background thread, where a failure is caught, not in a kernel thread mid-step."""
    for dtype in _DTYPES:
        x = np.arange(2 * 4 * 4 * 3, dtype=dtype).reshape(2, 4, 4, 3)
        z = np.empty((2, 2, 2, 3), dtype=dtype)
        idx = np.empty(z.shape, dtype=np.uint8)
        for relu in (True, False):
            k.max_pool_argmax(x, 2, 2, 2, 2, relu, z, idx)
            k.max_pool_argmax_2x2(x, 2, 2, relu, z, idx)
            k.max_pool_argmax_grad(z, z, idx, 2, 2, 2, 2, relu, k.factors(dtype), np.empty_like(x))
            k.max_pool_argmax_grad_2x2(z, z, idx, 2, 2, relu, k.factors(dtype), np.empty_like(x))
        flat, one = x.reshape(-1).copy(), dtype.type(1)
        k.relu_grad(flat, flat, k.factors(dtype), np.empty_like(flat))
        k.sgd(flat, flat, one)
        k.sgd_momentum(flat, flat, flat.copy(), one, one, False)
        k.adam(flat, flat, flat.copy(), np.abs(flat), one, one, one, one)


def relu_grad(g: np.ndarray, z: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``g * (z > 0)`` for NumPy arrays of one shape (the ReLU's input gradient from its
    output ``z``), into ``out`` (a new array by default): one compiled pass where Numba is
    here and all three are C-contiguous in one dtype, else NumPy's two passes (the same bits)."""
    out = np.empty_like(g) if out is None else out
    # the size first: most calls are small, and their arrays need no checking
    fast = kernels(g.dtype, g.size) if isinstance(g, np.ndarray) and g.shape == z.shape else None
    flat = None if fast is None else _flat((out, g, z))
    if fast is not None and flat is not None:
        o, gf, zf = flat
        fast.relu_grad(gf, zf, fast.factors(g.dtype), o)
    else:  # an explicit dtype: NumPy's mixed float-by-bool loop is several times slower
        np.multiply(g, z > 0, out=out, dtype=g.dtype)
    return out


def _flat(arrays: tuple[Any, ...]) -> tuple[np.ndarray, ...] | None:
    """The arrays as 1-D views, or None unless all are C-contiguous NumPy arrays of one dtype
    and size (the first writable) that the compiled kernels take."""
    first = arrays[0]
    if not isinstance(first, np.ndarray) or not first.flags.writeable:
        return None
    for a in arrays:
        if not isinstance(a, np.ndarray) or a.dtype != first.dtype or a.size != first.size:
            return None
        if not a.flags.c_contiguous:
            return None
    return tuple(a.reshape(-1) for a in arrays)


def sgd_update(
    var: Any, grad: Any, lr: Any, m: Any = None, mom: Any = None, nesterov: bool = False
) -> bool:
    """SGD's step (with momentum slot ``m`` and factor ``mom`` if given) in one compiled pass,
    the bits of :class:`psflow.update_rules.SGD`'s NumPy operations; False, having changed
    nothing, where the kernels do not apply (the caller's NumPy path)."""
    # the size first: a bias needs no checking (nor a GPU's array, which never starts Numba)
    fast = kernels(var.dtype, var.size) if isinstance(var, np.ndarray) else None
    flat = None if fast is None else _flat((var, grad) if m is None else (var, grad, m))
    if fast is None or flat is None:
        return False
    if m is None:
        fast.sgd(*flat, lr)
    else:
        fast.sgd_momentum(*flat, lr, mom, bool(nesterov))
    return True


def adam_update(
    var: Any, grad: Any, m: Any, v: Any, alpha: Any, b1c: Any, b2c: Any, eps: Any
) -> bool:
    """Adam's step (no AMSGrad) in one compiled pass, the bits of
    :class:`psflow.update_rules.Adam`'s NumPy operations; False, having changed nothing,
    where the kernels do not apply."""
    fast = kernels(var.dtype, var.size) if isinstance(var, np.ndarray) else None
    flat = None if fast is None else _flat((var, grad, m, v))
    if fast is None or flat is None:
        return False
    fast.adam(*flat, alpha, b1c, b2c, eps)
    return True

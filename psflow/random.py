"""Random numbers with TensorFlow's seeding model (``psflow.random``).

``set_seed(s)`` fixes the global seed: every random op and initializer after
it draws from a generator derived from ``s`` and a per-call counter, so a
single-process program that calls ``set_seed`` first is reproducible bit for
bit. An op-level ``seed`` gives an op its own stream for that global seed.

Numbers are drawn on the host with NumPy's PCG64 and moved to the device, so a
seeded run draws the same numbers on CPU and GPU.

Example:
    >>> import psflow as pf
    >>> pf.random.set_seed(0); a = pf.random.normal([3]).numpy()
    >>> pf.random.set_seed(0); b = pf.random.normal([3]).numpy()
    >>> bool((a == b).all())
    True
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from psflow import dtypes, errors
from psflow.framework.tensor import Tensor, _place

_lock = threading.Lock()
_state: dict[str, Any] = {"seed": None, "rng": np.random.default_rng(), "op_counts": {}}


def set_seed(seed: int | None) -> None:
    """Sets the global seed (``None`` returns to fresh entropy)."""
    with _lock:
        if seed is None:
            _state.update(seed=None, rng=np.random.default_rng(), op_counts={})
            return
        try:
            seed = int(seed)
        except (TypeError, ValueError):
            raise errors.InvalidArgumentError(f"set_seed needs an integer, got {seed!r}") from None
        _state.update(
            seed=seed,
            rng=np.random.default_rng(np.random.SeedSequence([seed & (2**63 - 1)])),
            op_counts={},
        )


def get_global_seed() -> int | None:
    """The seed last given to :func:`set_seed`, or ``None``."""
    return _state["seed"]


def _generator(seed: int | None) -> np.random.Generator:
    """The generator an op with op-level ``seed`` draws from."""
    if seed is None:
        return _state["rng"]
    with _lock:
        count = _state["op_counts"].get(seed, 0)
        _state["op_counts"][seed] = count + 1
    glob = _state["seed"] if _state["seed"] is not None else 87654321
    return np.random.default_rng(
        np.random.SeedSequence([glob & (2**63 - 1), int(seed) & (2**63 - 1), count])
    )


def _shape(shape: Any) -> tuple[int, ...]:
    if isinstance(shape, Tensor):
        shape = shape.numpy().tolist()
    if isinstance(shape, (int, np.integer)):
        shape = [shape]
    dims = tuple(int(d) for d in shape)
    if any(d < 0 for d in dims):
        raise errors.InvalidArgumentError(
            f"Random shape must have dimensions >= 0, got {list(dims)}"
        )
    return dims


def _float_dtype(dtype: Any, op: str) -> dtypes.DType:
    dt = dtypes.as_dtype(dtype)
    if not dt.is_floating:
        raise errors.InvalidArgumentError(f"{op} needs a floating dtype, got {dt.name}")
    return dt


def _uniform_array(shape: tuple[int, ...], np_dtype: np.dtype, seed: int | None) -> np.ndarray:
    gen = _generator(seed)
    with _lock:
        return gen.random(shape, dtype=np.float64).astype(np_dtype)


def normal(
    shape: Any,
    mean: float = 0.0,
    stddev: float = 1.0,
    dtype: Any = "float32",
    seed: int | None = None,
    name: str | None = None,
) -> Tensor:
    """Samples from a normal distribution."""
    dt = _float_dtype(dtype, "normal")
    gen = _generator(seed)
    with _lock:
        arr = gen.standard_normal(_shape(shape))
    return Tensor._wrap(_place((arr * float(stddev) + float(mean)).astype(dt.np)))


def truncated_normal(
    shape: Any,
    mean: float = 0.0,
    stddev: float = 1.0,
    dtype: Any = "float32",
    seed: int | None = None,
    name: str | None = None,
) -> Tensor:
    """Samples from a normal distribution, redrawing values beyond two standard deviations."""
    dt = _float_dtype(dtype, "truncated_normal")
    dims = _shape(shape)
    gen = _generator(seed)
    with _lock:
        arr = gen.standard_normal(dims)
        bad = np.abs(arr) > 2
        for _ in range(1000):
            if not bad.any():
                break
            arr[bad] = gen.standard_normal(int(bad.sum()))
            bad = np.abs(arr) > 2
    return Tensor._wrap(_place((arr * float(stddev) + float(mean)).astype(dt.np)))


def uniform(
    shape: Any,
    minval: Any = 0,
    maxval: Any = None,
    dtype: Any = "float32",
    seed: int | None = None,
    name: str | None = None,
) -> Tensor:
    """Uniform samples in ``[minval, maxval)`` (integers need an explicit ``maxval``)."""
    dt = dtypes.as_dtype(dtype)
    dims = _shape(shape)
    gen = _generator(seed)
    if dt.is_integer:
        if maxval is None:
            raise errors.InvalidArgumentError("uniform: integer dtypes need an explicit maxval")
        if int(maxval) <= int(minval):
            raise errors.InvalidArgumentError(
                f"uniform: maxval {maxval} must exceed minval {minval}"
            )
        with _lock:
            arr = gen.integers(int(minval), int(maxval), dims).astype(dt.np)
        return Tensor._wrap(_place(arr))
    if not dt.is_floating:
        raise errors.InvalidArgumentError(f"uniform: unsupported dtype {dt.name}")
    hi = 1.0 if maxval is None else float(maxval)
    lo = float(minval)
    with _lock:
        arr = gen.random(dims)
    return Tensor._wrap(_place((arr * (hi - lo) + lo).astype(dt.np)))


def shuffle(value: Any, seed: int | None = None, name: str | None = None) -> Tensor:
    """Shuffles along the first dimension."""
    from psflow.ops._core import node

    arr = node(value)._array()
    if arr.ndim == 0:
        raise errors.InvalidArgumentError("shuffle needs a tensor of rank >= 1")
    gen = _generator(seed)
    with _lock:
        perm = gen.permutation(arr.shape[0])
    return Tensor._wrap(arr[perm] if isinstance(arr, np.ndarray) else arr[_place(perm)])


def categorical(
    logits: Any,
    num_samples: int,
    dtype: Any = "int64",
    seed: int | None = None,
    name: str | None = None,
) -> Tensor:
    """Samples class indices from unnormalized log-probabilities, one row per batch entry."""
    from psflow import backend
    from psflow.ops._core import node

    lg = backend.to_numpy(node(logits)._array()).astype(np.float64)
    p = np.exp(lg - lg.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    gen = _generator(seed)
    with _lock:
        draws = np.stack([gen.choice(p.shape[-1], size=int(num_samples), p=row) for row in p])
    return Tensor._wrap(_place(draws.astype(dtypes.as_dtype(dtype).np)))


def new_generator(seed: int | None = None) -> np.random.Generator:
    """A NumPy generator derived from the global seed (for data shuffling and the like)."""
    if seed is not None:
        return _generator(seed)
    with _lock:
        return np.random.default_rng(_state["rng"].integers(0, 2**63 - 1))

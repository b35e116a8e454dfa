"""Shared helpers for psflow benchmarks (format: shared/BENCHMARKS.md).

- :func:`emit` prints one JSON measurement line on stdout; :func:`table` a
  short human table on stderr; :func:`progress` a progress line on stderr.
- :func:`time_calls` times a callable after a warm-up; :func:`alternate` times
  two callables A B A B... so machine drift hits both; :func:`summary` gives
  the median, p50 and p99 of the per-call times. Both take ``clock="wall"``
  (default) or ``"cpu"`` (process CPU time, steadier on a shared machine for
  single-threaded work).
- :func:`pin_blas_threads` re-executes the script once with the BLAS/OpenMP
  thread counts fixed, so the sides of a comparison do not oversubscribe the
  cores (it must run before NumPy does any work; the variables only take
  effect in a fresh process).

Kept free of NumPy and psflow imports so any benchmark can use it.

Example:
    >>> import time
    >>> a, b = alternate(lambda: None, lambda: time.sleep(0), rounds=3, number=10)
    >>> len(a) == len(b) == 3
    True
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

BLAS_VARIABLES = (
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "BLIS_NUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)
_PINNED_MARK = "PSFLOW_BENCH_PINNED"


def emit(bench: str, case: str, metric: str, value: float, unit: str, **extra: Any) -> None:
    """Prints one measurement as a JSON line on stdout (extra keys welcome)."""
    line = {"bench": bench, "case": case, "metric": metric, "value": value, "unit": unit}
    line.update(extra)
    print(json.dumps(line), flush=True)


def progress(message: str) -> None:
    """One progress line on stderr."""
    print(message, file=sys.stderr, flush=True)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A left-aligned text table on stderr; floats shown with 4 significant digits."""

    def cell(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    text = [[cell(v) for v in row] for row in [list(headers), *rows]]
    widths = [max(len(r[i]) for r in text) for i in range(len(headers))]
    for k, row in enumerate(text):
        progress("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())
        if k == 0:
            progress("  ".join("-" * w for w in widths))


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def time_calls(
    fn: Callable[[], Any], repeat: int, number: int = 1, warmup: int = 1, clock: str = "wall"
) -> list[float]:
    """Seconds per call of ``fn``: ``repeat`` samples, each the mean of ``number`` calls.

    ``clock="cpu"`` measures this process's CPU time instead of wall time: on a
    shared machine it leaves out the time other processes held the cores
    (meaningful only when the work runs on one thread).
    """
    now = CLOCKS[clock]
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        start = now()
        for _ in range(number):
            fn()
        samples.append((now() - start) / number)
    return samples


def alternate(
    a: Callable[[], Any],
    b: Callable[[], Any],
    rounds: int,
    number: int = 1,
    warmup: int = 2,
    clock: str = "wall",
) -> tuple[list[float], list[float]]:
    """Seconds per call of ``a`` and ``b``, timed in alternation (A B A B ...)."""
    for _ in range(warmup):
        a()
        b()
    times_a: list[float] = []
    times_b: list[float] = []
    for _ in range(rounds):
        times_a += time_calls(a, 1, number, warmup=0, clock=clock)
        times_b += time_calls(b, 1, number, warmup=0, clock=clock)
    return times_a, times_b


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation."""
    s = sorted(samples)
    if not s:
        return math.nan
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summary(samples: Sequence[float]) -> dict[str, float]:
    """``median``, ``p50``, ``p99`` and ``n`` of a list of per-call times."""
    return {
        "median": statistics.median(samples),
        "p50": percentile(samples, 50),
        "p99": percentile(samples, 99),
        "n": len(samples),
    }


def blas_env(threads: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """An environment with every BLAS/OpenMP thread count set to ``threads``."""
    env = dict(os.environ if base is None else base)
    env.update({name: str(threads) for name in BLAS_VARIABLES})
    return env


def pin_blas_threads(threads: int) -> None:
    """Re-executes this script once with BLAS threads fixed to ``threads`` (no-op if done)."""
    if os.environ.get(_PINNED_MARK) == str(threads):
        return
    env = blas_env(threads)
    env[_PINNED_MARK] = str(threads)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.argv], env)

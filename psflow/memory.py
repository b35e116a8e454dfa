"""How the process's allocator treats the large, short-lived arrays of training.

A training step allocates and frees the same megabyte-sized buffers over and
over: activations, gradients, optimizer temporaries, received messages.  glibc's
defaults serve each one with a fresh ``mmap`` (anything above its dynamic
threshold) and give the pages back when it is freed, so every page faults in
again on first touch.  On this project's reference machine that costs a third
of a 784-512-512-10 MLP step at batch 256 (``benchmarks/train_local.py``), and
more than the transfer itself for a 64 MB pull (~12k faults per call, ~100
tuned).  :func:`tune_malloc` raises the mmap and trim thresholds so freed pages
are reused, much as TensorFlow's own allocator keeps its memory.

psflow applies it when training starts (the first :class:`psflow.GradientTape`,
which ``Model.fit`` and every custom loop use, or the first all-reduce) and in its
process entry points; never on import.  ``PSFLOW_MALLOC_TUNING=0`` keeps glibc's defaults.
"""

from __future__ import annotations

import ctypes
import sys

from psflow import settings

__all__ = ["ENV_MALLOC_TUNING", "ensure_tuned", "tune_malloc"]

ENV_MALLOC_TUNING = settings.ENV_MALLOC_TUNING  # re-exported: the name callers knew
MMAP_THRESHOLD_BYTES = 256 << 20
TRIM_THRESHOLD_BYTES = 1 << 30

_TUNED = False
_CHECKED = False


def tune_malloc() -> bool:
    """Makes glibc keep freed memory for reuse instead of returning it to the OS.

    Blocks below 256 MB come from the heap and up to 1 GB of freed memory stays
    with the process.  Process-wide; idempotent.  Returns whether it applied
    (False off glibc).
    """
    global _TUNED
    if _TUNED:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    _TUNED = (
        mallopt(m_mmap_threshold, MMAP_THRESHOLD_BYTES) == 1
        and mallopt(m_trim_threshold, TRIM_THRESHOLD_BYTES) == 1
    )
    return _TUNED


def ensure_tuned(enabled: bool | None = None) -> None:
    """Applies :func:`tune_malloc` once, unless turned off; cheap after.

    Args:
        enabled: whether to tune (a server's ``--no-malloc-tuning``); None:
            what ``PSFLOW_MALLOC_TUNING`` says (:mod:`psflow.settings`).
    """
    global _CHECKED
    if _CHECKED:
        return
    _CHECKED = True
    if settings.current().malloc_tuning if enabled is None else enabled:
        tune_malloc()

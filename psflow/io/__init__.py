"""Files psflow writes: safetensors tensors and JSON manifests, written atomically.

* :mod:`psflow.io.safetensors` — a small reader/writer of the safetensors format
  (no dependency on the ``safetensors`` package, compatible with it).
* :mod:`psflow.io.manifest` — checkpoint manifests (names, shapes, dtypes,
  optimizer configs, versions, step, sha256 checksums).
* :func:`atomic_write` — write to a temporary file, fsync, rename.
"""

from .files import atomic_write

__all__ = ["atomic_write"]

"""Counting this machine's GPUs for ``ClusterResolver.num_accelerators``.

A *GPU probe* is any callable taking no arguments and returning how many GPUs
this process can use.  Resolvers take one so tests (and unusual machines) can
inject their own; the defaults here never raise and answer 0 when unsure.

Two defaults exist because they differ in a way that matters:

* :func:`cupy_gpu_count` asks CuPy (imported only when called).  That
  initializes CUDA in this process, after which ``CUDA_VISIBLE_DEVICES`` no
  longer has any effect here.
* :func:`visible_gpu_count` never touches CUDA: it reads
  ``CUDA_VISIBLE_DEVICES``, then the NVIDIA driver's ``/proc`` entries, then
  ``nvidia-smi``.  The Slurm resolver uses it, because it may still have to set
  ``CUDA_VISIBLE_DEVICES`` for this process afterwards.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Callable, Mapping

from psflow import settings

logger = logging.getLogger(__name__)

GpuProbe = Callable[[], int]
"""A callable returning the number of GPUs this process can use."""

_NVIDIA_PROC_GPUS = "/proc/driver/nvidia/gpus"
_NVIDIA_SMI_TIMEOUT_S = 10.0


def cupy_gpu_count() -> int:
    """Returns the number of CUDA devices CuPy sees, or 0 without CuPy or a GPU.

    Imports CuPy lazily and initializes CUDA in this process; never raises.
    """
    try:
        import cupy  # optional dependency: imported on use only

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception as error:  # ImportError, CUDA driver errors, no device...
        logger.debug("no GPUs through CuPy: %s", error)
        return 0


def _count_visible_devices(value: str) -> int:
    return sum(1 for item in value.split(",") if item.strip())


def visible_gpu_count(environ: Mapping[str, str] | None = None) -> int:
    """Returns how many NVIDIA GPUs this process may use, without touching CUDA.

    In order: the entries of ``CUDA_VISIBLE_DEVICES`` when it is set (an empty
    value means none, unlike TF, which counts it as one), the GPUs listed under
    ``/proc/driver/nvidia/gpus``, the ``GPU`` lines of ``nvidia-smi --list-gpus``
    (bounded by a timeout), else 0.  Never raises.

    Args:
        environ: the environment to read; the process environment (:func:`psflow.settings.environ`) by default.
    """
    env = settings.environ() if environ is None else environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return _count_visible_devices(visible)
    try:
        return len(os.listdir(_NVIDIA_PROC_GPUS))
    except OSError:
        pass
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        output = subprocess.run(
            [smi, "--list-gpus"],
            capture_output=True,
            text=True,
            timeout=_NVIDIA_SMI_TIMEOUT_S,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as error:
        logger.debug("nvidia-smi failed: %s", error)
        return 0
    return sum(1 for line in output.splitlines() if line.startswith("GPU "))


def probe_gpus(probe: GpuProbe) -> int:
    """Calls ``probe`` and returns its answer, or 0 if it fails or answers nonsense.

    A resolver's ``num_accelerators`` must never fail, so a probe that raises
    or returns something other than a non-negative integer is logged and
    counted as no GPUs.
    """
    try:
        count = probe()
    except Exception as error:
        logger.warning("GPU probe %r failed; assuming no GPUs: %s", probe, error)
        return 0
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        logger.warning("GPU probe %r returned %r; assuming no GPUs", probe, count)
        return 0
    return count

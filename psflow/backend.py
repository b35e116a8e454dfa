"""The array backend: NumPy on CPUs, CuPy on NVIDIA GPUs, behind one dispatch point.

Every op is written once against an array module ``xp`` obtained from its
inputs with :func:`xp_of`. CuPy is imported lazily, the first time a GPU is
asked for, never at import time.

Arrays are placed by the current device (:func:`device`), which is per thread so
that MirroredStrategy's replica threads each compute on their own device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from psflow import errors

_cupy: Any = None
_cupy_checked = False
_cupy_lock = threading.Lock()


def cupy_or_none() -> Any:
    """Returns the ``cupy`` module if it imports and sees a GPU, else ``None``."""
    global _cupy, _cupy_checked
    if _cupy_checked:
        return _cupy
    with _cupy_lock:
        if not _cupy_checked:
            try:
                import cupy

                if cupy.cuda.runtime.getDeviceCount() > 0:
                    _cupy = cupy
            except Exception:  # no CuPy, no driver, no device: CPU only
                _cupy = None
            _cupy_checked = True
    return _cupy


def gpu_count() -> int:
    """Number of CUDA GPUs CuPy can see (0 without CuPy)."""
    cp = cupy_or_none()
    return cp.cuda.runtime.getDeviceCount() if cp is not None else 0


def xp_of(array: Any) -> Any:
    """The array module (``numpy`` or ``cupy``) that owns ``array``."""
    if type(array) is np.ndarray or isinstance(array, (np.ndarray, np.generic)):
        return np
    if type(array).__module__.startswith("cupy"):
        return cupy_or_none()
    return np


def to_numpy(array: Any) -> np.ndarray:
    """Copies a CuPy array to the host; NumPy arrays pass through."""
    if isinstance(array, np.ndarray):
        return array
    if type(array).__module__.startswith("cupy"):
        return array.get()
    return np.asarray(array)


def to_contiguous_numpy(array: Any) -> np.ndarray:
    """A C-contiguous host copy-if-needed of ``array`` (0-d stays 0-d, unlike ``np.ascontiguousarray``).

    The wire and shared memory take raw bytes, so every buffer handed to them is
    made host-resident and contiguous here, once.
    """
    host = np.asarray(to_numpy(array))
    return host if host.flags.c_contiguous else np.ascontiguousarray(host)


@dataclasses.dataclass(frozen=True)
class Device:
    """A device: ``CPU:i`` (a logical CPU device) or ``GPU:i``."""

    device_type: str
    index: int = 0

    @property
    def name(self) -> str:
        """TensorFlow's full device name, e.g. ``/job:localhost/replica:0/task:0/device:GPU:0``."""
        return f"/job:localhost/replica:0/task:0/device:{self.device_type}:{self.index}"

    @property
    def is_gpu(self) -> bool:
        """Whether arrays on this device are CuPy arrays."""
        return self.device_type == "GPU"

    def __str__(self) -> str:
        return self.name


_DEVICE_RE = re.compile(r"(?:.*/)?(?:device:)?(?P<type>CPU|GPU)(?::(?P<index>\d+))?$", re.I)


def parse_device(spec: str | Device) -> Device:
    """Parses ``"/gpu:1"``, ``"GPU:0"``, ``"/job:localhost/.../device:CPU:0"``.

    Raises:
        InvalidArgumentError: the spec names no CPU or GPU device.
    """
    if isinstance(spec, Device):
        return spec
    m = _DEVICE_RE.match(str(spec).strip())
    if m is None:
        raise errors.InvalidArgumentError(f"Cannot parse device specification {spec!r}")
    return Device(m.group("type").upper(), int(m.group("index") or 0))


_local = threading.local()
CPU0 = Device("CPU", 0)


def default_device() -> Device:
    """GPU:0 when CuPy sees a GPU (TensorFlow's default), else CPU:0."""
    return Device("GPU", 0) if cupy_or_none() is not None else CPU0


def current_device() -> Device:
    """The device new arrays of this thread are placed on."""
    dev = getattr(_local, "device", None)
    return dev if dev is not None else default_device()


@contextlib.contextmanager
def device(spec: str | Device) -> Iterator[Device]:
    """Places arrays created in this thread on ``spec`` (TensorFlow's ``tf.device``).

    Example:
        >>> import psflow as pf
        >>> with pf.device("/CPU:0"):
        ...     x = pf.constant([1.0])
    """
    dev = parse_device(spec)
    if dev.is_gpu and dev.index >= (len(_gpu_map) if _gpu_map is not None else gpu_count()):
        raise errors.InvalidArgumentError(
            f"Device {spec!r} does not exist: {gpu_count()} GPU(s) visible"
        )
    prev = getattr(_local, "device", None)
    _local.device = dev
    try:
        if dev.is_gpu:  # CuPy allocates and launches on its own current device
            with cupy_or_none().cuda.Device(physical_gpu(dev.index)):
                yield dev
        else:
            yield dev
    finally:
        _local.device = prev


_gpu_map: list[int] | None = None


def set_gpu_map(mapping: list[int]) -> None:
    """Sets which physical GPU each logical GPU index runs on (``psflow.config`` calls it)."""
    global _gpu_map
    _gpu_map = list(mapping)


def physical_gpu(index: int) -> int:
    """The CUDA device id of logical GPU ``index``."""
    if _gpu_map is None:
        return index
    if not 0 <= index < len(_gpu_map):
        raise errors.InvalidArgumentError(
            f"Logical GPU {index} does not exist ({len(_gpu_map)} configured)"
        )
    return _gpu_map[index]


def xp_for(dev: Device) -> Any:
    """The array module for arrays on ``dev``."""
    return cupy_or_none() if dev.is_gpu else np


def place(array: Any, dev: Device | None = None) -> Any:
    """Moves (or copies) ``array`` to ``dev`` (the current device by default).

    An array already on ``dev`` is returned as it is; one on another GPU is
    copied there (``cupy.asarray`` alone would hand it back unmoved).
    """
    dev = dev or current_device()
    if not dev.is_gpu:
        return to_numpy(array)
    cp = cupy_or_none()
    target = physical_gpu(dev.index)
    if isinstance(array, cp.ndarray) and int(array.device.id) != target:
        return _peer_copy(cp, array, target)
    with cp.cuda.Device(target):
        return cp.asarray(array)


def _peer_copy(cp: Any, array: Any, target: int) -> Any:
    """A copy of a CuPy array on GPU ``target``, as a raw device-to-device memcpy.

    A memcpy needs no peer access between the GPUs, where a kernel reading
    the other GPU's memory would.
    """
    with cp.cuda.Device(int(array.device.id)):
        src = cp.ascontiguousarray(array)  # NumPy's rule: a 0-d array comes back 1-d
    with cp.cuda.Device(target):
        out = cp.empty(array.shape, src.dtype)
        if src.nbytes:
            out.data.copy_from_device(src.data, src.nbytes)
    return out


def device_of(array: Any) -> Device:
    """The (logical) device an array lives on.

    A CuPy array knows its CUDA device; with a device map (visible devices,
    logical splits) that is translated back, so ``place(x, device_of(y))``
    lands on ``y``'s GPU.
    """
    if isinstance(array, (np.ndarray, np.generic)):
        return CPU0
    return Device("GPU", logical_gpu(int(array.device.id)))


def on_device_of(array: Any) -> contextlib.AbstractContextManager[Any]:
    """A context in which ``array``'s GPU is CuPy's current device (nothing for host arrays).

    A CuPy kernel runs on the current device; one writing an array that lives
    on another GPU needs peer access, which many multi-GPU machines lack.
    """
    if xp_of(array) is np:
        return contextlib.nullcontext()
    return cupy_or_none().cuda.Device(int(array.device.id))


def logical_gpu(physical: int) -> int:
    """The first logical GPU index that runs on CUDA device ``physical``.

    Without a map (or for a GPU outside it) logical and physical indices agree.
    """
    if _gpu_map is None or physical not in _gpu_map:
        return physical
    return _gpu_map.index(physical)


def erf(array: Any) -> Any:
    """The error function, elementwise, on the array's own device.

    NumPy has no ``erf`` (``math.erf`` is applied per element); CuPy keeps it in
    ``cupyx.scipy.special``, not in the ``cupy`` namespace.
    """
    if xp_of(array) is np:  # NumPy arrays and scalars
        return _np_erf(np.result_type(array))(array)
    import cupyx.scipy.special

    return cupyx.scipy.special.erf(array)


def _np_erf(dtype: np.dtype) -> Any:
    import math

    return np.vectorize(math.erf, otypes=[dtype])


def scatter_add(out: Any, indices: Any, values: Any) -> None:
    """``out[indices] += values`` with repeated indices adding up, in place."""
    if isinstance(out, np.ndarray):
        np.add.at(out, indices, values)
    else:
        import cupyx

        cupyx.scatter_add(out, indices, values)

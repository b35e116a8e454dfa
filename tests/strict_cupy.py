"""A strict CuPy test double: NumPy underneath, CuPy's device discipline on top.

Real CuPy keeps device and host arrays apart: NumPy functions refuse CuPy
arrays (``np.asarray(device_array)`` raises "Implicit conversion to a NumPy
array is not allowed"), CuPy functions refuse NumPy arrays, and data crosses
only through explicit calls (``cupy.asarray`` to the device, ``.get()`` /
``cupy.asnumpy`` to the host). This double reproduces exactly that, on the CPU,
so CI runs psflow's GPU code paths and catches every implicit host/device mix.

It implements the part of CuPy's API psflow uses (``grep -rn cupy psflow``):
``cupy.ndarray`` (``.get``, ``.set``, ``.device.id``, ``.flags``, ``.data``
peer copies and raw pointers), array functions and ufuncs, ``cupy.cuda``
(``Device``, ``Stream``, ``Event``, ``get_current_stream``,
``runtime.getDeviceCount``/``getDevice``), ``cupyx.scatter_add`` and
``cupyx.scipy.special.erf``; with ``nccl=True``, ``cupy.cuda.nccl`` across
processes (``tests/strict_nccl.py``); with ``cudnn=True``, ``cupyx.cudnn``'s
convolutions (``tests/strict_cudnn.py``; without it ``cupyx.cudnn`` does not
import, as on a CuPy without cuDNN's libraries).

Kernels run at once; only NCCL collectives are asynchronous, as on a GPU:
an ``Event`` recorded after one is ``done`` once it has finished, and
touching memory an unfinished collective writes is refused (stricter than
CUDA, where a kernel later on the same stream would be ordered after it:
psflow waits for the collective before it reads the result).

Deliberately stricter than CuPy in two places, each a discipline psflow keeps:

* ``ndarray.tobytes()`` raises: serialising device memory must say where it
  copies to the host (``.get()`` first);
* devices have no peer access: a kernel whose operand lives on another GPU
  raises ``ValueError`` as CuPy does on GPUs without peer access.

Every device-to-host transfer (``.get()``, ``asnumpy``, ``float()``,
``.item()``, ``.tolist()``...) is counted in :class:`Transfers`, so tests can
bound how often a step synchronises with the device.

Usage::

    with strict_cupy.installed(devices=2) as transfers:
        ...  # psflow now sees two "GPUs"
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import time as _time
import types
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np

IMPLICIT = (
    "Implicit conversion to a NumPy array is not allowed. "
    "Please use `.get()` to construct a NumPy array explicitly."
)


class Transfers:
    """Counts of explicit copies between host and device since installation."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.to_host = 0
        self.to_device = 0

    def count(self, direction: str) -> None:
        """Adds one transfer (``"to_host"`` or ``"to_device"``)."""
        with self._lock:
            setattr(self, direction, getattr(self, direction) + 1)

    def reset(self) -> None:
        """Sets both counts back to zero."""
        with self._lock:
            self.to_host = self.to_device = 0


class CUDARuntimeError(RuntimeError):
    """What ``cupy.cuda.runtime`` raises for an invalid device ordinal."""


class _State:
    def __init__(self, devices: int) -> None:
        self.devices = devices
        self.local = threading.local()
        self.transfers = Transfers()
        # raw pointers handed out by ``ndarray.data`` (NCCL takes pointers): ptr -> array
        self.pointers: dict[int, tuple[weakref.ref, int]] = {}
        self.streams: dict[int, weakref.ref] = {}  # Stream.ptr -> the stream
        self.null_streams: dict[int, Stream] = {}  # each GPU's legacy default stream
        # bytes that an unfinished collective will write: (first, end) by its work
        self.pending: dict[int, tuple[int, int]] = {}

    def register(self, ptr: int, a: np.ndarray, dev: int) -> None:
        if len(self.pointers) > 4096:  # forget the freed ones
            self.pointers = {p: e for p, e in self.pointers.items() if e[0]() is not None}
        self.pointers[ptr] = (weakref.ref(a), dev)

    def resolve(self, ptr: Any, nbytes: int, dev: int, what: str) -> np.ndarray:
        """The bytes a raw device pointer names (as NCCL checks a pointer it is given)."""
        from tests.strict_nccl import INVALID_ARGUMENT, NcclError

        if isinstance(ptr, bool) or not isinstance(ptr, int):
            raise NcclError(INVALID_ARGUMENT, f"{what}: {ptr!r} is not a pointer")
        entry = self.pointers.get(ptr)
        a = entry[0]() if entry is not None else None
        if a is None:
            raise NcclError(
                INVALID_ARGUMENT,
                f"{what}: {ptr:#x} is not live device memory (host memory, or a freed buffer)",
            )
        if entry[1] != dev:
            raise NcclError(
                INVALID_ARGUMENT,
                f"{what} is on GPU {entry[1]}; the communicator is on GPU {dev}",
            )
        if not a.flags.c_contiguous:
            raise NcclError(INVALID_ARGUMENT, f"{what}: the array is not contiguous")
        if a.nbytes < nbytes:
            raise NcclError(
                INVALID_ARGUMENT, f"{what}: {nbytes} bytes needed, the buffer has {a.nbytes}"
            )
        return a.reshape(-1).view(np.uint8)[:nbytes]

    def stream_of(self, ptr: Any, dev: int) -> Stream:
        """The stream a raw stream pointer names (0: the GPU's default stream)."""
        from tests.strict_nccl import INVALID_ARGUMENT, NcclError

        if ptr == 0:
            return null_stream(dev)
        ref = self.streams.get(ptr) if isinstance(ptr, int) else None
        stream = ref() if ref is not None else None
        if stream is None:
            raise NcclError(INVALID_ARGUMENT, f"{ptr!r} is not a stream")
        if stream.device_id != dev:
            raise NcclError(
                INVALID_ARGUMENT, f"the stream is on GPU {stream.device_id}, not GPU {dev}"
            )
        return stream

    def writing(self, work: Any, dst: np.ndarray) -> None:
        first = dst.__array_interface__["data"][0]
        self.pending[id(work)] = (first, first + dst.nbytes)

    def written(self, work: Any) -> None:
        self.pending.pop(id(work), None)

    def check_ready(self, a: np.ndarray) -> None:
        """Refuses touching bytes a collective has not finished writing (wait on its stream)."""
        if not self.pending or a.size == 0:
            return
        first = a.__array_interface__["data"][0]
        end = first + a.nbytes
        for lo, hi in list(self.pending.values()):
            if first < hi and lo < end:
                raise RuntimeError(
                    "strict CuPy double: this array's memory is being written by an NCCL "
                    "collective that has not finished: wait for its stream (an Event) first"
                )

    def current(self) -> int:
        return getattr(self.local, "device", 0)

    def check(self, dev: int) -> int:
        dev = int(dev)
        if not 0 <= dev < self.devices:
            raise CUDARuntimeError(f"cudaErrorInvalidDevice: invalid device ordinal {dev}")
        return dev


_state: _State | None = None


def _st() -> _State:
    if _state is None:
        raise RuntimeError("the strict CuPy double is not installed")
    return _state


def _refuse(value: Any) -> None:
    raise TypeError(f"Unsupported type {type(value)}")


def _unwrap(value: Any, dev: int) -> Any:
    """The NumPy array behind a device operand; refuses host arrays and foreign devices."""
    if isinstance(value, ndarray):
        if value._dev != dev:
            raise ValueError(
                f"The device where the array resides ({value._dev}) is different from the "
                f"current device ({dev}). Peer access is unavailable between these devices."
            )
        _st().check_ready(value._a)
        return value._a
    if isinstance(value, np.ndarray):
        _refuse(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_unwrap(v, dev) for v in value)
    return value


def _wrap(value: Any, dev: int) -> Any:
    if isinstance(value, np.ndarray):
        return ndarray._of(value, dev)
    if isinstance(value, np.generic):  # CuPy reductions give 0-d device arrays
        return ndarray._of(np.asarray(value), dev)
    if isinstance(value, tuple):
        return tuple(_wrap(v, dev) for v in value)
    if isinstance(value, list):
        return [_wrap(v, dev) for v in value]
    return value


# Parameters CuPy reads on the host (shapes, split points, index lists): a NumPy
# array is accepted there. Position of the parameter in the function, and its name.
_HOST_PARAMS = {
    "split": (1, "indices_or_sections"),
    "array_split": (1, "indices_or_sections"),
    "take": (1, "indices"),
    "tile": (1, "reps"),
    "reshape": (1, "newshape"),
    "transpose": (1, "axes"),
    "broadcast_to": (1, "shape"),
    "repeat": (1, "repeats"),
}


def _kernel(fn: Any, args: tuple, kwargs: dict, host: tuple = (None, None)) -> Any:
    """Runs a NumPy function as a kernel on the current device.

    ``host`` names the one parameter (position, name) read on the host, where a
    NumPy array is not an operand.
    """
    dev = _st().current()
    pos, name = host
    args = tuple(
        a if i == pos and isinstance(a, np.ndarray) else _unwrap(a, dev) for i, a in enumerate(args)
    )
    kwargs = {
        k: v if k == name and isinstance(v, np.ndarray) else _unwrap(v, dev)
        for k, v in kwargs.items()
    }
    return _wrap(fn(*args, **kwargs), dev)


def _host_param(name: str, method: bool) -> tuple:
    pos, param = _HOST_PARAMS.get(name, (None, None))
    return (pos - 1 if method and pos is not None else pos), param


def _index(key: Any, dev: int) -> Any:
    # CuPy converts host index arrays itself, so only device operands are checked
    if isinstance(key, tuple):
        return tuple(_index(k, dev) for k in key)
    return _unwrap(key, dev) if isinstance(key, ndarray) else key


def _advanced(key: Any) -> bool:
    keys = key if isinstance(key, tuple) else (key,)
    return any(isinstance(k, (ndarray, np.ndarray, list)) for k in keys)


class _Flags:
    def __init__(self, a: np.ndarray) -> None:
        self.c_contiguous = bool(a.flags.c_contiguous)
        self.f_contiguous = bool(a.flags.f_contiguous)
        self.owndata = bool(a.flags.owndata)

    def __getitem__(self, name: str) -> bool:
        return {"C_CONTIGUOUS": self.c_contiguous, "F_CONTIGUOUS": self.f_contiguous}[name]


class _DeviceRef:
    def __init__(self, dev: int) -> None:
        self.id = dev

    def synchronize(self) -> None:
        pass


class _MemoryPointer:
    """``ndarray.data``: raw copies between device buffers (what peer copies use)."""

    def __init__(self, owner: ndarray) -> None:
        self._owner = owner
        self.device_id = owner._dev
        self.ptr = owner._a.__array_interface__["data"][0]
        _st().register(self.ptr, owner._a, owner._dev)

    def _bytes(self) -> np.ndarray:
        a = self._owner._a
        if not a.flags.c_contiguous:
            raise ValueError("raw copies need a C-contiguous array")
        return a.reshape(-1).view(np.uint8)

    def copy_from_device_async(self, src: _MemoryPointer, size: int, stream: Any = None) -> None:
        """Copies ``size`` bytes from another device buffer (any GPU) into this one."""
        self._bytes()[:size] = src._bytes()[:size]

    copy_from_device = copy_from_device_async


class ndarray:  # noqa: N801 - CuPy's name
    """A device array: a NumPy array that refuses to mix with host arrays."""

    __slots__ = ("_a", "_dev")
    __array_priority__ = 100

    def __init__(self, shape: Any, dtype: Any = float, memptr: Any = None, order: str = "C"):
        self._a = np.empty(shape, dtype=dtype, order=order)
        self._dev = _st().current()

    @classmethod
    def _of(cls, a: np.ndarray, dev: int) -> ndarray:
        obj = object.__new__(cls)
        obj._a = a
        obj._dev = dev
        return obj

    # -- host interop: explicit only --------------------------------------------------
    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(IMPLICIT)

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        for v in (*inputs, *kwargs.get("out", ())):
            if isinstance(v, np.ndarray):
                _refuse(v)
        return _kernel(getattr(ufunc, method) if method != "__call__" else ufunc, inputs, kwargs)

    def __array_function__(self, func: Any, types_: Any, args: tuple, kwargs: dict) -> Any:
        return _kernel(func, args, kwargs)

    def tobytes(self, order: str = "C") -> bytes:
        """Refused: copy to the host with ``.get()`` first (stricter than CuPy)."""
        raise TypeError("tobytes() on a device array: call .get() first and serialise that")

    tostring = tobytes

    def get(self, stream: Any = None, order: str = "C", out: Any = None, blocking=True) -> Any:
        """A host (NumPy) copy."""
        _st().check_ready(self._a)
        _st().transfers.count("to_host")
        host = np.array(self._a, order=order, copy=True)
        if out is not None:
            out[...] = host
            return out
        return host

    def set(self, arr: Any, stream: Any = None) -> None:
        """Copies a host array of the same shape and dtype into this one."""
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"Only numpy.ndarray can be set to cupy.ndarray, got {type(arr)}")
        if arr.shape != self._a.shape or arr.dtype != self._a.dtype:
            raise ValueError("Shape or dtype mismatch")
        _st().transfers.count("to_device")
        self._a[...] = arr

    def _sync(self) -> np.ndarray:
        _st().check_ready(self._a)
        _st().transfers.count("to_host")
        return self._a

    def item(self, *args: Any) -> Any:
        """The value of a one-element array (a device sync)."""
        return self._sync().item(*args)

    def tolist(self) -> Any:
        """The values as nested lists (a device sync)."""
        return self._sync().tolist()

    def __float__(self) -> float:
        return float(self._sync())

    def __int__(self) -> int:
        return int(self._sync())

    def __index__(self) -> int:
        return self._sync().__index__()

    def __bool__(self) -> bool:
        return bool(self._sync())

    def __complex__(self) -> complex:
        return complex(self._sync())

    def __repr__(self) -> str:
        return f"array({self._a.tolist()!r}, dtype={self._a.dtype})"

    def __reduce__(self) -> Any:
        return (_rebuild, (self.get(), self._dev))

    def __deepcopy__(self, memo: Any) -> ndarray:
        return self.copy()

    # -- attributes --------------------------------------------------------------------
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: _Flags(self._a))
    device = property(lambda self: _DeviceRef(self._dev))
    data = property(lambda self: _MemoryPointer(self))
    T = property(lambda self: ndarray._of(self._a.T, self._dev))
    real = property(lambda self: ndarray._of(self._a.real, self._dev))

    def __len__(self) -> int:
        return len(self._a)

    def __iter__(self) -> Iterator[Any]:
        for row in self._a:
            yield _wrap(row, self._dev)

    def __getitem__(self, key: Any) -> Any:
        return _wrap(self._a[_index(key, self._dev)], self._dev)

    def __setitem__(self, key: Any, value: Any) -> None:
        if isinstance(value, np.ndarray) and value.shape != ():
            # CuPy fills a basic slice with a scalar only; an advanced index (an
            # index array or mask) copies the host values over with cupy.array
            if not _advanced(key):
                raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
            _st().transfers.count("to_device")
        elif isinstance(value, ndarray):
            value = _unwrap(value, self._dev)
        self._a[_index(key, self._dev)] = value

    def __getattr__(self, name: str) -> Any:
        # dunders (``__array_interface__``, ``__array_struct__``...) must not leak
        # the host buffer: NumPy would use them to convert silently
        if name.startswith("__") or name in ("ctypes", "tofile", "dump", "dumps", "view_as"):
            raise AttributeError(name)
        attr = getattr(self._a, name)
        if not callable(attr):
            return _wrap(attr, self._dev)

        host = _host_param(name, method=True)

        def method(*args: Any, **kwargs: Any) -> Any:
            with _on(self._dev):  # a method runs on its array's device
                return _kernel(attr, args, kwargs, host)

        return method

    __hash__ = None  # type: ignore[assignment]


def _rebuild(host: np.ndarray, dev: int) -> ndarray:
    _st().transfers.count("to_device")
    return ndarray._of(np.array(host), dev)


def _binary(name: str, inplace: bool = False) -> Any:
    ufunc_name = name

    def op(self: ndarray, other: Any) -> Any:
        if isinstance(other, np.ndarray):
            _refuse(other)
        fn = getattr(np.ndarray, ufunc_name)
        with _on(self._dev):
            res = _kernel(fn, (self, other), {})
        if res is NotImplemented:
            return NotImplemented
        return self if inplace else res

    return op


_COMPARISONS = ("lt", "le", "gt", "ge", "eq", "ne")
_ARITHMETIC = ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul")
for _name in (*_ARITHMETIC, "and", "or", "xor", "lshift", "rshift", *_COMPARISONS, "divmod"):
    setattr(ndarray, f"__{_name}__", _binary(f"__{_name}__"))
    if _name not in _COMPARISONS:
        setattr(ndarray, f"__r{_name}__", _binary(f"__r{_name}__"))
    if _name not in (*_COMPARISONS, "divmod"):
        setattr(ndarray, f"__i{_name}__", _binary(f"__i{_name}__", inplace=True))
for _name in ("neg", "pos", "abs", "invert"):
    setattr(
        ndarray,
        f"__{_name}__",
        (lambda n: lambda self: ndarray._of(getattr(self._a, f"__{n}__")(), self._dev))(_name),
    )
ndarray.__module__ = "cupy"  # psflow (like any CuPy user) recognises arrays by their module


@contextlib.contextmanager
def _on(dev: int) -> Iterator[None]:
    st = _st()
    prev = st.current()
    st.local.device = dev
    try:
        yield
    finally:
        st.local.device = prev


# -- module functions --------------------------------------------------------------------------
def _to_device(a: Any, dtype: Any = None, copy: bool = False) -> ndarray:
    dev = _st().current()
    if isinstance(a, ndarray):
        if not copy and (dtype is None or np.dtype(dtype) == a.dtype):
            return a  # CuPy returns the array itself, wherever it lives
        return ndarray._of(np.array(a._a, dtype=dtype, copy=True), dev)
    if isinstance(a, (list, tuple)) and any(isinstance(v, ndarray) for v in a):
        return _kernel(np.array, (a,), {"dtype": dtype})
    host = np.array(a, dtype=dtype, copy=True)
    if host.dtype.kind in "OUS":  # CuPy has no text or object arrays
        raise ValueError(f"Unsupported dtype {host.dtype}")
    _st().transfers.count("to_device")
    return ndarray._of(host, dev)


def asarray(a: Any, dtype: Any = None, order: Any = None, **kwargs: Any) -> ndarray:
    """``a`` on the device: device arrays unchanged, host data copied to the current device."""
    return _to_device(a, dtype)


def array(obj: Any, dtype: Any = None, copy: bool = True, **kwargs: Any) -> ndarray:
    """A copy of ``obj`` on the current device."""
    return _to_device(obj, dtype, copy=copy)


def copyto(dst: ndarray, src: Any, casting: str = "same_kind", where: Any = None) -> None:
    """``dst[...] = src`` on the device; a host ``src`` only as a one-element scalar (as CuPy)."""
    if isinstance(src, np.ndarray):
        if src.size != 1:
            raise ValueError("non-scalar numpy.ndarray cannot be used for copyto")
        src = src.reshape(()).item()
    kwargs = {"casting": casting} if where is None else {"casting": casting, "where": where}
    _kernel(np.copyto, (dst, src), kwargs)


def asnumpy(a: Any, stream: Any = None, **kwargs: Any) -> np.ndarray:
    """A host copy of a device array (host arrays pass through)."""
    return a.get() if isinstance(a, ndarray) else np.asarray(a)


def get_array_module(*args: Any) -> Any:
    """``cupy`` when any argument is a device array, else ``numpy``."""
    return sys.modules["cupy"] if any(isinstance(a, ndarray) for a in args) else np


def _numpy_attr(source: Any, name: str) -> Any:
    attr = getattr(source, name)
    if isinstance(attr, types.ModuleType):
        return _proxy(attr, f"cupy.{name}")
    if isinstance(attr, type) or not callable(attr):
        return attr  # dtypes, constants
    if isinstance(attr, np.ufunc):
        return _Ufunc(attr)
    host = _host_param(name, method=False)
    return lambda *args, **kwargs: _kernel(attr, args, kwargs, host)


class _Ufunc:
    def __init__(self, ufunc: np.ufunc) -> None:
        self._u = ufunc
        self.__name__ = ufunc.__name__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _kernel(self._u, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._u, name)
        return (lambda *a, **k: _kernel(attr, a, k)) if callable(attr) else attr


def _proxy(source: Any, name: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__getattr__ = lambda attr: _numpy_attr(source, attr)  # type: ignore[method-assign]
    return mod


def _erf(x: Any) -> Any:
    return _kernel(np.vectorize(math.erf, otypes=[np.asarray(x._a).dtype]), (x,), {})


def _scatter_add(a: ndarray, slices: Any, value: Any) -> None:
    dev = _st().current()
    np.add.at(_unwrap(a, dev), _index(slices, dev), _unwrap(value, dev))


# -- cupy.cuda -----------------------------------------------------------------------------------
class Device:
    """``cupy.cuda.Device``: a context that makes a GPU current."""

    def __init__(self, device: Any = None) -> None:
        self.id = _st().current() if device is None else _st().check(device)
        self._prev: list[int] = []

    def __enter__(self) -> Device:
        st = _st()
        self._prev.append(st.current())
        st.local.device = self.id
        return self

    def __exit__(self, *exc: Any) -> None:
        _st().local.device = self._prev.pop()

    def use(self) -> None:
        """Makes this device current in this thread."""
        _st().local.device = self.id

    def synchronize(self) -> None:
        """Waits for every stream of the device."""
        st = _st()
        streams = [r() for r in list(st.streams.values())] + [null_stream(self.id)]
        for stream in streams:
            if stream is not None and stream.device_id == self.id:
                stream.synchronize()


# How long a wait on a stream whose work never completes is allowed in the double: on a
# GPU it would hang for good (a collective whose peer is gone); tests must not.
HANG_SECONDS = 60.0


def _wait_all(works: list[Any], what: str) -> None:
    deadline = _time.monotonic() + HANG_SECONDS
    for work in works:
        if not work.event.wait(max(0.0, deadline - _time.monotonic())):
            raise RuntimeError(
                f"strict CuPy double: {what} waited {HANG_SECONDS:.0f} s for {work.what}; "
                "on a GPU this wait would hang for good"
            )
        work.finished()


class Stream:
    """``cupy.cuda.Stream``: kernels run at once here; only collectives are asynchronous."""

    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False):
        self.device_id = _st().current()
        self.ptr = 0 if null else id(self)
        self._work: list[Any] = []  # unfinished collectives queued on this stream
        if not null:
            _st().streams[self.ptr] = weakref.ref(self)

    def enqueue(self, work: Any) -> None:
        """Queues an asynchronous collective (the NCCL double's calls)."""
        self._work = [w for w in self._work if not w.event.is_set()]
        self._work.append(work)

    def __enter__(self) -> Stream:
        stack = _streams().setdefault(self.device_id, [])
        stack.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _streams()[self.device_id].pop()

    @property
    def done(self) -> bool:
        """Whether everything queued on the stream has finished."""
        return all(w.finished() for w in list(self._work))

    def synchronize(self) -> None:
        """Waits for the stream's work."""
        _wait_all(list(self._work), "Stream.synchronize")

    def wait_event(self, event: Event) -> None:
        """Orders this stream after ``event``."""
        if not isinstance(event, Event):
            raise TypeError(f"expected an Event, got {type(event)}")

    def use(self) -> Stream:
        """Makes this stream current."""
        return self


def _streams() -> dict[int, list[Stream]]:
    local = _st().local
    if not hasattr(local, "streams"):
        local.streams = {}
    return local.streams


def null_stream(dev: int) -> Stream:
    """GPU ``dev``'s default stream (one per GPU, shared by every thread)."""
    st = _st()
    stream = st.null_streams.get(dev)
    if stream is None:
        with _on(dev):
            stream = st.null_streams.setdefault(dev, Stream(null=True))
    return stream


def get_current_stream(device_id: Any = None) -> Stream:
    """This thread's current stream on the current (or given) GPU."""
    dev = _st().current() if device_id is None else int(device_id)
    stack = _streams().get(dev)
    return stack[-1] if stack else null_stream(dev)


class Event:
    """``cupy.cuda.Event``: done once the work its stream had when recorded has finished."""

    def __init__(self, block: bool = False, disable_timing: bool = False, interprocess=False):
        self.recorded = False
        self._work: list[Any] = []

    def record(self, stream: Any = None) -> None:
        """Marks a point in ``stream`` (default: the current stream)."""
        stream = get_current_stream() if stream is None else stream
        self._work = [w for w in stream._work if not w.event.is_set()]
        self.recorded = True

    @property
    def done(self) -> bool:
        """Whether the stream has passed this event (``cudaEventQuery``)."""
        return all(w.finished() for w in self._work)

    def synchronize(self) -> None:
        """Waits for the event."""
        _wait_all(self._work, "Event.synchronize")


def _runtime() -> types.ModuleType:
    rt = types.ModuleType("cupy.cuda.runtime")
    rt.CUDARuntimeError = CUDARuntimeError
    rt.getDeviceCount = lambda: _st().devices
    rt.getDevice = lambda: _st().current()
    rt.setDevice = lambda d: setattr(_st().local, "device", _st().check(d))
    rt.deviceCanAccessPeer = lambda a, b: 0
    return rt


def build_modules(nccl: bool = False, cudnn: bool = False) -> dict[str, types.ModuleType]:
    """The ``cupy``/``cupyx`` modules (and submodules) to put in ``sys.modules``.

    With ``nccl``, ``cupy.cuda.nccl`` is the strict NCCL double (``tests/strict_nccl.py``);
    without it, importing ``cupy.cuda.nccl`` fails as on a CuPy built without NCCL.
    With ``cudnn``, ``cupyx.cudnn`` is the strict cuDNN double (``tests/strict_cudnn.py``);
    without it, importing ``cupyx.cudnn`` fails as without cuDNN's libraries.
    """
    cupy = types.ModuleType("cupy")
    cupy.__file__ = __file__
    cupy.ndarray = ndarray
    cupy.asarray = asarray
    cupy.array = array
    cupy.asnumpy = asnumpy
    cupy.copyto = copyto
    cupy.get_array_module = get_array_module
    cupy.__getattr__ = lambda name: _numpy_attr(np, name)  # type: ignore[method-assign]
    cuda = types.ModuleType("cupy.cuda")
    cuda.Device = Device
    cuda.Stream = Stream
    cuda.Event = Event
    cuda.get_current_stream = get_current_stream
    cuda.runtime = _runtime()
    cupy.cuda = cuda
    cupyx = types.ModuleType("cupyx")
    cupyx.scatter_add = _scatter_add
    scipy = types.ModuleType("cupyx.scipy")
    special = types.ModuleType("cupyx.scipy.special")
    special.erf = _erf
    scipy.special = special
    cupyx.scipy = scipy
    modules = {
        "cupy": cupy,
        "cupy.cuda": cuda,
        "cupy.cuda.runtime": cuda.runtime,
        "cupyx": cupyx,
        "cupyx.scipy": scipy,
        "cupyx.scipy.special": special,
    }
    if nccl:
        from tests import strict_nccl

        cuda.nccl = modules["cupy.cuda.nccl"] = strict_nccl.build_module()
    if cudnn:
        from tests import strict_cudnn

        cupyx.cudnn = modules["cupyx.cudnn"] = strict_cudnn.build_module()
    return modules


@contextlib.contextmanager
def installed(devices: int = 2, nccl: bool = False, cudnn: bool = False) -> Iterator[Transfers]:
    """Makes ``import cupy`` give the double (``devices`` GPUs) and psflow see it.

    ``nccl``: ``cupy.cuda.nccl`` is the strict NCCL double (else it does not import).
    ``cudnn``: ``cupyx.cudnn`` is the strict cuDNN double (else it does not import).

    psflow caches whether CuPy is present (``psflow.backend``); that cache is
    reset on entry and on exit, and the device configuration (visible and
    logical devices) is restored on exit, so code after the block sees the
    CPU again.
    """
    global _state
    from psflow import backend, config

    names = [*build_modules(), "cupy.cuda.nccl", "cupyx.cudnn"]
    saved = {name: sys.modules.get(name) for name in names}
    saved_map = backend._gpu_map
    # device configuration made while the fake GPUs exist must not outlive them
    saved_config = [(d, dict(d)) for d in (config._visible, config._logical)]
    _state = _State(devices)
    sys.modules.update(build_modules(nccl, cudnn))
    backend._cupy_checked = False
    try:
        yield _state.transfers
    finally:
        for name, mod in saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod
        backend._cupy, backend._cupy_checked = None, False
        backend._gpu_map = saved_map
        for live, copy in saved_config:
            live.clear()
            live.update(copy)
        _state = None

"""``psflow.Tensor``: an immutable n-dimensional array on a device.

A tensor wraps one NumPy or CuPy array. Conversion from Python values follows
TensorFlow's inference: Python ints become int32 (int64 when they do not fit),
floats float32, bools bool; NumPy arrays keep their dtype.

Example:
    >>> import psflow as pf
    >>> print(pf.constant([1, 2, 3, 4, 5]) + 1)
    psflow.Tensor([2 3 4 5 6], shape=(5,), dtype=int32)
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator
from typing import Any

import numpy as np

from psflow import backend, dtypes, errors
from psflow.framework.readable import Readable


class TensorShape(tuple):
    """A tensor's shape (TensorFlow's ``tf.TensorShape``); dimensions may be ``None``.

    Example:
        >>> import psflow as pf
        >>> pf.TensorShape([2, None]).as_list()
        [2, None]
    """

    def __new__(cls, dims: Any = ()) -> TensorShape:
        if dims is None:
            return super().__new__(cls, ())
        if isinstance(dims, numbers.Integral):
            dims = (dims,)
        return super().__new__(cls, (None if d is None else int(d) for d in dims))

    @property
    def rank(self) -> int:
        """Number of dimensions."""
        return len(self)

    @property
    def ndims(self) -> int:
        """Number of dimensions (TensorFlow 1's name)."""
        return len(self)

    def as_list(self) -> list[int | None]:
        """The dimensions as a list."""
        return list(self)

    def num_elements(self) -> int | None:
        """Product of the dimensions, ``None`` if any is unknown."""
        if any(d is None for d in self):
            return None
        return int(np.prod(self, dtype=np.int64)) if self else 1

    def is_fully_defined(self) -> bool:
        """Whether every dimension is known."""
        return all(d is not None for d in self)

    def is_compatible_with(self, other: Any) -> bool:
        """Whether the shapes could describe the same tensor (``None`` matches anything)."""
        other = TensorShape(other)
        return len(self) == len(other) and all(
            a is None or b is None or a == b for a, b in zip(self, other)
        )

    def __repr__(self) -> str:
        return f"TensorShape({list(self)})"

    def __getitem__(self, key: Any) -> Any:
        out = super().__getitem__(key)
        return TensorShape(out) if isinstance(key, slice) else out


def _python_array(value: Any, dtype: dtypes.DType | None) -> np.ndarray:
    """A NumPy array from Python data with TensorFlow's dtype inference.

    With ``dtype``, a conversion that would lose data is refused as TensorFlow
    refuses it: floats into integers or bool, integers into bool, integers
    out of the target's range.
    """
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError, OverflowError) as e:
        raise errors.InvalidArgumentError(
            f"Cannot convert {value!r} to a tensor: ragged or malformed ({e})"
        ) from None
    kind = arr.dtype.kind
    if kind == "c":
        raise TypeError(f"Complex values are not supported: {value!r}")
    if kind in "USO":
        return string_array(arr, value, dtype)
    if dtype is not None and dtype.np.kind == "O":
        raise TypeError(
            f"Cannot convert {value!r} to a tensor of dtype string (object arrays of text): not text"
        )
    if kind not in "fiub":
        raise TypeError(
            f"Cannot convert {value!r} (element type {arr.dtype}) to a psflow tensor: not numeric"
        )
    if dtype is not None:
        want = dtype.np
        lossy = (kind == "f" and want.kind in "iub") or (kind in "iu" and want.kind == "b")
        if not lossy and kind in "iu" and want.kind in "iu" and arr.size:
            info = np.iinfo(want)
            lossy = int(arr.max()) > info.max or int(arr.min()) < info.min
        if lossy:
            raise TypeError(f"Cannot convert {value!r} to a tensor of dtype {dtype.name}")
        return arr.astype(want)
    if kind == "f":
        return arr.astype(np.float32)
    if kind in "iu":
        if arr.size and (arr.max() > np.iinfo(np.int32).max or arr.min() < np.iinfo(np.int32).min):
            return arr.astype(np.int64)
        return arr.astype(np.int32)
    return arr


def _array_from(value: Any, dtype: dtypes.DType | None, copy: bool) -> Any:
    if isinstance(value, (Tensor, _variable_cls())):
        arr = value._array()
        if dtype is not None and arr.dtype != dtype.np:
            raise errors.InvalidArgumentError(
                f"Tensor conversion requested dtype {dtype.name} for a tensor of dtype "
                f"{arr.dtype.name}: {value!r}"
            )
        return arr.copy() if copy else arr
    if isinstance(value, np.ndarray) or type(value).__module__.startswith("cupy"):
        if value.dtype.kind in "USO":
            return string_array(value, value, dtype)
        if value.dtype.kind not in "fiub":
            raise TypeError(f"Cannot convert an array of element type {value.dtype} to a tensor")
        if dtype is not None and value.dtype != dtype.np:
            return value.astype(dtype.np)
        dtypes.from_numpy(value.dtype)
        return value.copy() if copy else value
    if isinstance(value, np.generic):
        return _array_from(np.asarray(value), dtype, copy)
    if hasattr(value, "_shard_variables"):  # a ShardedVariable: its shards joined
        return _array_from(Tensor._wrap(value._array()), dtype, copy)
    from psflow.framework.indexed_slices import IndexedSlices

    if isinstance(value, IndexedSlices):
        return value.dense_array()
    if isinstance(value, (list, tuple)) and any(
        isinstance(v, (Tensor, _variable_cls())) for v in value
    ):
        xp_arrays = [to_array(v) for v in value]
        xp = backend.xp_of(xp_arrays[0])
        return xp.stack([xp.asarray(a) for a in xp_arrays]).astype(
            dtype.np if dtype else xp_arrays[0].dtype, copy=False
        )
    return _python_array(value, dtype)


def string_array(arr: np.ndarray, value: Any, dtype: dtypes.DType | None = None) -> np.ndarray:
    """``arr`` (NumPy text or objects) as a string tensor's array: an object array of ``str``.

    Bytes are decoded as UTF-8. Always a new array, so the tensor owns it.

    Raises:
        TypeError: ``dtype`` is not ``string``, an element is neither ``str`` nor ``bytes``,
            or bytes are not UTF-8; the message quotes ``value``.
    """
    if dtype is not None and dtype.np.kind != "O":
        raise TypeError(f"Cannot convert {value!r} to a tensor of dtype {dtype.name}: it is text")
    if arr.dtype.kind == "U":
        return arr.astype(object)
    out = np.empty(arr.shape, dtype=object)
    flat_out = out.reshape(-1)
    for i, e in enumerate(arr.reshape(-1).tolist()):
        if isinstance(e, bytes):
            try:
                e = e.decode("utf-8")
            except UnicodeDecodeError:
                raise TypeError(
                    f"Cannot convert {value!r} to a string tensor: {e!r} is not UTF-8"
                ) from None
        elif not isinstance(e, str):
            raise TypeError(
                f"Cannot convert {value!r} (element type {arr.dtype}) to a psflow tensor: "
                f"{e!r} is neither a number nor text"
            )
        flat_out[i] = e
    return out


_VARIABLE_CLS: Any = None


def _variable_cls() -> type:
    global _VARIABLE_CLS
    if _VARIABLE_CLS is None:
        from psflow.framework.variable import Variable

        _VARIABLE_CLS = Variable
    return _VARIABLE_CLS


def to_array(value: Any, dtype: Any = None) -> Any:
    """The raw array behind a tensor, variable or Python value (no copy when possible)."""
    if type(value) is Tensor:
        arr = value._value
        if dtype is not None and arr.dtype != dtypes.as_dtype(dtype).np:
            raise errors.InvalidArgumentError(
                f"Expected dtype {dtypes.as_dtype(dtype).name}, got {arr.dtype.name}: {value!r}"
            )
        return arr
    arr = _array_from(value, dtypes.as_dtype(dtype) if dtype is not None else None, copy=False)
    if isinstance(arr, np.generic):
        arr = np.asarray(arr)
    return arr


def convert_to_tensor(
    value: Any, dtype: Any = None, dtype_hint: Any = None, name: str | None = None
) -> Tensor:
    """Converts tensors, variables, arrays and Python values into a :class:`Tensor`.

    Raises:
        TypeError: non-numeric data (strings, objects), the message quoting it.
        InvalidArgumentError: a tensor of another dtype than ``dtype``.
    """
    del name
    if type(value) is Tensor and dtype is None:
        return value
    if dtype is None and dtype_hint is not None and not isinstance(value, (Tensor, np.ndarray)):
        try:
            return Tensor._wrap(_place(_array_from(value, dtypes.as_dtype(dtype_hint), False)))
        except (TypeError, ValueError):
            pass
    want = dtypes.as_dtype(dtype) if dtype is not None else None
    return Tensor._wrap(_place(_array_from(value, want, copy=False)))


def _place(arr: Any) -> Any:
    if isinstance(arr, np.generic):
        arr = np.asarray(arr)
    dev = backend.current_device()
    if dev.is_gpu and isinstance(arr, np.ndarray) and arr.dtype.kind != "O":  # text stays on host
        return backend.place(arr, dev)
    return arr


def constant(value: Any, dtype: Any = None, shape: Any = None, name: str | None = None) -> Tensor:
    """Creates a tensor from a value (TensorFlow's ``tf.constant``); always copies.

    ``shape`` reshapes a value with as many elements, or fills it from a scalar.

    Example:
        >>> import psflow as pf
        >>> pf.constant(0.5, shape=(2,)).numpy().tolist()
        [0.5, 0.5]
    """
    del name
    want = dtypes.as_dtype(dtype) if dtype is not None else None
    if isinstance(value, (Tensor, _variable_cls())) and want is not None:
        arr = value._array().astype(want.np)
    else:
        arr = _array_from(value, want, copy=True)
    if shape is not None:
        shape = tuple(int(d) for d in shape)
        xp = backend.xp_of(arr)
        if arr.size == 1 and int(np.prod(shape, dtype=np.int64)) != 1:
            arr = xp.full(shape, arr.reshape(()), dtype=arr.dtype)
        elif arr.size == int(np.prod(shape, dtype=np.int64)):
            arr = arr.reshape(shape)
        else:
            raise errors.InvalidArgumentError(
                f"Cannot make a constant of shape {shape} from {arr.size} elements: {value!r}"
            )
    return Tensor._wrap(_place(arr))


def numpy_text(value: Any, is_repr: bool = False) -> str:
    """A value's text as TensorFlow prints it inside a tensor's or variable's str/repr.

    Reprs show scalars as Python values (``3.0``, not NumPy 2's ``np.float32(3.0)``);
    text that spans lines starts on a new line.
    """
    arr = np.asarray(value)
    if is_repr:
        text = repr(arr.item()) if arr.ndim == 0 else repr(arr)
    else:
        text = str(arr[()] if arr.ndim == 0 else arr)
    return "\n" + text if "\n" in text else text


class Tensor(Readable):
    """An immutable multidimensional array (TensorFlow's eager ``tf.Tensor``).

    Supports Python operators (elementwise, with broadcasting), basic indexing
    and slicing, iteration over the first dimension and ``numpy()``.

    Example:
        >>> import psflow as pf
        >>> t = pf.constant([[1.0, 2.0], [3.0, 4.0]])
        >>> (t @ t).numpy().tolist()
        [[7.0, 10.0], [15.0, 22.0]]
    """

    # ``_sigmoid_logits``: set only on a Keras sigmoid activation's output, so a
    # cross-entropy of it can work from the logits, as Keras does (see
    # ``psflow.keras.activations.sigmoid``)
    __slots__ = ("__weakref__", "_sigmoid_logits", "_value")
    _is_variable = False
    # NumPy defers to our reflected operators: ``np.float32(2) * t`` is a tensor op.
    __array_priority__ = 100

    def __init__(self, value: Any, dtype: Any = None) -> None:
        self._value = constant(value, dtype)._value

    @classmethod
    def _wrap(cls, array: Any) -> Tensor:
        t = object.__new__(Tensor)
        t._value = np.asarray(array) if isinstance(array, np.generic) else array
        return t

    def _array(self) -> Any:
        return self._value

    # -- attributes ------------------------------------------------------------------
    @property
    def shape(self) -> TensorShape:
        """The tensor's shape."""
        return TensorShape(self._value.shape)

    def get_shape(self) -> TensorShape:
        """The tensor's shape (TensorFlow 1's name)."""
        return self.shape

    @property
    def dtype(self) -> dtypes.DType:
        """The element type."""
        return dtypes.from_numpy(self._value.dtype)

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return self._value.ndim

    @property
    def device(self) -> str:
        """The full name of the device holding the data."""
        return backend.device_of(self._value).name

    def numpy(self) -> Any:
        """The value as a NumPy array (a NumPy scalar for 0-d tensors, as TensorFlow)."""
        arr = backend.to_numpy(self._value)
        return arr[()] if arr.ndim == 0 else arr

    def ref(self) -> Any:
        """A hashable reference to this tensor (tensors themselves are unhashable)."""
        return _Ref(self)

    # -- printing --------------------------------------------------------------------
    def __str__(self) -> str:
        body = numpy_text(self.numpy())
        return f"psflow.Tensor({body}, shape={tuple(self._value.shape)}, dtype={self.dtype.name})"

    def __repr__(self) -> str:
        shape = tuple(self._value.shape)
        body = numpy_text(self.numpy(), is_repr=True)
        return f"<psflow.Tensor: shape={shape}, dtype={self.dtype.name}, numpy={body}>"

    def __format__(self, format_spec: str) -> str:
        """Formats the value as NumPy does (TensorFlow's rule): ``f"{loss:.3f}"`` on a scalar;
        a format spec on a non-scalar raises ``TypeError``, as on a NumPy array."""
        return format(self.numpy(), format_spec)

    # -- Python protocols ------------------------------------------------------------
    __hash__ = None  # type: ignore[assignment]  # == is elementwise, as in TensorFlow 2

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        arr = backend.to_numpy(self._value)
        return arr.astype(dtype) if dtype is not None else arr

    def __len__(self) -> int:
        if self._value.ndim == 0:
            raise TypeError("len() of a 0-d (scalar) tensor")
        return self._value.shape[0]

    def __iter__(self) -> Iterator[Tensor]:
        if self._value.ndim == 0:
            raise TypeError("Cannot iterate over a scalar tensor")
        from psflow.ops import array_ops

        return (array_ops._getitem(self, i) for i in range(self._value.shape[0]))

    def __bool__(self) -> bool:
        if self._value.size != 1:
            raise errors.InvalidArgumentError(
                f"The truth value of a tensor with shape {tuple(self._value.shape)} is ambiguous"
            )
        return bool(self._value.reshape(()))

    def __float__(self) -> float:
        return float(backend.to_numpy(self._value).reshape(()))

    def __int__(self) -> int:
        return int(backend.to_numpy(self._value).reshape(()))

    def __index__(self) -> int:
        if self._value.dtype.kind not in "iu":
            raise TypeError(
                f"Only integer scalar tensors can be used as an index, not {self.dtype.name}"
            )
        return int(self)

    def __getitem__(self, key: Any) -> Tensor:
        from psflow.ops import array_ops

        return array_ops._getitem(self, key)

    def __reduce__(self):
        return (_rebuild_tensor, (backend.to_numpy(self._value),))


def _rebuild_tensor(arr: np.ndarray) -> Tensor:
    return Tensor._wrap(arr)


class _Ref:
    """A hashable wrapper of a tensor or variable, by identity (``tensor.ref()``)."""

    __slots__ = ("_obj",)

    def __init__(self, obj: Any) -> None:
        self._obj = obj

    def deref(self) -> Any:
        """The referenced tensor or variable."""
        return self._obj

    def __hash__(self) -> int:
        return id(self._obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Ref) and other._obj is self._obj


def is_tensor(x: Any) -> bool:
    """Whether ``x`` is a psflow tensor or variable."""
    return isinstance(x, (Tensor, _variable_cls()))

"""``psflow.Variable``: mutable state a model trains (TensorFlow's ``tf.Variable``).

Inside a strategy's ``scope()`` the strategy's variable creator intercepts
``Variable(...)`` and returns its own kind (mirrored copies, or a handle to a
parameter server), exactly as TensorFlow's ``variable_creator_scope`` does.

Example:
    >>> import psflow as pf
    >>> v = pf.Variable([1, 2, 3, 4, 5], name="weights")
    >>> print(v)
    <psflow.Variable 'weights:0' shape=(5,) dtype=int32, numpy=array([1, 2, 3, 4, 5], dtype=int32)>
"""

from __future__ import annotations

import contextlib
import enum
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from psflow import backend, dtypes, errors
from psflow.framework import tensor as tensor_lib
from psflow.framework.readable import Readable


class VariableSynchronization(enum.Enum):
    """When a distributed variable's copies are synchronized (TensorFlow's enum)."""

    AUTO = 0
    NONE = 1
    ON_WRITE = 2
    ON_READ = 3


class VariableAggregation(enum.Enum):
    """How per-replica updates of a distributed variable combine (TensorFlow's enum)."""

    NONE = 0
    SUM = 1
    MEAN = 2
    ONLY_FIRST_REPLICA = 3


Creator = Callable[..., Any]
_creator_local = threading.local()
_global_creators: list[Creator] = []


def _creators() -> list[Creator]:
    stack = getattr(_creator_local, "stack", None)
    return stack if stack is not None else _global_creators


@contextlib.contextmanager
def variable_creator_scope(creator: Creator, *, global_scope: bool = False) -> Iterator[None]:
    """Routes ``Variable(...)`` through ``creator(next_creator, **kwargs)``.

    ``global_scope`` makes the creator visible to every thread (strategies use
    it so replica threads see their scope); otherwise it applies to this
    thread only, as in TensorFlow.
    """
    if global_scope:
        _global_creators.append(creator)
    else:
        if getattr(_creator_local, "stack", None) is None:
            _creator_local.stack = list(_global_creators)
        _creator_local.stack.append(creator)
    try:
        yield
    finally:
        if global_scope:
            _global_creators.remove(creator)
        else:
            _creator_local.stack.remove(creator)
            if _creator_local.stack == _global_creators:
                _creator_local.stack = None


def _default_creator(**kwargs: Any) -> Variable:
    v = object.__new__(Variable)  # not Variable(...): that would consult the creators again
    v.__init__(**kwargs)
    return v


class _VariableMeta(type):
    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is Variable and _creators():
            kwargs = _normalize_args(args, kwargs)
            creators = list(_creators())

            def chain(i: int) -> Creator:
                if i < 0:
                    return _default_creator
                return lambda **kw: creators[i](chain(i - 1), **kw)

            return chain(len(creators) - 1)(**kwargs)
        return super().__call__(*args, **kwargs)


_ARG_NAMES = (
    "initial_value",
    "trainable",
    "validate_shape",
    "caching_device",
    "name",
    "variable_def",
    "dtype",
    "import_scope",
    "constraint",
    "synchronization",
    "aggregation",
    "shape",
)


def _normalize_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    if len(args) > len(_ARG_NAMES):
        raise TypeError(f"Variable takes at most {len(_ARG_NAMES)} positional arguments")
    out = dict(zip(_ARG_NAMES, args))
    for k, v in kwargs.items():
        if k in out:
            raise TypeError(f"Variable got multiple values for argument {k!r}")
        out[k] = v
    return out


def initial_array(initial_value: Any, dtype: Any = None, shape: Any = None) -> Any:
    """Evaluates a variable's initial value (a callable is called) into a fresh array."""
    if callable(initial_value):
        initial_value = initial_value()
    want = dtypes.as_dtype(dtype) if dtype is not None else None
    arr = tensor_lib.constant(initial_value, dtype=want)._value
    if shape is not None:
        shape_t = tensor_lib.TensorShape(shape)
        if not shape_t.is_compatible_with(arr.shape):
            raise errors.InvalidArgumentError(
                f"Variable's initial value has shape {tuple(arr.shape)}, not the declared {shape_t}"
            )
    return arr


class Variable(Readable, metaclass=_VariableMeta):
    """A mutable tensor (TensorFlow's ``tf.Variable``).

    Args:
        initial_value: a tensor, array, Python value, or a callable returning one.
        trainable: whether ``GradientTape`` watches it automatically.
        name: the variable's name; ``v.name`` is ``name + ":0"``.
        dtype: converts the initial value to this type.
        shape: the declared shape, checked against the initial value.
        synchronization, aggregation: how distributed copies stay in sync.
        constraint: a function applied after every optimizer update.
    """

    _is_variable = True
    __array_priority__ = 100  # NumPy defers to our reflected operators, as for tensors

    def __init__(
        self,
        initial_value: Any = None,
        trainable: bool | None = None,
        validate_shape: bool = True,
        caching_device: Any = None,
        name: str | None = None,
        variable_def: Any = None,
        dtype: Any = None,
        import_scope: Any = None,
        constraint: Callable[[Any], Any] | None = None,
        synchronization: VariableSynchronization = VariableSynchronization.AUTO,
        aggregation: VariableAggregation = VariableAggregation.NONE,
        shape: Any = None,
    ) -> None:
        del validate_shape, caching_device, variable_def, import_scope
        if initial_value is None:
            raise errors.InvalidArgumentError("Variable needs an initial_value")
        self._init_attrs(
            initial_array(initial_value, dtype, shape),
            trainable=trainable,
            name=name,
            constraint=constraint,
            synchronization=synchronization,
            aggregation=aggregation,
        )

    def _init_attrs(
        self,
        array: Any,
        *,
        trainable: bool | None,
        name: str | None,
        constraint: Any = None,
        synchronization: VariableSynchronization = VariableSynchronization.AUTO,
        aggregation: VariableAggregation = VariableAggregation.NONE,
    ) -> None:
        synchronization = VariableSynchronization(synchronization)
        if trainable is None:
            trainable = synchronization is not VariableSynchronization.ON_READ
        self._value = array
        self._trainable = bool(trainable)
        base = name or "Variable"
        self._name = base if ":" in base else f"{base}:0"
        self._constraint = constraint
        self._synchronization = synchronization
        self._aggregation = VariableAggregation(aggregation)

    # -- attributes ------------------------------------------------------------------
    def _array(self) -> Any:
        return self._value

    @property
    def name(self) -> str:
        """The name, with TensorFlow's ``:0`` output suffix."""
        return self._name

    @property
    def trainable(self) -> bool:
        """Whether tapes watch this variable automatically."""
        return self._trainable

    @property
    def dtype(self) -> dtypes.DType:
        """The element type."""
        return dtypes.from_numpy(self._array().dtype)

    @property
    def shape(self) -> tensor_lib.TensorShape:
        """The shape."""
        return tensor_lib.TensorShape(self._array().shape)

    def get_shape(self) -> tensor_lib.TensorShape:
        """The shape (TensorFlow 1's name)."""
        return self.shape

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self.shape)

    @property
    def constraint(self) -> Any:
        """The projection applied after optimizer updates, or ``None``."""
        return self._constraint

    @property
    def synchronization(self) -> VariableSynchronization:
        """When distributed copies are synchronized."""
        return self._synchronization

    @property
    def aggregation(self) -> VariableAggregation:
        """How per-replica updates combine."""
        return self._aggregation

    @property
    def device(self) -> str:
        """Where the value lives."""
        return backend.device_of(self._array()).name

    # -- reading ---------------------------------------------------------------------
    def read_value(self) -> tensor_lib.Tensor:
        """A tensor holding a copy of the current value (recorded by tapes)."""
        from psflow.ops import array_ops

        return array_ops.identity(self)

    def value(self) -> tensor_lib.Tensor:
        """Same as :meth:`read_value`."""
        return self.read_value()

    def numpy(self) -> Any:
        """A NumPy copy of the current value."""
        arr = np.array(backend.to_numpy(self._array()), copy=True)
        return arr[()] if arr.ndim == 0 else arr

    # -- writing ---------------------------------------------------------------------
    def _checked_update(self, value: Any, what: str) -> Any:
        current = self._array()
        if tensor_lib.is_tensor(value):
            new = value._array()
            if new.dtype != current.dtype:
                raise errors.InvalidArgumentError(
                    f"{what} on {self._name} of dtype {current.dtype.name} got dtype "
                    f"{new.dtype.name}"
                )
        else:
            # Python data converts to the variable's dtype, refusing lossy conversions
            # (1.5 into an int32 variable) as TensorFlow does.
            want = dtypes.from_numpy(current.dtype)
            try:
                new = tensor_lib._array_from(value, want, copy=False)
            except (TypeError, ValueError) as e:
                raise errors.InvalidArgumentError(f"{what} on {self._name}: {e}") from None
        if new.shape != current.shape:
            raise errors.InvalidArgumentError(
                f"{what} on {self._name} of shape {tuple(current.shape)} got shape "
                f"{tuple(new.shape)}"
            )
        here = backend.device_of(current)
        if backend.device_of(new) != here:  # host values into a GPU variable, and back
            new = backend.place(new, here)
        return new.astype(current.dtype, copy=False)

    def _write(self, array: Any) -> None:
        """Replaces the value with ``array`` (subclasses push it to where the value lives)."""
        xp = backend.xp_of(self._value)
        with backend.on_device_of(self._value):  # the copy runs where the variable lives
            xp.copyto(self._value, array)

    def assign(
        self, value: Any, use_locking: Any = None, name: Any = None, read_value: bool = True
    ) -> Any:
        """Sets the value; returns the variable (or ``None`` with ``read_value=False``).

        Raises:
            InvalidArgumentError: the value's shape or dtype differs from the variable's.
        """
        self._write(self._checked_update(value, "assign"))
        return self if read_value else None

    def assign_add(
        self, delta: Any, use_locking: Any = None, name: Any = None, read_value: bool = True
    ) -> Any:
        """Adds ``delta`` to the value."""
        delta = self._checked_update(delta, "assign_add")
        with backend.on_device_of(delta):  # placed where the variable lives
            self._write(self._array() + delta)
        return self if read_value else None

    def assign_sub(
        self, delta: Any, use_locking: Any = None, name: Any = None, read_value: bool = True
    ) -> Any:
        """Subtracts ``delta`` from the value."""
        delta = self._checked_update(delta, "assign_sub")
        with backend.on_device_of(delta):
            self._write(self._array() - delta)
        return self if read_value else None

    def ref(self) -> Any:
        """A hashable reference (variables hash by identity anyway)."""
        return tensor_lib._Ref(self)

    # -- Python protocols ------------------------------------------------------------
    def __repr__(self) -> str:
        arr = backend.to_numpy(self._array())
        return (
            f"<psflow.Variable '{self._name}' shape={tuple(arr.shape)} dtype={self.dtype.name}, "
            f"numpy={tensor_lib.numpy_text(arr, is_repr=True)}>"
        )

    __hash__ = object.__hash__

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        arr = self.numpy()
        arr = np.asarray(arr)
        return arr.astype(dtype) if dtype is not None else arr

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d (scalar) variable")
        return self.shape[0]

    def __bool__(self) -> bool:
        return bool(tensor_lib.Tensor._wrap(self._array()))

    def __float__(self) -> float:
        return float(self.numpy())

    def __int__(self) -> int:
        return int(self.numpy())

    def __iter__(self) -> Iterator[Any]:
        return iter(self.read_value())

    def __getitem__(self, key: Any) -> tensor_lib.Tensor:
        from psflow.ops import array_ops

        return array_ops._getitem(self, key)


def local_variable(
    initial_value: Any, *, name: str | None = None, trainable: bool = False, dtype: Any = None
) -> Variable:
    """A plain in-process variable, bypassing any strategy's variable creator."""
    v = object.__new__(Variable)
    v._init_attrs(initial_array(initial_value, dtype), trainable=trainable, name=name)
    return v

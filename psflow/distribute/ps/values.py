"""Handles to variables held by parameter servers: ``PSVariable`` and ``ShardedVariable``.

A handle knows a variable's name, PS task, shape and dtype, never its value:
reads go through the process's :class:`PSSession` (cached during a step),
writes and optimizer updates go to the PS. Pickled into a closure, a handle
travels as a reference and resolves to the worker's handle of the same variable.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from psflow import backend, dtypes, errors
from psflow.distribute.partitioners import shard_sizes
from psflow.distribute.protocols import GroupUpdated
from psflow.distribute.ps import session as session_lib
from psflow.framework import variable as variable_lib
from psflow.framework.indexed_slices import IndexedSlices
from psflow.framework.tensor import Tensor, TensorShape, to_array


class PSVariable(variable_lib.Variable, GroupUpdated):
    """A variable whose value lives on parameter-server task ``ps_index``.

    Args:
        session: the process's PS session.
        key: the variable's unique name on the PS.
        name: the user-facing name (``v.name`` is ``name + ":0"``).
        ps_index: which PS task holds it.
        shape, dtype, trainable: its spec.
    """

    def __init__(
        self,
        session: session_lib.PSSession,
        key: str,
        name: str,
        ps_index: int,
        shape: tuple[int, ...],
        dtype: Any,
        trainable: bool,
        *,
        synchronization: Any = variable_lib.VariableSynchronization.AUTO,
        aggregation: Any = variable_lib.VariableAggregation.NONE,
        constraint: Any = None,
    ) -> None:
        self._session = session
        self.key = key
        self._home = int(ps_index)  # where it was created; the session's map says where it is
        self.shape_tuple = tuple(int(d) for d in shape)
        self._dtype = dtypes.as_dtype(dtype)
        self.np_dtype = self._dtype.np
        self.sparse_access = False
        self._name = name if ":" in name else f"{name}:0"
        self._trainable = bool(trainable)
        self._constraint = constraint
        self._synchronization = variable_lib.VariableSynchronization(synchronization)
        self._aggregation = variable_lib.VariableAggregation(aggregation)

    # -- spec without a pull -------------------------------------------------------------
    @property
    def dtype(self) -> dtypes.DType:
        return self._dtype

    @property
    def shape(self) -> TensorShape:
        return TensorShape(self.shape_tuple)

    @property
    def nbytes(self) -> int:
        """Size of the value in bytes."""
        return int(np.prod(self.shape_tuple, dtype=np.int64)) * self._dtype.size

    @property
    def ps_index(self) -> int:
        """The PS task holding the variable now (it changes when the PS tasks are resized)."""
        return self._session.owner(self.key, self._home)

    @property
    def device(self) -> str:
        return f"/job:ps/replica:0/task:{self.ps_index}/device:CPU:0"

    @property
    def update_group(self) -> Any:
        """The PS session: it pushes this variable's gradients to its task."""
        return self._session

    def _mark_sparse_access(self) -> None:
        """Declares an embedding table: never prefetched whole, read and pushed by rows."""
        self.sparse_access = True

    # -- reads -------------------------------------------------------------------------
    def _array(self) -> Any:
        return self._session.read(self)

    @property
    def _value(self) -> Any:  # type: ignore[override]
        return self._array()

    def _embedding_lookup(self, ids: Any) -> Tensor:
        """Pulls only the rows ``ids`` uses; the gradient is sparse rows of this variable."""
        from psflow.ops._core import out

        self.sparse_access = True
        idx = backend.to_numpy(to_array(ids))
        if idx.dtype.kind not in "iu":
            raise errors.InvalidArgumentError(
                f"embedding_lookup: ids must be integers, got {idx.dtype.name}"
            )
        flat = idx.reshape(-1).astype(np.int64)
        rows_total = self.shape_tuple[0]
        if flat.size and (flat.min() < 0 or flat.max() >= rows_total):
            bad = int(flat.min()) if flat.min() < 0 else int(flat.max())
            raise errors.InvalidArgumentError(
                f"embedding_lookup: id {bad} is out of range [0, {rows_total}) for {self.name}"
            )
        unique, inverse = np.unique(flat, return_inverse=True)
        rows = self._session.read_rows(self, unique)
        gathered = rows[inverse].reshape((*idx.shape, *self.shape_tuple[1:]))
        dev = backend.current_device()
        if dev.is_gpu:
            gathered = backend.place(gathered, dev)
        shape = self.shape_tuple

        def backward(g: Any, needs: tuple[bool, ...]) -> tuple[Any]:
            return (IndexedSlices._raw(g.reshape((flat.size, *shape[1:])), flat, shape),)

        return out(gathered, (self,), backward)

    # -- writes ------------------------------------------------------------------------
    def _remote(self, op: str, value: Any) -> None:
        arr = to_array(value)
        if tuple(arr.shape) != self.shape_tuple:
            raise errors.InvalidArgumentError(
                f"{op} on {self.name} of shape {list(self.shape_tuple)} got shape {list(arr.shape)}"
            )
        # a typed value must match; a Python number or NumPy array is cast, as TF does
        typed = isinstance(value, (Tensor, variable_lib.Variable, GroupUpdated))
        if typed and arr.dtype != self.np_dtype:
            raise errors.InvalidArgumentError(
                f"{op} on {self.name} of dtype {self._dtype.name} got dtype {arr.dtype.name}"
            )
        self._session.write(self, op, arr)

    def _write(self, array: Any) -> None:
        self._session.write(self, "assign", array)

    def assign(
        self, value: Any, use_locking: Any = None, name: Any = None, read_value: bool = True
    ) -> Any:
        self._remote("assign", value)
        return self if read_value else None

    def assign_add(
        self, delta: Any, use_locking: Any = None, name: Any = None, read_value: bool = True
    ) -> Any:
        self._remote("assign_add", delta)
        return self if read_value else None

    def assign_sub(
        self, delta: Any, use_locking: Any = None, name: Any = None, read_value: bool = True
    ) -> Any:
        self._remote("assign_sub", delta)
        return self if read_value else None

    # -- travel ------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "name": self._name,
            "ps_index": self.ps_index,
            # the whole map after a resize (pickled once per closure: one object for all
            # handles), so a worker routes by the chief's layout; None before any resize
            "placement": self._session.placement if self._session.placement.version else None,
            "shape": self.shape_tuple,
            "dtype": self._dtype.name,
            "trainable": self._trainable,
            "sparse_access": self.sparse_access,
            "synchronization": self._synchronization.value,
            "aggregation": self._aggregation.value,
        }

    def __reduce__(self) -> tuple:
        return (_resolve, (self._state(),))

    def __deepcopy__(self, memo: dict) -> PSVariable:
        return self


def _resolve(state: dict[str, Any]) -> PSVariable:
    """Unpickles a handle as this process's handle of the same PS variable."""
    session = session_lib.current()
    session.adopt(state.get("placement"))
    try:
        return session.handle(state["key"])
    except KeyError:
        pass
    h = PSVariable(
        session,
        state["key"],
        state["name"],
        state["ps_index"],
        state["shape"],
        state["dtype"],
        state["trainable"],
        synchronization=state["synchronization"],
        aggregation=state["aggregation"],
    )
    h.sparse_access = state["sparse_access"]
    return session.register(h)


class ShardedVariable:
    """A variable split by rows into shards on several PS tasks (TensorFlow's ``ShardedVariable``).

    Reading it concatenates the shards; ``embedding_lookup`` gathers from each
    shard only the rows it holds; Keras layers list its shards as their weights.
    """

    _is_variable = False

    def __init__(self, shards: list[PSVariable], name: str) -> None:
        if not shards:
            raise errors.InvalidArgumentError("A ShardedVariable needs at least one shard")
        self._shards = list(shards)
        self._name = name if ":" in name else f"{name}:0"
        rows = sum(s.shape_tuple[0] for s in shards)
        self._shape = (rows, *shards[0].shape_tuple[1:])
        self._offsets = np.cumsum([0, *(s.shape_tuple[0] for s in shards)])

    @property
    def variables(self) -> list[PSVariable]:
        """The shards, in row order."""
        return list(self._shards)

    _shard_variables = variables

    @property
    def name(self) -> str:
        """The name given at creation."""
        return self._name

    @property
    def shape(self) -> TensorShape:
        """The full shape."""
        return TensorShape(self._shape)

    @property
    def dtype(self) -> dtypes.DType:
        """The element type."""
        return self._shards[0].dtype

    @property
    def trainable(self) -> bool:
        """Whether the shards are trainable."""
        return self._shards[0].trainable

    def _array(self) -> Any:
        parts = [s._array() for s in self._shards]
        return backend.xp_of(parts[0]).concatenate(parts, axis=0)

    def read_value(self) -> Tensor:
        """The whole value: the shards concatenated."""
        return Tensor._wrap(self._array())

    value = read_value

    def numpy(self) -> np.ndarray:
        """The whole value as NumPy."""
        return backend.to_numpy(self._array()).copy()

    def assign(
        self, value: Any, use_locking: Any = None, name: Any = None, read_value: bool = True
    ) -> Any:
        """Splits ``value`` by rows and assigns each shard its part."""
        arr = to_array(value)
        if tuple(arr.shape) != self._shape:
            raise errors.InvalidArgumentError(
                f"assign on {self.name} of shape {list(self._shape)} got {list(arr.shape)}"
            )
        for s, lo, hi in zip(self._shards, self._offsets[:-1], self._offsets[1:]):
            s.assign(arr[lo:hi])
        return self if read_value else None

    def _embedding_lookup(self, ids: Any) -> Tensor:
        from psflow.ops import nn_ops

        return nn_ops._sharded_lookup(self._shards, ids)

    def __repr__(self) -> str:
        return (
            f"<psflow.distribute.ShardedVariable '{self.name}' shape={self._shape} "
            f"dtype={self.dtype.name} shards={len(self._shards)}>"
        )


def split_rows(value: np.ndarray, num_shards: int) -> list[np.ndarray]:
    """TensorFlow's "div" split of ``value`` along axis 0."""
    sizes = shard_sizes(value.shape[0], num_shards)
    bounds = np.cumsum([0, *sizes])
    return [value[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]

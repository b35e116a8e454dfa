"""``DynamicEmbedding``: an embedding over int64 ids with no vocabulary.

The table lives on the parameter servers as a dynamic table
(:mod:`psflow.ps.dynamic_table`): a row is created on first lookup, seeded by
``(seed, id)``, sharded over the PS tasks by a hash of the id.  A batch pulls
only the rows of its unique ids; the tape's gradient is sparse rows
(:class:`~psflow.framework.indexed_slices.IndexedSlices` indexed by id), which
``optimizer.apply_gradients`` pushes back, summed per id, to be applied on the
PS by the optimizer's own update rule.

Where the table lives follows the strategy: the PS tasks of the current
ParameterServerStrategy the layer was created under (gRPC), the embedded PS
of its default mode (in process), or, created outside any strategy, a table
private to the layer.

Example:
    >>> import numpy as np
    >>> import psflow as pf
    >>> layer = pf.keras.layers.DynamicEmbedding(4, seed=1)
    >>> layer(np.array([[3, 10**15]])).shape
    TensorShape([1, 2, 4])
"""

from __future__ import annotations

import dataclasses
import functools
import time
import weakref
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from psflow import backend, dtypes, errors
from psflow.distribute.protocols import GroupUpdated, Readable, UpdateGroup
from psflow.distribute.ps import session as session_lib
from psflow.distribute.ps.inprocess import InProcessEmbeddingClient
from psflow.distribute.ps.table_moves import move_tables
from psflow.framework.indexed_slices import IndexedSlices
from psflow.framework.tensor import Tensor, TensorShape, to_array
from psflow.keras.layers.base import Layer
from psflow.ops._core import node, out
from psflow.ps.dynamic_table import TableConfig
from psflow.ps.hot_rows import HotRowPolicy
from psflow.ps.key_index import sum_rows, unique_ids
from psflow.train.checkpoint import ExternalState
from psflow.transport.embedding_client import EmbeddingClient
from psflow.update_rules import take_rows

__all__ = ["DynamicEmbedding", "DynamicTableHandle"]


class _Backend(UpdateGroup):
    """A table client and the optimizer hook that pushes its gradients.

    It is the ``update_group`` of every table it serves: the optimizer hands
    it all of a step's ``(IndexedSlices, handle)`` pairs at once.
    """

    def __init__(self, client: Any, request_ids: Any = None) -> None:
        self.client = client
        # the PS session's ids: a closure re-run on another worker pushes with the
        # same ids as its first run, so the PS applies its table gradients once
        self.request_ids = request_ids
        # the last update rule pushed with and its config: an optimizer hands out
        # the same (frozen) rule while its learning rate stays
        self._config: tuple[Any, dict] | None = None

    def apply_optimizer(self, optimizer: Any, pairs: list[tuple[Any, Any]], step: int) -> None:
        """Pushes each table's gradient rows with ``optimizer``'s update rule."""
        self.start_optimizer(optimizer, pairs, step)()

    def start_optimizer(
        self, optimizer: Any, pairs: list[tuple[Any, Any]], step: int
    ) -> Callable[[], None]:
        """Sends each table's gradient rows; the result waits for every shard's answer."""
        rule, held = optimizer.rule, self._config
        if held is None or held[0] is not rule:
            held = self._config = (rule, rule.get_config())
        config = held[1]
        finishes = []
        for grad, handle in pairs:
            if not isinstance(grad, IndexedSlices):
                raise errors.InvalidArgumentError(
                    f"{handle.name}: a dynamic table takes sparse row gradients, got a dense one"
                )
            values = backend.to_numpy(grad._values)
            ids = backend.to_numpy(grad._indices).astype(np.int64, copy=False).reshape(-1)
            values = values.reshape(ids.size, -1).astype(handle.config.dtype, copy=False)
            finishes.append(
                self.client.start_push(
                    handle.config.name, ids, values, optimizer=config, request_ids=self.request_ids
                )
            )

        def finish() -> None:
            for f in finishes:
                f()

        return finish


# One backend per PS session (the chief's, or a worker's), made on first use.
_by_session: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _backend_for(session: Any) -> _Backend:
    from psflow.distribute.ps.grpc_connection import GrpcPSConnection
    from psflow.distribute.ps.inprocess import InProcessPSConnection

    found = _by_session.get(session)
    connections = session.connections
    if found is not None:
        if isinstance(found.client, EmbeddingClient) and session.resize_origin is None:
            # a worker's session took a resized map: hash the ids over the new tasks.
            # Not while this session's own resize is unfinished: its tasks may be
            # the new ones while the rows are still where they were (the move
            # failed); the move itself retargets this client at its switch
            found.client.retarget([c.address for c in connections])
        return found
    if all(isinstance(c, GrpcPSConnection) for c in connections):
        client: Any = EmbeddingClient(
            [c.address for c in connections],
            security=connections[0].client.security,
            timeout=connections[0].client.timeout,
        )
        # the rows are hashed over the PS tasks: a resize re-shards them
        session.on_resize(functools.partial(_move_tables, client))
    elif len(connections) == 1 and isinstance(connections[0], InProcessPSConnection):
        client = InProcessEmbeddingClient()  # its own registry: a resize leaves it alone
    else:
        raise errors.UnimplementedError(
            "dynamic embedding tables need gRPC or embedded parameter servers"
        )
    return _by_session.setdefault(session, _Backend(client, _session_ids(weakref.ref(session))))


def _move_tables(client: EmbeddingClient, addresses: Sequence[str], deadline: float) -> None:
    """A resize's step: every table re-sharded over ``addresses``, rows over the wire.

    Raises:
        DeadlineExceededError: the resize's deadline passed before the move.
        OpError: a task failed (see :func:`~psflow.distribute.ps.table_moves.move_tables`): before the
            switch nothing was dropped and retrying the resize completes it.
    """
    if time.monotonic() > deadline:
        raise errors.DeadlineExceededError("no time left to move the dynamic tables")
    move_tables(client, addresses)


def _session_ids(ref: Any) -> Any:
    """``request_id(shard)`` of the session behind ``ref`` (weak: the backend is its value)."""

    def request_id(shard: int) -> tuple[str, int]:
        session = ref()
        if session is None:
            raise errors.FailedPreconditionError("the PS session of this table is gone")
        return session.request_id(shard)

    return request_id


class DynamicTableHandle(GroupUpdated, Readable, ExternalState):
    """The trainable "variable" of a :class:`DynamicEmbedding`: a reference to a
    dynamic table, never its rows.

    Its nominal shape is ``(0, dim)``: a dynamic table has no fixed row count,
    so ``get_weights`` holds no rows.  A :class:`psflow.train.Checkpoint` (and
    so ``BackupAndRestore``) has the parameter servers write and restore the
    tables themselves: every row, slot and counter.  Pickled into a closure, it
    travels as its config and finds the table through the receiving process's
    PS session.
    """

    _is_variable = True

    def __init__(
        self,
        config: TableConfig,
        local: _Backend | None = None,
        hot_rows: HotRowPolicy | None = None,
    ) -> None:
        self.config = config
        self.hot_rows = hot_rows
        self._local = local
        self._dtype = dtypes.as_dtype(config.dtype)
        self._trainable = True
        self.constraint = None

    @property
    def name(self) -> str:
        """The table's name, as a variable name."""
        return f"{self.config.name}:0"

    @property
    def dtype(self) -> dtypes.DType:
        """The rows' dtype."""
        return self._dtype

    @property
    def shape(self) -> TensorShape:
        """``(0, dim)``: no fixed row count."""
        return TensorShape((0, self.config.dim))

    @property
    def trainable(self) -> bool:
        """Always True."""
        return self._trainable

    @property
    def update_group(self) -> _Backend:
        """The backend that pushes this table's gradient rows."""
        return self.backend

    @property
    def backend(self) -> _Backend:
        """Where the table lives now (see the module doc)."""
        if self._local is not None:
            return self._local
        return _backend_for(session_lib.current())

    def _array(self) -> np.ndarray:
        return np.zeros((0, self.config.dim), self._dtype.np)

    def numpy(self) -> np.ndarray:
        """No rows (see the class doc)."""
        return self._array()

    def assign(self, value: Any, *args: Any, **kwargs: Any) -> None:
        """Accepts only the empty value :meth:`numpy` returns (``set_weights`` round trips)."""
        if tuple(np.shape(to_array(value))) != (0, self.config.dim):
            raise errors.InvalidArgumentError(
                f"{self.name}: a dynamic table cannot be assigned rows; restore a table checkpoint"
            )

    def lookup(self, ids: Any, training: bool = True) -> Tensor:
        """Rows of ``ids`` (any integer shape); the gradient is sparse rows by id.

        ``training=False`` (evaluate, predict) creates no rows: an unknown id
        reads the row its first training lookup would get.
        """
        idx = backend.to_numpy(to_array(node(ids)))
        if idx.dtype.kind not in "iu":
            raise errors.InvalidArgumentError(
                f"{self.config.name}: ids must be integers, got {idx.dtype.name}"
            )
        flat = idx.reshape(-1).astype(np.int64)
        dim = self.config.dim
        # Each id is pulled once and its gradient rows summed here, in order of
        # appearance (unsorted_segment_sum), so the push carries unique sorted ids.
        unique, inverse = unique_ids(flat)
        if unique.size:
            client = self.backend.client
            if self.hot_rows is not None:
                client.cache_hot_rows(self.config.name, self.hot_rows)
            rows = client.lookup(self.config.name, unique, training)
        else:
            rows = np.zeros((0, dim), self._dtype.np)
        gathered = (rows if unique is flat else take_rows(rows, inverse)).reshape((*idx.shape, dim))
        shape = (0, dim)

        def backward(g: Any, needs: tuple[bool, ...]) -> tuple[Any]:
            g = backend.to_numpy(g).reshape((flat.size, dim))
            if unique is not flat:
                g = sum_rows(g, inverse, unique.size)
            return (IndexedSlices._raw(g, unique, shape),)

        return out(gathered, (self,), backward)

    def save_external(self, directory: str) -> None:
        """Every PS task writes its tables (this one among them) into ``directory``."""
        self.backend.client.save(directory)

    def restore_external(self, directory: str) -> None:
        """Every PS task replaces the tables saved in ``directory`` with the ids it owns."""
        self.backend.client.restore(directory)

    @property
    def external_name(self) -> str:
        """The table's name: tables are restored by it."""
        return self.config.name

    def __reduce__(self) -> tuple:
        hot = None if self.hot_rows is None else dataclasses.astuple(self.hot_rows)
        return (_resolve, (self.config.to_json(), hot))

    def __deepcopy__(self, memo: dict) -> DynamicTableHandle:
        return self

    def __repr__(self) -> str:
        return f"<DynamicTableHandle {self.config.name!r} dim={self.config.dim}>"


def _resolve(config_json: str, hot: tuple[int, int] | None) -> DynamicTableHandle:
    policy = None if hot is None else HotRowPolicy(*hot)
    return DynamicTableHandle(TableConfig.from_json(config_json), hot_rows=policy)


class DynamicEmbedding(Layer):
    """Maps int64 ids from an unbounded space to vectors of ``output_dim``.

    Args:
        output_dim: floats per row.
        initializer: ``"uniform"`` (in ``[-init_scale, init_scale)``),
            ``"normal"`` (std ``init_scale``) or ``"zeros"``.
        init_scale: see ``initializer``.
        seed: seeds every row with its id (default: from the layer's name,
            so every process agrees).
        optimizer: the table's update rule config; None: the training
            optimizer's (bound by the first push).
        min_count: lookups an id needs before it gets its own row.
        ttl_steps: pushes a row may go untouched before it is evicted (0: never).
        capacity: rows each PS allocates up front.
        memory_rows: rows each PS keeps in memory, the rest on its local disk
            (a disk tier; 0: the PS's ``--table-memory-rows``, none: all in memory).
        memory_bytes: the same budget in bytes; at most one of the two.
        table_name: the table's name on the PS (default: the layer's name).
        hot_rows: each worker caches the table's busiest rows with this policy
            (:mod:`psflow.ps.hot_rows`: fewer pulled bytes, reads up to
            ``refresh_every - 1`` lookups stale); None: every row is pulled.
    """

    def __init__(
        self,
        output_dim: int,
        *,
        initializer: str = "uniform",
        init_scale: float = 0.05,
        seed: int | None = None,
        optimizer: dict | None = None,
        min_count: int = 1,
        ttl_steps: int = 0,
        capacity: int = 1024,
        memory_rows: int = 0,
        memory_bytes: int = 0,
        table_name: str | None = None,
        hot_rows: HotRowPolicy | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if isinstance(output_dim, bool) or not isinstance(output_dim, int) or output_dim <= 0:
            raise errors.InvalidArgumentError(
                f"DynamicEmbedding: output_dim must be an integer > 0, got {output_dim!r}"
            )
        name = table_name or self.name
        self.config = TableConfig(
            name,
            output_dim,
            dtype=dtypes.as_dtype(self.dtype).name,
            initializer=initializer,
            init_scale=float(init_scale),
            seed=zlib.crc32(name.encode()) if seed is None else int(seed),
            optimizer=optimizer,
            min_count=min_count,
            ttl_steps=ttl_steps,
            capacity=capacity,
            memory_rows=memory_rows,
            memory_bytes=memory_bytes,
        )
        self.output_dim = output_dim
        self.hot_rows = hot_rows
        self.table: DynamicTableHandle | None = None

    def build(self, input_shape: Any = None) -> None:
        """Creates the table where the strategy keeps variables."""
        # Without a strategy the table is the layer's own, even if a PS session
        # exists in this process (it belongs to another model).
        local = None if self._strategy is not None else _Backend(InProcessEmbeddingClient())
        self.table = DynamicTableHandle(self.config, local, self.hot_rows)
        self.table.backend.client.create_table(self.config)
        self._track_weight("table", self.table)
        self.built = True

    def call(self, inputs: Any, training: Any = None) -> Any:
        """The rows of ``inputs`` (integer ids of any shape); ``training=False``
        (evaluate, predict) reads without creating rows, None or True may create them."""
        return self.table.lookup(inputs, training is not False)

    def compute_output_shape(self, input_shape: Any) -> TensorShape:
        """``input_shape + (output_dim,)``."""
        return TensorShape((*tuple(input_shape), self.output_dim))

    def get_config(self) -> dict[str, Any]:
        """The layer's arguments."""
        c = self.config
        return {
            **super().get_config(),
            "output_dim": self.output_dim,
            "initializer": c.initializer,
            "init_scale": c.init_scale,
            "seed": c.seed,
            "optimizer": c.optimizer,
            "min_count": c.min_count,
            "ttl_steps": c.ttl_steps,
            "capacity": c.capacity,
            "memory_rows": c.memory_rows,
            "memory_bytes": c.memory_bytes,
            "table_name": c.name,
        }

"""The embedded mode's PS in this process: a connection to a variable store
(ParameterServerStrategy's embedded mode) and a client of dynamic tables."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from psflow.distribute.ps.connection import PSConnection, VarSpec
from psflow.ps.checkpoint import restore_shard, save_shard
from psflow.ps.dynamic_table import TableConfig, TableStats
from psflow.ps.hot_rows import HotRowPolicy
from psflow.ps.key_index import as_ids, gradient_rows
from psflow.ps.push_types import Gradient, PushContext, PushReply
from psflow.ps.store import VariableMeta, VariableStore
from psflow.ps.tables import TableRegistry
from psflow.transport.embedding_client import TableClient, WireBytes


class InProcessPSConnection(PSConnection):
    """Calls a :class:`VariableStore` directly: the same semantics as a PS task, no RPC.

    Args:
        store: the store to use (a new one by default).
        task: the task name used in messages.
    """

    def __init__(self, store: VariableStore | None = None, task: str = "ps:0") -> None:
        self.store = store or VariableStore(task=task)
        self.task = task
        self.address = f"in-process:{task}"  # a name in the placement map, not reachable

    def create(self, specs: Sequence[VarSpec], values: Sequence[np.ndarray]) -> list[int]:
        metas = [
            VariableMeta(s.name, np.dtype(s.dtype), tuple(s.shape), s.trainable) for s in specs
        ]
        return [version for _, version in self.store.create(metas, list(values))]

    def configure_optimizer(self, names: Sequence[str], config: dict[str, Any]) -> None:
        self.store.configure_optimizer(list(names), config)

    def pull(
        self, names: Sequence[str], rows: dict[int, np.ndarray] | None = None
    ) -> list[tuple[np.ndarray, int]]:
        return [(t.value, t.version) for t in self.store.pull(list(names), rows)]

    def push(self, grads: Sequence[Gradient], context: PushContext) -> PushReply:
        return self.store.push(grads, context)

    def write(
        self,
        op: str,
        names: Sequence[str],
        values: Sequence[np.ndarray],
        request_id: tuple[str, int] | None = None,
    ) -> list[int]:
        return self.store.assign(op, list(names), list(values), request_id=request_id)

    def list_variables(self) -> list[dict[str, Any]]:
        return [
            {
                "name": info.meta.name,
                "dtype": info.meta.dtype.name,
                "shape": tuple(info.meta.shape),
                "trainable": info.meta.trainable,
                "version": info.version,
                "optimizer_step": info.optimizer_step,
                "slot_names": tuple(info.slot_names),
            }
            for info in self.store.list_variables()
        ]

    def save(self, directory: str, step: int = 0, prefix: str = "") -> str:
        return save_shard(
            self.store, directory, prefix or self.task.replace(":", "-"), step
        ).manifest_path

    def restore(self, directory: str, prefix: str = "", names: Sequence[str] | None = None) -> int:
        prefix = prefix or self.task.replace(":", "-")
        return restore_shard(self.store, directory, prefix, list(names) if names else None).step

    def export_shard(self, names: Sequence[str], timeout: float | None = None) -> bytes:
        return self.store.export_shard(list(names))

    def import_shard(
        self, state: bytes, placement_version: int, timeout: float | None = None
    ) -> list[str]:
        return list(self.store.import_shard(state, placement_version))

    def release_shard(
        self,
        names: Sequence[str],
        owner: int,
        owner_address: str,
        placement_version: int,
        timeout: float | None = None,
    ) -> None:
        self.store.release(list(names), owner, owner_address, placement_version)

    def cancel_export(self, names: Sequence[str], timeout: float | None = None) -> None:
        self.store.unfence(list(names))

    def drain(self, timeout: float | None = None) -> None:
        self.store.drain()

    def stats(self, include_log: bool = False) -> dict[str, Any]:
        out = self.store.stats_snapshot(include_log)
        if include_log:
            out["log"] = [
                dataclasses.astuple(e) if dataclasses.is_dataclass(e) else e for e in out["log"]
            ]
        return out


class InProcessEmbeddingClient(TableClient):
    """The same interface as :class:`EmbeddingClient` over a :class:`TableRegistry`
    in this process (the embedded parameter server, or local training): the
    same tables and arithmetic, no RPC.

    Args:
        registry: the tables (a new registry by default).
    """

    def __init__(self, registry: TableRegistry | None = None) -> None:
        self.registry = registry or TableRegistry("ps:0")
        self.bytes = WireBytes()
        self.num_shards = 1

    def close(self) -> None:
        """Nothing to release."""

    def create_table(self, config: TableConfig) -> bool:
        """Creates the table (see :meth:`EmbeddingClient.create_table`)."""
        return self.registry.create(config, 0, 1)

    def cache_hot_rows(self, table: str, policy: HotRowPolicy) -> None:
        """Nothing to do: in process, every lookup reads the table itself."""

    def lookup(self, table: str, ids: Any, training: bool = True) -> np.ndarray:
        """Rows of ``ids``: shape ``ids.shape + (dim,)`` (``training=False``: no rows made)."""
        ids = np.asarray(ids)
        rows = self.registry.lookup(table, as_ids(ids), not training)
        return rows.reshape(*ids.shape, rows.shape[-1])

    def start_push(
        self,
        table: str,
        ids: Any,
        grads: Any,
        optimizer: dict | None = None,
        request_ids: Callable[[int], tuple[str, int]] | None = None,
    ) -> Callable[[], list[int]]:
        """Applies gradient rows now; the result returns the step (the
        interface of :meth:`EmbeddingClient.start_push`).

        Raises:
            InvalidArgumentError, NotFoundError: as :meth:`EmbeddingClient.push`.
        """
        flat = as_ids(ids)
        grads = gradient_rows(ids, grads)
        rid = None if request_ids is None else request_ids(0)
        steps = [self.registry.push(table, flat, grads, rid, optimizer)]
        return lambda: steps

    def fetch_hot_rows(self, table: str, count: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``count`` busiest ids and their rows."""
        t = self.registry.table(table)
        ids, _ = t.hot_ids(count)
        return ids, t.peek(ids)

    def stats(self) -> list[dict[str, TableStats]]:
        """The table counters (one shard)."""
        return [self.registry.stats()]

    def save(self, directory: str) -> list[str]:
        """Writes the tables into ``directory``."""
        return [self.registry.save(directory, "ps-0")[0]]

    def restore(self, directory: str) -> int:
        """Restores every table found in ``directory``; returns the rows restored."""
        return self.registry.restore(directory, 0, 1)[1]

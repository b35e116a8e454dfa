"""A connection to a variable store in this process (ParameterServerStrategy's embedded mode)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from psflow.distribute.ps.connection import PSConnection, VarSpec
from psflow.ps.checkpoint import restore_shard, save_shard
from psflow.ps.push_types import Gradient, PushContext, PushReply
from psflow.ps.store import VariableMeta, VariableStore


class InProcessPSConnection(PSConnection):
    """Calls a :class:`VariableStore` directly: the same semantics as a PS task, no RPC.

    Args:
        store: the store to use (a new one by default).
        task: the task name used in messages.
    """

    def __init__(self, store: VariableStore | None = None, task: str = "ps:0") -> None:
        super().__init__()
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

    def _push(self, grads: Sequence[Gradient], context: PushContext) -> PushReply:
        return self.store.push(
            grads,
            push_id=context.push_id,
            step=context.step,
            num_required=context.num_required,
            wait_applied=context.wait_applied,
            timeout=context.timeout,
        )

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

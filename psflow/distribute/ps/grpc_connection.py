"""A connection to a parameter-server task over gRPC (:class:`psflow.transport.PSClient`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from psflow.distribute.ps.connection import Grad, PSConnection, PushReply, VarSpec
from psflow.transport.client import PSClient


class GrpcPSConnection(PSConnection):
    """Adapts :class:`PSClient` (one PS task) to the session's interface.

    Args:
        address: ``host:port`` of the PS task.
        task: its name, e.g. ``"ps:1"``, used in errors.
        timeout: the deadline of each call.
        security: credentials to present (default: the environment's, see
            ``psflow.security.config``).
    """

    def __init__(
        self, address: str, task: str = "ps:0", *, timeout: float = 60.0, security: Any = None
    ) -> None:
        self.task = task
        self.address = address
        # One message up to 8 MB: a training step's few megabytes cost less unary than
        # streamed in 1 MB chunks (measured: benchmarks/pss_train.py); larger ones stream.
        self.client = PSClient(
            address, task=task, timeout=timeout, security=security, stream_threshold=8 << 20
        )

    def create(self, specs: Sequence[VarSpec], values: Sequence[np.ndarray]) -> list[int]:
        trainable = {s.name: s.trainable for s in specs}
        self.client.create_variables(
            {s.name: v for s, v in zip(specs, values)}, trainable=trainable
        )
        return [-1] * len(specs)

    def configure_optimizer(self, names: Sequence[str], config: dict[str, Any]) -> None:
        self.client.configure_optimizer(list(names), config)

    def pull(
        self, names: Sequence[str], rows: dict[int, np.ndarray] | None = None
    ) -> list[tuple[np.ndarray, int]]:
        if rows:
            ((i, idx),) = rows.items()
            if len(names) != 1 or i != 0:
                raise NotImplementedError("row pulls are one variable at a time")
            value, version = self.client.pull_rows(names[0], idx, return_version=True)
            return [(value, version)]
        arrays, versions = self.client.pull(list(names), return_versions=True)
        return list(zip(arrays, versions))

    def push(
        self,
        grads: Sequence[Grad],
        *,
        push_id: tuple[str, int],
        step: int | None = None,
        num_required: int = 0,
        wait_applied: bool = False,
        timeout: float | None = None,
    ) -> PushReply:
        payload = {
            g.name: (g.values if g.indices is None else (g.indices, g.values)) for g in grads
        }
        reply = self.client.push(
            payload,
            push_id=push_id,
            base_versions=[g.base_version for g in grads],
            step=step,
            num_required=num_required or None,
            wait_applied=wait_applied,
            timeout=timeout,
        )
        return PushReply(
            tuple(reply.versions), reply.applied, reply.duplicate, tuple(reply.staleness)
        )

    def write(
        self,
        op: str,
        names: Sequence[str],
        values: Sequence[np.ndarray],
        request_id: tuple[str, int] | None = None,
    ) -> list[int]:
        method = {
            "assign": self.client.assign,
            "assign_add": self.client.assign_add,
            "assign_sub": self.client.assign_sub,
        }[op]
        versions = method(dict(zip(names, values)))
        return [versions[n] for n in names]

    def list_variables(self) -> list[dict[str, Any]]:
        return [
            {
                "name": d.name,
                "dtype": np.dtype(d.dtype).name,
                "shape": tuple(d.shape),
                "trainable": d.trainable,
                "version": d.version,
                "optimizer_step": d.optimizer_step,
                "slot_names": tuple(d.slot_names),
            }
            for d in self.client.list_variables()
        ]

    def save(self, directory: str, step: int = 0, prefix: str = "") -> str:
        return self.client.save(directory, prefix=prefix, step=step)["manifest_path"]

    def restore(self, directory: str, prefix: str = "", names: Sequence[str] | None = None) -> int:
        return int(self.client.restore(directory, prefix=prefix, names=list(names or []))["step"])

    def stats(self, include_log: bool = False) -> dict[str, Any]:
        return self.client.stats(include_log=include_log)

    def close(self) -> None:
        self.client.close()

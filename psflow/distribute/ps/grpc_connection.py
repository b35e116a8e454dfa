"""A connection to a parameter-server task over gRPC (:class:`psflow.transport.PSClient`).

When the PS runs on this host (a loopback address) and mirrors its values into
shared memory, dense pulls read the mirrors directly (no RPC) and pushes hand
their bytes over through a shared-memory segment (the RPC carries only the
header); see :mod:`psflow.transport.shm`. Anything else, and any failure of
that path, goes over gRPC.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from psflow import errors
from psflow.compression import ErrorFeedback
from psflow.distribute.ps.connection import PSConnection, VarSpec
from psflow.ps import write_ops
from psflow.ps.push_types import Gradient, PushContext, PushReply
from psflow.transport import shm
from psflow.transport.client import PSClient
from psflow.transport.started import Started
from psflow.wire import codec

log = logging.getLogger("psflow.distribute")


class GrpcPSConnection(PSConnection):
    """Adapts :class:`PSClient` (one PS task) to the session's interface.

    Args:
        address: ``host:port`` of the PS task.
        task: its name, e.g. ``"ps:1"``, used in errors.
        timeout: the deadline of each call.
        security: credentials to present (default: the environment's, see
            ``psflow.security.config``).
        compression: encodes dense gradients before they are pushed, keeping
            what rounding lost for the next push (see :mod:`psflow.compression`).
        data_plane: pushes and pulls over the PS's data plane when it announces
            one (default: on unless ``PSFLOW_DATA_PLANE=off``); see :class:`PSClient`.
    """

    def __init__(
        self,
        address: str,
        task: str = "ps:0",
        *,
        timeout: float = 60.0,
        security: Any = None,
        compression: ErrorFeedback | None = None,
        data_plane: bool | None = None,
    ) -> None:
        self.task = task
        self._compression = compression
        self.address = address
        # One message up to 8 MB: a training step's few megabytes cost less unary than
        # streamed in 1 MB chunks (measured: benchmarks/pss_train.py); larger ones stream.
        self.client = PSClient(
            address,
            task=task,
            timeout=timeout,
            security=security,
            stream_threshold=8 << 20,
            data_plane=data_plane,
        )
        self._shm = shm.enabled() and shm.is_local_address(address)
        self._mirrors: dict[str, shm.MirrorReader | None] = {}
        self._payload: shm.PayloadBuffer | None = None
        self._shm_lock = threading.Lock()
        self._plain_pushes()

    @property
    def compression(self) -> ErrorFeedback | None:
        """The error feedback dense gradients are encoded with (None: sent as they are)."""
        return self._compression

    @compression.setter
    def compression(self, feedback: ErrorFeedback | None) -> None:
        self._compression = feedback
        self._plain_pushes()

    def _plain_pushes(self) -> None:
        """Has a push that needs nothing of this adapter (no compression, no
        payload segment) started by the client itself: the session's fan-out
        calls :meth:`PSClient.start_push` with no layer between (it, too,
        returns None where the data plane cannot take the push); any other
        goes through this adapter's :meth:`start_push`."""
        if self._compression is None and not self._shm:
            self.start_push = self.client.start_push  # type: ignore[method-assign]
        else:
            self.__dict__.pop("start_push", None)

    # -- the shared-memory path ------------------------------------------------------------
    def _mirror(self, name: str) -> shm.MirrorReader | None:
        """This variable's mirror, mapped on first use (None: not mirrored).

        Only what the PS lists is remembered, mirror or not: a name it does not
        list (yet: a restarted PS before its variables are restored) is looked
        up again on the next pull, so the restored variable gets its mirror.
        """
        if name in self._mirrors:
            return self._mirrors[name]
        with self._shm_lock:
            if name not in self._mirrors:
                for d in self.client.list_variables():
                    if d.name in self._mirrors:
                        continue
                    if not d.shm_name:
                        self._mirrors[d.name] = None  # the PS does not mirror it
                        continue
                    try:
                        self._mirrors[d.name] = shm.MirrorReader(d.shm_name, d.dtype, d.shape)
                    except (OSError, errors.OpError) as e:  # another host after all, or gone
                        log.info("%s: no shared-memory path for %s (%s)", self.task, d.name, e)
                        self._mirrors[d.name] = None
        return self._mirrors.get(name)

    def _forget_mirrors(self) -> None:
        with self._shm_lock:
            for reader in self._mirrors.values():
                if reader is not None:
                    reader.close()
            self._mirrors.clear()

    def _pull_shm(self, names: Sequence[str]) -> list[tuple[np.ndarray, int]] | None:
        for _attempt in range(2):
            readers = [self._mirror(n) for n in names]
            if any(r is None for r in readers):
                return None
            try:
                return [r.read() for r in readers]
            except shm.MirrorRetiredError:
                self._forget_mirrors()  # the PS restored or restarted: map its new mirrors
            except shm.MirrorDormantError:
                for reader in readers:  # the gRPC pull below wakes every one of them
                    reader.ask()
                return None
            except errors.UnavailableError:
                return None
        return None

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
        if self._shm:
            pulled = self._pull_shm(names)
            if pulled is not None:
                return pulled
        arrays, versions = self.client.pull(list(names), return_versions=True)
        return list(zip(arrays, versions))

    def start_pull(self, names: Sequence[str]) -> Started | None:
        """A pull started now: read from the PS's shared-memory mirrors at once
        (no call), else sent on the data plane; None where neither can serve it
        (:meth:`pull` makes it then)."""
        pulled = self._pull_shm(names) if self._shm else None
        if pulled is not None:
            return Started.done(pulled)
        return self.client.start_pull(list(names))

    def start_push(self, grads: Sequence[Gradient], context: PushContext) -> Started | None:
        """Sends a push through the payload segment now and returns it started
        (its ``result()`` reads the reply, ``cancel()`` gives it up); None where
        it cannot go that way (:meth:`push` makes it).  Compressed pushes are not
        started early: their error feedback is kept per push.  (A plain push is
        the client's own :meth:`PSClient.start_push`: see :meth:`_plain_pushes`.)"""
        if self.compression is not None or self.client.data_plane_address is None:
            return None
        # the payload segment is this push's from the write until the PS answered
        self._shm_lock.acquire()
        try:
            if self._payload is None:
                self._payload = shm.PayloadBuffer()
            started = self.client.start_push(grads, context=context, shm_buffer=self._payload)
        except BaseException:
            self._shm_lock.release()
            raise
        if started is None:
            self._shm_lock.release()
            return None

        def read() -> PushReply:
            try:
                return started.result()
            except errors.UnimplementedError as e:
                return self._segment_unreachable(e, grads, context)
            finally:
                self._shm_lock.release()

        def cancel() -> None:
            started.cancel()
            self._shm_lock.release()

        return Started(read, cancel, "Push")

    def _segment_unreachable(
        self, e: errors.OpError, grads: Sequence[Gradient], context: PushContext
    ) -> PushReply:
        """The push again over gRPC: the PS cannot see our segment (another host
        or container after all: ``shm.SegmentUnreachableError`` there) and
        applied nothing."""
        log.info("%s: pushes go over gRPC (%s)", self.task, e)
        self._shm = False
        self._plain_pushes()
        return self.client.push(grads, context=context)

    def push(self, grads: Sequence[Gradient], context: PushContext) -> PushReply:
        ef = self.compression
        if ef is not None:  # dense values travel encoded; what rounding lost waits for the next
            grads = [
                g
                if g.indices is not None
                else dataclasses.replace(g, values=ef.encode(g.name, codec.to_host(g.values)))
                for g in grads
            ]
        if not self._shm:
            return self.client.push(grads, context=context)
        with self._shm_lock:  # one payload segment: one push at a time through it
            if self._payload is None:
                self._payload = shm.PayloadBuffer()
            try:
                return self.client.push(grads, context=context, shm_buffer=self._payload)
            except errors.UnimplementedError as e:
                return self._segment_unreachable(e, grads, context)

    def write(
        self,
        op: str,
        names: Sequence[str],
        values: Sequence[np.ndarray],
        request_id: tuple[str, int] | None = None,
    ) -> list[int]:
        # PSClient names its public write methods after the ops (one table: write_ops)
        method = getattr(self.client, write_ops.check(op))
        # the caller's id travels to the PS: a re-run closure's write is applied once
        versions = method(dict(zip(names, values)), request_id=request_id)
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

    def export_shard(self, names: Sequence[str], timeout: float | None = None) -> bytes:
        return self.client.export_shard(names, timeout=timeout)

    def import_shard(
        self, state: bytes, placement_version: int, timeout: float | None = None
    ) -> list[str]:
        return self.client.import_shard(state, placement_version, timeout=timeout)

    def release_shard(
        self,
        names: Sequence[str],
        owner: int,
        owner_address: str,
        placement_version: int,
        timeout: float | None = None,
    ) -> None:
        self.client.release_shard(names, owner, owner_address, placement_version, timeout=timeout)

    def cancel_export(self, names: Sequence[str], timeout: float | None = None) -> None:
        self.client.release_shard(names, -1, "", -1, cancel=True, timeout=timeout)

    def drain(self, timeout: float | None = None) -> None:
        self.client.drain(timeout=timeout)

    def probe(self, timeout: float) -> None:
        # the health service answers first; ListVariables proves the PS service does too
        deadline = time.monotonic() + timeout
        status = self.client.health(timeout=timeout)
        if status != "SERVING":
            raise errors.UnavailableError(f"{self.task} reports {status}", task=self.task)
        self.client.list_variables(timeout=max(deadline - time.monotonic(), 0.001))

    def close(self) -> None:
        self._forget_mirrors()
        if self._payload is not None:
            self._payload.close()
        self.client.close()

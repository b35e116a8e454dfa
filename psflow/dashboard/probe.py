"""One round of questions to every task: ``GetStats`` to each PS, ``GetStatus`` to each worker.

Each PS is also asked ``GetTableStats``: its dynamic tables' rows in memory
and on disk, hit counts and disk bytes (``values["tables"]``; a PS whose
tables do not answer in time still answers for its variables, with no tables).

Every call has a short deadline and no retries: a task that does not answer
within it is reported as unreachable for this round (the collector decides
when that means lost).  The calls of one round run concurrently, so a round
takes about one deadline at worst, whatever the cluster's size.

Example::

    probe = ClusterProbe({"ps": ["127.0.0.1:2222"], "worker": ["127.0.0.1:2223"]})
    answers = probe.round()       # [TaskAnswer(task="ps:0", ok=True, ...), ...]
    probe.close()
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from psflow.errors import InvalidArgumentError, OpError
from psflow.proto import embedding_pb2, embedding_pb2_grpc, worker_pb2, worker_pb2_grpc
from psflow.security.config import SecurityConfig, default_security
from psflow.security.grpc_auth import open_channel
from psflow.transport.client import PSClient, RetryPolicy

__all__ = ["ClusterProbe", "TaskAnswer"]

PS, WORKER = "ps", "worker"

MAX_THREADS = 32
"""Concurrent calls of one round (a bigger cluster's round takes a few deadlines)."""


@dataclasses.dataclass(frozen=True)
class TaskAnswer:
    """What one task answered (``values``) or why it did not (``error``), and when."""

    job: str
    index: int
    address: str
    time: float
    values: Mapping[str, Any] | None = None
    error: str | None = None

    @property
    def task(self) -> str:
        """``"ps:0"``, ``"worker:1"``."""
        return f"{self.job}:{self.index}"

    @property
    def ok(self) -> bool:
        """Whether the task answered."""
        return self.values is not None


def _addresses(cluster: Mapping[str, Sequence[str]], job: str) -> list[str]:
    tasks = cluster.get(job, [])
    if isinstance(tasks, Mapping):  # TF_CONFIG allows {index: address}
        return [tasks[i] for i in sorted(tasks, key=int)]
    if isinstance(tasks, str) or not all(isinstance(a, str) for a in tasks):
        raise InvalidArgumentError(f"cluster[{job!r}] {tasks!r} must be a list of addresses")
    return list(tasks)


class _WorkerStatus:
    """A ``GetStatus`` caller for one worker (its own channel, the cluster's credentials)."""

    def __init__(self, address: str, security: SecurityConfig) -> None:
        self._channel = open_channel(address, security)
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)
        self._metadata = security.call_metadata() or None

    def __call__(self, timeout: float) -> dict[str, Any]:
        reply = self._stub.GetStatus(
            worker_pb2.GetStatusRequest(), timeout=timeout, metadata=self._metadata
        )
        return {
            "task": reply.task,
            "sessions": len(reply.session_ids),
            "closures_run": int(reply.closures_run),
            "closures_failed": int(reply.closures_failed),
            "pid": int(reply.pid),
            "started_at": float(reply.started_at),
        }

    def close(self) -> None:
        self._channel.close()


class _TableStats:
    """A ``GetTableStats`` caller for one PS (its own channel, the cluster's credentials)."""

    FIELDS = (
        "rows",
        "memory_rows",
        "disk_rows",
        "memory_hits",
        "disk_hits",
        "disk_bytes_read",
        "disk_bytes_written",
        "disk_bytes",
    )

    def __init__(self, address: str, security: SecurityConfig) -> None:
        self._channel = open_channel(address, security)
        self._stub = embedding_pb2_grpc.EmbeddingServiceStub(self._channel)
        self._metadata = security.call_metadata() or None

    def __call__(self, timeout: float) -> list[dict[str, Any]]:
        reply = self._stub.GetTableStats(
            embedding_pb2.GetTableStatsRequest(), timeout=timeout, metadata=self._metadata
        )
        return [
            {"table": t.table, **{f: int(getattr(t, f)) for f in self.FIELDS}}
            for t in sorted(reply.tables, key=lambda t: t.table)
        ]

    def close(self) -> None:
        self._channel.close()


class ClusterProbe:
    """Asks every PS and worker of ``cluster`` how it is, concurrently, with deadlines.

    Args:
        cluster: job name -> addresses (the ``TF_CONFIG`` cluster); jobs other
            than ``ps`` and ``worker`` are ignored.
        security: credentials to present (default: the environment's).
        timeout: deadline of each call, in seconds.

    Raises:
        InvalidArgumentError: ``timeout`` is not positive or the cluster is malformed.
    """

    def __init__(
        self,
        cluster: Mapping[str, Sequence[str]],
        *,
        security: SecurityConfig | None = None,
        timeout: float = 1.5,
    ) -> None:
        if not timeout > 0:
            raise InvalidArgumentError(f"probe timeout {timeout!r} must be > 0")
        self.timeout = timeout
        security = default_security() if security is None else security
        self._security = security
        self.ps_addresses = _addresses(cluster, PS)
        self.worker_addresses = _addresses(cluster, WORKER)
        self._ps = [self._ps_client(i, a) for i, a in enumerate(self.ps_addresses)]
        self._workers = [_WorkerStatus(a, security) for a in self.worker_addresses]
        self._tables: dict[str, _TableStats] = {}  # by address, made on first use
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=MAX_THREADS, thread_name_prefix="dashboard-probe"
        )

    def _ps_client(self, index: int, address: str) -> PSClient:
        # No retries: a task that does not answer within one deadline is news.
        once = RetryPolicy(max_attempts=1)
        return PSClient(
            address,
            f"ps:{index}",
            timeout=self.timeout,
            retry=once,
            max_workers=1,
            security=self._security,
        )

    def set_ps_addresses(self, addresses: Sequence[str]) -> None:
        """Probes the PS tasks at ``addresses`` from the next round on (after a resize).

        A task at the same index and address keeps its channel; the others
        are closed.  Call it between rounds (the monitor's thread does).

        Raises:
            InvalidArgumentError: ``addresses`` is not a list of addresses.
        """
        addresses = _addresses({PS: addresses}, PS)
        kept = [
            client if i < len(addresses) and addresses[i] == old else None
            for i, (old, client) in enumerate(zip(self.ps_addresses, self._ps))
        ]
        clients = [
            kept[i] if i < len(kept) and kept[i] is not None else self._ps_client(i, a)
            for i, a in enumerate(addresses)
        ]
        for client, keep in zip(self._ps, kept):
            if keep is None:
                client.close()
        for address in [a for a in self._tables if a not in addresses]:
            self._tables.pop(address).close()
        self.ps_addresses, self._ps = addresses, clients

    def _ask_ps(self, index: int) -> TaskAnswer:
        address = self.ps_addresses[index]
        try:
            values = self._ps[index].stats(timeout=self.timeout)
        except OpError as e:
            return TaskAnswer(PS, index, address, time.time(), error=f"{e.code.name}: {e.message}")
        tables = self._tables.get(address)
        if tables is None:
            tables = self._tables[address] = _TableStats(address, self._security)
        try:
            values = {**values, "tables": tables(self.timeout)}
        except grpc.RpcError:  # the variables answered: the tables are a detail of this round
            values = {**values, "tables": []}
        return TaskAnswer(PS, index, address, time.time(), values=values)

    def _ask_worker(self, index: int) -> TaskAnswer:
        address = self.worker_addresses[index]
        try:
            values = self._workers[index](self.timeout)
        except grpc.RpcError as e:
            error = f"{e.code().name}: {e.details()}"
            return TaskAnswer(WORKER, index, address, time.time(), error=error)
        return TaskAnswer(WORKER, index, address, time.time(), values=values)

    def round(self) -> list[TaskAnswer]:
        """Every task's answer: the PS tasks in order, then the workers."""
        futures = [self._pool.submit(self._ask_ps, i) for i in range(len(self._ps))]
        futures += [self._pool.submit(self._ask_worker, i) for i in range(len(self._workers))]
        # Each call is bounded by its deadline; the margin covers a loaded machine's scheduling.
        return [f.result(timeout=self.timeout + 30.0) for f in futures]

    def close(self) -> None:
        """Closes the channels and the thread pool."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        for client in self._ps:
            client.close()
        for worker in self._workers:
            worker.close()
        for tables in self._tables.values():
            tables.close()

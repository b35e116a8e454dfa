"""Client of the dynamic embedding tables spread over every PS task.

:class:`EmbeddingClient` holds one channel per PS task.  A lookup or a push
first reduces its ids to unique ones (a push sums the gradient rows of repeated
ids, as ``unsorted_segment_sum`` would), splits them by owner
(:func:`psflow.ps.key_index.shard_of`) and calls the owners in parallel, so the
wire carries each id at most once per call.  Lookups and pushes go over a
task's raw TCP data plane when it announces one
(:mod:`psflow.transport.embedding_plane`), gRPC otherwise.  Every call has a deadline; pushes
carry a request id and are retried once on UNAVAILABLE or DEADLINE_EXCEEDED
with the same id, so a lost reply never applies a gradient twice.

Example (a running cluster's PS addresses)::

    client = EmbeddingClient(["127.0.0.1:5000", "127.0.0.1:5001"])
    client.create_table(TableConfig("user", dim=16, optimizer={"name": "adagrad"}))
    rows = client.lookup("user", np.array([3, 10**12, 3]))
    client.push("user", np.array([3, 10**12, 3]), np.ones((3, 16), np.float32))
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import threading
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import numpy as np

from psflow import settings
from psflow.errors import DeadlineExceededError, InvalidArgumentError, UnavailableError
from psflow.proto import embedding_pb2
from psflow.ps.dynamic_table import TableConfig, TableStats
from psflow.ps.hot_rows import HotRowCaches, HotRowPolicy
from psflow.ps.key_index import ShardSplit, as_ids, unique_gradients, unique_ids
from psflow.security.config import SecurityConfig, default_security
from psflow.update_rules import put_rows, take_rows
from psflow.wire import codec

from . import embedding_plane
from .core import Call, Endpoint, RequestIds, RetryPolicy
from .options import DEFAULT_MAX_MESSAGE_BYTES
from .started import Started, fan_out, gather

__all__ = ["EmbeddingClient", "TableClient", "WireBytes"]

_SERVICE = embedding_pb2.DESCRIPTOR.services_by_name["EmbeddingService"]
_METHODS = {
    m.name: (
        f"/{_SERVICE.full_name}/{m.name}",
        getattr(embedding_pb2, m.output_type.name).FromString,
    )
    for m in _SERVICE.methods
}
# a table call is repeated once, at once, where it was UNAVAILABLE or timed out (each
# attempt with the whole timeout): pushes carry their request id, applied once
_RETRY = RetryPolicy(
    initial_backoff=0.0,
    retry_codes=frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}),
)
_PLANE_RETRIED = (UnavailableError, DeadlineExceededError)


@dataclasses.dataclass
class WireBytes:
    """Tensor bytes this client sent and received (ids, rows, gradients)."""

    pulled: int = 0
    pushed: int = 0
    lookups: int = 0
    pushes: int = 0


class TableClient:
    """What both table clients (this module's, and the in-process one of
    :mod:`psflow.distribute.ps.inprocess`) share: a push is a started push waited for."""

    def start_push(self, *args: Any, **kwargs: Any) -> Callable[[], list[int]]:
        """Sends gradient rows; calling the result waits and returns each shard's step."""
        raise NotImplementedError

    def push(self, *args: Any, **kwargs: Any) -> list[int]:
        """Applies gradient rows once; returns each shard's step (-1 where it got
        no ids): :meth:`start_push` (its arguments and errors), then waiting."""
        return self.start_push(*args, **kwargs)()


class EmbeddingClient(TableClient):
    """The dynamic tables of a cluster's PS tasks, addressed as one.

    Args:
        addresses: ``host:port`` of every PS task, in task order (shard i is ``ps:i``).
        timeout: deadline of each call, in seconds.
        security: token and TLS material (default: the environment's).
        max_message_bytes: gRPC message size limit.
        hot_rows: cache every table's busiest rows here (see
            :mod:`psflow.ps.hot_rows`; :meth:`cache_hot_rows` sets it per
            table); None: lookups go to the PS.
        data_plane: look up and push over a PS task's raw TCP data plane when
            it announces one (:mod:`psflow.transport.embedding_plane`; the
            same errors and deadlines), gRPC otherwise; None: the process
            setting (``PSFLOW_DATA_PLANE``, on by default).
        parallel: call the shards of one lookup or push at once (on the data
            plane from this thread, over gRPC all but one from a thread
            pool), or one after another from the
            calling thread: no thread hand-off, but the round trips add up.
            In ``benchmarks/recsys.py`` (2 PS and 2 workers on one 2-core
            host) one after another took less of a lone client's CPU yet gave
            fewer examples/s, hence the default.
    """

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        timeout: float = 60.0,
        security: SecurityConfig | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        hot_rows: HotRowPolicy | None = None,
        data_plane: bool | None = None,
        parallel: bool = True,
    ) -> None:
        if not addresses:
            raise InvalidArgumentError("EmbeddingClient needs at least one PS address")
        self._want_plane = settings.current().data_plane if data_plane is None else data_plane
        self.addresses = list(addresses)
        self.timeout = timeout
        self.security = default_security() if security is None else security
        self._ids = RequestIds()
        self.client_id = self._ids.client_id
        self.bytes = WireBytes()
        self._lock = threading.Lock()
        self._configs: dict[str, TableConfig] = {}
        self._hot = HotRowCaches(hot_rows, self.fetch_hot_rows)
        self.max_message_bytes = max_message_bytes
        self.parallel = parallel
        self._split = ShardSplit()  # a push reuses the split of the ids its lookup sent
        self._connect()

    def _connect(self) -> None:
        """An endpoint per task of ``self.addresses`` (its data plane asked for
        on its first lookup or push), their stubs, and the fan-out's pool."""
        want, limit = self._want_plane, self.max_message_bytes
        self._ends = [
            Endpoint(a, f"ps:{s}", self.security, self.client_id, limit, _RETRY, want)
            for s, a in enumerate(self.addresses)
        ]
        self._stubs = [
            {name: end.stub(*how) for name, how in _METHODS.items()} for end in self._ends
        ]
        # not gRPC futures, which start a thread per call when idle
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max(1, len(self.addresses)), thread_name_prefix="embedding-client"
        )

    @property
    def data_plane_addresses(self) -> list[str | None]:
        """Per task, the data plane its lookups and pushes go to, once known
        (None: gRPC, or not asked yet)."""
        planes = [end.link.known for end in self._ends]
        return [None if plane is None else plane.address for plane in planes]

    @property
    def num_shards(self) -> int:
        """The number of PS tasks the tables are spread over."""
        return len(self.addresses)

    def retarget(self, addresses: Sequence[str]) -> None:
        """Routes by ``addresses`` from now on (the PS tasks after a resize); moves no row.

        Call it between steps: a call in flight may still reach an old task.

        Raises:
            InvalidArgumentError: no address.
        """
        if not addresses:
            raise InvalidArgumentError("EmbeddingClient needs at least one PS address")
        if list(addresses) == self.addresses:
            return
        old_pool, old_ends = self._pool, self._ends
        with self._lock:
            self.addresses = list(addresses)
            self._connect()
            self._hot.clear()  # its rows were fetched shard by shard from the old tasks
        old_pool.shutdown(wait=False)
        for end in old_ends:
            end.close()

    def close(self) -> None:
        """Closes the channels, the data-plane connections and the thread pool."""
        self._pool.shutdown(wait=False)
        for end in self._ends:
            end.close()

    def __enter__(self) -> EmbeddingClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(
        self,
        shard: int,
        method: str,
        request: Any,
        retries: int = 0,
        timeout: float | None = None,
    ) -> Any:
        """One gRPC call of the table service to task ``shard``, repeated up to
        ``retries`` times where it was UNAVAILABLE or timed out (each attempt
        with ``timeout``, default the client's).

        Raises:
            OpError: the call's typed error, naming ``ps:<shard>``.
        """
        stub = self._stubs[shard][method]
        return self._run(shard, method, lambda left: stub(request, timeout=left), retries, timeout)

    def _run(
        self,
        shard: int,
        method: str,
        attempt: Callable[[float], Any],
        retries: int,
        timeout: float | None = None,
    ) -> Any:
        """``attempt(time_left)`` under the table client's retry policy: each
        attempt its own deadline, retried at once (the request id unchanged)."""
        each = timeout or self.timeout
        policy = dataclasses.replace(_RETRY, max_attempts=retries + 1, attempt_timeout=each)
        return self._ends[shard].run(method, attempt, each * (retries + 1), policy)

    def _exchange(self, shard: int, call: Call, retries: int = 1) -> Any:
        """``call`` on its task's data plane when it has one and the payload fits,
        else over gRPC; retried like :meth:`call`."""
        attempt = functools.partial(self._ends[shard].attempt, call)
        return self._run(shard, call.method, attempt, retries)

    def _fan_out(self, calls: dict[int, Call]) -> dict[int, Started]:
        """One call per shard, started by :func:`~psflow.transport.started.fan_out`:
        on the shard's data plane it is sent now, from this thread, its reply
        read by the result (where it failed it is made again, whole); over gRPC
        (no plane, or a payload above its limit) it runs on the pool, or, the
        first, is left to the thread that reads the calls; without
        ``parallel`` every call is left to it (one after another)."""
        starts = {s: functools.partial(self._start, s, c) for s, c in calls.items()}
        work = {s: functools.partial(self._exchange, s, c) for s, c in calls.items()}
        return fan_out(starts if self.parallel else {}, work, self._pool if self.parallel else None)

    def _start(self, shard: int, call: Call) -> Started | None:
        return self._ends[shard].link.start(
            call,
            self.timeout,
            lambda _left: self._exchange(shard, call, 0),  # with a deadline of its own
            _PLANE_RETRIED,
            budget=2 * self.timeout,
        )

    def on_every_shard(self, fn: Callable[[int], Any]) -> list[Any]:
        """``fn(shard)`` for every task at once (on the pool); their results in
        task order, under :func:`~psflow.transport.started.gather`'s rule."""
        work = {s: functools.partial(fn, s) for s in range(self.num_shards)}
        return list(gather(fan_out({}, work, self._pool)).values())

    def _call_every(self, method: str, request: Any) -> list[Any]:
        """:meth:`call` of ``method`` on every task at once; the replies in task
        order.  ``request``: the message, or a function of the shard giving it."""
        make = request if callable(request) else lambda _: request
        return self.on_every_shard(lambda s: self.call(s, method, make(s)))

    # -- tables -------------------------------------------------------------------------
    def create_table(self, config: TableConfig) -> bool:
        """Creates ``config``'s table on every PS task; True if any shard was new.

        Raises:
            AlreadyExistsError: a table of that name exists with another config.
        """
        text = config.to_json()
        replies = self._call_every(
            "CreateTable",
            lambda s: embedding_pb2.CreateTableRequest(
                config_json=text, shard_index=s, num_shards=self.num_shards
            ),
        )
        self._configs[config.name] = config
        return any(r.created for r in replies)

    def lookup(self, table: str, ids: Any, training: bool = True) -> np.ndarray:
        """Rows of ``ids`` (any shape of integers): shape ``ids.shape + (dim,)``.

        ``training=False`` reads without creating rows (see
        :meth:`~psflow.ps.dynamic_table.DynamicTable.lookup`'s ``read_only``).

        Raises:
            NotFoundError: unknown table.
            InvalidArgumentError: ids not integers.
        """
        ids = np.asarray(ids)
        flat = as_ids(ids)
        unique, inverse = unique_ids(flat)
        cached = self._hot.split(table, unique)
        missing = unique if cached is None else unique[~cached[0]]
        parts = self._split(missing, self.num_shards)
        calls = {
            s: self._lookup_call(s, table, missing[parts[s]], training)
            for s in range(self.num_shards)
            if parts[s].size
        }
        replies = gather(self._fan_out(calls))
        with self._lock:
            self.bytes.lookups += 1
            for s, rows in replies.items():  # ids sent (counted, not gathered again), rows got
                self.bytes.pulled += parts[s].size * missing.itemsize + rows.nbytes
        hit = cached is not None and cached[0].any()
        known = [*replies.values(), cached[1]] if hit else list(replies.values())
        if known:
            dim, dtype = known[0].shape[1], known[0].dtype
        else:  # no ids: the width comes from the config
            dim, dtype = self._dim(table), np.dtype(self._configs[table].dtype)
        out = np.empty((unique.shape[0], dim), dtype)
        at = None if cached is None else np.flatnonzero(~cached[0])  # None: every id asked
        for s, rows in replies.items():
            put_rows(out, parts[s] if at is None else at[parts[s]], rows)
        if hit:
            out[cached[0]] = cached[1]
        return (out if unique is flat else take_rows(out, inverse)).reshape(*ids.shape, dim)

    def _lookup_call(self, s: int, table: str, ids: np.ndarray, training: bool) -> Call:
        """The lookup of the rows of ``ids`` (all owned by task ``s``)."""
        header, payload = embedding_plane.lookup_request(table, ids, not training)

        def over_grpc(left: float) -> np.ndarray:  # the same request, the ids' bytes inside
            request = embedding_plane.grpc_request(header, embedding_pb2.LookupRequest, ids=ids)
            return codec.decode_tensor(self._stubs[s]["Lookup"](request, timeout=left).rows)

        read = embedding_plane.rows_from_reply
        return Call(embedding_plane.LOOKUP, header, payload, ids.nbytes, read, over_grpc)

    def cache_hot_rows(self, table: str, policy: HotRowPolicy) -> None:
        """Caches ``table``'s hot rows with ``policy`` from its next lookup on
        (a table's first policy stays)."""
        self._hot.set_policy(table, policy)

    def _dim(self, table: str) -> int:
        if table not in self._configs:
            raise InvalidArgumentError(f"the width of table {table!r} is unknown to this client")
        return self._configs[table].dim

    def start_push(
        self,
        table: str,
        ids: Any,
        grads: Any,
        optimizer: dict | None = None,
        request_ids: Callable[[int], tuple[str, int]] | None = None,
    ) -> Callable[[], list[int]]:
        """Sends gradient rows ``grads`` (``ids.shape + (dim,)``) to their shards
        and returns without waiting: calling the result makes the gRPC call left
        to it (every shard's without ``parallel``) from the calling thread, waits
        for every shard and returns each one's step (-1 where it got no ids).
        ``optimizer`` (an update rule's config) binds a table created without
        one, or must match it.  ``request_ids(shard)`` gives each shard's request id (a PS session's
        :meth:`~psflow.distribute.ps.session.PSSession.request_id`, so a re-run
        closure's push is applied once); by default this client's own sequence.

        Raises:
            InvalidArgumentError: ids not integers, grads of the wrong shape
                (here, before anything is sent).
            NotFoundError: unknown table (from calling the result, as every
                error a shard answers).
        """
        unique, summed = unique_gradients(ids, grads)
        parts = self._split(unique, self.num_shards)
        optimizer_json = "" if optimizer is None else json.dumps(optimizer, sort_keys=True)
        calls = {}
        for s in range(len(parts)):  # ids taken in shard order, so a re-run draws the same ones
            if parts[s].size:
                ids_s, grads_s = unique[parts[s]], take_rows(summed, parts[s])  # whole rows
                rid = self._ids() if request_ids is None else request_ids(s)
                calls[s] = self._push_call(s, table, ids_s, grads_s, rid, optimizer_json)
        started = self._fan_out(calls)

        def finish() -> list[int]:
            replies = gather(started)
            with self._lock:
                self.bytes.pushes += 1
                self.bytes.pushed += sum(c.nbytes for c in calls.values())
            return [replies.get(s, -1) for s in range(len(parts))]

        return finish

    def _push_call(
        self,
        s: int,
        table: str,
        ids: np.ndarray,
        grads: np.ndarray,
        request_id: tuple[str, int],
        optimizer_json: str,
    ) -> Call:
        """The push of gradient rows of ``ids`` (all owned by task ``s``); its value
        is the shard's step."""
        header, payload = embedding_plane.push_request(
            table, ids, grads, request_id, optimizer_json
        )

        def over_grpc(left: float) -> int:  # the same request, the tensors' bytes inside
            cls = embedding_pb2.PushGradientsRequest
            request = embedding_plane.grpc_request(header, cls, ids=ids, grads=grads)
            return self._stubs[s]["PushGradients"](request, timeout=left).step

        read, nbytes = embedding_plane.step_from_reply, ids.nbytes + grads.nbytes
        return Call(embedding_plane.PUSH, header, payload, nbytes, read, over_grpc)

    def fetch_hot_rows(self, table: str, count: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``count`` busiest ids of each shard and their rows (concatenated)."""
        replies = self._call_every(
            "HotRows", embedding_pb2.HotRowsRequest(table=table, count=count)
        )
        ids = np.concatenate([codec.decode_tensor(r.ids) for r in replies])
        rows = np.concatenate([codec.decode_tensor(r.rows) for r in replies])
        with self._lock:
            self.bytes.pulled += ids.nbytes + rows.nbytes
        return ids, rows

    def stats(self) -> list[dict[str, TableStats]]:
        """Every shard's table counters, in task order."""
        replies = self._call_every("GetTableStats", embedding_pb2.GetTableStatsRequest())
        return [embedding_plane.table_stats(reply) for reply in replies]

    def server_bytes(self) -> list[tuple[int, int]]:
        """``(bytes in, bytes out)`` of every task's Lookup and PushGradients calls
        (serialized messages), in task order."""
        replies = self._call_every("GetTableStats", embedding_pb2.GetTableStatsRequest())
        return [(r.bytes_in, r.bytes_out) for r in replies]

    def save(self, directory: str) -> list[str]:
        """Every task writes its tables into ``directory``; returns the files."""
        request = embedding_pb2.SaveTablesRequest(directory=directory)
        return [r.path for r in self._call_every("SaveTables", request)]

    def restore(self, directory: str) -> int:
        """Every task restores the ids it owns now from all table files in
        ``directory`` (written by any number of tasks); returns the rows restored."""
        replies = self._call_every(
            "RestoreTables",
            lambda s: embedding_pb2.RestoreTablesRequest(
                directory=directory, shard_index=s, num_shards=self.num_shards
            ),
        )
        return sum(r.rows for r in replies)

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
import itertools
import json
import logging
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import grpc
import numpy as np

from psflow import settings
from psflow.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    UnavailableError,
)
from psflow.proto import embedding_pb2, ps_pb2
from psflow.ps.dynamic_table import TableConfig, TableStats
from psflow.ps.hot_rows import HotRowCache, HotRowPolicy
from psflow.ps.key_index import as_ids, gradient_rows, shard_of, sum_rows, unique_ids
from psflow.security.config import SecurityConfig, default_security
from psflow.security.grpc_auth import open_channel
from psflow.update_rules import put_rows, take_rows
from psflow.wire import codec

from . import embedding_plane
from .core import PlaneLink, RetryPolicy
from .options import DEFAULT_MAX_MESSAGE_BYTES, channel_options
from .service import SERVICE as PS_SERVICE
from .started import Started, gather, settle

__all__ = ["EmbeddingClient", "TableClient", "WireBytes"]

log = logging.getLogger(__name__)

_SERVICE = embedding_pb2.DESCRIPTOR.services_by_name["EmbeddingService"]
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


@dataclasses.dataclass(frozen=True)
class _ShardCall:
    """A Lookup or PushGradients call to one task, either way it can travel.

    ``request()`` gives the data-plane header and payload buffers of ``method``
    (``nbytes`` of payload) and ``parse(header, payload)`` its reply's value;
    ``over_grpc(time_left)`` makes one attempt of the whole call over gRPC instead.
    """

    shard: int
    method: str
    nbytes: int
    request: Callable[[], tuple[bytes, Sequence[Any]]]
    parse: Callable[[bytes, memoryview], Any]
    over_grpc: Callable[[float], Any]


def _push_step(reply: bytes, payload: memoryview) -> int:
    """The step a data-plane PushGradients reply reports."""
    return embedding_plane.parse(reply, embedding_pb2.PushGradientsResponse).step


class TableClient:
    """What both table clients (this module's, and the in-process one of
    :mod:`psflow.distribute.ps.inprocess`) share: a push is a started push waited for."""

    def start_push(self, *args: Any, **kwargs: Any) -> Callable[[], list[int]]:
        """Sends gradient rows; calling the result waits and returns each shard's step."""
        raise NotImplementedError

    def push(self, *args: Any, **kwargs: Any) -> list[int]:
        """Applies gradient rows ``grads`` (``ids.shape + (dim,)``) once; returns
        each shard's step (-1 where it got no ids): :meth:`start_push`'s
        arguments, then waiting for it.

        Raises:
            NotFoundError: unknown table.
            InvalidArgumentError: ids not integers, grads of the wrong shape.
        """
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
        parallel: call the shards of one lookup or push at once (all but
            the last from a thread pool), or one after another from the
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
        process = settings.current()
        self._want_plane = process.data_plane if data_plane is None else data_plane
        self._plane_routes = dict(process.data_plane_routes)
        self.addresses = list(addresses)
        self.timeout = timeout
        self.security = default_security() if security is None else security
        self.client_id = uuid.uuid4().hex
        self.bytes = WireBytes()
        self._sequence = itertools.count(1)
        self._lock = threading.Lock()
        self._configs: dict[str, TableConfig] = {}
        self.hot_rows = hot_rows
        self._hot: dict[str, HotRowCache] = {}
        self._hot_policies: dict[str, HotRowPolicy] = {}
        self.max_message_bytes = max_message_bytes
        self.parallel = parallel
        # ``(ids, shard count, parts)`` of the last split: a push carries the unique
        # ids its lookup just split (one tuple, replaced whole: threads may share it)
        self._last_split: tuple[np.ndarray, int, list[np.ndarray]] | None = None
        self._connect()

    def _connect(self) -> None:
        """Channels, stubs and a thread pool for ``self.addresses``."""
        self._metadata = self.security.call_metadata() or None
        self._channels = [
            open_channel(a, self.security, channel_options(self.max_message_bytes))
            for a in self.addresses
        ]
        self._stubs: list[dict[str, grpc.UnaryUnaryMultiCallable]] = []
        for channel in self._channels:
            stubs = {}
            for method in _SERVICE.methods:
                response_cls = getattr(embedding_pb2, method.output_type.name)
                stubs[method.name] = channel.unary_unary(
                    f"/{_SERVICE.full_name}/{method.name}",
                    request_serializer=lambda m: m.SerializeToString(),
                    response_deserializer=response_cls.FromString,
                )
            self._stubs.append(stubs)
        # each task's data plane, asked for on its first lookup or push
        self._links = [
            PlaneLink(
                address,
                f"ps:{s}",
                self.security,
                self.client_id,
                functools.partial(
                    channel.unary_unary(
                        f"/{PS_SERVICE}/DataPlaneInfo",
                        request_serializer=lambda m: m.SerializeToString(),
                        response_deserializer=ps_pb2.DataPlaneInfoResponse.FromString,
                    ),
                    ps_pb2.DataPlaneInfoRequest(),
                    metadata=self._metadata,
                ),
                enabled=self._want_plane,
                route=self._plane_routes.get(address, ""),
            )
            for s, (address, channel) in enumerate(zip(self.addresses, self._channels))
        ]
        # fan-outs: one call per shard here (a lookup's last shard runs in the
        # calling thread); not gRPC futures, which start a thread per call when idle
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max(1, len(self.addresses)), thread_name_prefix="embedding-client"
        )

    @property
    def data_plane_addresses(self) -> list[str | None]:
        """Per task, the data plane its lookups and pushes go to, once known
        (None: gRPC, or not asked yet)."""
        return [None if link.known is None else link.known.address for link in self._links]

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
        old_pool, old_channels, old_links = self._pool, self._channels, self._links
        with self._lock:
            self.addresses = list(addresses)
            self._connect()
            self._hot.clear()  # its rows were fetched shard by shard from the old tasks
        old_pool.shutdown(wait=False)
        for channel in old_channels:
            channel.close()
        for link in old_links:
            link.close()

    def close(self) -> None:
        """Closes the channels, the data-plane connections and the thread pool."""
        self._pool.shutdown(wait=False)
        for channel in self._channels:
            channel.close()
        for link in self._links:
            link.close()

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
        return self._run(
            shard,
            method,
            lambda left: stub(request, timeout=left, metadata=self._metadata),
            retries,
            timeout,
        )

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
        address = self.addresses[shard]
        return policy.run(method, f"ps:{shard}", address, attempt, each * (retries + 1))

    def _exchange(self, call: _ShardCall, retries: int = 1) -> Any:
        """``call`` on its task's data plane when it has one and the payload fits,
        else over gRPC; retried like :meth:`call`."""
        link = self._links[call.shard]

        def attempt(left: float) -> Any:
            plane = link.get(left)
            if plane is None or call.nbytes > link.max_payload:
                return call.over_grpc(left)
            try:
                return call.parse(*plane.call(call.method, *call.request(), left))
            except _PLANE_RETRIED as e:
                link.failed(plane, e)
                raise

        return self._run(call.shard, call.method, attempt, retries)

    def _fan_out(self, calls: Iterable[tuple[int, _ShardCall]], last: int) -> dict[int, Started]:
        """Starts one call per shard, in order (``last``: the last one's shard).

        On the shard's data plane it is sent now, from this thread, and its
        reply read by the result: a fan-out sends to every shard before it
        reads any reply, so the tasks work at once with no thread hand-off;
        where it failed it is made again, whole, by the result.  Over gRPC (no
        plane, or a payload above the plane's limit) it runs on the pool, or,
        the last one, is left to the thread that waits; without ``parallel``
        every call is left to it (one after another).  Read them with
        :func:`~psflow.transport.started.gather` (its failure rule).
        """
        started: dict[int, Started] = {}
        try:
            for s, call in calls:
                started[s] = self._begin(call, last=s == last or not self.parallel)
        except BaseException:
            settle(started.values())  # the ones sent finish first
            raise
        return started

    def _begin(self, call: _ShardCall, last: bool) -> Started:
        link = self._links[call.shard]
        if self.parallel and link.known is not None and call.nbytes <= link.max_payload:
            started = link.start(
                call.method,
                *call.request(),
                call.nbytes,
                self.timeout,
                lambda reply: call.parse(*reply),
                lambda _left: self._exchange(call, 0),  # with a deadline of its own
                _PLANE_RETRIED,
                budget=2 * self.timeout,
            )
            if started is not None:
                return started
        work = functools.partial(self._exchange, call)
        return Started(work) if last else Started.pooled(self._pool.submit(work))

    def on_every_shard(self, fn: Callable[[int], Any]) -> list[Any]:
        """``fn(shard)`` for every task at once (on the pool); their results in
        task order, under :func:`~psflow.transport.started.gather`'s rule."""
        calls = {s: Started.pooled(self._pool.submit(fn, s)) for s in range(self.num_shards)}
        return list(gather(calls).values())

    # -- tables -------------------------------------------------------------------------
    def create_table(self, config: TableConfig) -> bool:
        """Creates ``config``'s table on every PS task; True if any shard was new.

        Raises:
            AlreadyExistsError: a table of that name exists with another config.
        """
        text = config.to_json()
        replies = self.on_every_shard(
            lambda s: self.call(
                s,
                "CreateTable",
                embedding_pb2.CreateTableRequest(
                    config_json=text, shard_index=s, num_shards=self.num_shards
                ),
            )
        )
        self._configs[config.name] = config
        return any(r.created for r in replies)

    def _request_id(
        self, shard: int, request_ids: Callable[[int], tuple[str, int]] | None
    ) -> tuple[str, int]:
        if request_ids is not None:
            return request_ids(shard)
        with self._lock:
            return (self.client_id, next(self._sequence))

    def _split(self, ids: np.ndarray) -> list[np.ndarray]:
        """Positions into ``ids`` owned by each shard.

        A step pushes the very ids it looked up: the last split is kept (with a
        copy of its ids, compared by value) and the push reuses it instead of
        hashing every id again.
        """
        n = self.num_shards
        if n == 1:
            return [np.arange(ids.shape[0])]
        last = self._last_split
        if last is not None and last[1] == n and np.array_equal(last[0], ids):
            return last[2]
        owner = shard_of(ids, n)
        parts = [np.flatnonzero(owner == s) for s in range(n)]
        self._last_split = (ids.copy(), n, parts)
        return parts

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
        cached: tuple[np.ndarray, np.ndarray] | None = None
        if unique.size and (self.hot_rows is not None or table in self._hot_policies):
            cached = self._hot_cache(table).split(unique)
        missing = unique if cached is None else unique[~cached[0]]
        parts = self._split(missing)
        shards = [s for s in range(self.num_shards) if parts[s].size]
        calls = ((s, self._lookup_call(s, table, missing[parts[s]], training)) for s in shards)
        replies = gather(self._fan_out(calls, shards[-1] if shards else -1))
        results: list[np.ndarray | None] = [None] * self.num_shards
        for s, rows in replies.items():
            results[s] = rows
        with self._lock:
            self.bytes.lookups += 1
            for s in replies:  # ids sent (counted, not gathered again) and rows received
                self.bytes.pulled += parts[s].size * missing.itemsize + results[s].nbytes
        known = [r for r in results if r is not None]
        if cached is not None and cached[0].any():
            known.append(cached[1])
        if known:
            dim, dtype = known[0].shape[1], known[0].dtype
        else:  # no ids: the width comes from the config
            dim, dtype = self._dim(table), np.dtype(self._configs[table].dtype)
        out = np.empty((unique.shape[0], dim), dtype)
        at = np.arange(unique.shape[0]) if cached is None else np.flatnonzero(~cached[0])
        for s, rows in enumerate(results):
            if rows is not None:
                put_rows(out, at[parts[s]], rows)
        if cached is not None and cached[0].any():
            out[cached[0]] = cached[1]
        return (out if unique is flat else take_rows(out, inverse)).reshape(*ids.shape, dim)

    def _lookup_call(self, s: int, table: str, ids: np.ndarray, training: bool) -> _ShardCall:
        """The lookup of the rows of ``ids`` (all owned by task ``s``)."""

        def over_grpc(left: float) -> np.ndarray:
            request = embedding_pb2.LookupRequest(
                table=table, ids=codec.encode_tensor(ids), read_only=not training
            )
            reply = self._stubs[s]["Lookup"](request, timeout=left, metadata=self._metadata)
            return codec.decode_tensor(reply.rows)

        return _ShardCall(
            s,
            embedding_plane.LOOKUP,
            ids.nbytes,
            functools.partial(embedding_plane.lookup_request, table, ids, not training),
            embedding_plane.rows_from_reply,
            over_grpc,
        )

    def cache_hot_rows(self, table: str, policy: HotRowPolicy) -> None:
        """Caches ``table``'s hot rows with ``policy`` from its next lookup on
        (a table's first policy stays)."""
        with self._lock:
            self._hot_policies.setdefault(table, policy)

    def _hot_cache(self, table: str) -> HotRowCache:
        with self._lock:
            cache = self._hot.get(table)
            if cache is None:
                policy = self._hot_policies.get(table, self.hot_rows)
                cache = self._hot[table] = HotRowCache(
                    policy, lambda: self.fetch_hot_rows(table, policy.count)
                )
            return cache

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
        and returns without waiting: calling the result sends the last shard's
        (every shard's without ``parallel``) from the calling thread, waits for
        every shard and returns each one's step (-1 where it got no ids).
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
        flat = as_ids(ids)
        grads = gradient_rows(ids, grads)
        unique, inverse = unique_ids(flat)
        if unique is flat:  # sorted unique already (a DynamicEmbedding's gradient)
            summed = grads
        elif unique.shape[0] != flat.shape[0]:
            summed = sum_rows(grads, inverse, unique.shape[0])
        else:
            summed = np.empty_like(grads)
            summed[inverse] = grads
        parts = self._split(unique)
        optimizer_json = "" if optimizer is None else json.dumps(optimizer, sort_keys=True)
        shards = [s for s in range(len(parts)) if parts[s].size]
        # ids are taken here, in shard order, so a re-run draws the same ones
        rids = {s: self._request_id(s, request_ids) for s in shards}
        sent = 0

        def calls() -> Iterator[tuple[int, _ShardCall]]:
            nonlocal sent
            for s in shards:  # each sent before the next shard's rows are gathered
                ids_s, grads_s = unique[parts[s]], take_rows(summed, parts[s])  # whole rows
                sent += ids_s.nbytes + grads_s.nbytes
                yield s, self._push_call(s, table, ids_s, grads_s, rids[s], optimizer_json)

        started = self._fan_out(calls(), shards[-1] if shards else -1)

        def finish() -> list[int]:
            replies = gather(started)
            with self._lock:
                self.bytes.pushes += 1
                self.bytes.pushed += sent
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
    ) -> _ShardCall:
        """The push of gradient rows of ``ids`` (all owned by task ``s``); its value
        is the shard's step."""

        def over_grpc(left: float) -> int:
            request = embedding_pb2.PushGradientsRequest(
                table=table,
                ids=codec.encode_tensor(ids),
                grads=codec.encode_tensor(grads),
                request_id=ps_pb2.RequestId(client_id=request_id[0], sequence=request_id[1]),
                optimizer_json=optimizer_json,
            )
            stub = self._stubs[s]["PushGradients"]
            return stub(request, timeout=left, metadata=self._metadata).step

        return _ShardCall(
            s,
            embedding_plane.PUSH,
            ids.nbytes + grads.nbytes,
            functools.partial(
                embedding_plane.push_request, table, ids, grads, request_id, optimizer_json
            ),
            _push_step,
            over_grpc,
        )

    def fetch_hot_rows(self, table: str, count: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``count`` busiest ids of each shard and their rows (concatenated)."""

        def one(s: int) -> tuple[np.ndarray, np.ndarray]:
            reply = self.call(s, "HotRows", embedding_pb2.HotRowsRequest(table=table, count=count))
            ids, rows = codec.decode_tensor(reply.ids), codec.decode_tensor(reply.rows)
            with self._lock:
                self.bytes.pulled += ids.nbytes + rows.nbytes
            return ids, rows

        results = self.on_every_shard(one)
        return np.concatenate([r[0] for r in results]), np.concatenate([r[1] for r in results])

    def stats(self) -> list[dict[str, TableStats]]:
        """Every shard's table counters, in task order."""

        def one(s: int) -> dict[str, TableStats]:
            reply = self.call(s, "GetTableStats", embedding_pb2.GetTableStatsRequest())
            fields = [f.name for f in dataclasses.fields(TableStats)]
            return {t.table: TableStats(**{f: getattr(t, f) for f in fields}) for t in reply.tables}

        return self.on_every_shard(one)

    def server_bytes(self) -> list[tuple[int, int]]:
        """``(bytes in, bytes out)`` of every task's Lookup and PushGradients calls
        (serialized messages), in task order."""

        def one(s: int) -> tuple[int, int]:
            reply = self.call(s, "GetTableStats", embedding_pb2.GetTableStatsRequest())
            return reply.bytes_in, reply.bytes_out

        return self.on_every_shard(one)

    def save(self, directory: str) -> list[str]:
        """Every task writes its tables into ``directory``; returns the files."""
        request = embedding_pb2.SaveTablesRequest(directory=directory)
        return [r.path for r in self.on_every_shard(lambda s: self.call(s, "SaveTables", request))]

    def restore(self, directory: str) -> int:
        """Every task restores the ids it owns now from all table files in
        ``directory`` (written by any number of tasks); returns the rows restored."""

        def one(s: int) -> int:
            request = embedding_pb2.RestoreTablesRequest(
                directory=directory, shard_index=s, num_shards=self.num_shards
            )
            return self.call(s, "RestoreTables", request).rows

        return sum(self.on_every_shard(one))

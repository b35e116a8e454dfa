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
import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
import numpy as np

from psflow import settings
from psflow.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    OpError,
    UnavailableError,
    error_class,
    from_grpc,
)
from psflow.proto import embedding_pb2, ps_pb2
from psflow.ps.dynamic_table import TableConfig, TableStats
from psflow.ps.hot_rows import HotRowCache, HotRowPolicy
from psflow.ps.key_index import shard_of, sum_rows, unique_ids
from psflow.ps.tables import TableRegistry
from psflow.security.config import SecurityConfig, default_security
from psflow.security.grpc_auth import open_channel
from psflow.update_rules import put_rows, take_rows

from . import codec, embedding_plane
from .dataplane import DataPlaneClient
from .options import DEFAULT_MAX_MESSAGE_BYTES, channel_options
from .service import SERVICE as PS_SERVICE

__all__ = ["EmbeddingClient", "InProcessEmbeddingClient", "WireBytes"]

log = logging.getLogger(__name__)

_SERVICE = embedding_pb2.DESCRIPTOR.services_by_name["EmbeddingService"]
# seconds to open the first data-plane connection before falling back to gRPC
_PLANE_CONNECT_TIMEOUT = 5.0


@dataclasses.dataclass
class WireBytes:
    """Tensor bytes this client sent and received (ids, rows, gradients)."""

    pulled: int = 0
    pushed: int = 0
    lookups: int = 0
    pushes: int = 0


def _as_ids(ids: Any) -> np.ndarray:
    ids = np.asarray(ids)
    if ids.dtype.kind not in "iu":
        raise InvalidArgumentError(f"ids must be integers, got dtype {ids.dtype}")
    if ids.dtype == np.uint64 and ids.size and int(ids.max()) >= 2**63:
        raise InvalidArgumentError(f"id {int(ids.max())} does not fit in int64")
    return ids.reshape(-1).astype(np.int64, copy=False)


@dataclasses.dataclass(frozen=True)
class _ShardCall:
    """A Lookup or PushGradients call to one task, either way it can travel.

    ``request()`` gives the data-plane header and payload buffers of ``method``
    (``nbytes`` of payload) and ``parse(header, payload)`` its reply's value;
    ``over_grpc()`` makes the whole call over gRPC instead.
    """

    shard: int
    method: str
    nbytes: int
    request: Callable[[], tuple[bytes, Sequence[Any]]]
    parse: Callable[[bytes, memoryview], Any]
    over_grpc: Callable[[], Any]


def _close_planes(planes: Sequence[Any]) -> None:
    for plane in planes:
        if plane:
            plane[0].close()


class _Pending:
    """A call to one shard in flight on the client's pool, already done (the
    calling thread made it itself), deferred (the thread that waits for it
    makes it then), or sent on the data plane with its reply read then:
    :meth:`result` waits for the reply or raises its typed error."""

    __slots__ = ("_deferred", "_future", "_on_cancel", "_reply")

    def __init__(
        self,
        future: concurrent.futures.Future | None,
        reply: Any = None,
        deferred: Callable[[], Any] | None = None,
        on_cancel: Callable[[], None] | None = None,
    ) -> None:
        self._future, self._reply, self._deferred = future, reply, deferred
        self._on_cancel = on_cancel

    def result(self) -> Any:
        """The reply.

        Raises:
            OpError: the call failed (its typed error, naming ``ps:<shard>``).
        """
        if self._deferred is not None:
            call, self._deferred, self._on_cancel = self._deferred, None, None
            self._reply = call()
        return self._reply if self._future is None else self._future.result()

    def cancel(self) -> None:
        """Gives up on a call not started yet (or sent and not answered yet)."""
        self._deferred = None
        if self._future is not None:
            self._future.cancel()
        if self._on_cancel is not None:
            on_cancel, self._on_cancel = self._on_cancel, None
            on_cancel()


def _gather(pending: dict[int, _Pending]) -> dict[int, Any]:
    """Every shard's reply; on the first failure the others are cancelled and it raises."""
    replies = {}
    try:
        for shard, call in pending.items():
            replies[shard] = call.result()
    except BaseException:
        for call in pending.values():
            call.cancel()
        raise
    return replies


@contextlib.contextmanager
def _cancelled_on_error(pending: dict[int, _Pending]) -> Iterator[None]:
    """Cancels the calls started so far when starting the next one raises."""
    try:
        yield
    except BaseException:
        for call in pending.values():
            call.cancel()
        raise


def _push_step(reply: bytes, payload: memoryview) -> int:
    """The step a data-plane PushGradients reply reports."""
    return embedding_plane.parse(reply, embedding_pb2.PushGradientsResponse).step


class EmbeddingClient:
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
        self._plane_lock = threading.Lock()
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
        self._max_message_bytes = max_message_bytes
        self.parallel = parallel
        # ``(ids, shard count, parts)`` of the last split: a push carries the unique
        # ids its lookup just split (one tuple, replaced whole: threads may share it)
        self._last_split: tuple[np.ndarray, int, list[np.ndarray]] | None = None
        self._connect()

    def _connect(self) -> None:
        """Channels, stubs and a thread pool for ``self.addresses``."""
        self._metadata = self.security.call_metadata() or None
        self._channels = [
            open_channel(a, self.security, channel_options(self._max_message_bytes))
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
        self._info_stubs = [
            channel.unary_unary(
                f"/{PS_SERVICE}/DataPlaneInfo",
                request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=ps_pb2.DataPlaneInfoResponse.FromString,
            )
            for channel in self._channels
        ]
        # each task's data plane: None until asked (first lookup or push), then
        # ``(client, max payload bytes)`` or False (gRPC)
        self._planes: list[tuple[DataPlaneClient, int] | bool | None] = [
            None if self._want_plane else False for _ in self.addresses
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
        return [p[0].address if p else None for p in self._planes]

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
        old_pool, old_channels, old_planes = self._pool, self._channels, self._planes
        with self._lock:
            self.addresses = list(addresses)
            self._connect()
            self._hot.clear()  # its rows were fetched shard by shard from the old tasks
        old_pool.shutdown(wait=False)
        for channel in old_channels:
            channel.close()
        _close_planes(old_planes)

    def move_to(self, addresses: Sequence[str], chunk_bytes: int | None = None) -> int:
        """Re-shards every table over ``addresses`` over the wire; returns the rows held after.

        For each old task and table, the rows (with every optimizer slot,
        admission candidate and count, TTL clock) another task owns under the
        new count are exported in chunks bounded by the message limit and
        staged by their new owners (tasks added start empty and only
        receive); then every task of the new layout switches (drops exactly
        the rows it exported, merges what it staged) and this client routes
        by ``addresses``. No filesystem is involved. Nothing may look up or
        push meanwhile (the coordinator fences the resize at a step boundary).
        The tasks removed keep their rows until they are drained.
        ``chunk_bytes`` bounds the row bytes of one chunk (default: a quarter of the
        message limit).

        Raises:
            InvalidArgumentError: no address, or a layout that moves a kept task.
            OpError: a task failed before the switch (the error names the table
                and the tasks): nothing was dropped anywhere, this client still
                routes by the old tasks, and calling again completes the move;
                or a task failed during the switch (the error says which
                tasks switched).
        """
        new = list(addresses)
        if not new:
            raise InvalidArgumentError("EmbeddingClient needs at least one PS address")
        old_n, new_n = self.num_shards, len(new)
        kept = min(old_n, new_n)
        if new[:kept] != self.addresses[:kept]:
            raise InvalidArgumentError(
                f"a resize keeps the tasks it does not add or remove: {self.addresses[:kept]} "
                f"became {new[:kept]}"
            )
        if new == self.addresses:
            return sum(t.rows for shard in self.stats() for t in shard.values())
        names = sorted(set().union(*(shard.keys() for shard in self.stats())))
        move_id = uuid.uuid4().hex
        target = EmbeddingClient(
            new,
            timeout=self.timeout,
            security=self.security,
            max_message_bytes=self._max_message_bytes,
        )
        try:
            try:
                for name in names:  # the old tasks export in parallel
                    futures = [
                        self._pool.submit(self._move_rows, target, move_id, name, s, chunk_bytes)
                        for s in range(old_n)
                    ]
                    concurrent.futures.wait(futures)
                    for f in futures:
                        f.result()
            except OpError:
                self._abort_move(target, move_id)
                raise
            rows = self._commit_move(target, move_id)
        finally:
            target.close()
        self.retarget(new)
        return rows

    def _move_rows(
        self,
        target: EmbeddingClient,
        move_id: str,
        name: str,
        source: int,
        chunk_bytes: int | None,
    ) -> None:
        """Hands table ``name``'s rows leaving task ``source`` to their new owners."""
        new_n = target.num_shards
        for t in range(new_n):
            if t == source:
                continue
            for chunk_index in range(1 << 30):  # bounded by the rows: each chunk holds >= 1
                try:
                    reply = self._call(
                        source,
                        "ExportRows",
                        embedding_pb2.ExportRowsRequest(
                            move_id=move_id,
                            table=name,
                            num_shards=new_n,
                            target_shard=t,
                            chunk_index=chunk_index,
                            max_bytes=chunk_bytes or self._max_message_bytes // 4,
                        ),
                        retries=1,
                    )
                    if t >= self.num_shards and chunk_index == 0:
                        # an added task starts empty and serves nothing before the
                        # switch; its optimizer binds there
                        config = TableConfig.from_json(reply.chunk.config_json)
                        config = dataclasses.replace(config, optimizer=None)
                        target._call(
                            t,
                            "CreateTable",
                            embedding_pb2.CreateTableRequest(
                                config_json=config.to_json(),
                                shard_index=t,
                                num_shards=new_n,
                                move_id=move_id,
                            ),
                            retries=1,
                        )
                    target._call(
                        t,
                        "ImportRows",
                        embedding_pb2.ImportRowsRequest(
                            move_id=move_id,
                            source_shard=source,
                            chunk_index=chunk_index,
                            shard_index=t,
                            num_shards=new_n,
                            chunk=reply.chunk,
                        ),
                        retries=1,
                    )
                except OpError as e:
                    raise error_class(e.code)(
                        f"moving dynamic table {name!r} from ps:{source} to ps:{t} of "
                        f"{new_n}: {e.message} (nothing was dropped: the old layout stays; "
                        "retry the resize)",
                        task=e.task,
                    ) from e
                if not reply.more:
                    break

    def _abort_move(self, target: EmbeddingClient, move_id: str) -> None:
        """Best effort: every task reachable forgets the move's snapshots and chunks."""
        request = embedding_pb2.AbortMoveRequest(move_id=move_id)
        for client in (self, target):
            for s in range(client.num_shards):
                with contextlib.suppress(OpError):
                    client._call(s, "AbortMove", request, timeout=min(self.timeout, 5.0))

    def _commit_move(self, target: EmbeddingClient, move_id: str) -> int:
        """The switch on every task of the new layout; returns the rows they hold."""
        rows, done = 0, []
        for t in range(target.num_shards):
            request = embedding_pb2.CommitMoveRequest(
                move_id=move_id, shard_index=t, num_shards=target.num_shards
            )
            try:
                rows += target._call(t, "CommitMove", request, retries=1).rows
            except OpError as e:
                raise error_class(e.code)(
                    f"switching the dynamic tables to {target.num_shards} tasks failed at "
                    f"ps:{t} after {done} switched: {e.message}",
                    task=e.task,
                ) from e
            done.append(f"ps:{t}")
        return rows

    def close(self) -> None:
        """Closes the channels, the data-plane connections and the thread pool."""
        self._pool.shutdown(wait=False)
        for channel in self._channels:
            channel.close()
        with self._plane_lock:
            planes, self._planes = self._planes, [False] * len(self._planes)
        _close_planes(planes)

    def __enter__(self) -> EmbeddingClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(
        self,
        shard: int,
        method: str,
        request: Any,
        retries: int = 0,
        timeout: float | None = None,
    ) -> Any:
        for attempt in range(retries + 1):
            try:
                return self._stubs[shard][method](
                    request, timeout=timeout or self.timeout, metadata=self._metadata
                )
            except grpc.RpcError as e:
                error = from_grpc(e, task=f"ps:{shard}")
                retriable = isinstance(error, (UnavailableError, DeadlineExceededError))
                if attempt == retries or not retriable:
                    raise error from None
        raise AssertionError("unreachable")

    def _plane(self, shard: int) -> tuple[DataPlaneClient, int] | None:
        """Task ``shard``'s data plane and its payload limit, asked over gRPC on
        first use (None: use gRPC).

        Raises:
            OpError: the question failed (the call fails as a gRPC call would;
                the next one asks again).
        """
        plane = self._planes[shard]
        if plane is not None:
            return plane or None
        with self._plane_lock:
            if self._planes[shard] is None:
                self._planes[shard] = self._ask_plane(shard)
            return self._planes[shard] or None

    def _ask_plane(self, shard: int) -> tuple[DataPlaneClient, int] | bool:
        try:
            info = self._info_stubs[shard](
                ps_pb2.DataPlaneInfoRequest(), timeout=self.timeout, metadata=self._metadata
            )
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:  # a PS from before the data plane
                return False
            raise from_grpc(e, task=f"ps:{shard}") from None
        if not info.port and not info.address:
            return False
        grpc_address = self.addresses[shard]
        address = (
            self._plane_routes.get(grpc_address, "")
            or info.address
            or f"{grpc_address.rpartition(':')[0]}:{info.port}"
        )
        plane = DataPlaneClient(
            address, self.security, task=f"ps:{shard}", client_name=self.client_id
        )
        try:
            plane.connect(min(self.timeout, _PLANE_CONNECT_TIMEOUT))
        except OpError as e:
            plane.close()
            log.warning(
                "ps:%d announces a data plane at %s, which cannot be used (%s): table "
                "lookups and pushes to it go over gRPC",
                shard,
                address,
                e,
            )
            return False
        return plane, info.max_payload_bytes

    def _exchange(self, call: _ShardCall, retries: int = 1) -> Any:
        """``call`` on its task's data plane when it has one and the payload fits,
        else over gRPC; retried like :meth:`_call`."""
        for attempt in range(retries + 1):
            plane = None
            try:
                plane = self._plane(call.shard)
                if plane is None or call.nbytes > plane[1]:
                    return call.over_grpc()
                header, buffers = call.request()
                return call.parse(*plane[0].call(call.method, header, buffers, self.timeout))
            except (UnavailableError, DeadlineExceededError) as e:
                self._plane_failed(call.shard, plane, e)
                if attempt == retries:
                    raise
        raise AssertionError("unreachable")

    def _plane_failed(
        self, shard: int, plane: tuple[DataPlaneClient, int] | None, error: OpError
    ) -> None:
        if plane is not None and isinstance(error, UnavailableError):
            # a restarted task listens elsewhere: ask again on the next call
            self._forget_plane(shard, plane)

    def _begin(self, call: _ShardCall, last: bool) -> _Pending:
        """Starts one shard's call of a fan-out.

        On the shard's data plane it is sent now, from this thread, and its
        reply read by the result: a fan-out sends to every shard before it
        reads any reply, so the tasks work at once with no thread hand-off.
        Where it failed it is made again, whole, by the result.  Over gRPC
        (no plane, or a payload above the plane's limit) it runs on the pool,
        or, ``last`` of the fan-out, is left to the thread that waits.
        """
        plane = self._planes[call.shard]
        if not plane or call.nbytes > plane[1]:  # unknown yet, none, or too large: as before
            return self._start(functools.partial(self._exchange, call), defer=last)
        try:
            sent = plane[0].send(call.method, *call.request(), self.timeout)
        except (UnavailableError, DeadlineExceededError) as e:
            self._plane_failed(call.shard, plane, e)
            return _Pending(None, deferred=functools.partial(self._exchange, call, 0))

        def finish() -> Any:
            try:
                reply, payload = sent.result()
            except (UnavailableError, DeadlineExceededError) as e:
                self._plane_failed(call.shard, plane, e)
                return self._exchange(call, 0)
            return call.parse(reply, payload)

        return _Pending(None, deferred=finish, on_cancel=sent.cancel)

    def _forget_plane(self, shard: int, plane: tuple[DataPlaneClient, int]) -> None:
        with self._plane_lock:
            if self._planes[shard] is plane:
                self._planes[shard] = None
        plane[0].close()

    def _start(
        self, call: Callable[[], Any], inline: bool = False, defer: bool = False
    ) -> _Pending:
        """Runs ``call`` on the pool without waiting for it, ``inline`` in this
        thread (a fan-out's last call: one thread hand-off fewer), or with ``defer``
        leaves it to the thread that waits for its result (the same, for a caller that
        does other work between starting and waiting)."""
        if inline:
            return _Pending(None, call())
        if defer:
            return _Pending(None, deferred=call)
        return _Pending(self._pool.submit(call))

    def _on_every_shard(self, fn: Callable[[int], Any]) -> list[Any]:
        futures = [self._pool.submit(fn, s) for s in range(self.num_shards)]
        return [f.result() for f in futures]

    # -- tables -------------------------------------------------------------------------
    def create_table(self, config: TableConfig) -> bool:
        """Creates ``config``'s table on every PS task; True if any shard was new.

        Raises:
            AlreadyExistsError: a table of that name exists with another config.
        """
        text = config.to_json()
        replies = self._on_every_shard(
            lambda s: self._call(
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
        flat = _as_ids(ids)
        unique, inverse = unique_ids(flat)
        cached: tuple[np.ndarray, np.ndarray] | None = None
        if unique.size and (self.hot_rows is not None or table in self._hot_policies):
            cached = self._hot_cache(table).split(unique)
        missing = unique if cached is None else unique[~cached[0]]
        parts = self._split(missing)
        shards = [s for s in range(self.num_shards) if parts[s].size]
        pending: dict[int, _Pending] = {}
        with _cancelled_on_error(pending):
            for s in shards:
                call = self._lookup_call(s, table, missing[parts[s]], training)
                if not self.parallel:
                    pending[s] = _Pending(None, self._exchange(call))
                else:
                    pending[s] = self._begin(call, last=s == shards[-1])
        replies = _gather(pending)
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

        def over_grpc() -> np.ndarray:
            request = embedding_pb2.LookupRequest(
                table=table, ids=codec.encode_tensor(ids), read_only=not training
            )
            return codec.decode_tensor(self._call(s, "Lookup", request).rows)

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

    def push(
        self,
        table: str,
        ids: Any,
        grads: Any,
        optimizer: dict | None = None,
        request_ids: Callable[[int], tuple[str, int]] | None = None,
    ) -> list[int]:
        """Applies gradient rows ``grads`` (``ids.shape + (dim,)``) once; returns
        each shard's step (-1 where it got no ids).  :meth:`start_push`, then
        waiting for it.

        Raises:
            NotFoundError: unknown table.
            InvalidArgumentError: ids not integers, grads of the wrong shape.
        """
        return self.start_push(table, ids, grads, optimizer, request_ids)()

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
        flat = _as_ids(ids)
        grads = np.asarray(grads)
        if grads.ndim < 1 or grads.shape[:-1] != np.shape(ids):
            raise InvalidArgumentError(
                f"gradients of shape {grads.shape} do not match ids of shape {np.shape(ids)}"
            )
        grads = grads.reshape(flat.shape[0], grads.shape[-1])
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
        pending = {}
        sent = 0
        shards = [s for s in range(len(parts)) if parts[s].size]
        # ids are taken here, in shard order, so a re-run draws the same ones
        rids = {s: self._request_id(s, request_ids) for s in shards}
        with _cancelled_on_error(pending):
            for s in shards:
                # each shard's ids and rows are gathered once (take: whole rows per copy)
                shard_ids, shard_grads = unique[parts[s]], take_rows(summed, parts[s])
                sent += shard_ids.nbytes + shard_grads.nbytes
                call = self._push_call(s, table, shard_ids, shard_grads, rids[s], optimizer_json)
                if not self.parallel:  # one after another, made by finish()
                    pending[s] = _Pending(None, deferred=functools.partial(self._exchange, call))
                else:
                    pending[s] = self._begin(call, last=s == shards[-1])

        def finish() -> list[int]:
            replies = _gather(pending)
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

        def over_grpc() -> int:
            request = embedding_pb2.PushGradientsRequest(
                table=table,
                ids=codec.encode_tensor(ids),
                grads=codec.encode_tensor(grads),
                request_id=ps_pb2.RequestId(client_id=request_id[0], sequence=request_id[1]),
                optimizer_json=optimizer_json,
            )
            return self._call(s, "PushGradients", request).step

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
            reply = self._call(s, "HotRows", embedding_pb2.HotRowsRequest(table=table, count=count))
            ids, rows = codec.decode_tensor(reply.ids), codec.decode_tensor(reply.rows)
            with self._lock:
                self.bytes.pulled += ids.nbytes + rows.nbytes
            return ids, rows

        results = self._on_every_shard(one)
        return np.concatenate([r[0] for r in results]), np.concatenate([r[1] for r in results])

    def stats(self) -> list[dict[str, TableStats]]:
        """Every shard's table counters, in task order."""

        def one(s: int) -> dict[str, TableStats]:
            reply = self._call(s, "GetTableStats", embedding_pb2.GetTableStatsRequest())
            fields = [f.name for f in dataclasses.fields(TableStats)]
            return {t.table: TableStats(**{f: getattr(t, f) for f in fields}) for t in reply.tables}

        return self._on_every_shard(one)

    def server_bytes(self) -> list[tuple[int, int]]:
        """``(bytes in, bytes out)`` of every task's Lookup and PushGradients calls
        (serialized messages), in task order."""

        def one(s: int) -> tuple[int, int]:
            reply = self._call(s, "GetTableStats", embedding_pb2.GetTableStatsRequest())
            return reply.bytes_in, reply.bytes_out

        return self._on_every_shard(one)

    def save(self, directory: str) -> list[str]:
        """Every task writes its tables into ``directory``; returns the files."""
        request = embedding_pb2.SaveTablesRequest(directory=directory)
        return [
            r.path for r in self._on_every_shard(lambda s: self._call(s, "SaveTables", request))
        ]

    def restore(self, directory: str) -> int:
        """Every task restores the ids it owns now from all table files in
        ``directory`` (written by any number of tasks); returns the rows restored."""

        def one(s: int) -> int:
            request = embedding_pb2.RestoreTablesRequest(
                directory=directory, shard_index=s, num_shards=self.num_shards
            )
            return self._call(s, "RestoreTables", request).rows

        return sum(self._on_every_shard(one))


class InProcessEmbeddingClient:
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
        rows = self.registry.lookup(table, _as_ids(ids), not training)
        return rows.reshape(*ids.shape, rows.shape[-1])

    def push(
        self,
        table: str,
        ids: Any,
        grads: Any,
        optimizer: dict | None = None,
        request_ids: Callable[[int], tuple[str, int]] | None = None,
    ) -> list[int]:
        """Applies gradient rows (see :meth:`EmbeddingClient.push`)."""
        return self.start_push(table, ids, grads, optimizer, request_ids)()

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
        flat = _as_ids(ids)
        grads = np.asarray(grads)
        if grads.ndim < 1 or grads.shape[:-1] != np.shape(ids):
            raise InvalidArgumentError(
                f"gradients of shape {grads.shape} do not match ids of shape {np.shape(ids)}"
            )
        grads = grads.reshape(flat.shape[0], grads.shape[-1])
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

"""Re-sharding the dynamic embedding tables over a new set of PS tasks.

The tables' half of a resize (:mod:`psflow.distribute.ps.resize` moves the
dense variables): rows leave the tasks that no longer own them, in chunks,
through the table service's ExportRows / ImportRows / CommitMove calls, and
the table client routes by the new tasks once every task switched.  It runs
at a step boundary (the coordinator fences it), never concurrently with
lookups or pushes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import uuid
from collections.abc import Sequence

from psflow.errors import InvalidArgumentError, OpError, error_class
from psflow.proto import embedding_pb2
from psflow.ps.dynamic_table import TableConfig
from psflow.transport.embedding_client import EmbeddingClient

__all__ = ["move_tables"]


def move_tables(
    client: EmbeddingClient, addresses: Sequence[str], chunk_bytes: int | None = None
) -> int:
    """Re-shards every table of ``client`` over ``addresses`` over the wire; returns
    the rows held after.

    For each old task and table, the rows (with every optimizer slot,
    admission candidate and count, TTL clock) another task owns under the
    new count are exported in chunks bounded by the message limit and
    staged by their new owners (tasks added start empty and only
    receive); then every task of the new layout switches (drops exactly
    the rows it exported, merges what it staged) and ``client`` routes
    by ``addresses``. No filesystem is involved. Nothing may look up or
    push meanwhile (the coordinator fences the resize at a step boundary).
    The tasks removed keep their rows until they are drained.
    ``chunk_bytes`` bounds the row bytes of one chunk (default: a quarter of the
    message limit).

    Raises:
        InvalidArgumentError: no address, or a layout that moves a kept task.
        OpError: a task failed before the switch (the error names the table
            and the tasks): nothing was dropped anywhere, ``client`` still
            routes by the old tasks, and calling again completes the move;
            or a task failed during the switch (the error says which
            tasks switched).
    """
    new = list(addresses)
    if not new:
        raise InvalidArgumentError("a table resize needs at least one PS address")
    old_n, new_n = client.num_shards, len(new)
    kept = min(old_n, new_n)
    if new[:kept] != client.addresses[:kept]:
        raise InvalidArgumentError(
            f"a resize keeps the tasks it does not add or remove: {client.addresses[:kept]} "
            f"became {new[:kept]}"
        )
    if new == client.addresses:
        return sum(t.rows for shard in client.stats() for t in shard.values())
    names = sorted(set().union(*(shard.keys() for shard in client.stats())))
    move_id = uuid.uuid4().hex
    target = EmbeddingClient(
        new,
        timeout=client.timeout,
        security=client.security,
        max_message_bytes=client.max_message_bytes,
    )
    try:
        try:
            for name in names:  # the old tasks export in parallel
                client.on_every_shard(
                    functools.partial(_move_rows, client, target, move_id, name, chunk_bytes)
                )
        except OpError:
            _abort_move(client, target, move_id)
            raise
        rows = _commit_move(target, move_id)
    finally:
        target.close()
    client.retarget(new)
    return rows


def _move_rows(
    client: EmbeddingClient,
    target: EmbeddingClient,
    move_id: str,
    name: str,
    chunk_bytes: int | None,
    source: int,
) -> None:
    """Hands table ``name``'s rows leaving task ``source`` to their new owners."""
    new_n = target.num_shards
    for t in range(new_n):
        if t == source:
            continue
        for chunk_index in range(1 << 30):  # bounded by the rows: each chunk holds >= 1
            try:
                reply = client.call(
                    source,
                    "ExportRows",
                    embedding_pb2.ExportRowsRequest(
                        move_id=move_id,
                        table=name,
                        num_shards=new_n,
                        target_shard=t,
                        chunk_index=chunk_index,
                        max_bytes=chunk_bytes or client.max_message_bytes // 4,
                    ),
                    retries=1,
                )
                if t >= client.num_shards and chunk_index == 0:
                    # an added task starts empty and serves nothing before the
                    # switch; its optimizer binds there
                    config = TableConfig.from_json(reply.chunk.config_json)
                    config = dataclasses.replace(config, optimizer=None)
                    target.call(
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
                target.call(
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


def _abort_move(client: EmbeddingClient, target: EmbeddingClient, move_id: str) -> None:
    """Best effort: every task reachable forgets the move's snapshots and chunks."""
    request = embedding_pb2.AbortMoveRequest(move_id=move_id)
    for one in (client, target):
        for s in range(one.num_shards):
            with contextlib.suppress(OpError):
                one.call(s, "AbortMove", request, timeout=min(client.timeout, 5.0))


def _commit_move(target: EmbeddingClient, move_id: str) -> int:
    """The switch on every task of the new layout; returns the rows they hold."""
    rows, done = 0, []
    for t in range(target.num_shards):
        request = embedding_pb2.CommitMoveRequest(
            move_id=move_id, shard_index=t, num_shards=target.num_shards
        )
        try:
            rows += target.call(t, "CommitMove", request, retries=1).rows
        except OpError as e:
            raise error_class(e.code)(
                f"switching the dynamic tables to {target.num_shards} tasks failed at "
                f"ps:{t} after {done} switched: {e.message}",
                task=e.task,
            ) from e
        done.append(f"ps:{t}")
    return rows

"""The dynamic embedding tables of one parameter-server task: plain Python, no gRPC.

A :class:`TableRegistry` creates table shards, routes lookups and pushes to
them, applies each push once (requests carry an id; see
:mod:`psflow.ps.dedup`), and saves and restores its tables.

Checkpoints: each task writes its tables to ``<prefix>.tables.<uuid>.safetensors``
and then, as the commit point, ``<prefix>.tables.json`` naming that file, the
tables' configs, its shard and the sha256 of every tensor (atomic renames; a
crash leaves the previous checkpoint whole).  A restore reads the files of
*every* task found in the directory and keeps the ids the restoring task owns
now, so 2 tasks' tables restore onto 3.

Resizes move rows over the wire instead (no filesystem): :meth:`TableRegistry.export_rows`
snapshots and hands out the rows leaving this task, :meth:`~TableRegistry.import_rows`
stages what arrives, :meth:`~TableRegistry.commit_move` switches (see
:mod:`psflow.ps.row_moves`).

Example:
    >>> import numpy as np
    >>> from psflow.ps.dynamic_table import TableConfig
    >>> reg = TableRegistry("ps:0")
    >>> reg.create(TableConfig("t", dim=2, initializer="zeros"), 0, 1)
    True
    >>> reg.lookup("t", np.array([5], np.int64)).shape
    (1, 2)
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import json
import os
import threading
import uuid
from typing import Any

import numpy as np

from psflow.errors import (
    AlreadyExistsError,
    DataLossError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
)
from psflow.io.files import atomic_write
from psflow.io.safetensors import load_file, save_file

from .dedup import DedupWindow, State
from .dynamic_table import DynamicTable, IdCheck, TableConfig, TableStats, check_ids
from .key_index import shard_of
from .row_moves import Outgoing, check_part, merge
from .tiered_table import TieredTable, TierOptions, safe_name, tier_root

__all__ = ["TableRegistry"]

_MANIFEST = ".tables.json"
# moves whose snapshots and staged chunks are kept (an abandoned one is forgotten
# after this many newer ones), and committed move ids remembered for retries
_OPEN_MOVES = 4
_COMMITTED_MOVES = 32


@dataclasses.dataclass
class _Move:
    """One resize's rows on this task: what leaves (by table), what was staged."""

    outgoing: dict[str, Outgoing] = dataclasses.field(default_factory=dict)
    # shards created for the move (a task it adds): installed at the switch
    created: dict[str, tuple[DynamicTable, int, int]] = dataclasses.field(default_factory=dict)
    # (table, source shard, chunk index) -> (the source's config, the part)
    staged: dict[tuple[str, int, int], tuple[TableConfig, dict]] = dataclasses.field(
        default_factory=dict
    )


class TableRegistry:
    """Every dynamic table shard one PS task holds.

    Args:
        task: this task's name (``"ps:0"``), for file names and errors.
        tier: the disk tier's options (:mod:`psflow.ps.tiered_table`): a table
            whose config or these options give a memory budget keeps only that
            many rows in memory, the rest on local disk.
    """

    def __init__(self, task: str = "ps:0", tier: TierOptions | None = None) -> None:
        self.task = task
        self.tier = tier or TierOptions()
        self._tier_root: str | None = None
        self._tables: dict[str, tuple[DynamicTable, int, int]] = {}
        self._lock = threading.Lock()
        self._dedup = DedupWindow()
        self._move_lock = threading.Lock()
        self._moves: collections.OrderedDict[str, _Move] = collections.OrderedDict()
        self._committed: collections.deque[str] = collections.deque(maxlen=_COMMITTED_MOVES)

    # -- tables ------------------------------------------------------------------------
    def create(
        self, config: TableConfig, shard_index: int, num_shards: int, move_id: str = ""
    ) -> bool:
        """Creates a shard; False if an identical one exists.

        With ``move_id`` (a task a resize adds) the shard stays invisible (no
        lookup or push reaches it) until that move switches (:meth:`commit_move`),
        so a move that fails leaves nothing a mis-routed client could read.

        Raises:
            InvalidArgumentError: a shard outside ``[0, num_shards)``.
            AlreadyExistsError: a table of that name with another config or shard.
        """
        _check_shard(shard_index, num_shards)
        with self._lock:
            held = self._tables.get(config.name)
            if held is not None:
                same_shard = (held[1], held[2]) == (shard_index, num_shards)
                if not (same_shard and held[0].config.accepts(config)):
                    raise AlreadyExistsError(
                        f"table {config.name!r} exists with config {held[0].config.to_json()} "
                        f"as shard {held[1]} of {held[2]}",
                        task=self.task,
                    )
                return False
            if not move_id:
                self._tables[config.name] = (self._new_table(config), shard_index, num_shards)
                return True
        with self._move_lock:
            created = self._move(move_id).created
            if config.name not in created:
                created[config.name] = (self._new_table(config), shard_index, num_shards)
                return True
        return False

    def _budget(self, config: TableConfig) -> tuple[int, int]:
        """``(memory_rows, memory_bytes)`` of a shard of ``config`` here (both 0: no tier)."""
        rows = config.memory_rows or (0 if config.memory_bytes else self.tier.memory_rows)
        nbytes = config.memory_bytes or (0 if config.memory_rows else self.tier.memory_bytes)
        return rows, nbytes

    def _new_table(self, config: TableConfig, capacity: int | None = None) -> DynamicTable:
        """An empty shard of ``config``: with a disk tier when its config or the
        task's tier options give a memory budget."""
        rows, nbytes = self._budget(config)
        if not rows and not nbytes:
            return DynamicTable(config, capacity)
        if self._tier_root is None:
            self._tier_root = tier_root(self.tier.directory, self.task)
        directory = os.path.join(
            self._tier_root, f"{safe_name(config.name)}.{uuid.uuid4().hex[:12]}"
        )
        return TieredTable(
            config,
            capacity,
            directory=directory,
            memory_rows=rows,
            memory_bytes=nbytes,
            backend=self.tier.backend,
            queue_rows=self.tier.queue_rows,
        )

    def table(self, name: str) -> DynamicTable:
        """The shard of table ``name``.

        Raises:
            NotFoundError: no such table (the known ones are listed).
        """
        held = self._tables.get(name)
        if held is None:
            raise NotFoundError(
                f"unknown table {name!r}; tables here: {sorted(self._tables)}", task=self.task
            )
        return held[0]

    def _owned(self, name: str, ids: Any) -> tuple[DynamicTable, np.ndarray, IdCheck | None]:
        """The shard of table ``name``, ``ids`` checked, and the check of the ids
        without a row there: they must be this shard's (the table calls it before
        it changes anything; an id with a row was checked when the row was made,
        and a resize keeps only the rows a shard owns).  Hashing only those is what
        keeps a lookup of known ids from paying for it."""
        table = self.table(name)
        _, index, count = self._tables[name]
        ids = check_ids(ids)
        if count == 1:
            return table, ids, None

        def owned(new: np.ndarray) -> None:
            if not new.size:
                return
            wrong = shard_of(new, count) != index
            if wrong.any():
                raise InvalidArgumentError(
                    f"id {int(new[wrong][0])} of table {name!r} belongs to shard "
                    f"{int(shard_of(new[wrong][:1], count)[0])}, not {index} of {count}",
                    task=self.task,
                )

        return table, ids, owned

    def lookup(self, name: str, ids: Any, read_only: bool = False) -> np.ndarray:
        """Rows of ``ids`` (see :meth:`DynamicTable.lookup`).

        Raises:
            NotFoundError: unknown table.
            InvalidArgumentError: bad ids, or ids another shard owns.
        """
        table, ids, owned = self._owned(name, ids)
        return table.lookup(ids, read_only, owned)

    def push(
        self,
        name: str,
        ids: Any,
        grads: Any,
        request_id: tuple[str, int] | None = None,
        optimizer: dict | None = None,
    ) -> int:
        """Applies gradient rows once per ``request_id``; returns the table's step.

        ``optimizer`` binds or must match the table's update rule (see
        :meth:`DynamicTable.apply_gradients`).

        Raises:
            NotFoundError: unknown table.
            InvalidArgumentError: bad ids or gradients, or a request id too old
                to tell whether it was applied.
        """
        table, ids, owned = self._owned(name, ids)
        if request_id is None:
            return table.apply_gradients(ids, grads, optimizer, owned)
        state, entry = self._dedup.begin(*request_id)
        if state is State.TOO_OLD:
            raise InvalidArgumentError(
                f"request id {request_id} is older than the exactly-once window", task=self.task
            )
        if state is not State.NEW:
            entry.done.wait(60.0)
            if entry.reply is None:
                raise InvalidArgumentError(f"request {request_id} failed", task=self.task)
            return entry.reply
        try:
            step = table.apply_gradients(ids, grads, optimizer, owned)
        except BaseException:
            self._dedup.abandon(*request_id, entry)
            raise
        self._dedup.complete(*request_id, entry, step)
        return step

    def tier_gauges(self) -> dict[str, dict[str, int]]:
        """Every table's memory rows and, with a disk tier, its disk rows, hits and
        bytes, by name: cheap (no flush, no eviction scan), for metrics."""
        with self._lock:
            held = dict(self._tables)
        out = {}
        for name, (table, _, _) in held.items():
            out[name] = (
                table.gauges()
                if isinstance(table, TieredTable)
                else {"memory_rows": table._index.size}
            )
        return out

    def stats(self) -> dict[str, TableStats]:
        """Every table's counters, by name."""
        with self._lock:
            held = dict(self._tables)
        return {name: held[name][0].stats() for name in sorted(held)}

    # -- moving rows on a resize -------------------------------------------------------
    def _move(self, move_id: str) -> _Move:
        """The open move ``move_id`` (opened on first use; the oldest beyond a few is
        forgotten). Call with ``_move_lock`` held."""
        if not move_id:
            raise InvalidArgumentError("a row move needs a move id", task=self.task)
        if move_id in self._committed:
            raise FailedPreconditionError(f"move {move_id!r} was committed", task=self.task)
        move = self._moves.get(move_id)
        if move is None:
            move = self._moves[move_id] = _Move()
            while len(self._moves) > _OPEN_MOVES:
                self._moves.popitem(last=False)
        return move

    def export_rows(
        self,
        move_id: str,
        name: str,
        num_shards: int,
        target: int,
        chunk_index: int,
        max_bytes: int,
    ) -> tuple[TableConfig, dict, bool]:
        """Chunk ``chunk_index`` of table ``name``'s rows that ``target`` owns among
        ``num_shards`` tasks; returns ``(config, part, more)`` (see
        :mod:`psflow.ps.row_moves`). Nothing is dropped until :meth:`commit_move`.

        Raises:
            NotFoundError: unknown table.
            InvalidArgumentError: a bad task count, target or chunk index.
            FailedPreconditionError: the move was committed already.
        """
        table = self.table(name)
        _check_shard(target, num_shards)
        with self._move_lock:
            move = self._move(move_id)
            out = move.outgoing.get(name)
            if out is None or out.num_shards != num_shards:
                index = self._tables[name][1]
                out = move.outgoing[name] = Outgoing(table.export_state(), index, num_shards)
            part, more = out.chunk(target, chunk_index, max_bytes)
        return table.config, part, more

    def import_rows(
        self,
        move_id: str,
        source: int,
        chunk_index: int,
        shard_index: int,
        num_shards: int,
        config: TableConfig,
        part: dict,
    ) -> int | None:
        """Stages a chunk ``source`` exported; returns the rows and candidates staged
        (None for a chunk staged before: a retry changes nothing).

        Raises:
            NotFoundError: the chunk's table is not here.
            InvalidArgumentError: a bad chunk (see :func:`check_part`), or a
                layout that does not put this task at ``shard_index``.
            FailedPreconditionError: the move was committed already.
        """
        _check_shard(shard_index, num_shards)
        with self._move_lock:
            held = self._tables.get(config.name) or self._move(move_id).created.get(config.name)
        if held is None:
            self.table(config.name)  # raises NotFoundError
        table, index, _ = held
        if index != shard_index:
            raise InvalidArgumentError(
                f"table {config.name!r} here is shard {index}, not {shard_index}",
                task=self.task,
            )
        check_part(part, config, table.config, shard_index, num_shards)
        with self._move_lock:
            move = self._move(move_id)
            key = (config.name, int(source), int(chunk_index))
            if key in move.staged:
                return None
            move.staged[key] = (config, part)
        return int(part["ids"].shape[0] + part["candidate_ids"].shape[0])

    def commit_move(self, move_id: str, shard_index: int, num_shards: int) -> int:
        """The switch: every table drops exactly the rows it exported in ``move_id``,
        merges the rows staged for it, and owns ``shard_index`` of ``num_shards``
        from now on; returns the rows held. All tables change or none; a retry
        of a committed move changes nothing.

        Raises:
            InvalidArgumentError: a bad layout, or one that moves this task.
            FailedPreconditionError: rows leaving this task were never exported.
        """
        _check_shard(shard_index, num_shards)
        with self._move_lock:
            if move_id in self._committed:
                return sum(s.rows for s in self.stats().values())
            move = self._move(move_id)
            with self._lock:
                held = {**move.created, **self._tables}
            replaced = {}
            for name, (table, index, _) in held.items():
                if index != shard_index:
                    raise InvalidArgumentError(
                        f"table {name!r} here is shard {index}; a resize keeps it, "
                        f"not {shard_index}",
                        task=self.task,
                    )
                out = move.outgoing.get(name)
                if out is None:  # nothing exported: nothing may leave
                    out = Outgoing(table.export_state(), index, num_shards)
                own = out.kept(table.export_state())
                staged = [v for k, v in sorted(move.staged.items()) if k[0] == name]
                parts = [(table.config, own), *staged]
                replaced[name] = (
                    merge(table.config, parts, make=self._new_table),
                    index,
                    num_shards,
                )
            with self._lock:
                self._tables.update(replaced)
            del self._moves[move_id]
            self._committed.append(move_id)
        return sum(t.stats().rows for t, _, _ in replaced.values())

    def abort_move(self, move_id: str) -> None:
        """Forgets ``move_id``'s snapshots and staged chunks; no table changes."""
        with self._move_lock:
            self._moves.pop(move_id, None)

    # -- checkpoints ------------------------------------------------------------------
    def save(self, directory: str, prefix: str) -> tuple[str, list[str]]:
        """Writes every table under ``directory/prefix.tables.*``; returns
        ``(data file, table names)``.

        A shard with a disk tier writes its rows on disk to segment files
        streamed from the store's snapshot, and incrementally: saved again to
        the same directory and prefix, only the rows whose record changed since
        (and the ids that left the disk) are written, and the manifest names
        the earlier segments too; once the changes outweigh the full segments
        the next save is a full one again.
        """
        os.makedirs(directory, exist_ok=True)
        with self._lock:
            held = dict(self._tables)
        previous = _previous_manifest(os.path.join(directory, prefix + _MANIFEST))
        tensors: dict[str, np.ndarray] = {}
        tables = {}
        stem = f"{prefix}.tables.{uuid.uuid4().hex}"
        keep = {f"{stem}.safetensors"}
        begun: list[TieredTable] = []
        try:
            for name, (table, index, count) in sorted(held.items()):
                entry = {"config": table.config.to_json(), "shard": index, "shards": count}
                if isinstance(table, TieredTable):
                    begun.append(table)
                    state = self._save_tier(directory, stem, name, table, previous, entry)
                    keep.update(seg["file"] for seg in entry["segments"])
                else:
                    state = table.export_state()
                for key, value in state.items():
                    tensors[f"{name}\x00{key}"] = value
                tables[name] = entry
            data = f"{stem}.safetensors"
            digests = save_file(os.path.join(directory, data), tensors)
            manifest = {"data": data, "tables": tables, "sha256": digests}
            with atomic_write(os.path.join(directory, prefix + _MANIFEST)) as f:
                f.write(json.dumps(manifest, sort_keys=True).encode())
        except BaseException:
            for table in begun:
                table.abort_save()
            raise
        for table in begun:
            table.commit_save(tables[table.config.name]["chain"])
        for old in glob.glob(
            os.path.join(directory, glob.escape(prefix) + ".tables.*.safetensors")
        ):
            if os.path.basename(old) not in keep:
                os.remove(old)
        return os.path.join(directory, data), sorted(tables)

    def _save_tier(
        self,
        directory: str,
        stem: str,
        name: str,
        table: TieredTable,
        previous: dict | None,
        entry: dict,
    ) -> dict[str, np.ndarray]:
        """Writes a tiered shard's segments (a delta on its previous chain where
        that is the one in ``directory``); fills ``entry``; returns memory's state."""
        before = (previous or {}).get("tables", {}).get(name, {})
        chain = list(before.get("segments", ()))
        base = sum(seg.get("rows", 0) for seg in chain if seg.get("base"))
        changes = sum(seg.get("rows", 0) for seg in chain if not seg.get("base"))
        delta = bool(table.chain) and before.get("chain") == table.chain and changes <= base
        state, chunks, deleted = table.export_chunks(delta=delta)
        segments = chain if delta else []
        for i, chunk in enumerate(chunks):
            file = f"{stem}.{safe_name(name)}.{i:06d}.safetensors"
            digests = save_file(os.path.join(directory, file), chunk)
            rows = int(chunk["ids"].shape[0])
            segments.append({"file": file, "sha256": digests, "rows": rows, "base": not delta})
        gone = np.concatenate([*deleted, np.zeros(0, np.int64)])
        if gone.size:
            file = f"{stem}.{safe_name(name)}.deleted.safetensors"
            digests = save_file(os.path.join(directory, file), {"ids": gone})
            count = int(gone.size)
            segments.append(
                {"file": file, "sha256": digests, "rows": count, "base": False, "deleted": True}
            )
        entry["segments"] = segments
        entry["chain"] = f"{table.chain_id}.{uuid.uuid4().hex[:12]}"
        return state

    def saved_shard(self, directory: str, prefix: str) -> tuple[int, int] | None:
        """``(shard_index, num_shards)`` this prefix saved with, None without a checkpoint."""
        path = os.path.join(directory, prefix + _MANIFEST)
        if not os.path.exists(path):
            return None
        tables = _read_manifest(path)["tables"]
        if not tables:
            return None
        first = tables[sorted(tables)[0]]
        return int(first["shard"]), int(first["shards"])

    def restore(self, directory: str, shard_index: int, num_shards: int) -> tuple[list[str], int]:
        """Replaces every table found in ``directory`` with the ids this task owns
        as ``shard_index`` of ``num_shards``; returns ``(tables, rows kept)``.

        Onto the layout it was saved with, each shard gets back its own step
        (shards step independently: a push reaches only the shards owning its
        ids); onto another layout the parts merge and every shard takes the
        largest step (see :meth:`DynamicTable.from_parts`).

        Everything is read and verified before anything changes.

        Raises:
            InvalidArgumentError: a bad shard.
            NotFoundError: no table checkpoint in ``directory``.
            DataLossError: a file missing, corrupt, or configs that disagree.
        """
        _check_shard(shard_index, num_shards)
        manifests = sorted(glob.glob(os.path.join(glob.escape(directory), "*" + _MANIFEST)))
        if not manifests:
            raise NotFoundError(f"no table checkpoint in {directory!r}", task=self.task)
        parts: dict[str, list[dict[str, np.ndarray]]] = {}
        # the disk tiers' segment chains: one list of (entry, path) per saved shard
        segments: dict[str, list[list[tuple[dict, str]]]] = {}
        counted: dict[str, list[bool]] = {}
        own_step: dict[str, int] = {}
        configs: dict[str, TableConfig] = {}
        for path in manifests:
            manifest = _read_manifest(path)
            data = os.path.join(directory, manifest["data"])
            try:
                arrays = load_file(data, checksums=manifest["sha256"])
            except OSError as e:
                raise DataLossError(f"{path} names {data}, which cannot be read: {e}") from e
            for name, entry in manifest["tables"].items():
                config = TableConfig.from_json(entry["config"])
                prior = configs.setdefault(name, config)
                # shards differ in capacity (restored ones are sized to their rows), and a
                # shard no push reached yet has no optimizer bound: neither is a conflict
                config = dataclasses.replace(config, capacity=prior.capacity)
                if prior.accepts(config):
                    pass
                elif config.accepts(prior):
                    configs[name] = config
                else:
                    raise DataLossError(f"table {name!r} has different configs in {path}")
                part = {}
                for key, value in arrays.items():
                    table_name, _, field = key.partition("\x00")
                    if table_name == name:
                        part[field] = value
                parts.setdefault(name, []).append(part)
                # a saved shard's counters go to the same shard of the same layout,
                # else all to shard 0: the cluster's totals stay what they were
                same = (int(entry["shard"]), int(entry["shards"])) == (shard_index, num_shards)
                layout = int(entry["shards"]) == num_shards
                counted.setdefault(name, []).append(same if layout else shard_index == 0)
                if same:  # this shard's own optimizer step (Adam's bias correction, ttl clocks)
                    own_step[name] = int(part.get("step", 0))
                if entry.get("segments"):
                    segments.setdefault(name, []).append(
                        [(seg, os.path.join(directory, seg["file"])) for seg in entry["segments"]]
                    )
        restored = {}
        rows = 0

        def keep(ids: np.ndarray) -> np.ndarray:
            return shard_of(ids, num_shards) == shard_index

        for name, config in configs.items():
            tiered = self._budget(config) != (0, 0)
            table_parts, table_counted = list(parts[name]), list(counted[name])
            # memory's rows were saved last: they hold over any segment's
            held = [p["ids"][keep(p["ids"])] for p in parts[name]]
            override = np.sort(np.concatenate([*held, np.zeros(0, np.int64)]))
            if not tiered:  # all in memory: each task's chain applied, then a part
                for chain in segments.get(name, ()):
                    chained = _apply_chain(chain, keep, override)
                    if chained:
                        table_parts.append(_segment_part(chained, parts[name][0]))
                        table_counted.append(False)
            table = DynamicTable.from_parts(
                config,
                table_parts,
                keep=keep,
                counted=table_counted,
                step=own_step.get(name),
                make=self._new_table,
            )
            if tiered:  # streamed, segment by segment, straight to the disk tier
                for chain in segments.get(name, ()):
                    for seg, path in chain:
                        segment = _load_segment(path, seg["sha256"])
                        mine = keep(segment["ids"])
                        if seg.get("deleted"):
                            table.drop_rows(segment["ids"][mine], override)
                        else:
                            table.load_rows({k: v[mine] for k, v in segment.items()}, override)
            rows += table.stats().rows
            restored[name] = (table, shard_index, num_shards)
        with self._lock:
            self._tables.update(restored)
        self._dedup.clear()
        return sorted(restored), rows


def _check_shard(index: int, count: int) -> None:
    if count < 1 or not 0 <= index < count:
        raise InvalidArgumentError(
            f"shard {index} of {count}: need 0 <= shard < shards, shards >= 1"
        )


def _load_segment(path: str, digests: dict) -> dict[str, np.ndarray]:
    """A disk tier's segment file, verified.

    Raises:
        DataLossError: missing or corrupt.
    """
    try:
        return load_file(path, checksums=digests)
    except OSError as e:
        raise DataLossError(f"table segment {path} cannot be read: {e}") from e


def _previous_manifest(path: str) -> dict | None:
    """The manifest at ``path`` if it is readable (an incremental save extends it)."""
    try:
        return _read_manifest(path) if os.path.exists(path) else None
    except DataLossError:
        return None


def _apply_chain(
    chain: list[tuple[dict, str]], keep: Any, override: np.ndarray
) -> dict[str, np.ndarray]:
    """The rows a saved shard's segment chain holds at its end (later segments
    replace earlier rows, deletions remove them), less the ids in sorted
    ``override``, keeping the ids ``keep`` accepts."""
    held: dict[str, np.ndarray] | None = None
    for seg, path in chain:
        segment = _load_segment(path, seg["sha256"])
        mine = keep(segment["ids"])
        segment = {k: v[mine] for k, v in segment.items()}
        if held is None:
            if not seg.get("deleted"):  # nothing to delete from yet
                held = segment
            continue
        if seg.get("deleted"):
            stay = ~np.isin(held["ids"], segment["ids"])
            held = {k: v[stay] for k, v in held.items()}
            continue
        both = {k: np.concatenate([held[k], segment[k]]) for k in segment}
        # the last occurrence of each id wins
        _, first = np.unique(both["ids"][::-1], return_index=True)
        last = both["ids"].shape[0] - 1 - first
        held = {k: v[last] for k, v in both.items()}
    if held is None:
        return {}
    stay = ~np.isin(held["ids"], override)
    return {k: v[stay] for k, v in held.items()}


def _segment_part(segment: dict[str, np.ndarray], like: dict[str, np.ndarray]) -> dict:
    """A segment's rows as a part :meth:`DynamicTable.from_parts` takes: no
    candidates, no counters, the step of its table's part ``like``."""
    return {
        **segment,
        "candidate_ids": like["candidate_ids"][:0],
        "candidate_counts": like["candidate_counts"][:0],
        "candidate_touched": like["candidate_touched"][:0],
        "step": like["step"],
        "counters": np.zeros_like(like["counters"]),
    }


def _read_manifest(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            manifest = json.loads(f.read())
        if not isinstance(manifest, dict) or not {"data", "tables", "sha256"} <= manifest.keys():
            raise ValueError("missing keys")
    except (OSError, ValueError) as e:
        raise DataLossError(f"table manifest {path} is unreadable: {e}") from e
    return manifest

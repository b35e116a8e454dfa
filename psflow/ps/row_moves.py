"""Rows of a dynamic table in transit on a resize: snapshots, chunks, checks, merges.

A resize re-shards a table over a new task count with no filesystem: each old
owner snapshots the rows (and admission candidates) another task owns under
the new count (:class:`Outgoing`), hands them out in chunks bounded in bytes
(:meth:`Outgoing.chunk`), each new owner checks and stages the chunks
(:func:`check_part`), and at the switch every task drops exactly the rows it
handed out and merges what it staged (:func:`merge`).

A *part* is a dict of arrays in :meth:`DynamicTable.export_state`'s format:
``ids``, ``rows``, ``slot/<name>``, ``touched``, ``traffic``,
``candidate_ids``, ``candidate_counts``, ``candidate_touched``, ``step`` (0-d)
and ``counters`` (sorted names; empty: none carried).

Example:
    >>> import numpy as np
    >>> from psflow.ps.dynamic_table import DynamicTable, TableConfig
    >>> t = DynamicTable(TableConfig("t", dim=2, initializer="zeros"))
    >>> _ = t.lookup(np.arange(10, dtype=np.int64))
    >>> out = Outgoing(t.export_state(), own_index=0, num_shards=2)
    >>> part, more = out.chunk(1, 0, max_bytes=1 << 20)
    >>> int(part["ids"].size) == int(out.leaving.sum()), more
    (True, False)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from psflow.errors import FailedPreconditionError, InvalidArgumentError
from psflow.update_rules import rule_from_config

from .dynamic_table import DynamicTable, TableConfig
from .key_index import shard_of

__all__ = ["COUNTER_COUNT", "Outgoing", "check_part", "merge"]

# DynamicTable's counters: created, admitted, evicted_rows, evicted_candidates,
# dropped_gradients, lookups
COUNTER_COUNT = 6
_PER_ROW = ("ids", "touched", "traffic")
_PER_CANDIDATE = ("candidate_ids", "candidate_counts", "candidate_touched")
_CLOCKS = ("touched", "traffic", "candidate_counts", "candidate_touched")


class Outgoing:
    """The rows of one table shard that leave it under a new task count.

    Args:
        state: the shard's :meth:`DynamicTable.export_state` (a snapshot: the
            resize is fenced at a step boundary, nothing changes meanwhile).
        own_index: the shard's task index (kept by a resize, if kept at all).
        num_shards: the task count after the resize.
    """

    def __init__(self, state: dict[str, np.ndarray], own_index: int, num_shards: int) -> None:
        # the wire carries clocks and counts as int64 (the table holds uint32)
        self.state = {k: v.astype(np.int64) if k in _CLOCKS else v for k, v in state.items()}
        self.own_index = own_index
        self.num_shards = num_shards
        self.owner = shard_of(state["ids"], num_shards)
        self.candidate_owner = shard_of(state["candidate_ids"], num_shards)
        self.leaving = self.owner != own_index
        self.candidates_leaving = self.candidate_owner != own_index
        # what was handed out: the switch drops exactly these
        self.sent = np.zeros(self.owner.shape[0], bool)
        self.candidates_sent = np.zeros(self.candidate_owner.shape[0], bool)

    def chunk(self, target: int, chunk_index: int, max_bytes: int) -> tuple[dict, bool]:
        """Chunk ``chunk_index`` of the rows ``target`` owns now; returns ``(part, more)``.

        A chunk holds at most ``max_bytes`` of row and slot bytes (at least one
        row); a task being removed carries its counters in its first chunk to
        task 0, so the cluster's totals survive.

        Raises:
            InvalidArgumentError: ``target`` is this task or out of range, or
                ``chunk_index`` negative.
        """
        if not 0 <= target < self.num_shards or target == self.own_index:
            raise InvalidArgumentError(
                f"target shard {target} is not another task of {self.num_shards}"
            )
        if chunk_index < 0:
            raise InvalidArgumentError(f"chunk_index must be >= 0, got {chunk_index}")
        rows = self.state["rows"]
        slots = [k for k in self.state if k.startswith("slot/")]
        per_row = max(1, rows.itemsize * rows.shape[1] * (1 + len(slots)) + 24)
        size = max(1, int(max_bytes) // per_row)
        picked = np.flatnonzero(self.owner == target)[chunk_index * size : (chunk_index + 1) * size]
        cand = np.flatnonzero(self.candidate_owner == target)
        cand = cand[chunk_index * size : (chunk_index + 1) * size]
        more = (
            int((self.owner == target).sum()) > (chunk_index + 1) * size
            or int((self.candidate_owner == target).sum()) > (chunk_index + 1) * size
        )
        part = {k: self.state[k][picked] for k in (*_PER_ROW, "rows", *slots)}
        part.update({k: self.state[k][cand] for k in _PER_CANDIDATE})
        part["step"] = self.state["step"]
        carries = self.own_index >= self.num_shards and target == 0 and chunk_index == 0
        part["counters"] = self.state["counters"] if carries else np.zeros(0, np.int64)
        self.sent[picked] = True
        self.candidates_sent[cand] = True
        return part, more

    def kept(self, current: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The shard's ``current`` state (:meth:`DynamicTable.export_state`) less
        exactly the rows and candidates handed out.

        Raises:
            FailedPreconditionError: a row or candidate this shard does not own
                under the new count was never handed out (its new owner would
                not have it): the move cannot switch.
        """
        keep = ~np.isin(current["ids"], self.state["ids"][self.sent])
        ckeep = ~np.isin(
            current["candidate_ids"], self.state["candidate_ids"][self.candidates_sent]
        )
        stray = int((shard_of(current["ids"][keep], self.num_shards) != self.own_index).sum())
        stray += int(
            (shard_of(current["candidate_ids"][ckeep], self.num_shards) != self.own_index).sum()
        )
        if stray:
            raise FailedPreconditionError(
                f"{stray} rows or candidates leaving shard {self.own_index} of "
                f"{self.num_shards} were never exported; the move cannot switch"
            )
        part = {k: v[keep] for k, v in current.items() if k in _PER_ROW or k == "rows"}
        part.update({k: v[keep] for k, v in current.items() if k.startswith("slot/")})
        part.update({k: current[k][ckeep] for k in _PER_CANDIDATE})
        part["step"], part["counters"] = current["step"], current["counters"]
        return part


def check_part(
    part: dict[str, np.ndarray],
    config: TableConfig,
    held: TableConfig,
    shard_index: int,
    num_shards: int,
) -> None:
    """Checks a chunk ``config``'s shard exported before ``held``'s shard stages it.

    Raises:
        InvalidArgumentError: another table, config or layout, arrays of the
            wrong dtype or shape, slots the optimizer does not have, ids
            another shard owns, clocks past the source's step.
    """
    name = held.name
    same = dataclasses.replace(config, capacity=held.capacity)
    if config.name != name or not (held.accepts(same) or same.accepts(held)):
        raise InvalidArgumentError(
            f"a chunk of table {config.name!r} with config {config.to_json()} cannot join "
            f"table {name!r} with config {held.to_json()}"
        )
    ids = part["ids"]
    dtype = np.dtype(held.dtype)
    if ids.ndim != 1 or ids.dtype != np.int64:
        raise InvalidArgumentError(
            f"table {name!r}: chunk ids must be 1-D int64, got {ids.dtype} {ids.shape}"
        )
    n = ids.shape[0]
    slots = sorted(k[5:] for k in part if k.startswith("slot/"))
    wanted = (
        [] if config.optimizer is None else sorted(rule_from_config(config.optimizer).slot_names)
    )
    if slots != wanted:
        raise InvalidArgumentError(
            f"table {name!r}: chunk slots {slots}, its optimizer has {wanted}"
        )
    for key in ("rows", *(f"slot/{s}" for s in slots)):
        if part[key].shape != (n, held.dim) or part[key].dtype != dtype:
            raise InvalidArgumentError(
                f"table {name!r}: chunk {key} must be {dtype} of shape ({n}, {held.dim}), got "
                f"{part[key].dtype} {part[key].shape}"
            )
    m = part["candidate_ids"].shape
    for key in (*_PER_ROW, *_PER_CANDIDATE):
        want = (n,) if key in _PER_ROW else m
        if part[key].ndim != 1 or part[key].shape != want or part[key].dtype != np.int64:
            raise InvalidArgumentError(
                f"table {name!r}: chunk {key} must be int64 of shape {want}, got "
                f"{part[key].dtype} {part[key].shape}"
            )
    step = int(part["step"])
    for key in ("touched", "candidate_touched"):
        if part[key].size and (part[key].min() < 0 or part[key].max() > step):
            raise InvalidArgumentError(f"table {name!r}: chunk {key} outside [0, step {step}]")
    if part["counters"].shape not in ((0,), (COUNTER_COUNT,)):
        raise InvalidArgumentError(
            f"table {name!r}: chunk carries {part['counters'].shape[0]} counters, "
            f"not 0 or {COUNTER_COUNT}"
        )
    for key in ("ids", "candidate_ids"):
        if num_shards > 1 and part[key].size:
            wrong = shard_of(part[key], num_shards) != shard_index
            if wrong.any():
                raise InvalidArgumentError(
                    f"id {int(part[key][wrong][0])} of table {name!r} does not belong to "
                    f"shard {shard_index} of {num_shards}"
                )


def merge(
    config: TableConfig,
    parts: list[tuple[TableConfig, dict[str, np.ndarray]]],
    make: Callable[[TableConfig, int], DynamicTable] | None = None,
) -> DynamicTable:
    """One shard holding every part (a kept shard's own first, then the staged ones).

    Configs merge as a restore does (an unbound optimizer takes the bound one;
    rows without slots get fresh ones). The step becomes the largest part's,
    and every part's clocks shift with it, so a row is as many pushes from
    eviction as it was. Counters sum over the parts that carry them.
    ``make(config, capacity)`` makes the empty shard (a disk tier's, say).
    """
    for other, _ in parts:
        other = dataclasses.replace(other, capacity=config.capacity)
        if not config.accepts(other) and other.accepts(config):
            config = other
    rule = None if config.optimizer is None else rule_from_config(config.optimizer)
    step = max((int(p["step"]) for _, p in parts), default=0)
    ready, counted = [], []
    for _, part in parts:
        part = dict(part)
        shift = step - int(part["step"])
        part["touched"] = part["touched"] + shift
        part["candidate_touched"] = part["candidate_touched"] + shift
        if rule is not None:
            fresh = rule.init_slots(part["rows"])
            for k, v in fresh.items():
                part.setdefault(f"slot/{k}", v)
        counted.append(part["counters"].size > 0)
        if not counted[-1]:
            part["counters"] = np.zeros(COUNTER_COUNT, np.int64)
        ready.append(part)
    return DynamicTable.from_parts(config, ready, counted=counted, make=make)

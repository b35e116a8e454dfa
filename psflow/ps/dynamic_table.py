"""Dynamic embedding tables: rows keyed by int64 ids from an unbounded space.

A :class:`DynamicTable` is one parameter-server task's shard of a table with
no vocabulary.  Guarantees:

* **No collisions.** Every id owns its row (a :class:`~psflow.ps.key_index.KeyIndex`
  maps ids to dense slots); nothing is hashed into shared buckets.
* **Deterministic rows.** A row is created on first touch by the initializer,
  seeded by ``(seed, id)`` (:func:`initial_rows`), so its value does not depend
  on arrival order, on other ids or on the number of shards.
* **Sparse updates as TensorFlow sums them.** Duplicate ids in a push are summed
  in order of appearance (``unsorted_segment_sum``), then the table's update
  rule (:mod:`psflow.update_rules`, lazy: only touched rows and their slots
  change) runs on the touched rows.  ``step`` is the number of pushes this
  shard applied, so a dense table with the same rows and the same pushes gets
  the same bits.
* **Admission.** With ``min_count > 1`` an id is a *candidate* until it was
  looked up in ``min_count`` requests; until then it reads the shared default
  row (zeros) and its gradients are dropped (counted).
* **Eviction.** With ``ttl_steps``, a row (or candidate) not touched during
  the last ``ttl_steps`` pushes is gone: every read and push treats it as
  removed, and counts it evicted when it meets it.  The scan that reclaims
  all such rows runs every ``max(1, ttl_steps // 8)`` pushes (not per push:
  it reads every row) and before :meth:`~DynamicTable.stats`,
  :meth:`~DynamicTable.hot_ids` and :meth:`~DynamicTable.export_state`, so
  what a caller can observe is exactly what a per-push scan would give.
* **No partial state change on bad input.** Requests are validated before any
  change; one lock per table serialises changes.

Example:
    >>> import numpy as np
    >>> table = DynamicTable(TableConfig("t", dim=2, initializer="zeros",
    ...                                  optimizer={"name": "sgd", "learning_rate": 1.0}))
    >>> table.lookup(np.array([7, 10**15], np.int64)).tolist()
    [[0.0, 0.0], [0.0, 0.0]]
    >>> _ = table.apply_gradients(np.array([7, 7], np.int64), np.ones((2, 2), np.float32))
    >>> table.lookup(np.array([7], np.int64)).tolist()
    [[-2.0, -2.0]]
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from psflow.errors import FailedPreconditionError, InvalidArgumentError
from psflow.update_rules import UpdateRule, put_rows, rule_from_config, take_rows

from .key_index import _GOLDEN, KeyIndex, mix64, mix64_in_place, sum_rows, unique_ids

__all__ = ["INITIALIZERS", "DynamicTable", "IdCheck", "TableConfig", "TableStats", "initial_rows"]

INITIALIZERS = ("uniform", "normal", "zeros")
_SEED_MIX = np.uint64(0xD1B54A32D192ED03)
# Lookups whose slots a table remembers for the pushes that follow them.
_RECENT_LOOKUPS = 8
_COLUMN_MIX = np.uint64(0x9E3779B97F4A7C15)

IdCheck = Callable[[np.ndarray], None]
"""``check(ids)``: raises for ids (int64, 1-D) a table shard must not hold."""


def _hashed_bits(seed: int, ids: np.ndarray, dim: int, stream: int) -> np.ndarray:
    """53 random bits per word, int64 of shape ``(len(ids), dim)``: a counter-based
    hash of ``(seed, stream, id, column)``, so each row depends on its id alone."""
    base = mix64(ids ^ np.int64(seed))
    if stream:
        base ^= np.uint64(stream) * _SEED_MIX
    # Each word is its row's base plus its column's offset, the mix's own
    # golden-ratio step added in (mod 2**64, the same words): one pass fewer.
    # The bases repeated then the tiled offsets added: both passes run along
    # the whole array, where a broadcast (rows, 1) + (1, dim) runs one short
    # inner loop per row, about twice as slow.
    bits = np.repeat(base, dim)
    bits += _column_offsets(dim, ids.shape[0])
    mix64_in_place(bits)
    bits >>= np.uint64(11)
    return bits.view(np.int64).reshape(ids.shape[0], dim)


# Tiled column offsets by width, at most this many words each (more: tiled per call).
_OFFSETS_HELD = 1 << 16
_offsets: dict[int, np.ndarray] = {}


def _column_offsets(dim: int, rows: int) -> np.ndarray:
    """``rows`` copies of the ``dim`` column offsets (with the golden-ratio step), flat."""
    held = _offsets.get(dim)
    if held is None or held.shape[0] < rows * dim:
        cols = np.arange(1, dim + 1, dtype=np.uint64) * _COLUMN_MIX + _GOLDEN
        if rows * dim > _OFFSETS_HELD:
            return np.tile(cols, rows)
        held = np.tile(cols, max(_OFFSETS_HELD // dim, 1))
        held.flags.writeable = False  # shared by every table of this width
        _offsets[dim] = held
    return held[: rows * dim]


def _uniform_bits(seed: int, ids: np.ndarray, dim: int, stream: int) -> np.ndarray:
    """Uniform floats in ``[0, 1)``, shape ``(len(ids), dim)``, from :func:`_hashed_bits`."""
    out = _hashed_bits(seed, ids, dim, stream).astype(np.float64)
    out *= 1.0 / (1 << 53)
    return out


def initial_rows(
    initializer: str, seed: int, ids: np.ndarray, dim: int, scale: float, dtype: np.dtype
) -> np.ndarray:
    """The first value of the rows of ``ids``: a pure function of ``(seed, id)``.

    ``uniform`` draws from ``[-scale, scale)``, ``normal`` from N(0, scale^2)
    (Box-Muller), ``zeros`` is zeros.
    """
    if initializer == "zeros":
        return np.zeros((ids.shape[0], dim), dtype)
    step = math.ldexp(scale, -52)
    if initializer == "uniform" and math.ldexp(step, 52) == scale:
        # (2u - 1) * scale for u = b / 2**53 (53 bits b): 2u - 1 is (b - 2**52) / 2**52
        # exactly, and a power of two moves into the scale exactly (checked above:
        # no underflow), so one rounding of the same product, as in three passes
        # of floats, in one pass of integers
        bits = _hashed_bits(seed, ids, dim, 0)
        bits -= np.int64(1 << 52)
        u = bits.astype(np.float64)
        u *= step
        return u.astype(dtype)
    u = _uniform_bits(seed, ids, dim, 0)
    if initializer == "uniform":  # (2u - 1) * scale, in place
        u *= 2.0
        u -= 1.0
        u *= scale
        return u.astype(dtype)
    v = _uniform_bits(seed, ids, dim, 1)
    radius = np.sqrt(-2.0 * np.log1p(-u))  # 1 - u is in (0, 1]: no log(0)
    return (radius * np.cos(2.0 * np.pi * v) * scale).astype(dtype)


@dataclasses.dataclass(frozen=True)
class TableConfig:
    """What a dynamic table is; the same on every shard.

    Attributes:
        name: the table's name.
        dim: floats per row (> 0).
        dtype: the rows' floating dtype name.
        initializer: one of :data:`INITIALIZERS`.
        init_scale: the initializer's range / standard deviation.
        seed: seeds every row's initial value together with its id.
        optimizer: the update rule's config (``{"name": "adagrad", ...}``); None:
            bound by the first push that names one (the training optimizer's).
        min_count: lookups an id needs before it gets its own row (>= 1).
        ttl_steps: pushes a row may go untouched before eviction (0: never).
        capacity: rows to allocate up front (the table grows beyond it).
        memory_rows: rows each shard keeps in memory, the rest on the PS's local
            disk (:mod:`psflow.ps.tiered_table`); 0: the PS's default (its
            ``--table-memory-rows``; none: every row in memory).
        memory_bytes: the same budget in bytes (rows, slots, bookkeeping); at
            most one of the two.
    """

    name: str
    dim: int
    dtype: str = "float32"
    initializer: str = "uniform"
    init_scale: float = 0.05
    seed: int = 0
    optimizer: dict | None = None
    min_count: int = 1
    ttl_steps: int = 0
    capacity: int = 1024
    memory_rows: int = 0
    memory_bytes: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidArgumentError(f"table name must be a non-empty string, got {self.name!r}")
        for field, low in (
            ("dim", 1),
            ("min_count", 1),
            ("ttl_steps", 0),
            ("capacity", 1),
            ("memory_rows", 0),
            ("memory_bytes", 0),
        ):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidArgumentError(
                    f"table {self.name!r}: {field} must be an integer >= {low}, got {value!r}"
                )
        if self.memory_rows and self.memory_bytes:
            raise InvalidArgumentError(
                f"table {self.name!r}: give memory_rows or memory_bytes, not both "
                f"(got {self.memory_rows} and {self.memory_bytes})"
            )
        try:
            kind = np.dtype(self.dtype).kind
        except TypeError:
            kind = None
        if kind != "f":
            raise InvalidArgumentError(
                f"table {self.name!r}: dtype must be a float type, got {self.dtype!r}"
            )
        if self.initializer not in INITIALIZERS:
            raise InvalidArgumentError(
                f"table {self.name!r}: unknown initializer {self.initializer!r}; "
                f"accepted: {list(INITIALIZERS)}"
            )
        if not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**63:
            raise InvalidArgumentError(
                f"table {self.name!r}: seed must be an int64, got {self.seed!r}"
            )
        if self.optimizer is not None:
            rule_from_config(self.optimizer)  # raises on a bad optimizer config

    def accepts(self, other: TableConfig) -> bool:
        """Whether creating ``other`` where this table exists is a no-op: the same
        config, or the same but for an optimizer ``other`` leaves unset."""
        if other.optimizer is None:
            other = dataclasses.replace(other, optimizer=self.optimizer)
        return other == self

    def to_json(self) -> str:
        """The config as JSON (it travels in requests and checkpoints)."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TableConfig:
        """Parses :meth:`to_json`'s output.

        Raises:
            InvalidArgumentError: not JSON, not an object, unknown or bad fields.
        """
        try:
            data = json.loads(text)
        except ValueError as e:
            raise InvalidArgumentError(f"table config is not JSON: {e}") from e
        if not isinstance(data, dict):
            raise InvalidArgumentError(f"table config must be an object, got {data!r}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise InvalidArgumentError(f"unknown table config fields {unknown}")
        try:
            return cls(**data)
        except TypeError as e:
            raise InvalidArgumentError(f"bad table config: {e}") from e


@dataclasses.dataclass(frozen=True)
class TableStats:
    """A table shard's counters at one moment."""

    rows: int
    candidates: int
    step: int
    created: int
    admitted: int
    evicted_rows: int
    evicted_candidates: int
    dropped_gradients: int
    lookups: int
    nbytes: int
    # a disk tier's (psflow.ps.tiered_table); without one every row is in memory
    memory_rows: int = 0
    disk_rows: int = 0
    memory_hits: int = 0
    disk_hits: int = 0
    disk_bytes_read: int = 0
    disk_bytes_written: int = 0
    disk_bytes: int = 0

    @property
    def hit_rate(self) -> float:
        """The share of looked-up or pushed rows found in memory (1.0 without a tier)."""
        total = self.memory_hits + self.disk_hits
        return 1.0 if total == 0 else self.memory_hits / total


def check_ids(ids: Any, what: str = "ids") -> np.ndarray:
    """``ids`` as a 1-D int64 array.

    Raises:
        InvalidArgumentError: not 1-D, or not int64 (int32 too: ids come from an
            unbounded space and must not be narrowed silently).
    """
    ids = np.asarray(ids)
    if ids.ndim != 1 or ids.dtype != np.int64:
        raise InvalidArgumentError(
            f"{what} must be a 1-D int64 array, got dtype {ids.dtype} and shape {ids.shape}"
        )
    return ids


class DynamicTable:
    """One shard of a dynamic embedding table (see the module doc).

    Args:
        config: what the table is.
        capacity: rows to allocate up front (default: ``config.capacity``).
    """

    def __init__(self, config: TableConfig, capacity: int | None = None) -> None:
        self.config = config
        self.rule: UpdateRule | None = (
            None if config.optimizer is None else rule_from_config(config.optimizer)
        )
        self.dtype = np.dtype(config.dtype)
        self._lock = threading.Lock()
        self._index = KeyIndex(config.capacity if capacity is None else capacity)
        # ``(ids, slots, index removals)`` of recent lookups: a push carries the ids its
        # worker just looked up, and finds their slots here instead of probing again
        self._recent: collections.deque = collections.deque(maxlen=_RECENT_LOOKUPS)
        self._parsed_rule: tuple[str, UpdateRule] | None = None
        self._rows = np.zeros((self._index.capacity, config.dim), self.dtype)
        self._slots = {} if self.rule is None else self.rule.init_slots(self._rows)
        self._touched = np.zeros(self._index.capacity, np.uint32)
        self._traffic = np.zeros(self._index.capacity, np.uint32)
        # Candidates (ids waiting for admission): counts and last touch only.
        self._cand = KeyIndex(64)
        self._cand_count = np.zeros(self._cand.capacity, np.uint32)
        self._cand_touched = np.zeros(self._cand.capacity, np.uint32)
        self.step = 0
        self._next_scan = 0  # the push after which the eviction scan runs next
        # eviction scans run so far (they are amortised over max(1, ttl // 8) pushes)
        self.eviction_scans = 0
        self._counters = dict.fromkeys(
            (
                "created",
                "admitted",
                "evicted_rows",
                "evicted_candidates",
                "dropped_gradients",
                "lookups",
            ),
            0,
        )

    # -- reads ----------------------------------------------------------------------
    def lookup(self, ids: Any, read_only: bool = False, owned: IdCheck | None = None) -> np.ndarray:
        """The rows of ``ids`` (int64, 1-D), creating and admitting rows as needed.

        Repeated ids in one request count once towards admission.  With
        ``read_only`` (inference: evaluate, predict) nothing is created, counted
        or touched; an id without a row reads what its first training lookup
        would return (its initial row, or zeros while ``min_count > 1``).
        ``owned(ids)`` is called with the ids that have no row here before
        anything changes, and raises for ids this shard must not hold (an id
        with a row here was checked when its row was made).

        Raises:
            InvalidArgumentError: ``ids`` not a 1-D int64 array; nothing changes.
            OpError: what ``owned`` raised; nothing changes.
        """
        ids = check_ids(ids)
        unique, inverse = unique_ids(ids)
        if read_only:
            out = self._read(unique, owned)
            return out if unique is ids else out[inverse]
        with self._lock:
            self._check_tier()
            found, free = self._index.find_free(unique)
            found = self._bring_in(unique, found)
            absent = np.flatnonzero(found < 0)
            if owned is not None:
                owned(unique[absent])
            self._counters["lookups"] += 1
            slots = self._evict_met(found)
            missing = absent if slots is found else np.flatnonzero(slots < 0)
            if missing.size:
                at = missing if self.config.min_count <= 1 else None
                if at is None:  # admission: the ids seen often enough
                    at = missing[self._count_candidates(unique[missing])]
                if at.size:
                    slots[at] = self._create(unique[at], (free[0][at], free[1]))
            have = slots >= 0
            if have.all():
                self._touched[slots] = self.step
                _count(self._traffic, slots)
                out = take_rows(self._rows, slots)
                # a copy: the ids may view a request buffer that is reused
                self._recent.append((unique.copy(), slots, self._index.removals))
                kept = slots
            else:  # candidates read the default row (zeros)
                kept = slots[have]
                self._touched[kept] = self.step
                self._traffic[kept] += 1
                out = np.zeros((unique.shape[0], self.config.dim), self.dtype)
                out[have] = take_rows(self._rows, kept)
            self._settle(kept)
        return out if unique is ids else out[inverse]

    def _read(self, unique: np.ndarray, owned: IdCheck | None) -> np.ndarray:
        with self._lock:
            found = self._index.find(unique)
            if owned is not None:
                owned(unique[found < 0])
            slots = self._live(found)
            have = slots >= 0
            out = np.empty((unique.shape[0], self.config.dim), self.dtype)
            out[have] = self._rows[slots[have]]
            if not have.all():  # rows held outside memory (a disk tier)
                have[~have] = self._read_held(unique[~have], out, np.flatnonzero(~have))
        if not have.all():
            c = self.config
            if c.min_count > 1:  # a first sighting leaves it a candidate: the default row
                out[~have] = 0
            else:
                out[~have] = initial_rows(
                    c.initializer, c.seed, unique[~have], c.dim, c.init_scale, self.dtype
                )
        return out

    def peek(self, ids: Any) -> np.ndarray:
        """The current rows of ``ids`` without creating, counting or touching any
        (zeros where an id has no row)."""
        ids = check_ids(ids)
        with self._lock:
            slots = self._live(self._index.find(ids))
            out = np.zeros((ids.shape[0], self.config.dim), self.dtype)
            out[slots >= 0] = self._rows[slots[slots >= 0]]
            if (slots < 0).any():
                self._read_held(ids[slots < 0], out, np.flatnonzero(slots < 0))
        return out

    def _count_candidates(self, ids: np.ndarray) -> np.ndarray:
        """Counts one sighting of each (absent) id; True where it is now admitted."""
        if self.config.min_count <= 1:
            return np.ones(ids.shape[0], bool)
        cand = self._evict_met(self._cand.find(ids), candidates=True)
        new = cand < 0
        if new.any():
            if self._cand.reserve(int(new.sum())):
                self._cand_count = _grown(self._cand_count, self._cand.capacity)
                self._cand_touched = _grown(self._cand_touched, self._cand.capacity)
            cand[new] = self._cand.insert(ids[new])
            self._cand_count[cand[new]] = 0
        self._cand_count[cand] += 1
        self._cand_touched[cand] = self.step
        admit = self._cand_count[cand] >= self.config.min_count
        self._cand.remove(cand[admit])
        self._counters["admitted"] += int(admit.sum())
        return admit

    def _reserve(self, n: int) -> None:
        """Makes room for ``n`` more rows (growing every per-slot array)."""
        if self._index.reserve(n):
            cap = self._index.capacity
            self._rows = _grown(self._rows, cap)
            self._slots = {k: _grown(v, cap) for k, v in self._slots.items()}
            self._touched = _grown(self._touched, cap)
            self._traffic = _grown(self._traffic, cap)

    def _create(self, ids: np.ndarray, free: tuple[np.ndarray, int] | None = None) -> np.ndarray:
        self._reserve(ids.shape[0])
        slots = self._index.insert(ids, free)
        c = self.config
        rows = initial_rows(c.initializer, c.seed, ids, c.dim, c.init_scale, self.dtype)
        # new slots are mostly one run (freed ones are reused first): then each
        # array takes its rows in one sequential copy instead of a scatter
        run = _run_of(slots)
        if run is None:
            put_rows(self._rows, slots, rows)
        else:
            self._rows[run] = rows
        if self.rule is not None:
            for k, v in self.rule.init_slots(rows).items():
                if run is None:
                    put_rows(self._slots[k], slots, v)
                else:
                    self._slots[k][run] = v
        self._traffic[slots if run is None else run] = 0
        self._counters["created"] += ids.shape[0]
        return slots

    # -- writes -----------------------------------------------------------------------
    def apply_gradients(
        self,
        ids: Any,
        grads: Any,
        optimizer: dict | None = None,
        owned: IdCheck | None = None,
    ) -> int:
        """Applies gradient rows ``grads`` for ``ids``; returns the new step.

        Duplicates are summed first; ids without a row (not admitted, or evicted
        since their lookup) have their gradients dropped and counted.  Then rows
        untouched for ``ttl_steps`` pushes are evicted.  ``optimizer`` (a rule
        config) binds a table created without one; it must match a bound one.
        ``owned``: as in :meth:`lookup`.

        Raises:
            InvalidArgumentError: bad ids, ``grads`` not ``(len(ids), dim)`` of a
                float dtype, or a bad optimizer config; nothing changes.
            FailedPreconditionError: no optimizer bound or given, or another one
                than the bound one.
            OpError: what ``owned`` raised; nothing changes.
        """
        rule = None if optimizer is None else self._rule_of(optimizer)
        ids = check_ids(ids)
        grads = np.asarray(grads)
        if grads.shape != (ids.shape[0], self.config.dim) or grads.dtype.kind != "f":
            raise InvalidArgumentError(
                f"table {self.config.name!r}: gradients must be float of shape "
                f"({ids.shape[0]}, {self.config.dim}), got {grads.dtype} {grads.shape}"
            )
        grads = grads.astype(self.dtype, copy=False)
        unique, inverse = unique_ids(ids)
        if unique is ids:  # sorted unique already (what clients send)
            summed = grads
        elif unique.shape[0] == ids.shape[0]:
            summed = np.empty_like(grads)
            summed[inverse] = grads
        else:  # unsorted_segment_sum, in order of appearance
            summed = sum_rows(grads, inverse, unique.shape[0])
        with self._lock:
            self._check_tier()
            found = self._find_pushed(unique)
            if owned is not None:
                owned(unique[found < 0])
            self._bind(rule)
            found = self._bring_in(unique, found)
            slots = self._evict_met(found)
            have = slots >= 0
            self._counters["dropped_gradients"] += int((~have).sum())
            self.step += 1
            if have.all():  # slots of unique ids: unique, in range
                self.rule.apply_rows(self._rows, slots, summed, self._slots, self.step)
                self._touched[slots] = self.step
                _count(self._traffic, slots)
            elif have.any():
                self.rule.apply_rows(self._rows, slots[have], summed[have], self._slots, self.step)
                self._touched[slots[have]] = self.step
                self._traffic[slots[have]] += 1
            if self.step >= self._next_scan:
                self._evict()
            self._settle(slots if have.all() else slots[have])
            return self.step

    # -- hooks for a tier below memory (psflow.ps.tiered_table); here: no tier ----------
    def _check_tier(self) -> None:
        """Raises, before a request changes anything, when the tier below cannot
        take writes (lock held)."""

    def _bring_in(self, unique: np.ndarray, found: np.ndarray) -> np.ndarray:
        """``found`` (slots of ``unique``, ``-1``: not in memory) with the rows held
        below memory brought in (lock held)."""
        return found

    def _read_held(self, ids: np.ndarray, out: np.ndarray, at: np.ndarray) -> np.ndarray:
        """Writes the live rows of ``ids`` held below memory to ``out[at]`` without
        changing anything; True where one was (lock held)."""
        return np.zeros(ids.shape[0], bool)

    def _settle(self, keep: np.ndarray) -> None:
        """Moves rows out of memory once a request is done, never the slots ``keep``
        it used (lock held)."""

    def _rule_of(self, optimizer: dict) -> UpdateRule:
        """``rule_from_config(optimizer)``, parsed once while pushes name the same
        config (every push carries it); its canonical JSON is the key, so a
        config differing only in a value's type is parsed (and checked) anew."""
        key = json.dumps(optimizer, sort_keys=True, default=repr)
        held = self._parsed_rule
        if held is None or held[0] != key:
            held = self._parsed_rule = (key, rule_from_config(optimizer))
        return held[1]

    def _find_pushed(self, unique: np.ndarray) -> np.ndarray:
        """The slots of a push's unique ids: a recent lookup's when it had the same
        ids and no key was removed since (every one of them still maps to the
        slot it had), else from the index."""
        for ids, slots, removals in reversed(self._recent):
            if (
                removals == self._index.removals
                and ids.shape == unique.shape
                and np.array_equal(ids, unique)
            ):
                return slots
        return self._index.find(unique)

    def _bind(self, rule: UpdateRule | None) -> None:
        if rule is None:
            if self.rule is None:
                raise FailedPreconditionError(
                    f"table {self.config.name!r} has no optimizer: give one in its config "
                    "or with the push"
                )
            return
        if self.rule is None:
            self.rule = rule
            self._slots = rule.init_slots(self._rows)
            self.config = dataclasses.replace(self.config, optimizer=rule.get_config())
        elif rule != self.rule:
            raise FailedPreconditionError(
                f"table {self.config.name!r} is updated by {self.rule.get_config()}, "
                f"not {rule.get_config()}"
            )

    def _horizon(self) -> int:
        """Rows last touched before this step are gone (0: nothing is)."""
        ttl = self.config.ttl_steps
        return self.step - ttl if ttl and self.step > ttl else 0

    def _stale(self, slots: np.ndarray, candidates: bool = False) -> np.ndarray | None:
        """Where ``slots`` (``-1``: absent) hold rows due for eviction; None: nowhere
        (no TTL, or none passed yet)."""
        horizon = self._horizon()
        if not horizon:
            return None
        stale = np.zeros(slots.shape[0], bool)
        touched = self._cand_touched if candidates else self._touched
        found = np.flatnonzero(slots >= 0)
        stale[found] = touched[slots[found]] < horizon
        return stale

    def _live(self, slots: np.ndarray) -> np.ndarray:
        """``slots`` with rows due for eviction read as absent (nothing changes)."""
        stale = self._stale(slots)
        return np.where(stale, -1, slots) if stale is not None and stale.any() else slots

    def _evict_met(self, slots: np.ndarray, candidates: bool = False) -> np.ndarray:
        """Evicts (and counts) the rows due for eviction among unique ``slots``;
        returns ``slots`` with them absent."""
        stale = self._stale(slots, candidates)
        if stale is None or not stale.any():
            return slots
        index = self._cand if candidates else self._index
        index.remove(slots[stale])
        self._counters["evicted_candidates" if candidates else "evicted_rows"] += int(stale.sum())
        return np.where(stale, -1, slots)

    def _evict(self, full: bool = False) -> None:
        """The scan: removes every row and candidate due for eviction (lock held);
        ``full``: also where a tier below memory would scan only now and then."""
        ttl = self.config.ttl_steps
        if not ttl:
            return
        self._next_scan = self.step + max(1, ttl // 8)
        horizon = self._horizon()
        if not horizon:
            return
        self.eviction_scans += 1
        live = self._index.live_slots()
        stale = live[self._touched[live] < horizon]
        self._index.remove(stale)
        self._counters["evicted_rows"] += stale.size
        cand = self._cand.live_slots()
        stale = cand[self._cand_touched[cand] < horizon]
        self._cand.remove(stale)
        self._counters["evicted_candidates"] += stale.size

    # -- inspection and checkpoints -------------------------------------------------
    def stats(self) -> TableStats:
        """The counters, row counts and bytes held, consistently."""
        with self._lock:
            self._evict(full=True)
            extra = self._tier_stats()
            return TableStats(
                rows=self._index.size + extra.get("disk_rows", 0),
                candidates=self._cand.size,
                step=self.step,
                nbytes=self.nbytes,
                **self._counters,
                **extra,
            )

    def _tier_stats(self) -> dict[str, int]:
        """The :class:`TableStats` fields of a tier below memory (lock held)."""
        return {"memory_rows": self._index.size}

    @property
    def nbytes(self) -> int:
        """Bytes of every array the table holds (rows, slots, index, counters)."""
        return (
            self._rows.nbytes
            + sum(v.nbytes for v in self._slots.values())
            + self._touched.nbytes
            + self._traffic.nbytes
            + self._index.nbytes
            + self._cand.nbytes
            + self._cand_count.nbytes
            + self._cand_touched.nbytes
        )

    def hot_ids(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` ids with the most traffic (lookups + pushes), and their counts,
        busiest first."""
        with self._lock:
            self._evict()
            live = self._index.live_slots()
            traffic = self._traffic[live]
            k = min(int(k), live.size)
            if k <= 0:
                return np.zeros(0, np.int64), np.zeros(0, np.int64)
            top = np.argpartition(-traffic.astype(np.int64), k - 1)[:k]
            top = top[np.argsort(-traffic[top].astype(np.int64), kind="stable")]
            return self._index.keys[live[top]].copy(), traffic[top].astype(np.int64)

    def export_state(self) -> dict[str, np.ndarray]:
        """Every id, row, slot and counter as arrays (a consistent copy)."""
        with self._lock:
            self._evict(full=True)
            return self._with_held(self._export_memory())

    def _export_memory(self) -> dict[str, np.ndarray]:
        """:meth:`export_state` of the rows in memory (lock held)."""
        live = self._index.live_slots()
        cand = self._cand.live_slots()
        state = {
            "ids": self._index.keys[live].copy(),
            "rows": self._rows[live].copy(),
            "touched": self._touched[live].copy(),
            "traffic": self._traffic[live].copy(),
            "candidate_ids": self._cand.keys[cand].copy(),
            "candidate_counts": self._cand_count[cand].copy(),
            "candidate_touched": self._cand_touched[cand].copy(),
            "step": np.array(self.step, np.int64),
            "counters": np.array([self._counters[k] for k in sorted(self._counters)], np.int64),
        }
        for k, v in self._slots.items():
            state[f"slot/{k}"] = v[live].copy()
        return state

    def _with_held(self, state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``state`` (memory's rows) with the rows held below memory (lock held)."""
        return state

    @classmethod
    def from_parts(
        cls,
        config: TableConfig,
        parts: list[dict[str, np.ndarray]],
        keep: Any = None,
        counted: list[bool] | None = None,
        step: int | None = None,
        make: Callable[[TableConfig, int], DynamicTable] | None = None,
    ) -> DynamicTable:
        """A table holding the union of exported ``parts`` (:meth:`export_state` of
        any number of shards), keeping the ids for which ``keep(ids)`` is True.

        The step is ``step`` where the caller knows it (the shard's own, saved
        with the same layout); otherwise, merging parts, the largest part's step
        (shards step independently and a step cannot be split by id, so Adam's
        bias correction and the ttl clocks continue from the furthest shard).
        The counters are the sum of the parts ``counted`` marks (default: all;
        a counter cannot be split by id, so of several new shards only one
        should count a part).  ``make(config, capacity)`` makes the empty table
        (default: this class's).
        """
        ids = np.concatenate([p["ids"] for p in parts]) if parts else np.zeros(0, np.int64)
        mask = np.ones(ids.shape[0], bool) if keep is None else np.asarray(keep(ids), bool)

        def cat(key: str, like: np.ndarray) -> np.ndarray:
            return np.concatenate([p[key] for p in parts])[mask] if parts else like

        # sized for its rows, its config unchanged (shards and a later create must agree)
        fresh = (make or cls)(config, max(int(mask.sum()), 1))
        with fresh._lock:
            new_slots = fresh._create(ids[mask])
            fresh._rows[new_slots] = cat("rows", fresh._rows[:0])
            for k in fresh._slots:
                fresh._slots[k][new_slots] = cat(f"slot/{k}", fresh._rows[:0])
            fresh._touched[new_slots] = cat("touched", fresh._touched[:0])
            fresh._traffic[new_slots] = cat("traffic", fresh._traffic[:0])
            cids = np.concatenate([p["candidate_ids"] for p in parts]) if parts else ids[:0]
            cmask = np.ones(cids.shape[0], bool) if keep is None else np.asarray(keep(cids), bool)
            if cmask.any():
                if fresh._cand.reserve(int(cmask.sum())):
                    fresh._cand_count = _grown(fresh._cand_count, fresh._cand.capacity)
                    fresh._cand_touched = _grown(fresh._cand_touched, fresh._cand.capacity)
                cs = fresh._cand.insert(cids[cmask])
                fresh._cand_count[cs] = np.concatenate([p["candidate_counts"] for p in parts])[
                    cmask
                ]
                fresh._cand_touched[cs] = np.concatenate([p["candidate_touched"] for p in parts])[
                    cmask
                ]
            names = sorted(fresh._counters)
            fresh._counters = {n: 0 for n in names}
            for p, count in zip(parts, counted or [True] * len(parts)):
                for n, v in zip(names, p["counters"].tolist()):
                    fresh._counters[n] += v if count else 0
            fresh.step = (
                max((int(p["step"]) for p in parts), default=0) if step is None else int(step)
            )
            fresh._settle(np.zeros(0, np.int64))
        return fresh


def _count(counts: np.ndarray, slots: np.ndarray) -> None:
    """``counts[slots] += 1`` for unique ``slots``, in one pass (a scalar of the
    counts' own dtype keeps ``np.add.at`` on its fast path)."""
    np.add.at(counts, slots, counts.dtype.type(1))


def _run_of(slots: np.ndarray) -> slice | None:
    """``slots`` as a slice when they are consecutive and increasing, else None."""
    n = slots.shape[0]
    if n == 0 or int(slots[-1]) - int(slots[0]) != n - 1:
        return None
    if n > 1 and not bool((slots[1:] - slots[:-1] == 1).all()):
        return None
    return slice(int(slots[0]), int(slots[0]) + n)


def _grown(array: np.ndarray, rows: int) -> np.ndarray:
    """``array`` with its first dimension extended to ``rows`` (new entries zero).

    One fresh allocation, written once: the kernel zeroes every fresh page on
    first touch, so building the tail apart and concatenating (two allocations,
    the tail written twice) cost a table about twice the page clearing.
    """
    out = np.empty((rows, *array.shape[1:]), array.dtype)
    out[: array.shape[0]] = array
    out[array.shape[0] :] = 0
    return out

"""A vectorised open-addressing map from int64 keys to dense slot numbers.

Dynamic embedding tables (:mod:`psflow.ps.dynamic_table`) keep their rows in
dense NumPy arrays; this index says which slot holds which key.  It is a
linear-probing hash table over one ``int32`` array (``EMPTY``, ``TOMBSTONE`` or
a slot number), probed for a whole batch of keys at once: every round of the
probe loop handles all keys still searching, so the Python loop runs as many
times as the longest probe sequence, not once per key.

Memory per key: 8 bytes of key, 1 byte of liveness and 4 bytes per index
entry at a load between 0.28 and ``MAX_LOAD`` (so 6 to 15 bytes per key).
Removed keys leave tombstones; the index is rebuilt, sized for a quarter more
keys than it holds, when keys and tombstones together pass ``MAX_LOAD``.
Freed slots are reused before new ones.

Example:
    >>> import numpy as np
    >>> index = KeyIndex(4)
    >>> index.insert(np.array([10, -7], np.int64))
    array([0, 1])
    >>> index.find(np.array([-7, 3, 10], np.int64))
    array([ 1, -1,  0])
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from psflow.errors import InvalidArgumentError

__all__ = [
    "EMPTY",
    "MAX_LOAD",
    "TOMBSTONE",
    "WINDOW",
    "KeyIndex",
    "ShardSplit",
    "as_ids",
    "gradient_rows",
    "mix64",
    "mix64_in_place",
    "shard_of",
    "sum_rows",
    "unique_gradients",
    "unique_ids",
]

EMPTY = -1
TOMBSTONE = -2
MAX_LOAD = 0.7
# Index entries the second probe round reads per key (32 bytes: one or two cache
# lines); later rounds double it.
WINDOW = 8
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def as_ids(ids: Any) -> np.ndarray:
    """``ids`` (any shape of integers) as a flat ``int64`` array.

    Raises:
        InvalidArgumentError: not integers, or a ``uint64`` id beyond ``int64``.
    """
    ids = np.asarray(ids)
    if ids.dtype.kind not in "iu":
        raise InvalidArgumentError(f"ids must be integers, got dtype {ids.dtype}")
    if ids.dtype == np.uint64 and ids.size and int(ids.max()) >= 2**63:
        raise InvalidArgumentError(f"id {int(ids.max())} does not fit in int64")
    return ids.reshape(-1).astype(np.int64, copy=False)


def gradient_rows(ids: Any, grads: Any) -> np.ndarray:
    """Gradient rows ``grads`` (``ids.shape + (dim,)``) as one row per id.

    Raises:
        InvalidArgumentError: a shape that does not match ``ids``.
    """
    grads = np.asarray(grads)
    if grads.ndim < 1 or grads.shape[:-1] != np.shape(ids):
        raise InvalidArgumentError(
            f"gradients of shape {grads.shape} do not match ids of shape {np.shape(ids)}"
        )
    return grads.reshape(math.prod(np.shape(ids)), grads.shape[-1])


def mix64(keys: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser of int64 (or uint64) ``keys``, as uint64.

    A bijection with good avalanche: consecutive ids land far apart, so both
    the index and the shard assignment stay balanced on sequential ids.
    """
    # In place over one scratch array: two allocations instead of nine (the
    # hash of every new row's columns runs it over tens of thousands of words).
    return mix64_in_place(np.ascontiguousarray(keys).view(np.uint64) + _GOLDEN)


def mix64_in_place(z: np.ndarray) -> np.ndarray:
    """:func:`mix64` of ``z - golden`` (uint64, C-contiguous), written over ``z``:
    for a caller whose last pass over its words can add the golden ratio itself."""
    t = np.right_shift(z, _S30)
    z ^= t
    z *= _M1
    np.right_shift(z, _S27, out=t)
    z ^= t
    z *= _M2
    np.right_shift(z, _S31, out=t)
    z ^= t
    return z


def shard_of(keys: np.ndarray, num_shards: int) -> np.ndarray:
    """The shard (``0..num_shards-1``) that owns each int64 key, by hash.

    It mixes the key twice so it is independent of the index position a shard
    uses (which mixes once): a shard's keys still spread over its whole index.
    """
    mixed = mix64(keys)
    mixed += _GOLDEN  # the second mix over the first's array
    mix64_in_place(mixed)
    # a power of two (the usual count): the same bits as the remainder, no division
    if num_shards > 0 and num_shards & (num_shards - 1) == 0:
        mixed &= np.uint64(num_shards - 1)
    else:
        mixed %= np.uint64(num_shards)
    return mixed.view(np.int64)


def unique_ids(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(ids, return_inverse=True)`` of 1-D ``ids``, without the sort
    when ``ids`` is already strictly increasing (clients send sorted unique ids)."""
    if ids.shape[0] < 2 or bool((ids[1:] > ids[:-1]).all()):
        return ids, np.arange(ids.shape[0])
    packs = ids.dtype == np.int64 and ids.shape[0] <= _PACKED_MAX
    found = _packed_unique(ids) if packs else None
    if found is not None:
        return found
    unique, inverse = np.unique(ids, return_inverse=True)
    return unique, inverse.reshape(-1)


# Up to this many ids, :func:`_packed_unique` packs each one's position into the
# low bits of a sort key (16 bits: a batch of ids, never a whole table).
_PACKED_MAX = 1 << 16


def _packed_unique(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """``np.unique``'s result of int64 ``ids`` (2 to ``_PACKED_MAX`` of them), or
    None where this way cannot tell.

    ``np.unique`` sorts ``ids`` by ``argsort``; sorting plain int64 values is
    about three times faster (a vectorised sort), so each id's position rides in
    the low bits of its key and the sorted keys give the permutation.  Ids
    within a span that leaves room for the position are shifted up (exact);
    others keep their high bits only, the order holds unless two distinct ids
    share those bits, which the sorted ids show (then: None).
    """
    n = ids.shape[0]
    bits = (n - 1).bit_length()
    low = np.int64((1 << bits) - 1)
    lo, hi = int(ids.min()), int(ids.max())
    if hi - lo < 1 << (63 - bits):  # the span fits above the position: exact
        key = ids - np.int64(lo)
        key <<= np.int64(bits)
    else:  # equal high bits sort by position, not by id: checked below
        key = ids & ~low
    key |= np.arange(n, dtype=np.int64)
    key.sort()
    perm = key & low
    ordered = ids.take(perm)
    if not bool((ordered[1:] >= ordered[:-1]).all()):
        return None
    first = np.empty(n, bool)  # where a new id starts in the sorted ids
    first[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    rank = np.cumsum(first)
    rank -= 1
    inverse = np.empty(n, np.intp)
    inverse[perm] = rank
    return ordered[first], inverse


def sum_rows(values: np.ndarray, inverse: np.ndarray, n: int) -> np.ndarray:
    """``unsorted_segment_sum``: row ``i`` of the result sums the rows of 2-D
    ``values`` whose ``inverse`` is ``i``, in order of appearance (bit for bit
    ``np.add.at(out, inverse, values)``).

    One 1-D ``np.add.at`` per column: NumPy's fast path takes only 1-D
    operands, and the 2-D form is about six times slower.  Each call costs
    about as much as a pass over its elements whatever its width, so float32
    and float64 columns go in pairs, as the parts of one complex column: a
    complex sum adds its real and imaginary parts apart, each rounded as the
    float sum it stands for (the same bits, half the calls).
    """
    out = np.zeros((n, values.shape[1]), values.dtype)
    pair = _PAIRED.get(values.dtype)
    paired = 0 if pair is None else values.shape[1] // 2 * 2
    if paired:
        values = np.ascontiguousarray(values)
        both, pairs = out[:, :paired].view(pair), values[:, :paired].view(pair)
        for column in range(paired // 2):
            np.add.at(both[:, column], inverse, pairs[:, column])
    for column in range(paired, values.shape[1]):
        np.add.at(out[:, column], inverse, values[:, column])
    return out


# float dtypes whose column pairs :func:`sum_rows` adds as one complex column
_PAIRED = {
    np.dtype(np.float32): np.dtype(np.complex64),
    np.dtype(np.float64): np.dtype(np.complex128),
}


def unique_gradients(ids: Any, grads: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(unique ids, their gradient rows)`` of rows ``grads`` (``ids.shape +
    (dim,)``), the rows of a repeated id summed as ``unsorted_segment_sum`` would.

    Raises:
        InvalidArgumentError: ids not integers, grads of the wrong shape.
    """
    flat = as_ids(ids)
    grads = gradient_rows(ids, grads)
    unique, inverse = unique_ids(flat)
    if unique is flat:  # sorted unique already (a DynamicEmbedding's gradient)
        return unique, grads
    if unique.shape[0] != flat.shape[0]:
        return unique, sum_rows(grads, inverse, unique.shape[0])
    summed = np.empty_like(grads)
    summed[inverse] = grads
    return unique, summed


class ShardSplit:
    """Splits 1-D ids by owner: positions into ``ids`` owned by each of
    ``num_shards`` shards.

    A step pushes the very ids it looked up: the last split is kept (with a
    copy of its ids, compared by value) and reused instead of hashing every
    id again.  It is one tuple, replaced whole: threads may share a splitter.
    """

    def __init__(self) -> None:
        self._last: tuple[np.ndarray, int, list[np.ndarray]] | None = None

    def __call__(self, ids: np.ndarray, num_shards: int) -> list[np.ndarray]:
        if num_shards == 1:
            return [np.arange(ids.shape[0])]
        last = self._last
        if last is not None and last[1] == num_shards and np.array_equal(last[0], ids):
            return last[2]
        owner = shard_of(ids, num_shards)
        parts = [np.flatnonzero(owner == s) for s in range(num_shards)]
        self._last = (ids.copy(), num_shards, parts)
        return parts


def _extended(array: np.ndarray, n: int) -> np.ndarray:
    """1-D ``array`` extended to ``n`` entries, zeros after it: one fresh allocation,
    each page written once (the kernel clears a fresh page on its first touch)."""
    out = np.empty(n, array.dtype)
    out[: array.shape[0]] = array
    out[array.shape[0] :] = 0
    return out


def _index_size(keys: int) -> int:
    size = 8
    while size * MAX_LOAD < keys:
        size *= 2
    return size


class KeyIndex:
    """Maps unique int64 keys to slots ``0..capacity-1``; not thread-safe (callers lock).

    Args:
        capacity: slots to allocate up front (grows by half when full).
    """

    def __init__(self, capacity: int = 1024) -> None:
        capacity = max(int(capacity), 1)
        self.keys = np.zeros(capacity, np.int64)
        self.live = np.zeros(capacity, bool)
        self._table = np.full(_index_size(capacity), EMPTY, np.int32)
        self._next = 0  # slots below this were used at least once
        self._free: list[np.ndarray] = []
        self._num_free = 0
        self._tombstones = 0
        self.size = 0
        # keys removed so far: a slot found before is still the key's while it is unchanged
        self.removals = 0
        # rebuilds so far: entries probed before one are stale
        self.rebuilds = 0

    @property
    def capacity(self) -> int:
        """Slots the dense arrays hold."""
        return self.keys.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes of the index's own arrays."""
        return self.keys.nbytes + self.live.nbytes + self._table.nbytes

    def live_slots(self) -> np.ndarray:
        """The slots holding a key, ascending."""
        return np.flatnonzero(self.live[: self._next])

    # -- lookups ---------------------------------------------------------------------
    def _window(self, pos: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
        """``(index positions, entries)`` of the ``width`` entries from each of ``pos``."""
        at = (pos[:, None] + np.arange(width, dtype=np.int64)) & (self._table.shape[0] - 1)
        return at, self._table.take(at)

    def _width(self, r: int) -> int:
        """The window width of probe round ``r`` after the first: ``WINDOW``, then
        doubling up to the table size, so a long cluster (near ``MAX_LOAD``) costs
        a few rounds rather than one per ``WINDOW`` entries."""
        return min(WINDOW << min(r, 40), self._table.shape[0])

    def _probe(self, keys: np.ndarray, want: str = "") -> tuple[np.ndarray, np.ndarray | None]:
        """``(slot, positions)`` of each key, slot ``-1`` where absent.  ``positions``
        (None unless asked): ``want="found"``, where each present key sits in the
        index; ``want="free"``, the EMPTY entry at which each absent key's probe
        ended, where it may be placed (:meth:`insert`'s ``free``); ``-1`` elsewhere."""
        size = self._table.shape[0]
        mix = mix64(keys)
        mix &= np.uint64(size - 1)
        pos = mix.view(np.int64)  # below the table size: the same values
        # Round one reads each key's home entry (most keys end there); the few
        # left read a window per round, doubling from WINDOW entries, so the
        # Python loop runs about log2(longest probe / WINDOW) times. An empty
        # entry always exists (load < 1), so every probe ends within the table.
        # ``take`` rather than indexing (a fifth faster), clipped: an EMPTY or
        # TOMBSTONE entry reads slot 0's key, which ``entry >= 0`` then discards
        entry = self._table.take(pos)
        hit = self.keys.take(entry, mode="clip") == keys
        hit &= entry >= 0
        slots = np.where(hit, entry, np.int64(-1))  # one pass each, no masked writes
        empty = entry == EMPTY
        where = None
        if want == "found":
            where = np.where(hit, pos, np.int64(-1))
        elif want == "free":
            where = np.where(empty, pos, np.int64(-1))
        empty |= hit
        pending = np.flatnonzero(~empty)
        if pending.size:
            self._probe_on(keys, pending, (pos[pending] + 1) & (size - 1), slots, where, want)
        return slots, where

    def _probe_on(
        self,
        keys: np.ndarray,
        pending: np.ndarray,
        pos: np.ndarray,
        slots: np.ndarray,
        where: np.ndarray | None,
        want: str,
    ) -> None:
        """The probe's later rounds: each of ``keys[pending]`` from ``pos`` on."""
        size = self._table.shape[0]
        for r in range(size // WINDOW + 1):
            if pending.size == 0:
                break
            width = self._width(r)
            _, entry = self._window(pos, width)
            hit = self.keys.take(entry, mode="clip") == keys[pending][:, None]
            hit &= entry >= 0
            stop = hit | (entry == EMPTY)
            first = stop.argmax(axis=1)
            # each key's first stopping entry, read through flat positions: one
            # 1-D take per array instead of 2-D fancy indexing
            flat = np.arange(0, pending.shape[0] * width, width)
            flat += first
            found = hit.reshape(-1).take(flat)
            slots[pending[found]] = entry.reshape(-1).take(flat[found])
            if want == "found":
                where[pending[found]] = (pos[found] + first[found]) & (size - 1)
            go_on = ~stop.reshape(-1).take(flat)
            if want == "free":  # ended on an EMPTY entry: absent, and free there
                ended = ~(found | go_on)
                where[pending[ended]] = (pos[ended] + first[ended]) & (size - 1)
            pending = pending[go_on]
            pos = (pos[go_on] + width) & (size - 1)

    def find(self, keys: np.ndarray) -> np.ndarray:
        """The slot of each key in ``keys`` (int64, 1-D), ``-1`` where absent."""
        return self._probe(keys)[0]

    def find_free(self, keys: np.ndarray) -> tuple[np.ndarray, tuple[np.ndarray, int]]:
        """:meth:`find`'s slots, and where each absent key may go: an :meth:`insert`
        of absent ones among them with this ``free`` (its entries taken where
        they are still free) skips their probe while the index was not rebuilt."""
        slots, free = self._probe(keys, "free")
        return slots, (free, self.rebuilds)

    def locate(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(slots, entries)`` of ``keys``: :meth:`find`'s slots and where each sits
        in the index (``-1`` where absent), for a :meth:`remove` with no probe
        while nothing changed in between."""
        return self._probe(keys, "found")

    # -- changes ----------------------------------------------------------------------
    def reserve(self, extra: int) -> bool:
        """Makes room for ``extra`` more keys; True when the dense arrays grew
        (the caller then grows its own per-slot arrays to :attr:`capacity`)."""
        grew = False
        free_slots = self._num_free + self.capacity - self._next
        if extra > free_slots:
            need = self.capacity + extra - free_slots
            new_cap = max(need, self.capacity + self.capacity // 2)
            self.keys = _extended(self.keys, new_cap)
            self.live = _extended(self.live, new_cap)
            grew = True
        if (self.size + self._tombstones + extra) > MAX_LOAD * self._table.shape[0]:
            # sized for a quarter more keys: rebuilt just under MAX_LOAD, a table
            # that churns (removes leave tombstones) would rebuild every few calls
            self._rebuild(_index_size((self.size + extra) * 5 // 4))
        return grew

    def _allocate(self, n: int) -> np.ndarray:
        taken: list[np.ndarray] = []
        while n and self._free:
            block = self._free.pop()
            use, rest = block[:n], block[n:]
            if rest.size:
                self._free.append(rest)
            taken.append(use)
            self._num_free -= use.size
            n -= use.size
        if n:
            taken.append(np.arange(self._next, self._next + n, dtype=np.int64))
            self._next += n
        return np.concatenate(taken) if taken else np.zeros(0, np.int64)

    def insert(self, keys: np.ndarray, free: tuple[np.ndarray, int] | None = None) -> np.ndarray:
        """Adds ``keys`` (unique, absent, int64); returns their slots.

        The caller has checked absence with :meth:`find` (or :meth:`find_free`,
        whose ``free``, cut to these keys, saves placing them anew); call
        :meth:`reserve` first when it keeps per-slot arrays of its own.
        """
        n = keys.shape[0]
        self.reserve(n)
        slots = self._allocate(n)
        self.keys[slots] = keys
        self.live[slots] = True
        # entries found free before a rebuild mean nothing now
        at = None if free is None or free[1] != self.rebuilds else free[0]
        self._place(keys, slots, at)
        self.size += n
        return slots

    def _claim(self, targets: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Writes ``slots`` into the free index entries ``targets``; where several
        want the same entry one takes it (read back: no sort). Returns who won."""
        before = self._table.take(targets)
        self._table[targets] = slots
        won = self._table.take(targets) == slots
        self._tombstones -= int(np.count_nonzero(before[won] == TOMBSTONE))
        return won

    def _place(self, keys: np.ndarray, slots: np.ndarray, at: np.ndarray | None = None) -> None:
        size = self._table.shape[0]
        if at is not None and at.shape[0] and at.min() >= 0:
            # where a probe since the last rebuild ended: every entry before it on
            # the key's path was taken then and is not EMPTY now (only a rebuild
            # makes EMPTY entries), so the key is found there; no key needs its hash
            pos = at
        else:
            mix = mix64(keys)
            mix &= np.uint64(size - 1)
            pos = mix.view(np.int64)
            if at is not None:  # -1: no probe ended for that key
                pos = np.where(at >= 0, at, pos)
        # Round one: a key whose home (or probed) entry is free takes it, one key per
        # entry (most do at a load below MAX_LOAD).
        home_free = np.flatnonzero(self._table.take(pos) < 0)
        won = np.zeros(keys.shape[0], bool)
        won[home_free] = self._claim(pos[home_free], slots[home_free])
        pending = np.flatnonzero(~won)
        pos = pos[pending]
        for r in range(2 * keys.shape[0] + size // WINDOW + 1):
            if pending.size == 0:
                break
            width = self._width(r)
            at, entry = self._window(pos, width)
            free = entry < 0
            has = free.any(axis=1)
            first = free.argmax(axis=1)
            rows = np.flatnonzero(has)
            target = at[rows, first[rows]]
            won = np.zeros(pending.shape[0], bool)
            won[rows] = self._claim(target, slots[pending[rows]])
            # every entry before a key's first free one is occupied: losers restart
            # there (now taken); keys that met no free entry go on past the window
            pos[rows] = target
            pos[~has] = (pos[~has] + width) & (size - 1)
            pending = pending[~won]
            pos = pos[~won]

    def remove(self, slots: np.ndarray, entries: np.ndarray | None = None) -> None:
        """Removes the keys held in ``slots`` (live, unique); their slots become free.
        ``entries``: where they sit in the index, from a :meth:`locate` since which
        nothing changed (saves probing for them again)."""
        if slots.size == 0:
            return
        where = self._probe(self.keys[slots], "found")[1] if entries is None else entries
        self._table[where] = TOMBSTONE
        self._tombstones += slots.size
        self.live[slots] = False
        self._free.append(np.array(slots, np.int64))
        self._num_free += slots.size
        self.size -= slots.size
        self.removals += slots.size

    def _rebuild(self, size: int) -> None:
        self.rebuilds += 1
        live = self.live_slots()
        self._table = np.full(max(size, _index_size(live.size)), EMPTY, np.int32)
        self._tombstones = 0
        self._place(self.keys[live], live)

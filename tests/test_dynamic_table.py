"""DynamicTable (one PS shard of a dynamic embedding table), in process.

Numerics are checked against a dense table holding the same ids' rows and
updated by the same update rule; admission/eviction against scripted traffic
whose counts are worked out by hand.
"""

from __future__ import annotations

import numpy as np
import pytest

from psflow.errors import FailedPreconditionError, InvalidArgumentError
from psflow.ps.dynamic_table import DynamicTable, TableConfig, _uniform_bits, initial_rows
from psflow.ps.key_index import (
    _PACKED_MAX,
    MAX_LOAD,
    KeyIndex,
    mix64,
    shard_of,
    sum_rows,
    unique_ids,
)
from psflow.ps.tables import TableRegistry
from psflow.update_rules import rule_from_config

DIM = 4
OPTIMIZERS = {
    "sgd": {"name": "sgd", "learning_rate": 0.1},
    "adagrad": {"name": "adagrad", "learning_rate": 0.1},
    "adam": {"name": "adam", "learning_rate": 0.01},
    "ftrl": {"name": "ftrl", "learning_rate": 0.1, "l1_regularization_strength": 0.001},
}


def _batches(seed: int, steps: int, vocab: np.ndarray):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        ids = rng.choice(vocab, size=12)  # duplicates on purpose
        yield ids, rng.standard_normal((12, DIM)).astype(np.float32)


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_lookups_and_pushes_equal_a_dense_table(opt):
    vocab = np.array([3, -1, 2**40 + 7, 17, 5, 99, -(2**62), 1234567], np.int64)
    config = TableConfig("t", DIM, seed=11, optimizer=OPTIMIZERS[opt])
    table = DynamicTable(config)
    # The dense reference: one row per vocabulary id, same initial values.
    dense = initial_rows("uniform", 11, vocab, DIM, 0.05, np.dtype("float32"))
    rule = rule_from_config(OPTIMIZERS[opt])
    slots = rule.init_slots(dense)
    row_of = {int(k): i for i, k in enumerate(vocab)}
    for step, (ids, grads) in enumerate(_batches(0, 30, vocab), start=1):
        idx = np.array([row_of[int(i)] for i in ids])
        np.testing.assert_array_equal(table.lookup(ids), dense[idx])
        rule.apply_sparse(dense, idx, grads, slots, step)
        assert table.apply_gradients(ids, grads) == step
    got = table.lookup(vocab)
    if opt == "sgd":
        assert got.tobytes() == dense.tobytes()
    else:
        np.testing.assert_allclose(got, dense, rtol=0, atol=1e-6)
    state = table.export_state()
    order = np.argsort(state["ids"])
    ref_order = np.argsort(vocab)
    for k in rule.slot_names:
        np.testing.assert_allclose(state[f"slot/{k}"][order], slots[k][ref_order], atol=1e-6)


def test_initial_rows_depend_on_seed_and_id_only():
    ids = np.array([5, 9, -3, 2**50], np.int64)
    a = initial_rows("normal", 3, ids, 8, 0.1, np.dtype("float32"))
    b = initial_rows("normal", 3, ids[::-1], 8, 0.1, np.dtype("float32"))[::-1]
    assert a.tobytes() == b.tobytes()
    assert not np.array_equal(a, initial_rows("normal", 4, ids, 8, 0.1, np.dtype("float32")))
    # Reasonable statistics over many ids.
    many = initial_rows("uniform", 0, np.arange(20000, dtype=np.int64), 8, 0.05, np.float32)
    assert abs(float(many.mean())) < 1e-3 and many.min() >= -0.05 and many.max() < 0.05
    normal = initial_rows("normal", 0, np.arange(20000, dtype=np.int64), 8, 1.0, np.float64)
    assert abs(normal.std() - 1.0) < 0.02 and len(np.unique(normal)) == normal.size


def test_rows_do_not_depend_on_arrival_order_or_sharding():
    ids = np.arange(-50, 50, dtype=np.int64) * 7919
    one = DynamicTable(TableConfig("t", DIM, seed=5))
    whole = one.lookup(ids)
    shards = [DynamicTable(TableConfig("t", DIM, seed=5)) for _ in range(3)]
    owner = shard_of(ids, 3)
    assert set(owner.tolist()) == {0, 1, 2}
    for s, table in enumerate(shards):
        mine = ids[owner == s][::-1]
        np.testing.assert_array_equal(table.lookup(mine), whole[owner == s][::-1])


def test_admission_and_eviction_counts_are_exact():
    table = DynamicTable(
        TableConfig(
            "t",
            2,
            initializer="zeros",
            min_count=3,
            ttl_steps=2,
            optimizer={"name": "sgd", "learning_rate": 1.0},
        )
    )
    ones = np.ones((1, 2), np.float32)
    a, b = np.array([1], np.int64), np.array([2], np.int64)
    # 1 seen twice: still a candidate, reads the default row, its gradient is dropped.
    table.lookup(np.array([1, 1, 2], np.int64))  # duplicates count once
    table.lookup(a)
    table.apply_gradients(a, ones)  # step 1
    st = table.stats()
    assert (st.rows, st.candidates, st.admitted, st.dropped_gradients) == (0, 2, 0, 1)
    np.testing.assert_array_equal(table.lookup(a), [[0.0, 0.0]])  # third sighting: admitted
    table.apply_gradients(a, ones)  # step 2: applied
    np.testing.assert_array_equal(table.lookup(a), [[-1.0, -1.0]])
    st = table.stats()
    assert (st.rows, st.candidates, st.admitted, st.created) == (1, 1, 1, 1)
    # Candidate 2 was last seen at step 0: evicted after step 3 (3 - 2 > 0).
    table.apply_gradients(b, ones)  # step 3, dropped
    st = table.stats()
    assert (st.candidates, st.evicted_candidates, st.dropped_gradients) == (0, 1, 2)
    # Row 1 was last touched at step 2; untouched during steps 3 and 4, gone after step 5.
    table.apply_gradients(b, ones)  # step 4
    assert table.stats().rows == 1
    table.apply_gradients(b, ones)  # step 5
    st = table.stats()
    assert (st.rows, st.evicted_rows, st.step) == (0, 1, 5)
    # Evicted means forgotten: counted from zero again.
    np.testing.assert_array_equal(table.lookup(a), [[0.0, 0.0]])
    assert table.stats().candidates == 1


@pytest.mark.parametrize(
    "ids, grads, match",
    [
        (np.array([1, 2], np.int32), np.ones((2, DIM), np.float32), "int64"),
        (np.array([[1, 2]], np.int64), np.ones((2, DIM), np.float32), "1-D"),
        (np.array([1, 2], np.int64), np.ones((2, DIM + 1), np.float32), "shape"),
        (np.array([1, 2], np.int64), np.ones((2, DIM), np.int32), "float"),
    ],
)
def test_bad_input_is_typed_and_changes_nothing(ids, grads, match):
    table = DynamicTable(TableConfig("t", DIM))
    table.lookup(np.array([1, 2], np.int64))
    before = table.export_state()
    with pytest.raises(InvalidArgumentError, match=match):
        table.apply_gradients(ids, grads)
    with pytest.raises(InvalidArgumentError):
        table.lookup(np.array([1.5]))
    after = table.export_state()
    assert before.keys() == after.keys()
    for k in before:
        assert before[k].tobytes() == after[k].tobytes(), k


def test_ids_of_another_shard_are_refused_naming_one_and_nothing_changes():
    registry = TableRegistry("ps:0")
    registry.create(TableConfig("t", DIM, optimizer=OPTIMIZERS["adagrad"]), 0, 2)
    ids = np.arange(1, 200, dtype=np.int64)
    mine, theirs = ids[shard_of(ids, 2) == 0], ids[shard_of(ids, 2) == 1]
    registry.lookup("t", mine)  # rows made: later lookups of them skip the ownership hash
    registry.push("t", mine, np.ones((mine.size, DIM), np.float32), ("c", 1))
    table = registry.table("t")
    before, stats = table.export_state(), table.stats()
    mixed = np.sort(np.concatenate([mine[:5], theirs[:1]]))
    grads = np.ones((mixed.size, DIM), np.float32)
    calls = [
        lambda: registry.lookup("t", mixed),
        lambda: registry.lookup("t", mixed, read_only=True),
        lambda: registry.push("t", mixed, grads, ("c", 2)),
        lambda: registry.push("t", mixed, grads),
    ]
    for call in calls:
        with pytest.raises(InvalidArgumentError, match=f"id {theirs[0]} .* not 0 of 2"):
            call()
    after = table.export_state()
    assert table.stats() == stats
    for k in before:
        assert before[k].tobytes() == after[k].tobytes(), k
    # the refused request id was not used up: the same push of owned ids applies once
    assert registry.push("t", mine[:5], grads[:5], ("c", 2)) == stats.step + 1
    assert registry.push("t", mine[:5], grads[:5], ("c", 2)) == stats.step + 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"dim": -3}, "dim"),
        ({"dim": 0}, "dim"),
        ({"dtype": "int32"}, "float"),
        ({"initializer": "glorot"}, "initializer"),
        ({"min_count": 0}, "min_count"),
        ({"optimizer": {"name": "lamb"}}, "lamb"),
    ],
)
def test_bad_config_is_typed(kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        TableConfig("t", **{"dim": 2, **kwargs})


def test_two_shards_restore_onto_three_with_every_row_and_slot():
    config = TableConfig("t", DIM, optimizer=OPTIMIZERS["adam"], min_count=2)
    ids = np.arange(0, 400, dtype=np.int64) * 104729
    old = [DynamicTable(config) for _ in range(2)]
    owner = shard_of(ids, 2)
    rng = np.random.default_rng(2)
    for _ in range(3):
        for s, table in enumerate(old):
            mine = ids[owner == s]
            table.lookup(mine)
            table.apply_gradients(mine, rng.standard_normal((mine.size, DIM)).astype(np.float32))
    for s, table in enumerate(old):  # some candidates too
        table.lookup(np.array([-1 - s * 1000], np.int64))
    parts = [t.export_state() for t in old]
    new = [
        DynamicTable.from_parts(config, parts, keep=lambda k, s=s: shard_of(k, 3) == s)
        for s in range(3)
    ]
    kept = [t.stats().rows for t in new]
    assert sum(kept) == ids.size
    assert all(t.config == old[0].config for t in new)  # shards agree: restorable again
    merged = {}
    for t in new:
        st = t.export_state()
        for i, k in enumerate(st["ids"].tolist()):
            merged[k] = (st["rows"][i], st["slot/momentum"][i], st["slot/velocity"][i])
        assert set(shard_of(st["ids"], 3).tolist()) <= {new.index(t)}
    for p in parts:
        for i, k in enumerate(p["ids"].tolist()):
            np.testing.assert_array_equal(merged[k][0], p["rows"][i])
            np.testing.assert_array_equal(merged[k][1], p["slot/momentum"][i])
            np.testing.assert_array_equal(merged[k][2], p["slot/velocity"][i])
    assert sum(t.stats().candidates for t in new) == 2
    assert max(t.stats().step for t in new) == 3


def _remove_some(index, ref, rng, most):
    """Remove up to ``most`` random keys of ``ref`` from ``index`` and from ``ref``."""
    if ref:
        victims = rng.choice(list(ref), size=min(most, len(ref)), replace=False)
        index.remove(np.array([ref.pop(int(v)) for v in victims], np.int64))


def _assert_finds_every_key(index, ref):
    """``index`` finds every key of ``ref`` at its slot and holds nothing else."""
    every = np.array(list(ref), np.int64)
    np.testing.assert_array_equal(index.find(every), [ref[k] for k in every.tolist()])
    assert index.size == len(ref)


def test_key_index_matches_a_dict_under_inserts_and_removals():
    rng = np.random.default_rng(0)
    index, ref = KeyIndex(4), {}
    for r in range(60):
        keys = np.unique(
            rng.integers(-(2**63), 2**63 - 1, size=rng.integers(0, 80), dtype=np.int64)
        )
        keys = np.concatenate([keys, np.array(list(ref)[:5], np.int64)])
        found = index.find(keys)
        new = np.unique(keys[found < 0])
        for k, slot in zip(new.tolist(), index.insert(new).tolist()):
            ref[k] = slot
        if r % 3 == 0:
            _remove_some(index, ref, rng, 15)
        _assert_finds_every_key(index, ref)


def test_key_index_inserts_at_probed_entries_only_while_they_hold():
    # find_free's entries let insert skip the probe; one taken since (another
    # insert), a rebuild since, or keys of one batch racing for the same entry
    # must still leave every key found at its slot, once.
    rng = np.random.default_rng(3)
    index, ref = KeyIndex(8), {}
    size = index._table.shape[0]
    for r in range(80):
        pool = rng.integers(-(2**63), 2**63 - 1, size=int(rng.integers(1, 120)), dtype=np.int64)
        if r % 4 == 1:  # keys sharing two home entries: they race for the same free ones
            pool = pool[np.isin(mix64(pool) & np.uint64(size - 1), [0, 1])]
        keys = np.unique(np.concatenate([pool, np.array(list(ref)[:7], np.int64)]))
        found, free = index.find_free(keys)
        np.testing.assert_array_equal(found, [ref.get(k, -1) for k in keys.tolist()])
        new = keys[found < 0]
        hint = (free[0][found < 0], free[1])
        if r % 5 == 2 and new.size > 1:  # another insert takes entries first
            first = index.insert(new[:1])
            ref[int(new[0])] = int(first[0])
            new, hint = new[1:], (hint[0][1:], hint[1])
        if r % 7 == 3:  # a rebuild makes the probed entries stale
            index.reserve(int(index._table.shape[0] * MAX_LOAD))
            size = index._table.shape[0]
        for k, slot in zip(new.tolist(), index.insert(new, hint).tolist()):
            ref[k] = slot
        if r % 3 == 0:
            _remove_some(index, ref, rng, 10)
        _assert_finds_every_key(index, ref)
        assert (index._table >= 0).sum() == index.size
    assert index.rebuilds > 0


@pytest.mark.parametrize("num_shards", [1, 2, 3, 4, 7, 8])
def test_shard_of_is_the_mixed_id_modulo_the_shards(num_shards):
    ids = np.random.default_rng(4).integers(-(2**63), 2**63 - 1, size=5000, dtype=np.int64)
    owner = shard_of(ids, num_shards)
    assert owner.dtype == np.int64
    np.testing.assert_array_equal(owner, mix64(mix64(ids)) % np.uint64(num_shards))


def test_memory_per_row_stays_within_row_and_slot_bytes_plus_32():
    n = 200_000
    table = DynamicTable(TableConfig("t", 8, optimizer=OPTIMIZERS["adagrad"], capacity=n))
    table.lookup(np.arange(n, dtype=np.int64) * 31)
    row_and_slot = 8 * 4 * 2
    assert table.stats().rows == n
    assert table.nbytes / n <= row_and_slot + 32


def test_hot_ids_are_the_busiest_first():
    table = DynamicTable(TableConfig("t", 2))
    for i in range(1, 6):
        table.lookup(np.arange(i, dtype=np.int64))  # id 0 seen 5 times, id 4 once
    ids, counts = table.hot_ids(3)
    assert ids.tolist() == [0, 1, 2] and counts.tolist() == [5, 4, 3]


def test_the_first_push_binds_the_optimizer_and_another_is_refused():
    table = DynamicTable(TableConfig("t", 2, initializer="zeros"))
    ids, grads = np.array([4], np.int64), np.ones((1, 2), np.float32)
    table.lookup(ids)
    with pytest.raises(FailedPreconditionError, match="no optimizer"):
        table.apply_gradients(ids, grads)
    assert table.stats().step == 0
    table.apply_gradients(ids, grads, {"name": "adagrad", "learning_rate": 0.5})
    with pytest.raises(FailedPreconditionError, match="sgd"):
        table.apply_gradients(ids, grads, {"name": "sgd"})
    table.apply_gradients(ids, grads)  # the bound rule
    assert table.stats().step == 2
    assert table.config.optimizer["name"] == "adagrad"
    assert TableConfig("t", 2, initializer="zeros").optimizer is None
    assert table.config.accepts(TableConfig("t", 2, initializer="zeros"))


@pytest.mark.parametrize("min_count", [1, 2])
def test_read_only_lookup_creates_nothing_and_reads_the_first_training_row(min_count):
    config = TableConfig(
        "t", DIM, seed=5, min_count=min_count, optimizer={"name": "sgd", "learning_rate": 1.0}
    )
    table = DynamicTable(config)
    known = np.array([3, 10**15], np.int64)
    for _ in range(min_count):
        table.lookup(known)
    table.apply_gradients(known, np.ones((2, DIM), np.float32))
    before = table.stats()
    unseen = np.array([-9, 3, 2**62, -9], np.int64)  # unknown, known, unknown, repeated
    got = table.lookup(unseen, read_only=True)
    assert table.stats() == before  # no row, candidate, counter or step changed
    np.testing.assert_array_equal(got[1], table.peek(known[:1])[0])
    np.testing.assert_array_equal(got[0], got[3])
    fresh = DynamicTable(config).lookup(unseen[[0, 2]])  # what training reads first
    np.testing.assert_array_equal(got[[0, 2]], fresh)
    if min_count > 1:
        np.testing.assert_array_equal(fresh, 0.0)  # candidates read the default row
    else:
        assert np.abs(fresh).max() > 0


class _PerPushEvictionReference:
    """Admission and ttl eviction as plain dicts, the eviction scan run after every push."""

    def __init__(self, dim: int, min_count: int, ttl: int) -> None:
        self.dim, self.min_count, self.ttl, self.step = dim, min_count, ttl, 0
        self.rows: dict[int, list] = {}  # id -> [row, last touch]
        self.cands: dict[int, list] = {}  # id -> [sightings, last touch]
        self.counters = dict.fromkeys(
            ("created", "admitted", "evicted_rows", "evicted_candidates", "dropped", "lookups"), 0
        )

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        self.counters["lookups"] += 1
        out = {}
        for i in sorted(set(ids.tolist())):
            if i not in self.rows:
                cand = self.cands.setdefault(i, [0, self.step])
                cand[0] += 1
                cand[1] = self.step
                if cand[0] < self.min_count:
                    out[i] = np.zeros(self.dim, np.float32)
                    continue
                del self.cands[i]
                self.counters["admitted"] += 1
                self.counters["created"] += 1
                self.rows[i] = [np.zeros(self.dim, np.float32), self.step]
            self.rows[i][1] = self.step
            out[i] = self.rows[i][0].copy()
        return np.stack([out[i] for i in ids.tolist()])

    def push(self, ids: np.ndarray, grads: np.ndarray) -> None:
        self.step += 1
        summed: dict[int, np.ndarray] = {}
        for i, g in zip(ids.tolist(), grads):
            summed[i] = summed.get(i, np.zeros(self.dim, np.float32)) + g
        for i, g in sorted(summed.items()):
            if i in self.rows:
                self.rows[i] = [self.rows[i][0] - g, self.step]
            else:
                self.counters["dropped"] += 1
        horizon = self.step - self.ttl
        for store, counter in ((self.rows, "evicted_rows"), (self.cands, "evicted_candidates")):
            for i in [i for i, (_, touched) in store.items() if touched < horizon]:
                del store[i]
                self.counters[counter] += 1


def test_amortised_eviction_scan_observes_exactly_what_a_per_push_scan_gives():
    ttl, pushes = 24, 0
    table = DynamicTable(
        TableConfig(
            "t",
            2,
            initializer="zeros",
            min_count=2,
            ttl_steps=ttl,
            optimizer={"name": "sgd", "learning_rate": 1.0},
        )
    )
    ref = _PerPushEvictionReference(2, min_count=2, ttl=ttl)
    rng = np.random.default_rng(7)
    for op in range(400):
        # ids drift through a small space, so rows go stale, are evicted and come back
        low = (op // 40) * 6
        ids = rng.integers(low, low + 20, size=rng.integers(1, 8)).astype(np.int64)
        ids[0] = ids[0] if rng.random() < 0.7 else rng.integers(1000, 10**6)  # a one-off id
        if rng.random() < 0.5:
            np.testing.assert_array_equal(table.lookup(ids), ref.lookup(ids))
        else:
            grads = rng.integers(-3, 4, size=(ids.size, 2)).astype(np.float32)
            table.apply_gradients(ids, grads)
            ref.push(ids, grads)
            pushes += 1
        if op % 50 == 49:  # scripted observation points
            st = table.stats()
            c = ref.counters
            assert (st.rows, st.candidates, st.step) == (len(ref.rows), len(ref.cands), ref.step)
            assert (st.created, st.admitted, st.lookups) == (
                c["created"],
                c["admitted"],
                c["lookups"],
            )
            assert (st.evicted_rows, st.evicted_candidates, st.dropped_gradients) == (
                c["evicted_rows"],
                c["evicted_candidates"],
                c["dropped"],
            )
    assert ref.counters["evicted_rows"] > 10 and ref.counters["evicted_candidates"] > 10
    every = np.arange(0, 80, dtype=np.int64)
    expected = np.stack([ref.rows[i][0] if i in ref.rows else np.zeros(2) for i in every.tolist()])
    np.testing.assert_array_equal(table.peek(every), expected)
    # the scan ran about once per ttl // 8 pushes (plus once per stats call), not per push
    assert table.eviction_scans <= pushes // (ttl // 8) + 10


@pytest.mark.parametrize(
    "dtype, width",
    [("float32", DIM), ("float32", 8), ("float32", 5), ("float64", 3), ("float16", 4)],
)
@pytest.mark.parametrize("contiguous", [True, False])
def test_sum_rows_equals_add_at_bit_for_bit(dtype, width, contiguous):
    rng = np.random.default_rng(3)
    ids = rng.zipf(1.3, size=5000)
    _, inverse = np.unique(ids, return_inverse=True)
    # magnitudes far apart: any other summation order would round differently
    values = rng.standard_normal((5000, width)).astype(dtype)
    values *= (10.0 ** rng.integers(-4, 5, size=(5000, 1))).astype(dtype)
    # signed zeros (a sum starts at +0.0), infinities and NaNs ride along
    values[::97] = -0.0
    values[5::389, 0] = np.inf
    values[7::401, -1] = np.nan
    if not contiguous:  # a column-major copy: paired columns need a C-contiguous copy
        values = np.asfortranarray(values)
    expected = np.zeros((inverse.max() + 1, width), dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        np.add.at(expected, inverse, values)
        got = sum_rows(values, inverse, inverse.max() + 1)
    assert got.dtype == expected.dtype and got.tobytes() == expected.tobytes()


@pytest.mark.parametrize("rows", [0, 1, 3000, 9000])
@pytest.mark.parametrize("dim", [1, 3, 8, 33])
def test_uniform_initial_rows_equal_the_float_formula_bit_for_bit(rows, dim):
    """The uniform rows are ``(2u - 1) * scale`` of the hashed ``u``, computed as
    integers then one product: bit for bit the float formula's rounding (sizes
    within and past the held column offsets)."""
    ids = np.random.default_rng(rows + dim).integers(-(2**63), 2**63 - 1, rows, np.int64)
    for scale in (0.05, 1.0, -0.5, 3e-300, 1e300):
        for dtype in (np.dtype("float32"), np.dtype("float64")):
            u = _uniform_bits(7, ids, dim, 0)
            u *= 2.0
            u -= 1.0
            u *= scale
            with np.errstate(over="ignore"):
                expected = u.astype(dtype)
                got = initial_rows("uniform", 7, ids, dim, scale, dtype)
            assert got.shape == (rows, dim) and got.tobytes() == expected.tobytes()


def _id_cases() -> list[np.ndarray]:
    rng = np.random.default_rng(11)
    hashed = rng.integers(-(2**63), 2**63 - 1, size=600, dtype=np.int64)
    twins = np.concatenate([hashed, hashed ^ 1, hashed[:50]])  # equal high bits, distinct ids
    rng.shuffle(twins)
    extremes = np.array([2**63 - 1, -(2**63), 0, -(2**63), 2**63 - 1], np.int64)
    return [
        rng.choice(hashed, size=13_312),  # a CTR batch: hashed ids, repeats
        rng.integers(0, 50, size=1000),  # small ids: the exact (shifted) keys
        rng.integers(-(2**40), 2**40, size=_PACKED_MAX),  # as many as the positions allow
        rng.integers(0, 1000, size=_PACKED_MAX + 1),  # past them: np.unique itself
        twins,  # high bits shared: the sort's order is checked and np.unique taken
        extremes,
        np.array([7, 7, 7], np.int64),
        np.array([5, 3], np.int64),
    ]


@pytest.mark.parametrize("case", range(len(_id_cases())))
def test_unique_ids_equals_numpy_unique(case):
    ids = _id_cases()[case].astype(np.int64)
    unique, inverse = unique_ids(ids)
    expected, expected_inverse = np.unique(ids, return_inverse=True)
    np.testing.assert_array_equal(unique, expected)
    np.testing.assert_array_equal(inverse, expected_inverse.reshape(-1))
    assert inverse.dtype == np.intp


def test_key_index_finds_every_key_near_full_load_with_long_clusters():
    # Keys chosen to share few home entries: long clusters that take several
    # widening probe windows, and batch inserts whose keys race for the same
    # free entries (one takes it, the others probe on).
    index = KeyIndex(64)
    size = index._table.shape[0]
    homes = np.flatnonzero(np.arange(size) < 4)  # four home entries for every key
    rng = np.random.default_rng(5)
    pool = rng.integers(-(2**63), 2**63 - 1, size=200_000, dtype=np.int64)
    crowded = pool[np.isin(mix64(pool) & np.uint64(size - 1), homes)]
    keys = np.unique(crowded)[: int(size * 0.45)]
    slots = index.insert(keys)
    assert index._table.shape[0] == size  # no rebuild: the clusters stay long
    np.testing.assert_array_equal(index.find(keys), slots)
    absent = np.setdiff1d(crowded, keys)[:50]
    np.testing.assert_array_equal(index.find(absent), -1)
    index.remove(slots[::3])  # tombstones inside the clusters
    kept = np.ones(keys.size, bool)
    kept[::3] = False
    np.testing.assert_array_equal(index.find(keys[kept]), slots[kept])
    np.testing.assert_array_equal(index.find(keys[~kept]), -1)
    again = index.insert(keys[~kept])  # tombstones reused, no duplicate entries
    np.testing.assert_array_equal(index.find(keys[~kept]), again)
    assert index._table.shape[0] == size  # the tombstones were reused, not rebuilt away
    assert (index._table >= 0).sum() == keys.size


def test_a_push_after_its_ids_were_evicted_and_their_slots_reused_is_dropped():
    # The push's ids were looked up (their slots remembered), then evicted, and a
    # new id took a freed slot: the push must not land on the new id's row.
    sgd = {"name": "sgd", "learning_rate": 1.0}
    table = DynamicTable(TableConfig("t", DIM, optimizer=sgd, ttl_steps=1))
    ids = np.array([1, 2], np.int64)
    table.lookup(ids)
    for _ in range(3):  # pushes of an unknown id advance the clock past the TTL
        table.apply_gradients(np.array([9], np.int64), np.ones((1, DIM), np.float32))
    assert table.stats().evicted_rows == 2
    newcomer = np.array([3], np.int64)
    first = table.lookup(newcomer)  # takes a freed slot
    dropped = table.stats().dropped_gradients
    table.apply_gradients(ids, np.ones((2, DIM), np.float32))
    assert table.stats().dropped_gradients == dropped + 2
    np.testing.assert_array_equal(table.peek(newcomer), first)


def test_a_table_grown_from_one_row_equals_a_presized_one():
    # Growth copies every array (rows, optimizer slots, clocks, traffic, index):
    # a table that starts with one row and grows many times must hold, bit for
    # bit, what a table allocated for all its rows up front holds.
    rng = np.random.default_rng(4)
    config = TableConfig("t", DIM, seed=2, optimizer=OPTIMIZERS["adagrad"], capacity=1)
    grown = DynamicTable(config)
    presized = DynamicTable(config, capacity=4096)
    for _ in range(40):
        ids = (rng.zipf(1.3, size=64).astype(np.int64) * 7919) % (2**50)
        grads = rng.standard_normal((64, DIM)).astype(np.float32)
        assert grown.lookup(ids).tobytes() == presized.lookup(ids).tobytes()
        assert grown.apply_gradients(ids, grads) == presized.apply_gradients(ids, grads)
    a, b = grown.export_state(), presized.export_state()
    assert a.keys() == b.keys()
    order_a, order_b = np.argsort(a["ids"]), np.argsort(b["ids"])
    for k in a:
        if a[k].ndim and a[k].shape[0] == a["ids"].shape[0]:
            assert a[k][order_a].tobytes() == b[k][order_b].tobytes(), k
        else:
            assert a[k].tobytes() == b[k].tobytes(), k
    assert grown.stats().rows == presized.stats().rows > 500
    assert grown.nbytes < presized.nbytes  # it grew from one row, not to 4096

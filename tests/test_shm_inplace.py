"""Updates applied in place in a live mirror's segment (no copy after the apply).

While a reader on the host follows a variable, the PS keeps the value in the
mirror's segment and applies each change there under the seqlock.  Checked
against a store without mirrors (the same bits, every rule), against a reader
in another process (never a torn value), through dormancy, restore and close
(a retired segment is never written) and on bad input (nothing changes).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from psflow import errors
from psflow.ps.checkpoint import restore_shard, save_shard
from psflow.ps.push_types import Gradient
from psflow.ps.store import VariableMeta, VariableStore
from psflow.ps.tensors import Segments
from psflow.transport import shm
from psflow.update_rules import SGD, registered_rules

from .conftest import child_env

pytestmark = pytest.mark.skipif(not shm.enabled(), reason="no usable /dev/shm on this machine")

RULES = [
    {"name": "sgd", "learning_rate": 0.1},
    {"name": "sgd", "learning_rate": 0.1, "momentum": 0.9},
    {"name": "sgd", "learning_rate": 0.1, "momentum": 0.9, "nesterov": True},
    {"name": "adam", "learning_rate": 0.01},
    {"name": "adam", "learning_rate": 0.01, "amsgrad": True},
    {"name": "adagrad", "learning_rate": 0.1},
    {"name": "rmsprop", "learning_rate": 0.01},
    {"name": "rmsprop", "learning_rate": 0.01, "momentum": 0.5, "centered": True},
    {
        "name": "ftrl",
        "learning_rate": 0.1,
        "l1_regularization_strength": 0.01,
        "l2_regularization_strength": 0.01,
        "l2_shrinkage_regularization_strength": 0.01,
    },
]
SHAPE = (37, 5)


def test_every_rule_is_covered():
    assert {c["name"] for c in RULES} == set(registered_rules())


def _store(dtype, config, mirrored: bool) -> VariableStore:
    store = VariableStore(mirrors=shm.MirrorSet(idle=60.0) if mirrored else None)
    init = np.random.default_rng(1).standard_normal(SHAPE).astype(dtype)
    store.create([VariableMeta("w", np.dtype(dtype), SHAPE)], [init], [config])
    return store


def _sgd_store(size: int, dtype: str = "float32", idle: float = 60.0) -> VariableStore:
    """A store with mirrors holding zeros ``w`` of ``size`` elements, SGD at rate 1."""
    store = VariableStore(mirrors=shm.MirrorSet(idle=idle))
    meta = VariableMeta("w", np.dtype(dtype), (size,))
    store.create([meta], [np.zeros(size, dtype)], [{"name": "sgd", "learning_rate": 1.0}])
    return store


def _follow(store: VariableStore, wake: bool = True) -> shm.MirrorReader:
    """A reader of ``w``'s mirror that asked for it (its first read) and, with ``wake``,
    woke it (the reader's fallback pull over gRPC); else the next update will."""
    (info,) = [i for i in store.list_variables() if i.meta.name == "w"]
    reader = shm.MirrorReader(info.shm_name, info.meta.dtype, info.meta.shape)
    with pytest.raises(shm.MirrorDormantError):
        reader.read()
    if wake:
        store.pull(["w"])
    return reader


def _pushes(dtype, steps: int):
    """Each step's push: dense, segmented, rows, a sync step, an assign_add; new values each."""
    rng = np.random.default_rng(2)
    for k in range(steps):
        grad = rng.standard_normal(SHAPE).astype(dtype)
        kind = k % 5
        if kind == 0:
            yield "push", Gradient("w", grad), {}
        elif kind == 1:
            flat = grad.reshape(-1)
            parts = [(0, flat[:50]), (50, flat[50:51]), (51, flat[51:])]
            yield "push", Gradient("w", Segments(np.dtype(dtype), SHAPE, parts)), {}
        elif kind == 2:
            rows = np.array([3, 0, 3, 36])  # a repeated row: summed first
            yield "push", Gradient("w", grad[:4], indices=rows), {}
        elif kind == 3:
            yield "push", Gradient("w", grad), {"step": k, "num_required": 1}
        else:
            yield "assign", grad, {}


def _state(store: VariableStore) -> tuple:
    with store.exporting() as (var,):
        slots = {k: s.tobytes() for k, s in var.slots.items()}
        return var.value.tobytes(), slots, var.version, var.optimizer_step


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("config", RULES, ids=lambda c: "-".join(map(str, c.values())))
def test_updates_in_place_give_the_bits_of_a_store_without_mirrors(dtype, config):
    mirrored, plain = _store(dtype, config, True), _store(dtype, config, False)
    # asked, not woken: the first update copies the value in (the segment is behind),
    # the others go in place
    reader = _follow(mirrored, wake=False)
    try:
        for k, (kind, item, extra) in enumerate(_pushes(dtype, 15)):
            for store in (mirrored, plain):
                if kind == "push":
                    store.push([item], push_id=("c", k), **extra)
                else:
                    store.assign("assign_add", ["w"], [item])
            with mirrored.exporting() as (var,):
                assert var.mirror.backs(var.value) == (k > 0), "not applied in place"
            assert _state(mirrored) == _state(plain), (k, kind)
            got, version = reader.read()
            assert got.tobytes() == _state(plain)[0] and version == k + 1
            if k % 4 == 3:  # a pull over gRPC moves the value out; the next update back in
                np.testing.assert_array_equal(mirrored.pull(["w"])[0].value, got)
        assert mirrored.list_variables()[0].version == 15
        assert shm.peek(reader.segment.name).copies == 15  # each update
    finally:
        reader.close()
        mirrored.close()


def test_a_snapshot_taken_for_a_pull_stays_while_the_next_update_goes_in_place():
    store = _store(np.float32, {"name": "sgd", "learning_rate": 1.0}, True)
    reader = _follow(store)
    try:
        store.push([Gradient("w", np.ones(SHAPE, "float32"))], push_id=("c", 1))
        with store.reading(["w"]) as (snap,):  # a pull over gRPC, its bytes still to send
            held = snap.value.tobytes()
            store.push([Gradient("w", np.ones(SHAPE, "float32"))], push_id=("c", 2))
            assert snap.value.tobytes() == held and snap.version == 1
            with store.exporting() as (var,):
                assert var.mirror.backs(var.value)  # moved back in, without a copy
        assert reader.read()[1] == 2
    finally:
        reader.close()
        store.close()


_READER = textwrap.dedent(
    """
    import sys, time
    from psflow.transport import shm
    reader = shm.MirrorReader(sys.argv[1], "float32", (int(sys.argv[2]),))
    reader.ask()
    print("asked", flush=True)
    served, versions, last, deadline = 0, set(), -1, time.monotonic() + 60
    while last < int(sys.argv[3]) and time.monotonic() < deadline:
        try:
            got, version = reader.read()
        except shm.MirrorDormantError:
            continue  # before the PS woke it
        served += 1
        if not (got.min() == got.max() == version):
            print(f"torn: version {version}, values {got.min()}..{got.max()}", flush=True)
            sys.exit(1)
        if version < last:
            print(f"back in time: {version} after {last}", flush=True)
            sys.exit(1)
        last = version
        versions.add(version)
    print(f"served {served} versions {len(versions)} last {last}", flush=True)
    """
)


def test_a_reader_in_another_process_never_sees_a_torn_value_while_updates_go_in_place():
    size, updates = 1 << 18, 1500  # 1 MB: an update takes long enough to overlap reads
    store = _sgd_store(size, idle=30.0)
    (info,) = store.list_variables()
    proc = subprocess.Popen(
        [sys.executable, "-c", _READER, info.shm_name, str(size), str(updates)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=child_env(),
    )
    try:
        assert proc.stdout.readline().strip() == "asked"
        store.pull(["w"])  # wakes the mirror the reader asked for
        minus_one = np.full(size, -1.0, "float32")
        ones = np.ones(size, "float32")
        for k in range(updates):  # each update adds 1: version k holds k everywhere
            if k % 2:
                store.push([Gradient("w", minus_one)], push_id=("c", k))
            else:
                store.assign("assign_add", ["w"], [ones])
            time.sleep(0.0005)  # a PS applies pushes as they come, not back to back
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
        store.close()
    assert proc.returncode == 0, out
    served, seen = (int(x) for x in out.split()[1:4:2])
    assert served >= 100 and seen >= 20, out  # the reads overlapped many updates


def _mirror_bytes(reader: shm.MirrorReader) -> bytes:
    """Everything in the reader's mapping of the segment, header included."""
    return bytes(reader.segment.view())


def test_a_dormant_mirror_keeps_the_value_in_place_and_a_wake_copies_only_what_it_lacks():
    store = _sgd_store(8, "float64", idle=0.3)
    reader = _follow(store)
    try:
        for k in range(1, 4):
            store.push([Gradient("w", -np.ones(8))], push_id=("c", k))
            assert reader.read()[1] == k
        time.sleep(0.5)  # nobody read for longer than the idle time
        store.push([Gradient("w", -np.ones(8))], push_id=("c", 4))
        with store.exporting() as (var,):
            assert var.mirror.backs(var.value)  # it stays in the segment, written in place
        assert shm.peek(reader.segment.name) == shm.MirrorState(False, 4, 3)
        with pytest.raises(shm.MirrorDormantError):  # never version 3's stale value
            reader.read()
        assert store.pull(["w"])[0].value.tolist() == [4.0] * 8  # the pull wakes it
        got, version = reader.read()
        assert version == 4 and got.tolist() == [4.0] * 8
        assert shm.peek(reader.segment.name) == shm.MirrorState(True, 5, 4)

        time.sleep(0.5)  # dormant again; a pull moves the value out, an update stays out
        store.pull(["w"])
        store.push([Gradient("w", -np.ones(8))], push_id=("c", 5))
        with store.exporting() as (var,):
            assert not var.mirror.backs(var.value)
        with pytest.raises(shm.MirrorDormantError):
            reader.read()
        store.pull(["w"])  # the segment is behind: this wake copies version 5 in
        got, version = reader.read()
        assert version == 5 and got.tolist() == [5.0] * 8
        assert shm.peek(reader.segment.name) == shm.MirrorState(True, 6, 5)
    finally:
        reader.close()
        store.close()


def test_a_retired_segment_is_never_written_after_a_restore_or_a_close(tmp_path):
    store = _sgd_store(16)
    first = _follow(store)
    try:
        store.push([Gradient("w", -np.ones(16, "float32"))], push_id=("c", 1))
        save_shard(store, str(tmp_path), "ps-0")
        store.push([Gradient("w", -np.ones(16, "float32"))], push_id=("c", 2))
        with store.exporting() as (old,):
            assert old.mirror.backs(old.value)

        restore_shard(store, str(tmp_path), "ps-0")  # while the mirror is live
        retired = _mirror_bytes(first)
        assert old.mirror is None and old.value.tolist() == [2.0] * 16
        with old.lock:  # the replaced variable's value moved out of the segment first
            old.assign("assign_add", np.ones(16, "float32"))
        assert _mirror_bytes(first) == retired
        with pytest.raises(shm.MirrorRetiredError):
            first.read()
        assert store.pull(["w"])[0].value.tolist() == [1.0] * 16  # the saved value
        second = _follow(store)
        store.push([Gradient("w", -np.ones(16, "float32"))], push_id=("c", 3))
        assert second.read()[0].tolist() == [2.0] * 16
        assert _mirror_bytes(first) == retired

        store.close()  # removes the mirrors; the variables stay usable
        closed = _mirror_bytes(second)
        store.push([Gradient("w", -np.ones(16, "float32"))], push_id=("c", 4))
        assert store.pull(["w"])[0].value.tolist() == [3.0] * 16
        assert _mirror_bytes(second) == closed and _mirror_bytes(first) == retired
        with pytest.raises(shm.MirrorRetiredError):
            second.read()
    finally:
        first.close()
        store.close()


@pytest.mark.parametrize(
    "bad, match",
    [
        (Gradient("w", np.ones(7, "float32")), "shape"),
        (Gradient("w", np.ones(8, "float64")), "dtype"),
        (Gradient("w", np.ones((1,), "float32"), indices=np.array([9])), "out of range"),
    ],
)
def test_a_refused_push_changes_neither_the_value_nor_the_mirror(bad, match):
    store = VariableStore(mirrors=shm.MirrorSet(idle=60.0))
    metas = [VariableMeta(n, np.dtype("float32"), (8,)) for n in ("v", "w")]
    store.create(metas, [np.zeros(8, "float32")] * 2)
    store.configure_optimizer(["v", "w"], {"name": "adam"})
    reader = _follow(store)
    try:
        store.push([Gradient("w", np.ones(8, "float32"))], push_id=("c", 1))
        before, mirrored = _state_of(store), _mirror_bytes(reader)
        with pytest.raises(errors.InvalidArgumentError, match=match):
            store.push([Gradient("v", np.ones(8, "float32")), bad], push_id=("c", 2))
        assert _state_of(store) == before and _mirror_bytes(reader) == mirrored
    finally:
        reader.close()
        store.close()


def _state_of(store: VariableStore) -> list:
    with store.exporting() as variables:
        return [
            (v.value.tobytes(), {k: s.tobytes() for k, s in v.slots.items()}, v.version)
            for v in variables
        ]


@dataclasses.dataclass(frozen=True)
class _FailingHalfWay(SGD):
    """SGD that writes half the variable, then fails (an error inside the arithmetic)."""

    def _update(self, var, grad, slots, step):
        var[: var.size // 2] = 99.0
        raise FloatingPointError("overflow")


def test_an_update_failing_half_way_leaves_the_mirror_dormant_not_torn():
    store = _sgd_store(8)
    reader = _follow(store)
    try:
        store.push([Gradient("w", -np.ones(8, "float32"))], push_id=("c", 1))
        with store.exporting() as (var,):
            var.rule = _FailingHalfWay()
        with pytest.raises(FloatingPointError):
            store.push([Gradient("w", -np.ones(8, "float32"))], push_id=("c", 2))
        state = shm.peek(reader.segment.name)
        assert not state.live and state.version == 1  # the half-written bytes are not served
        with pytest.raises(shm.MirrorDormantError):  # at once: the seqlock is even again
            reader.read()
        (pulled,) = store.pull(["w"])  # what the variable holds now, exactly, and a wake
        assert pulled.version == 1 and pulled.value.tolist() == [99.0] * 4 + [1.0] * 4
        got, version = reader.read()
        assert version == 1 and got.tobytes() == pulled.value.tobytes()
    finally:
        reader.close()
        store.close()

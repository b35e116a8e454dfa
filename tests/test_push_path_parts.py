"""The pieces of a push's path on the PS that were made cheaper keep their contracts.

Each is compared with a reference (the straightforward construction it replaced)
or checked for the behaviour callers rely on: the reply's bytes, the frame
kind's type, the order of the touch log, the locks released, the counters kept,
and a push segment's name still checked when the cache does not know it.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from psflow import errors
from psflow.proto import ps_pb2
from psflow.ps.dedup import TouchLog
from psflow.ps.push_types import Gradient, PushContext, PushReply
from psflow.ps.store import VariableMeta, VariableStore
from psflow.transport import messages, shm
from psflow.transport.dataplane import frames

REPLIES = [
    PushReply((1, 2, 3), True, False, (-1, 0, 7)),
    PushReply((5,), True, True, (2,)),
    PushReply((), False),
    PushReply((1 << 40, 0), True, False, ()),
]


@pytest.mark.parametrize("reply", REPLIES)
def test_push_reply_bytes_equal_the_keyword_built_message(reply: PushReply) -> None:
    reference = ps_pb2.PushResponse(
        versions=reply.versions,
        applied=reply.applied,
        duplicate=reply.duplicate,
        staleness=reply.staleness,
    ).SerializeToString()
    raw = messages.push_reply_bytes(reply)
    assert raw == reference
    assert messages.push_reply(ps_pb2.PushResponse.FromString(raw)) == reply


@pytest.mark.parametrize("kind", list(frames.Kind))
def test_an_unpacked_frame_head_carries_the_kind_member(kind: frames.Kind) -> None:
    head = frames.unpack(frames.pack(kind, 7, 9, 3, 5, 11), max_header=16, max_payload=16)
    assert head.kind is kind
    assert (head.method, head.call_id, head.header_len, head.timeout_ms, head.payload_len) == (
        7,
        9,
        3,
        5,
        11,
    )


def test_an_unknown_frame_kind_is_refused_with_its_value() -> None:
    raw = bytearray(frames.pack(frames.Kind.REQUEST))
    raw[5] = 42
    with pytest.raises(frames.FrameError, match="kind 42"):
        frames.unpack(bytes(raw), max_header=16, max_payload=16)


def test_a_push_id_recorded_again_merges_its_names_and_becomes_the_newest() -> None:
    log = TouchLog(capacity=2)
    log.record(("c", 1), ["a"])
    log.record(("c", 2), ["b"])
    log.record(("c", 1), ["x"])  # now the newest: ("c", 2) is the oldest
    log.record(("c", 3), ["d"])
    assert log.export(["a", "b", "d", "x"]) == [("c", 1, ("a", "x")), ("c", 3, ("d",))]


def _store(names: list[str]) -> VariableStore:
    store = VariableStore(task="ps:0")
    metas = [VariableMeta(n, np.dtype("float32"), (4,), True) for n in names]
    values = [np.zeros(4, np.float32) for _ in names]
    store.create(metas, values, [{"name": "sgd", "learning_rate": 0.5}] * len(names))
    return store


def test_a_push_takes_its_variables_locks_and_releases_them() -> None:
    store = _store(["b", "a"])
    variables = [store._vars["b"], store._vars["a"]]
    with store._locked(variables):
        assert all(v.lock.locked() for v in variables)
    assert not any(v.lock.locked() for v in variables)
    with pytest.raises(RuntimeError), store._locked(variables):
        raise RuntimeError("inside")
    assert not any(v.lock.locked() for v in variables)


class _Recorded:
    """A lock that notes its name in ``order`` when taken."""

    def __init__(self, name: str, order: list[str]) -> None:
        self.name, self.order, self.lock = name, order, threading.Lock()

    def acquire(self) -> bool:
        self.order.append(self.name)
        return self.lock.acquire(timeout=10)

    def release(self) -> None:
        self.lock.release()

    def locked(self) -> bool:
        return self.lock.locked()


def test_a_pushs_locks_are_taken_in_name_order_whatever_the_gradients_order() -> None:
    store = _store(["c", "a", "b"])
    order: list[str] = []
    for name, var in store._vars.items():
        var.lock = _Recorded(name, order)
    variables = [store._vars[n] for n in ("c", "a", "b", "a")]
    with store._locked(variables):
        assert order == ["a", "b", "c"]  # each once, by name: no two pushes wait on each other
    assert not any(v.lock.locked() for v in variables)


def test_applied_pushes_are_counted_per_variable() -> None:
    store = _store(["a", "b"])
    grad = np.ones(4, np.float32)
    for seq in range(3):
        names = ["a", "b"] if seq < 2 else ["a"]
        store.push([Gradient(n, grad) for n in names], PushContext(("w", seq)))
    store.push([Gradient("a", grad)], PushContext(("w", 0)))  # a duplicate: not counted
    assert store.stats.applied_counts() == {"a": 3, "b": 2}
    np.testing.assert_array_equal(store._vars["a"].value, np.full(4, -1.5, np.float32))


@pytest.mark.skipif(not shm.enabled(), reason="no usable /dev/shm on this machine")
def test_a_cached_push_segment_is_read_again_and_unknown_names_are_still_checked() -> None:
    buffer = shm.PayloadBuffer()
    cache = shm.SegmentCache()
    try:
        name = buffer.write([np.arange(4, dtype=np.float32)])
        first = cache.view(name, 16)
        assert np.frombuffer(first, np.float32).tolist() == [0, 1, 2, 3]
        buffer.write([np.arange(4, 8, dtype=np.float32)])  # the same segment, new bytes
        assert np.frombuffer(cache.view(name, 16), np.float32).tolist() == [4, 5, 6, 7]
        with pytest.raises(errors.InvalidArgumentError, match="payload bytes"):
            cache.view(name, 1 << 30)  # more than the segment holds
        for bad in ("../etc/passwd", "../" + name, name + "/x"):
            with pytest.raises(errors.InvalidArgumentError, match="shared-memory segment name"):
                cache.view(bad, 16)
        with pytest.raises(errors.InvalidArgumentError, match="no token"):
            cache.view(name.rsplit("-", 1)[0] + "-short", 16)
        del first
    finally:
        buffer.close()


@pytest.mark.skipif(not shm.enabled(), reason="no usable /dev/shm on this machine")
def test_a_mirror_updated_in_place_shows_each_version_to_its_reader() -> None:
    value = np.zeros(8, np.float32)
    mirror = shm.Mirror(f"{shm.new_prefix()}-inplace", value, idle=60.0)
    reader = shm.MirrorReader(mirror.name, value.dtype, value.shape)
    try:
        with pytest.raises(shm.MirrorDormantError):
            reader.read()  # asks: the next change goes live
        assert mirror.publish(value, 1)
        target = mirror.begin_update(value, 1)
        assert target is mirror.array
        target += 2.0
        assert mirror.end_update(2)
        got, version = reader.read()
        assert version == 2 and got.tolist() == [2.0] * 8
        assert mirror.live and mirror.copies == 2
        assert shm.peek(mirror.name) == shm.MirrorState(True, 2, 2)
    finally:
        reader.close()
        mirror.close()

"""The cross-process ring's data path: frame-by-frame pipelining and reused result buffers.

Real :class:`PeerLinks` over 127.0.0.1 (token auth), one thread per worker, with
frames made small (64 KiB) so that every step's chunk travels in several frames
(a ragged last one included) and a step forwards frames while the previous one
still arrives, on arrays of a few MB.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import psflow as pf
from psflow.collective import cross_host, peer_link
from psflow.collective.cross_host import CrossHostRing
from psflow.collective.peer_link import PeerLinks
from psflow.transport.dataplane import frames
from tests.multi_worker_util import ring_links

pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")

EPS32 = float(np.finfo(np.float32).eps)


@pytest.fixture(autouse=True)
def small_frames(monkeypatch):
    monkeypatch.setattr(cross_host, "_FRAME_BYTES", 64 << 10)
    # the TCP ring's data path: its all-reduces stay off the same-host shared memory
    # (tests/test_shm_ring.py covers that)
    monkeypatch.setenv("PSFLOW_SHM", "0")


def _rings(n: int, timeout: float = 10.0) -> list[CrossHostRing]:
    return [CrossHostRing(lk, timeout=timeout) for lk in ring_links(n, timeout)]


def _on_all(rings: list[CrossHostRing], call: Callable[[int, CrossHostRing], Any]) -> list:
    """``call(i, rings[i])`` on one thread per worker; the results (or errors) in order."""
    out: list = [None] * len(rings)

    def run(i: int) -> None:
        try:
            out[i] = call(i, rings[i])
        except pf.errors.OpError as e:
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(rings))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    return out


def _assert_sum(got: np.ndarray, xs: list[np.ndarray], divisor: int = 1) -> None:
    """Within the float32 ring's rounding: N-1 additions (and a division) per element,
    each off by at most half an ulp of a partial sum, so by eps32 * sum|x| at most."""
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0) / divisor
    bound = EPS32 * (len(xs) + 1) * np.sum([np.abs(x.astype(np.float64)) for x in xs], axis=0)
    assert got.dtype == np.float32
    assert np.all(np.abs(got.astype(np.float64) - exact) <= bound / divisor + 1e-30)


@pytest.mark.parametrize("segment", [256 << 10, 12 << 10])
@pytest.mark.parametrize("pack", [0, 200_000])
def test_three_workers_sum_multi_frame_chunks_to_the_same_bits(pack, segment, monkeypatch):
    # 0.64 MB per worker: chunks of 3.25 frames, so every step is several frames and a
    # ragged one; packs of 200 kB make 4 rings, each running while the previous pack's
    # last frames leave.  Frames of up to a segment are summed once they are whole, larger
    # ones a segment at a time as they arrive (12 kB: 5.33 segments a frame, one ragged);
    # with small segments every frame's head is also read alone (as a large frame's is)
    monkeypatch.setattr(cross_host, "_SEGMENT_BYTES", segment)
    if segment < cross_host._FRAME_BYTES:
        monkeypatch.setattr(peer_link, "_ALONE_BYTES", 0)
    frame_items = cross_host._FRAME_BYTES // 4
    size = 9 * frame_items + 12_345
    rng = np.random.default_rng(21)
    xs = [rng.standard_normal(size).astype(np.float32) for _ in range(3)]
    kept = [x.copy() for x in xs]
    rings = _rings(3)
    try:
        got = _on_all(rings, lambda i, r: r.all_reduce([xs[i]], bytes_per_pack=pack)[0])
        mean = _on_all(rings, lambda i, r: r.all_reduce([xs[i]], divisor=3)[0])
    finally:
        for r in rings:
            r.close()
    assert not any(isinstance(g, Exception) for g in got + mean), got + mean
    for x, k in zip(xs, kept):  # the inputs are only read
        assert np.array_equal(x, k)
    for results, divisor in ((got, 1), (mean, 3)):
        assert all(np.array_equal(results[0], g) for g in results[1:])  # identical bits
        _assert_sum(results[0], xs, divisor)


@pytest.mark.parametrize("shm", ["0", "1"])  # the TCP ring's results, or shared memory's
def test_a_result_buffer_is_reused_only_once_the_caller_dropped_it(shm, monkeypatch):
    monkeypatch.setenv("PSFLOW_SHM", shm)
    size = 3 * cross_host._FRAME_BYTES // 4 + 7  # two workers: chunks of 1.5 frames
    rng = np.random.default_rng(4)
    first = [rng.standard_normal(size).astype(np.float32) for _ in range(2)]
    second = [rng.standard_normal(size).astype(np.float32) for _ in range(2)]
    rings = _rings(2)
    try:
        held = _on_all(rings, lambda i, r: r.all_reduce([first[i]])[0])
        kept = [h.copy() for h in held]
        again = _on_all(rings, lambda i, r: r.all_reduce([second[i]])[0])
        # results still held are never written by a later call
        for h, k, a in zip(held, kept, again):
            assert np.array_equal(h, k) and not np.shares_memory(h, a)
        del h
        assert np.array_equal(kept[0], first[0] + first[1])  # two workers: one addition
        assert np.array_equal(again[0], second[0] + second[1])
        where = [a.__array_interface__["data"][0] for a in again]
        del again, a
        # dropped (and no thread of the ring still holding a view of it): the next call's
        # results land in the same memory, which has no fresh pages to fault in
        third = _on_all(rings, lambda i, r: r.all_reduce([second[i]])[0])
        assert [t.__array_interface__["data"][0] for t in third] == where
        assert np.array_equal(third[0], second[0] + second[1])
        assert np.array_equal(held[0], kept[0]) and np.array_equal(held[1], kept[1])
    finally:
        for r in rings:
            r.close()


def test_broadcast_of_many_frames_reaches_every_worker():
    rng = np.random.default_rng(8)
    big = rng.standard_normal(2 * cross_host._FRAME_BYTES // 8 + 3)  # float64, 3 frames
    small = np.arange(6, dtype=np.int32).reshape(2, 3)
    rings = _rings(3)
    try:
        out = _on_all(
            rings,
            lambda i, r: r.broadcast(
                [big, small] if i == 1 else [np.zeros_like(big), np.zeros_like(small)], root=1
            ),
        )
    finally:
        for r in rings:
            r.close()
    for got in out:
        assert np.array_equal(got[0], big) and np.array_equal(got[1], small)
        assert got[1].shape == (2, 3) and got[1].dtype == np.int32


@pytest.mark.parametrize("size,count", [(200 << 10, 96), (2 << 20, 10)])
def test_frames_started_without_waiting_arrive_whole_with_heartbeats_only_between_them(
    size: int, count: int
) -> None:
    import time

    rings = _rings(2)
    try:
        sender, receiver = rings[0].links, rings[1].links
        sender.heartbeat = 0.005  # heartbeats try to go while a frame's rest waits
        sender.begin()
        # frames up to 2 MB start from the caller's thread; 96 of 200 kB (19 MB) or 10 of
        # 2 MB (20 MB) are more than the kernel takes while nobody reads (its send and
        # receive buffers, 8 MB each at most), so a frame's rest goes to the sender thread
        frames = [np.full(size, i, np.uint8) for i in range(count)]
        deadline = time.monotonic() + 30
        sent = [sender.send([f], deadline) for f in frames]
        assert not all(s.is_set() for s in sent)
        time.sleep(0.1)
        receiver.begin()
        for i, f in enumerate(frames):
            got = np.empty_like(f)
            receiver.receive_into(memoryview(got), deadline)
            assert (got == i).all(), i
        for s in sent:
            sender.wait_sent(s, deadline)
    finally:
        for ring in rings:
            ring.close()


@pytest.mark.parametrize(
    "generations,nbytes,error",
    [
        ((0, 0), 300_000, pf.errors.InternalError),  # another size: another collective
        ((1, 0), 200_000, pf.errors.AbortedError),  # another membership generation
    ],
)
def test_a_frame_other_than_the_expected_one_is_a_typed_error_naming_the_left_neighbour(
    generations: tuple[int, int], nbytes: int, error: type
) -> None:
    import time

    links = ring_links(2, generations=generations)
    try:
        deadline = time.monotonic() + 10
        links[0].begin()
        links[1].begin()
        links[0].send([np.ones(nbytes, np.uint8)], deadline)  # starts without waiting
        dest = np.zeros(200_000, np.uint8)
        with pytest.raises(error) as caught:
            links[1].receive_into(memoryview(dest), deadline)
        assert caught.value.task == "worker:0"
        assert not dest.any()  # nothing of the wrong frame landed in the destination
    finally:
        for lk in links:
            lk.close()


def test_a_frame_started_without_waiting_to_a_closed_neighbour_is_unavailable_naming_it() -> None:
    import time

    links = ring_links(2)
    try:
        links[1].close()
        deadline = time.monotonic() + 10
        frame = np.ones(256 << 10, np.uint8)
        with pytest.raises(pf.errors.UnavailableError) as caught:
            for _ in range(200):  # the first sends may still land in the kernel's buffer
                links[0].send([frame], deadline)
                time.sleep(0.005)
        assert caught.value.task == "worker:1"
    finally:
        links[0].close()


def _half_frame(links: PeerLinks, nbytes: int) -> None:
    """Writes the head of the next data frame of ``nbytes`` and half its payload, no more."""
    head = peer_link._FIXED.pack(
        frames.MAGIC, frames.VERSION, int(frames.Kind.REQUEST), 0, peer_link._METHOD,
        links._call_id(links._sent + 1), 0, 0, nbytes,
    )  # fmt: skip
    links._right.sock.sendall(head + bytes(nbytes // 2))


@pytest.mark.parametrize("how", ["silent", "closed"])
def test_a_left_neighbour_stopping_inside_a_frame_is_a_typed_error_naming_it_in_time(
    how: str,
) -> None:
    # the plain links' receive blocks in the kernel (MSG_WAITALL): a payload that stops
    # half way still ends by the deadline (a silent peer) or at once (a closed one)
    import time

    links = ring_links(2)
    try:
        links[0].begin()
        links[1].begin()
        _half_frame(links[0], 1 << 20)
        if how == "closed":
            links[0].close()
        start = time.monotonic()
        dest = np.zeros(1 << 20, np.uint8)
        error = pf.errors.DeadlineExceededError if how == "silent" else pf.errors.UnavailableError
        with pytest.raises(error) as caught:
            links[1].receive_into(memoryview(dest), start + 0.6)
        took = time.monotonic() - start
        assert caught.value.task == "worker:0"
        assert (0.55 <= took < 1.5) if how == "silent" else took < 0.5, took
    finally:
        for lk in links:
            lk.close()


def _frame_after_heartbeats(unread: float, send_after: float) -> None:
    """Worker 0 heartbeats (every 0.05 s) to worker 1 (silence bound 0.3 s), which leaves
    its left link unread for ``unread`` s, then reads a frame worker 0 sends ``send_after``
    s later: it must arrive, no one blamed."""
    import time

    links = ring_links(2)
    try:
        links[1].silence = 0.3
        links[0].heartbeat = 0.05
        links[0].begin()
        time.sleep(1.1)  # the sender thread's first wait (1 s) is over: heartbeats flow
        links[1].begin()
        time.sleep(unread)
        frame = np.arange(300_000, dtype=np.float32)
        send = lambda: links[0].send([frame], time.monotonic() + 5)  # noqa: E731
        timer = threading.Timer(send_after, send)
        timer.start()
        dest = np.zeros_like(frame)
        links[1].receive_into(memoryview(dest), time.monotonic() + 5)
        timer.join()
        assert np.array_equal(dest, frame)
    finally:
        for lk in links:
            lk.close()


def test_heartbeats_between_blocking_receives_keep_a_slow_left_neighbour_alive() -> None:
    # the left neighbour sends its frame only after several of the receiver's ticks and
    # more than its silence bound: its heartbeats keep it from being blamed meanwhile
    _frame_after_heartbeats(unread=0.0, send_after=0.8)


def test_a_link_left_unread_past_the_silence_bound_is_not_blamed_for_its_queued_heartbeats() -> (
    None
):
    # a worker busy elsewhere (another link set, a long sum) reads its left link again
    # after more than the silence bound; the heartbeats queued meanwhile prove the
    # neighbour spoke, so the read goes on instead of blaming it at once
    _frame_after_heartbeats(unread=0.8, send_after=0.1)


def test_a_neighbour_frozen_for_good_after_its_queued_heartbeats_is_blamed_one_bound_later() -> (
    None
):
    # the unhappy side of the rule above: the queued heartbeats buy one silence bound,
    # no more; a neighbour that stops for good is then named, well before the deadline
    import time

    links = ring_links(2)
    try:
        links[1].silence = 0.3
        links[0].heartbeat = 0.05
        links[0].begin()
        time.sleep(1.1)  # heartbeats flow
        links[1].begin()
        time.sleep(0.8)  # unread: heartbeats queue up
        links[0].end()  # then no more heartbeats, nor a frame: frozen, its socket open
        dest = np.zeros(1000, np.float32)
        start = time.monotonic()
        with pytest.raises(pf.errors.DeadlineExceededError, match="sent nothing") as caught:
            links[1].receive_into(memoryview(dest), start + 10)
        took = time.monotonic() - start
        assert caught.value.task == "worker:0"
        assert took < 2.0, took  # one silence bound after the last queued heartbeat
    finally:
        for lk in links:
            lk.close()

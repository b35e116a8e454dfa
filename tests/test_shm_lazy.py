"""Lazy shared-memory mirrors: a PS copies a value into its mirror only while a reader asks.

A mirror starts dormant; a read asks for the value (stamps the segment) and,
finding it dormant, falls back to a pull over gRPC, which makes the PS copy the
value in; from then on every update is copied until no reader asked for
``idle`` seconds.  Readers never see a stale or torn value: a dormant mirror is
refused under the seqlock, not read.
"""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

from psflow import errors
from psflow.distribute.ps.grpc_connection import GrpcPSConnection
from psflow.transport import shm
from psflow.transport.client import PSClient

pytestmark = pytest.mark.skipif(not shm.enabled(), reason="no usable /dev/shm on this machine")


def test_a_lazy_mirror_copies_only_while_a_reader_asks_and_the_fallback_pull_wakes_it():
    value = np.arange(6, dtype=np.float64)
    mirror = shm.Mirror(f"{shm.new_prefix()}-lazy", value, idle=1.0)
    reader = shm.MirrorReader(mirror.name, value.dtype, value.shape)
    try:
        assert not mirror.wake(value, 0)  # nobody asked yet
        for k in range(1, 4):  # updates nobody reads cost no copy
            assert not mirror.publish(value + k, k)
        assert mirror.copies == 0 and not mirror.live
        with pytest.raises(shm.MirrorDormantError):  # refused, and asked for
            reader.read()
        assert mirror.wake(value + 3, 3)  # the PS serving the reader's pull over gRPC
        assert not mirror.wake(value + 3, 3)  # live already: nothing to do
        got, version = reader.read()
        assert version == 3 and got.tolist() == (value + 3).tolist()
        for k in range(4, 9):  # a reader that keeps reading gets every update, exactly
            assert mirror.publish(value + k, k)
            got, version = reader.read()
            assert version == k and got.tolist() == (value + k).tolist()
        assert mirror.copies == 6
        time.sleep(1.2)  # no read for longer than the idle time
        assert not mirror.publish(value + 9, 9)  # dormant: no copy
        assert mirror.copies == 6 and not mirror.live
        assert shm.peek(mirror.name) == shm.MirrorState(live=False, copies=6, version=8)
        with pytest.raises(shm.MirrorDormantError):  # never the stale value of version 8
            reader.read()
        assert mirror.wake(value + 9, 9)
        assert reader.read()[1] == 9
        assert shm.peek(mirror.name) == shm.MirrorState(live=True, copies=7, version=9)
    finally:
        reader.close()
        mirror.close()
    with pytest.raises(errors.InvalidArgumentError, match="-1"):
        shm.Mirror(f"{shm.new_prefix()}-bad", value, idle=-1)
    with pytest.raises(errors.InvalidArgumentError, match="0"):
        shm.MirrorSet(idle=0)


def test_readers_see_whole_values_while_the_mirror_keeps_going_dormant_and_waking():
    """An idle time of 1 ms: the mirror flips between dormant and live under the reader."""
    value = np.zeros(1 << 18, np.float32)  # 1 MB: copies release the GIL, the threads overlap
    lock = threading.Lock()  # the PS's variable lock: publish and wake never overlap
    mirror = shm.Mirror(f"{shm.new_prefix()}-flip", value, idle=0.001)
    reader = shm.MirrorReader(mirror.name, value.dtype, value.shape)
    current = [0]
    stop = threading.Event()

    def writer():
        k = 0
        while not stop.is_set() and k < 20_000:
            k += 1
            with lock:
                value.fill(k)
                current[0] = k
                mirror.publish(value, k)
            time.sleep(0.0002)

    t = threading.Thread(target=writer)
    t.start()
    rng = random.Random(0)
    served, dormant, last = 0, 0, -1
    try:
        deadline = time.monotonic() + 20
        while (served < 200 or dormant < 20) and time.monotonic() < deadline:
            try:
                got, version = reader.read()
            except shm.MirrorDormantError:
                dormant += 1
                with lock:  # the fallback pull: the PS wakes the mirror under the lock
                    mirror.wake(value, current[0])
            else:
                served += 1
                assert got.min() == got.max() == version, "a read mixed two writes"
                assert version >= last, "a read went back in time"
                last = version
            time.sleep(rng.random() * 0.003)  # sometimes longer than the idle time
    finally:
        stop.set()
        t.join(30)
        reader.close()
        mirror.close()
    assert served >= 200 and dormant >= 20, (served, dormant)


def test_a_ps_copies_nothing_for_remote_clients_and_follows_while_a_local_one_reads(start_ps):
    server = start_ps("--shm-idle", "2")
    remote = PSClient(server.address, task="ps:0", timeout=30.0)  # gRPC only, as elsewhere
    local = GrpcPSConnection(server.address, task="ps:0", timeout=30.0)
    try:
        value = np.arange(1024, dtype=np.float32)
        remote.create_variable("w", value, optimizer={"name": "sgd", "learning_rate": 1.0})
        (name,) = [d.shm_name for d in remote.list_variables() if d.name == "w"]
        grad = np.full(1024, 0.5, np.float32)
        for _ in range(20):
            remote.push({"w": grad})
        assert shm.peek(name) == shm.MirrorState(live=False, copies=0, version=0)

        before = remote.stats()["pulls"]
        for _ in range(10):
            remote.push({"w": grad})
            ((fast, fast_version),) = local.pull(["w"])
            (slow,), (slow_version,) = remote.pull(["w"], return_versions=True)
            np.testing.assert_array_equal(fast, slow)  # exact, whichever path
            assert fast_version == slow_version
        np.testing.assert_array_equal(fast, value - 0.5 * 30)
        # 10 pulls of the remote client, 1 of the local one: its first, which woke the mirror
        assert remote.stats()["pulls"] - before == 11
        state = shm.peek(name)
        assert state.live and state.copies == 10  # the wake, then 9 pushes while it reads

        time.sleep(2.5)  # no local read for longer than --shm-idle
        for _ in range(5):
            remote.push({"w": grad})
        assert shm.peek(name) == shm.MirrorState(live=False, copies=10, version=state.version)
        ((fast, _),) = local.pull(["w"])  # refused by the dormant mirror: over gRPC
        np.testing.assert_array_equal(fast, value - 0.5 * 35)
        assert shm.peek(name).live
    finally:
        local.close()
        remote.close()


def test_a_ps_refuses_an_idle_time_that_is_not_a_positive_number(tmp_path, capsys):
    from ps_server.__main__ import main

    for raw in ("0", "-1", "inf"):
        assert main(["--port", "0", "--shm-idle", raw]) == 2
        assert "--shm-idle" in capsys.readouterr().err

"""A request id's completion flag: made cheap per push, still waking a concurrent duplicate."""

from __future__ import annotations

import threading
import time

import numpy as np

from psflow.ps.dedup import LazyEvent
from psflow.ps.push_types import Gradient
from psflow.ps.store import VariableStore
from psflow.ps.variables import VariableMeta


def test_lazy_event_wakes_a_waiter_and_times_out_like_an_event():
    e = LazyEvent()
    assert not e.is_set()
    start = time.monotonic()
    assert e.wait(0.05) is False
    assert time.monotonic() - start >= 0.04
    woke = []
    t = threading.Thread(target=lambda: woke.append(e.wait(10.0)))
    t.start()
    time.sleep(0.05)  # the waiter is (very likely) blocked by now
    e.set()
    t.join(5.0)
    assert woke == [True] and e.is_set()
    assert e.wait(0) is True  # set before the wait: no blocking


def test_the_same_push_id_from_many_threads_at_once_is_applied_exactly_once():
    store = VariableStore(task="ps:0")
    meta = VariableMeta("v", np.dtype("float64"), (4,), True)
    store.create([meta], [np.zeros(4)], [{"name": "sgd", "learning_rate": 1.0}])
    ids, threads_per_id = 40, 6
    barrier = threading.Barrier(threads_per_id)
    replies: list = []

    def pusher():
        for seq in range(1, ids + 1):
            barrier.wait(10.0)  # every thread pushes id `seq` at the same moment
            g = Gradient("v", np.full(4, float(seq)), None, -1)
            replies.append(store.push([g], push_id=("c", seq), timeout=10.0))

    threads = [threading.Thread(target=pusher) for _ in range(threads_per_id)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60.0)
    assert len(replies) == ids * threads_per_id
    assert sum(not r.duplicate for r in replies) == ids
    expected = -sum(range(1, ids + 1))  # SGD with rate 1: minus each id's gradient once
    (pulled,) = store.pull(["v"])
    np.testing.assert_array_equal(pulled.value, np.full(4, float(expected)))
    assert pulled.version == ids

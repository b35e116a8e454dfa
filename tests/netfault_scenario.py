"""Async PS training under a network fault, run the same way by every network-fault test.

The chief (this process, or a script in a network namespace) schedules closure
after closure through the ClusterCoordinator; closure ``i`` pushes the gradient
``-increment(i)`` of a PS variable under SGD(1.0), so after ``n`` closures
applied exactly once the variable is :func:`expected_total` everywhere (exact in
float32) and the PS has applied ``n`` pushes: a lost update or a doubled one
shows in both.  Each closure returns the
task and pid that ran it and when it started and ended, so a test can say which
worker's runs won while a fault lasted.

:func:`run_fault` warms up, calls ``fault_on``, waits ``seconds`` while training
goes on, calls ``fault_off`` and then waits (bounded) for the ``victim`` to
win closures again; :func:`check` asserts what every scenario must show.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import psflow as pf
from psflow.observability import events

SIZE = 4


class Training:
    """Closures scheduled in a steady stream (at most ``window`` unfinished at once)."""

    def __init__(self, strategy: Any, *, pause: float = 0.05, window: int = 5) -> None:
        with strategy.scope():
            total = pf.Variable(np.zeros(SIZE, np.float32), name="netfault_total")
            optimizer = pf.keras.optimizers.SGD(1.0)
        self.strategy = strategy
        self.total = total
        self.coordinator = pf.distribute.coordinator.ClusterCoordinator(strategy)
        self.window = window
        self.values: list[tuple[int, Any]] = []
        self.workers_up: list[tuple[float, int]] = []  # (time.time(), workers up) samples
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._schedule, name="netfault-chief", daemon=True)

        def step(i: int) -> tuple[str, int, float, float]:
            from psflow.distribute.ps import session as session_lib

            started = time.time()
            with pf.GradientTape() as tape:
                loss = -pf.reduce_sum(total * np.float32(increment(i)))
            grads = tape.gradient(loss, [total])
            optimizer.apply_gradients(zip(grads, [total]))
            time.sleep(pause)  # a steady, modest closure rate
            return session_lib.current().task, os.getpid(), started, time.time()

        self._step = step

    def start(self) -> None:
        """Starts scheduling (in a thread) until :meth:`stop`."""
        self._thread.start()

    def _schedule(self) -> None:
        try:
            i = 0
            sampled = 0.0
            while not self._stop.is_set() and i < 100_000:
                counters = self.coordinator.counters()
                now = time.time()
                if now - sampled > 0.1:
                    self.workers_up.append((now, counters["workers_up"]))
                    sampled = now
                if counters["unfinished"] >= self.window:
                    time.sleep(0.005)
                    continue
                i += 1
                self.values.append((i, self.coordinator.schedule(self._step, args=(i,))))
        except BaseException as e:  # reported by stop()
            self.error = e

    def wins(self, task: str, started_after: float = 0.0) -> int:
        """Closures finished so far whose kept result came from ``task``, started after a time."""
        n = 0
        for _, value in list(self.values):
            if value.done():
                try:
                    who, _, started, _ = value.fetch()
                except pf.errors.OpError:
                    continue
                n += who == task and started > started_after
        return n

    def wait_wins(self, task: str, count: int, timeout: float, started_after: float = 0.0) -> bool:
        """Waits (bounded) until ``task`` won ``count`` closures started after a time."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.error is None:
            if self.wins(task, started_after) >= count:
                return True
            time.sleep(0.05)
        return False

    def stop(self, join_timeout: float = 60.0) -> dict[str, Any]:
        """Stops scheduling, joins, and returns what :func:`check` needs."""
        self._stop.set()
        self._thread.join(30)
        if self.error is not None:
            raise self.error
        self.coordinator.join(timeout=join_timeout)
        results = []
        for i, value in self.values:
            who, pid, started, ended = value.fetch()
            results.append({"i": i, "task": who, "pid": pid, "start": started, "end": ended})
        stats = self.strategy.ps_stats()
        return {
            "scheduled": len(self.values),
            "counters": self.coordinator.counters(),
            "applied": sum(s["pushes_applied"] for s in stats),
            "total": self.total.numpy().tolist(),
            "results": results,
            "workers_up": self.workers_up,
        }


def run_fault(
    strategy: Any,
    fault_on: Callable[[], None],
    fault_off: Callable[[], None],
    seconds: float,
    *,
    victim: str = "worker:1",
    survivor: str = "worker:0",
    warm: int = 5,
    rejoin: int = 3,
    rejoin_timeout: float = 25.0,
    pause: float = 0.05,
    window: int = 5,
) -> dict[str, Any]:
    """Trains, puts a fault on ``victim``'s path for ``seconds``, heals it, waits for it back.

    ``pause`` and ``window``: as :class:`Training`'s.
    """
    log = events.EventLog()
    previous = events.install(log)
    training = Training(strategy, pause=pause, window=window)
    try:
        training.start()
        for task in (survivor, victim):
            if not training.wait_wins(task, warm, timeout=30.0):
                raise AssertionError(f"{task} did not win {warm} closures before the fault")
        down = time.time()
        fault_on()
        try:
            time.sleep(seconds)
        finally:
            fault_off()
        up = time.time()
        rejoined = training.wait_wins(victim, rejoin, rejoin_timeout, started_after=up)
        result = training.stop()
    finally:
        events.install(previous)
        training.coordinator.shutdown()
    result.update(
        down=down,
        up=up,
        rejoined=rejoined,
        victim=victim,
        survivor=survivor,
        requeued=log.count(events.EventKind.CLOSURE_REQUEUED, victim),
    )
    return result


def increment(i: int) -> int:
    """What closure ``i`` adds: distinct for neighbours, small enough that float32 sums of
    thousands of them stay exact (below 2**24)."""
    return i % 97 + 1


def expected_total(n: int) -> float:
    """The variable after closures ``1..n``, each applied once."""
    return float(sum(increment(i) for i in range(1, n + 1)))


def check(result: dict[str, Any], *, moved: bool = True) -> None:
    """Asserts exact counts and, with ``moved``, that the victim's closures moved and it came back.

    ``moved``: the fault lasted longer than the health grace, so the survivor
    alone must have run what finished in the middle of it.
    """
    n = result["scheduled"]
    # every update applied exactly once: one push per closure, and their exact sum
    assert result["applied"] == n, (result["applied"], n)
    assert result["total"] == [expected_total(n)] * SIZE, (result["total"], expected_total(n))
    assert sorted(r["i"] for r in result["results"]) == list(range(1, n + 1))
    if not moved:
        return
    victim, survivor, down, up = result["victim"], result["survivor"], result["down"], result["up"]
    # while the fault lasted, the survivor ran every closure (a run that ended just as the
    # fault began may still have been kept from the victim: a margin of half a second)
    during = [r for r in result["results"] if down + 0.5 < r["end"] < up]
    assert during, "no closure finished during the fault: training stopped"
    assert {r["task"] for r in during} == {survivor}, {r["task"] for r in during}
    # the coordinator saw the victim go: closures re-queued, and fewer workers up
    assert result["requeued"] >= 1, result["requeued"]
    assert any(down < t < up and n_up == 1 for t, n_up in result["workers_up"])
    # the healed victim (the same process) rejoined and won closures again
    assert result["rejoined"], "the victim won no closure after the fault healed"
    after = [r for r in result["results"] if r["task"] == victim and r["start"] > up]
    before = {r["pid"] for r in result["results"] if r["task"] == victim and r["end"] < down}
    assert after and {r["pid"] for r in after} == before
    assert result["counters"]["workers_up"] == 2


def run_steady(strategy: Any, per_worker: int = 10, timeout: float = 60.0) -> dict[str, Any]:
    """Trains until every worker won ``per_worker`` closures (bounded); no fault of its own."""
    training = Training(strategy)
    start = time.monotonic()
    try:
        training.start()
        for task in ("worker:0", "worker:1"):
            if not training.wait_wins(task, per_worker, timeout=timeout):
                raise AssertionError(f"{task} did not win {per_worker} closures in {timeout}s")
        result = training.stop()
    finally:
        training.coordinator.shutdown()
    result["seconds"] = time.monotonic() - start
    return result

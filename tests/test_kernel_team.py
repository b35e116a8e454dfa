"""The kernels' thread team: every thread runs the job, one caller at a time, errors stay put.

Real threads throughout; every wait is bounded so a broken team fails instead of hanging.
"""

from __future__ import annotations

import threading

import pytest

from psflow.ops import kernel_pool, kernel_team

WAIT_S = 10.0


def test_team_runs_the_job_on_each_helper_and_the_caller_then_returns() -> None:
    team = kernel_team.Team(helpers=3)
    try:
        seen: list[str] = []
        lock = threading.Lock()

        def job() -> None:
            with lock:
                seen.append(threading.current_thread().name)

        assert team.try_run(job, 3)
        assert len(seen) == 4 and len(set(seen)) == 4
        assert threading.current_thread().name in seen
        seen.clear()
        assert team.try_run(job, 1)  # fewer helpers than the team has
        assert len(seen) == 2
    finally:
        team.close()


def test_team_refuses_a_second_caller_and_more_helpers_than_it_has() -> None:
    team = kernel_team.Team(helpers=1)
    inside, release = threading.Event(), threading.Event()
    answers: list[bool] = []

    def slow() -> None:
        inside.set()
        assert release.wait(WAIT_S)

    holder = threading.Thread(target=lambda: answers.append(team.try_run(slow, 1)))
    holder.start()
    try:
        assert inside.wait(WAIT_S)
        ran: list[int] = []
        assert not team.try_run(lambda: ran.append(1), 1)  # busy: nothing ran
        assert ran == []
    finally:
        release.set()
        holder.join(WAIT_S)
    assert answers == [True]
    assert not team.try_run(lambda: None, 2)  # only one helper
    team.close()
    assert not team.try_run(lambda: None, 1)  # closed


def test_team_survives_a_job_that_raises_on_its_threads() -> None:
    team = kernel_team.Team(helpers=1)
    try:
        caller = threading.current_thread()

        def fails_off_the_caller() -> None:
            if threading.current_thread() is not caller:
                raise RuntimeError("helper failed")

        assert team.try_run(fails_off_the_caller, 1)  # the helper's error is the job's to report

        def fails_everywhere() -> None:
            raise ValueError("caller failed")

        with pytest.raises(ValueError, match="caller failed"):
            team.try_run(fails_everywhere, 1)
        ran: list[int] = []
        assert team.try_run(lambda: ran.append(1), 1)  # still serves after both
        assert ran == [1, 1]
    finally:
        team.close()


def test_chunks_fall_back_to_the_executor_while_another_thread_has_the_team() -> None:
    kernel_pool.set_thread_width(2)
    try:
        team = kernel_pool._team(1)
        inside, release = threading.Event(), threading.Event()

        def hold() -> None:
            if threading.current_thread().name.startswith("psflow-kernel"):
                return
            inside.set()
            assert release.wait(WAIT_S)

        holder = threading.Thread(target=lambda: team.try_run(hold, 1))
        holder.start()
        try:
            assert inside.wait(WAIT_S)
            bounds = [(i, i + 1) for i in range(6)]
            assert kernel_pool.run_chunks(lambda lo, hi: lo * 10, bounds) == [0, 10, 20, 30, 40, 50]
        finally:
            release.set()
            holder.join(WAIT_S)
    finally:
        kernel_pool.set_thread_width(None)

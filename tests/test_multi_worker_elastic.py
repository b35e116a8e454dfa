"""Elastic MultiWorkerMirroredStrategy: real worker processes lose, freeze and drain a member.

Each case starts 3 processes of ``tests/elastic_scenario.py`` on 127.0.0.1,
hits one of them (SIGKILL in the forward pass, in the middle of the
all-reduce, or after the update while the others reduce the loss; SIGSTOP
past the silence timeout; its veth link down in a network namespace, where
root and ``ip`` allow; SIGTERM to drain), and checks that the survivors

* finish in the same processes (each writes its result and exits 0);
* trained every example of every epoch exactly once (the gathered ids of
  each step the group committed);
* hold the weights of one process that replays the same per-step global
  batches: ``atol=1e-6, rtol=1e-5``, because the group sums each step's
  gradient over replicas in another order than one process (a few float32
  ulps per step; 10 Adam steps of a 5-4-1 model stay well inside).
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import signal
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest

import psflow as pf
from psflow.collective import door as door_lib
from psflow.collective.membership import (
    Position,
    StaleGenerationError,
    View,
    agree,
    ask_to_join,
    running_view,
)
from psflow.security.config import SecurityConfig
from tests.conftest import ROOT, child_env, pick_free_port
from tests.multi_worker_util import TOKEN, replay_reference, tf_config

sys.path.insert(0, str(ROOT / "benchmarks"))
import _netns

SCENARIO = ROOT / "tests" / "elastic_scenario.py"
ATOL, RTOL = 1e-6, 1e-5
SAMPLES = 48


def _start(
    tmp: pathlib.Path,
    workers: int,
    env: dict[str, str],
    mode: str = "train",
    *,
    hosts: list[str] | None = None,
    wrap: Any = None,
) -> tuple[list, list, list]:
    """Starts the workers (on ``hosts[i]``, through ``wrap(i, argv)``: a network namespace)."""
    ports = [pick_free_port() for _ in range(workers)]
    procs, outs, logs = [], [], []
    for i in range(workers):
        out, log = tmp / f"w{i}.json", tmp / f"w{i}.log"
        extra = {
            "TF_CONFIG": _tf_config(ports, i, hosts),
            "PSFLOW_AUTH_TOKEN": TOKEN,
            "PSFLOW_NUM_CPU_DEVICES": env.get("DEVICES", "1"),
            "SCENARIO_SEED": str(1 + i),
            **env,
        }
        (tmp / f"w{i}.tf_config").write_text(extra["TF_CONFIG"])  # to start it again
        with open(log, "wb") as f:
            procs.append(
                subprocess.Popen(
                    (wrap or (lambda _i, a: a))(i, [sys.executable, str(SCENARIO), mode, str(out)]),
                    env=child_env(extra),
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    cwd=ROOT,
                )
            )
        outs.append(out)
        logs.append(log)
    return procs, outs, logs


def _tf_config(ports: list[int], index: int, hosts: list[str] | None) -> str:
    if hosts is None:
        return tf_config(ports, index)
    cluster = {"worker": [f"{h}:{p}" for h, p in zip(hosts, ports)]}
    return json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})


def _wait(procs: list, ranks: set[int], deadline: float) -> dict[int, int | None]:
    codes: dict[int, int | None] = {}
    for i in sorted(ranks):
        try:
            codes[i] = procs[i].wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            codes[i] = None
    return codes


def _reap(procs: list) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGCONT)  # a stopped process must wake up to die
                p.kill()
        p.wait()


def _results(outs: list, logs: list) -> tuple[list[dict], list[str]]:
    results = [json.loads(o.read_text()) if o.exists() else {} for o in outs]
    return results, [log.read_text(errors="replace") for log in logs]


def _reference(tmp: pathlib.Path, epochs: list, env: dict[str, str] | None = None) -> dict:
    return replay_reference(SCENARIO, tmp, epochs, env)


def _check_training(tmp: pathlib.Path, survivors: list[dict], logs: str) -> dict:
    first = survivors[0]
    for r in survivors[1:]:
        assert r["weights"] == first["weights"], "survivors hold different weights"
        assert r["epochs"] == first["epochs"]
    for epoch in first["epochs"]:
        seen = sorted(i for step in epoch for i in step)
        assert seen == list(range(SAMPLES)), (epoch, logs)
    reference = _reference(tmp, first["epochs"])
    for got, want in zip(first["weights"], reference["weights"]):
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)
    assert first["iterations"] == reference["iterations"] == sum(len(e) for e in first["epochs"])
    return reference


@pytest.mark.parametrize("fault", ["forward", "allreduce", "reduce"])
def test_survivors_of_a_killed_worker_finish_the_epochs_like_one_process(tmp_path, fault):
    procs, outs, logs = _start(
        tmp_path,
        3,
        {"FAULT": fault, "FAULT_RANK": "1", "FAULT_STEP": "2", "SCENARIO_TIMEOUT": "10"},
    )
    try:
        codes = _wait(procs, {0, 1, 2}, time.monotonic() + 120)
    finally:
        _reap(procs)
    results, texts = _results(outs, logs)
    assert codes[1] == -signal.SIGKILL, texts[1][-2000:]
    assert codes[0] == codes[2] == 0, "\n---\n".join(t[-3000:] for t in texts)
    survivors = [results[0], results[2]]
    # the processes that started are the ones that finished: nothing was restarted
    assert [results[0]["pid"], results[2]["pid"]] == [procs[0].pid, procs[2].pid]
    _check_training(tmp_path, survivors, texts[0][-3000:])
    for r in survivors:
        (change,) = r["changes"]
        assert change["members"] == [0, 2] and change["previous_members"] == [0, 1, 2]
        assert change["reason"] == "lost" and change["generation"] == 1
        assert change["resumed_step"] == 2  # the interrupted step was done again, by 2
        assert change["global_batch_scale"] == pytest.approx(2 / 3)
        assert r["replicas"] == 2
    # steps 0-1 of 12 examples, then the epoch's other 24 in steps of 8 (the per-replica 4 kept)
    assert [len(s) for s in survivors[0]["epochs"][0]] == [12, 12, 8, 8, 8]
    assert [len(s) for s in survivors[0]["epochs"][1]] == [8] * 6


def test_keep_global_cuts_the_same_global_batches_over_the_survivors(tmp_path):
    procs, outs, logs = _start(
        tmp_path,
        3,
        {"FAULT": "forward", "FAULT_RANK": "0", "FAULT_STEP": "5", "BATCH_POLICY": "keep_global"},
    )
    try:
        codes = _wait(procs, {0, 1, 2}, time.monotonic() + 120)
    finally:
        _reap(procs)
    results, texts = _results(outs, logs)
    assert codes == {0: -signal.SIGKILL, 1: 0, 2: 0}, "\n---\n".join(t[-3000:] for t in texts)
    # worker 0 (the first leader, the chief) is gone: worker 1 leads and becomes rank 0
    _check_training(tmp_path, [results[1], results[2]], texts[1][-3000:])
    (change,) = results[1]["changes"]
    assert change["members"] == [1, 2] and change["resumed_step"] == 5
    assert change["global_batch_scale"] == 1.0
    for epoch in results[1]["epochs"]:  # the dataset's batches, whole, before and after
        assert epoch == [list(range(k, k + 12)) for k in range(0, SAMPLES, 12)]


def test_a_frozen_worker_is_dropped_and_later_refused_as_stale(tmp_path):
    timeout = 3.0
    procs, outs, logs = _start(
        tmp_path,
        3,
        {
            "FAULT": "sigstop",
            "FAULT_RANK": "1",
            "FAULT_STEP": "3",
            "SCENARIO_TIMEOUT": str(timeout),
            "STEP_SLEEP": "0.5",  # the group still trains when the frozen worker wakes up
        },
    )
    try:
        deadline = time.monotonic() + 60
        while "generation 1: members [0, 2]" not in logs[0].read_text(errors="replace"):
            assert time.monotonic() < deadline and procs[0].poll() is None, logs[0].read_text()
            time.sleep(0.1)
        procs[1].send_signal(signal.SIGCONT)  # it wakes up in a group that went on without it
        codes = _wait(procs, {0, 1, 2}, time.monotonic() + 120)
    finally:
        _reap(procs)
    results, texts = _results(outs, logs)
    assert codes[0] == codes[2] == 0, "\n---\n".join(t[-3000:] for t in texts)
    _check_training(tmp_path, [results[0], results[2]], texts[0][-3000:])
    assert results[0]["changes"][0]["members"] == [0, 2]
    assert codes[1] == 3, texts[1][-3000:]
    assert results[1]["error"] == "StaleGenerationError", results[1]
    assert "generation" in results[1]["message"]


@pytest.mark.parametrize("mode", ["train", "fit"])
def test_a_restarted_worker_rejoins_at_a_step_boundary_with_the_group_state(tmp_path, mode):
    env = {
        "FAULT": "forward",
        "FAULT_RANK": "1",
        "FAULT_STEP": "2",
        "SCENARIO_TIMEOUT": "10",
        "STEP_SLEEP": "1.0",  # the group still trains when the restarted worker is up
    }
    procs, outs, logs = _start(tmp_path, 3, env, mode=mode)
    rejoined = None
    try:
        assert procs[1].wait(60) == -signal.SIGKILL
        deadline = time.monotonic() + 60
        while "generation 1: members [0, 2]" not in logs[0].read_text(errors="replace"):
            assert time.monotonic() < deadline and procs[0].poll() is None, logs[0].read_text()
            time.sleep(0.1)
        # worker 1 again, in its slot (same TF_CONFIG, port and token), as a pod restarted
        config = (tmp_path / "w1.tf_config").read_text()
        out, log = tmp_path / "w1-again.json", tmp_path / "w1-again.log"
        extra = {
            "TF_CONFIG": config,
            "PSFLOW_AUTH_TOKEN": TOKEN,
            "PSFLOW_NUM_CPU_DEVICES": "1",
            "SCENARIO_SEED": "99",  # its own initial weights: the group's state must replace them
            "SCENARIO_TIMEOUT": "10",
            "STEP_SLEEP": "1.0",
        }
        with open(log, "wb") as f:
            rejoined = subprocess.Popen(
                [sys.executable, str(SCENARIO), mode, str(out)],
                env=child_env(extra),
                stdout=f,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )
        codes = _wait([*procs, rejoined], {0, 2, 3}, time.monotonic() + 120)
    finally:
        _reap([*procs, *([rejoined] if rejoined else [])])
    results, texts = _results(outs, logs)
    texts.append(log.read_text(errors="replace"))
    again = json.loads(out.read_text()) if out.exists() else {}
    assert codes[0] == codes[2] == codes[3] == 0, "\n---\n".join(t[-3000:] for t in texts)
    if mode == "fit":  # Keras: the joiner's fit starts in the group's epoch, at its step
        assert [c["members"] for c in results[0]["changes"]] == [[0, 2], [0, 1, 2]]
        assert again["weights"] == results[0]["weights"] == results[2]["weights"]
        assert again["iterations"] == results[0]["iterations"]
        assert again["steps_run"] >= 1  # it trained with the group, not only received its end
        return
    _check_training(tmp_path, [results[0], results[2]], texts[0][-3000:])
    assert [c["members"] for c in results[0]["changes"]] == [[0, 2], [0, 1, 2]]
    assert [c["reason"] for c in results[0]["changes"]] == ["lost", "joined"]
    joined_at = results[0]["changes"][1]["resumed_step"]
    (mine,) = again["changes"]
    assert mine["reason"] == "joined" and mine["resumed_step"] == joined_at
    # the joiner holds the group's bits, and trained the group's steps from its admission
    assert again["weights"] == results[0]["weights"]
    assert again["iterations"] == results[0]["iterations"]
    assert sum(len(e) for e in again["epochs"]) >= 1  # it trained steps with the group
    # after the admission the global batch is 12 again (3 workers x 4), but for what an
    # epoch has left at its end
    step = 0
    for epoch in results[0]["epochs"]:
        for k, ids in enumerate(epoch):
            if step >= joined_at and k < len(epoch) - 1:
                assert len(ids) == 12, results[0]["epochs"]
            step += 1


def _wait_for(path: pathlib.Path, text: str, proc: subprocess.Popen, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while text not in path.read_text(errors="replace"):
        assert time.monotonic() < deadline and proc.poll() is None, path.read_text()[-4000:]
        time.sleep(0.1)


def _ports(tmp: pathlib.Path, workers: int) -> list[int]:
    """The ports :func:`_start` gave its workers."""
    cluster = json.loads((tmp / "w0.tf_config").read_text())["cluster"]["worker"]
    return [int(a.rsplit(":", 1)[1]) for a in cluster[:workers]]


def _start_new_worker(
    tmp: pathlib.Path, ports: list[int], i: int, env: dict[str, str]
) -> tuple[subprocess.Popen, pathlib.Path, pathlib.Path]:
    """Worker ``i`` with a TF_CONFIG listing the workers up to itself (the job scaled up)."""
    out, log = tmp / f"w{i}.json", tmp / f"w{i}.log"
    extra = {
        **env,
        "TF_CONFIG": tf_config(ports[: i + 1], i),
        "PSFLOW_AUTH_TOKEN": TOKEN,
        "PSFLOW_NUM_CPU_DEVICES": "1",
        "SCENARIO_SEED": str(50 + i),  # its own weights: the group's must replace them
    }
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, str(SCENARIO), "train", str(out)],
            env=child_env(extra),
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
    return proc, out, log


def test_new_workers_beyond_the_tf_config_list_join_up_to_max_workers(tmp_path):
    """The job scaled up: two workers start with TF_CONFIG listing 2 and max_workers 3; two
    more start with longer lists (ids 2 and 3). One is admitted at a step boundary (the
    group learns its address from its request), the other is refused naming max_workers.
    The group waits after step 1 until both requests are queued (HOLD_AT), so both come in
    at the barrier of step 2 however long the new processes take to start."""
    env = {"SCENARIO_TIMEOUT": "10", "STEP_SLEEP": "0.2", "MAX_WORKERS": "3"}
    env.update(PRINT_STEPS="1", HOLD_AT="1", HOLD_ADMITS="2", HOLD_FILE=str(tmp_path / "go"))
    procs, outs, logs = _start(tmp_path, 2, env)
    ports = [*_ports(tmp_path, 2), pick_free_port(), pick_free_port()]
    extra_procs, extra_outs, extra_logs = [], [], []
    try:
        _wait_for(logs[0], "step 1 done", procs[0], 60)
        for i in (2, 3):
            proc, out, log = _start_new_worker(tmp_path, ports, i, env)
            extra_procs.append(proc)
            extra_outs.append(out)
            extra_logs.append(log)
        everyone = [*procs, *extra_procs]
        codes = _wait(everyone, {0, 1, 2, 3}, time.monotonic() + 120)
    finally:
        _reap([*procs, *extra_procs])
    results, texts = _results([*outs, *extra_outs], [*logs, *extra_logs])
    assert codes[0] == codes[1] == 0, "\n---\n".join(t[-3000:] for t in texts)
    assert sorted([codes[2], codes[3]]) == [0, 3], "\n---\n".join(t[-3000:] for t in texts)
    joined = 2 if codes[2] == 0 else 3
    refused = results[5 - joined]
    assert refused["error"] == "ResourceExhaustedError", refused
    assert "max_workers 3" in refused["message"], refused
    _check_training(tmp_path, results[:2], texts[0][-3000:])
    (change,) = results[0]["changes"]
    assert change["members"] == [0, 1, joined] and change["reason"] == "joined"
    assert change["resumed_step"] == 1
    assert results[1]["changes"] == results[0]["changes"]
    again = results[joined]
    assert again["weights"] == results[0]["weights"]
    assert again["iterations"] == results[0]["iterations"]
    assert again["replicas"] == 3 and sum(len(e) for e in again["epochs"]) >= 1
    # the per-replica batch of the 2 starting workers (6) is kept: 18 a step once it is in,
    # but for what an epoch has left at its end
    step = 0
    for epoch in results[0]["epochs"]:
        for k, ids in enumerate(epoch):
            if step >= change["resumed_step"] and k < len(epoch) - 1:
                assert len(ids) == 18, results[0]["epochs"]
            step += 1


@pytest.mark.parametrize("at", [4, 8])
def test_a_joiner_that_asks_at_an_epochs_end_is_admitted_where_a_step_follows(tmp_path, at):
    """A request to join queued when the group is at an epoch's end (after step 4: epoch 1's
    last, after step 8: the run's last) is not admitted there, where the joiner would have no
    step to train and its optimizer would never take the group's step count (it ended with 0
    iterations): it waits for the next epoch's first barrier, or, when no step follows,
    fails with a typed error when the group finishes, and the group changes nothing."""
    env = {"SCENARIO_TIMEOUT": "10", "STEP_SLEEP": "0", "MAX_WORKERS": "3", "PRINT_STEPS": "1"}
    env.update(HOLD_AT=str(at), HOLD_FILE=str(tmp_path / "go"))
    procs, outs, logs = _start(tmp_path, 2, env)
    joiner = None
    try:
        _wait_for(logs[0], f"step {at} done", procs[0], 60)
        joiner, out, log = _start_new_worker(
            tmp_path, [*_ports(tmp_path, 2), pick_free_port()], 2, env
        )
        codes = _wait([*procs, joiner], {0, 1, 2}, time.monotonic() + 120)
    finally:
        _reap([*procs, *([joiner] if joiner else [])])
    results, texts = _results([*outs, out], [*logs, log])
    why = "\n---\n".join(t[-3000:] for t in texts)
    assert codes[0] == codes[1] == 0, why
    _check_training(tmp_path, results[:2], texts[0][-3000:])
    # after a join at step 4, epoch 2 takes 18 examples a step: 18 + 18 + 12, 7 steps in all
    assert results[0]["iterations"] == results[1]["iterations"] == (8 if at == 8 else 7)
    if at == 8:
        assert codes[2] == 3 and results[2]["error"] == "UnavailableError", why
        assert results[0]["changes"] == results[1]["changes"] == []
        return
    assert codes[2] == 0, why
    (change,) = results[0]["changes"]
    assert change["members"] == [0, 1, 2] and change["resumed_step"] == 4, change
    assert results[1]["changes"] == results[0]["changes"]
    assert results[2]["weights"] == results[0]["weights"]
    assert results[2]["iterations"] == 7
    assert [len(e) for e in results[2]["epochs"]] == [3]  # it starts in epoch 2


def test_a_joiner_beyond_the_list_without_a_usable_address_is_refused_and_nothing_changes(
    tmp_path,
):
    """Bad input at an elastic worker's port, after authentication: an admission request
    of a worker beyond the group's table whose address is not host:port gets a typed error
    naming it, and the group trains on unchanged."""
    env = {"SCENARIO_TIMEOUT": "10", "STEP_SLEEP": "0.5", "MAX_WORKERS": "6", "PRINT_STEPS": "1"}
    procs, outs, logs = _start(tmp_path, 2, env)
    door = door_lib.Door(f"127.0.0.1:{pick_free_port()}", SecurityConfig(token=TOKEN), "worker:5")
    try:
        _wait_for(logs[0], "step 1 done", procs[0], 60)
        ours = ("", "", "", "no-port-here")  # ids 2-4 unknown, 5 is this one
        view = running_view(door, (*[f"127.0.0.1:{p}" for p in _ports(tmp_path, 2)], *ours), 5)
        assert view is not None and view.members == (0, 1)
        with pytest.raises(pf.errors.InvalidArgumentError, match="no-port-here"):
            ask_to_join(door, view, 5, wait=30)
        codes = _wait(procs, {0, 1}, time.monotonic() + 120)
    finally:
        door.close()
        _reap(procs)
    results, texts = _results(outs, logs)
    assert codes == {0: 0, 1: 0}, "\n---\n".join(t[-3000:] for t in texts)
    assert results[0]["changes"] == results[1]["changes"] == []
    _check_training(tmp_path, results, texts[0][-3000:])


def test_a_joiner_killed_during_its_state_broadcast_is_dropped_and_the_group_goes_on(tmp_path):
    """kill -9 of an admitted worker while the members send it their state: the members
    re-form without it from the same step boundary, in the same processes.  The group waits
    after step 1 until the joiner's request is queued (HOLD_AT): on a loaded machine its
    process can take longer to start than the group takes to finish."""
    env = {"SCENARIO_TIMEOUT": "5", "STEP_SLEEP": "0.5", "MAX_WORKERS": "3", "PRINT_STEPS": "1"}
    env.update(HOLD_AT="1", HOLD_FILE=str(tmp_path / "go"))
    procs, outs, logs = _start(tmp_path, 2, env)
    joiner = None
    try:
        _wait_for(logs[0], "step 1 done", procs[0], 60)
        joiner, joiner_out, joiner_log = _start_new_worker(
            tmp_path, [*_ports(tmp_path, 2), pick_free_port()], 2,
            {**env, "FAULT": "join_broadcast", "FAULT_RANK": "2"},
        )  # fmt: skip
        codes = _wait([*procs, joiner], {0, 1, 2}, time.monotonic() + 120)
    finally:
        _reap([*procs, *([joiner] if joiner else [])])
    results, texts = _results(outs, logs)
    ended = joiner_out.read_text() if joiner_out.exists() else ""  # a psflow error's record
    assert codes[2] == -signal.SIGKILL, ended + joiner_log.read_text()[-3000:]
    assert codes[0] == codes[1] == 0, "\n---\n".join(t[-3000:] for t in texts)
    assert [results[0]["pid"], results[1]["pid"]] == [procs[0].pid, procs[1].pid]
    _check_training(tmp_path, results, texts[0][-3000:])
    assert results[1]["changes"] == results[0]["changes"]
    # every member announces the admission it decided, then the loss (whether its own send
    # of the state failed, or the next collective did): the listeners agree (a learning
    # rate scaled by each change's global_batch_scale ends the same on every member)
    joined, lost = results[0]["changes"]
    assert joined["reason"] == "joined" and joined["members"] == [0, 1, 2]
    assert lost["reason"] == "lost" and lost["members"] == [0, 1] and lost["generation"] == 2
    assert lost["resumed_step"] == joined["resumed_step"]  # no step lost
    assert joined["global_batch_scale"] * lost["global_batch_scale"] == pytest.approx(1.0)


@pytest.mark.slow
@pytest.mark.skipif(_netns.unavailable() is not None, reason=f"{_netns.unavailable()}")
def test_a_partitioned_worker_is_dropped_and_the_minority_side_stops(tmp_path):
    # workers 0 and 2 in namespace "a", worker 1 alone in "b": its veth end goes down for good
    with _netns.VethPair(tag=7) as net:
        a, b = _netns.SERVER_ADDR, _netns.CLIENT_ADDR
        procs, outs, logs = _start(
            tmp_path,
            3,
            {"SCENARIO_TIMEOUT": "3", "MIN_WORKERS": "2", "STEP_SLEEP": "0.2", "PRINT_STEPS": "1"},
            hosts=[a, b, a],
            wrap=lambda i, argv: net.exec_in("b" if i == 1 else "a", argv),
        )
        try:
            deadline = time.monotonic() + 90
            while "step 3 done" not in logs[0].read_text(errors="replace"):
                assert time.monotonic() < deadline and procs[0].poll() is None, logs[0].read_text()
                time.sleep(0.05)
            net.set_link("b", up=False)
            codes = _wait(procs, {0, 1, 2}, time.monotonic() + 120)
        finally:
            _reap(procs)
    results, texts = _results(outs, logs)
    assert codes[0] == codes[2] == 0, "\n---\n".join(t[-3000:] for t in texts)
    _check_training(tmp_path, [results[0], results[2]], texts[0][-3000:])
    assert results[0]["changes"][0]["members"] == [0, 2]
    # alone on its side, worker 1 cannot make min_workers=2: it stops instead of training alone
    assert codes[1] == 3, texts[1][-3000:]
    assert results[1]["error"] == "UnavailableError", results[1]
    assert "min_workers is 2" in results[1]["message"]


def test_a_drained_worker_leaves_at_a_step_boundary_and_no_step_is_lost(tmp_path):
    # the scenario wraps each step in PreemptionCheckpointHandler.run (TensorFlow's API): the
    # group saves at the boundary where worker 2 leaves, and goes on instead of exiting
    saved = tmp_path / "preemption"
    procs, outs, logs = _start(
        tmp_path,
        3,
        {"FAULT": "drain", "FAULT_RANK": "2", "FAULT_STEP": "1", "PREEMPTION_DIR": str(saved)},
    )
    try:
        codes = _wait(procs, {0, 1, 2}, time.monotonic() + 120)
    finally:
        _reap(procs)
    results, texts = _results(outs, logs)
    assert codes == {0: 0, 1: 0, 2: 0}, "\n---\n".join(t[-3000:] for t in texts)
    assert "worker:2 drained after step 2" in texts[2]
    _check_training(tmp_path, [results[0], results[1]], texts[0][-3000:])
    for r in (results[0], results[1]):
        (change,) = r["changes"]
        assert change["reason"] == "drained" and change["members"] == [0, 1]
        assert change["resumed_step"] == 2
    # no step done twice: steps 0 and 1 whole, then 8 at a time
    assert [len(s) for s in results[0]["epochs"][0]] == [12, 12, 8, 8, 8]
    assert results[0]["preemption_saves"] == results[1]["preemption_saves"] == 1
    assert results[0]["run_calls"] == 11
    # the chief wrote the checkpoint of the boundary: 2 steps done
    opt = pf.keras.optimizers.Adam(0.01)
    model = pf.keras.Sequential(
        [pf.keras.layers.Dense(4, activation="tanh"), pf.keras.layers.Dense(1)]
    )
    model.build((None, 5))
    checkpoint = pf.train.Checkpoint(model=model, optimizer=opt)
    checkpoint.restore(pf.train.latest_checkpoint(str(saved))).expect_partial()
    assert int(opt.iterations) == 2


def test_keras_fit_goes_on_without_a_killed_worker_and_callbacks_see_the_change(tmp_path):
    procs, outs, logs = _start(
        tmp_path,
        3,
        {"FAULT": "forward", "FAULT_RANK": "2", "FAULT_STEP": "2", "SCENARIO_TIMEOUT": "10"},
        mode="fit",
    )
    try:
        codes = _wait(procs, {0, 1, 2}, time.monotonic() + 120)
    finally:
        _reap(procs)
    results, texts = _results(outs, logs)
    assert codes[2] == -signal.SIGKILL, texts[2][-2000:]
    assert codes[0] == codes[1] == 0, "\n---\n".join(t[-3000:] for t in texts)
    first, second = results[0], results[1]
    assert [first["pid"], second["pid"]] == [procs[0].pid, procs[1].pid]
    assert first["weights"] == second["weights"] and first["changes"] == second["changes"]
    (change,) = first["changes"]
    assert change["members"] == [0, 1] and change["resumed_step"] == 2
    assert change["global_batch_scale"] == pytest.approx(2 / 3)
    assert first["lr_seen"] == [pytest.approx(0.01 * 2 / 3)]
    # the steps fit took: 2 of 12 examples, then the epochs' rest 8 at a time (4 per replica)
    rows = [list(range(0, 12)), list(range(12, 24))]
    rows += [list(range(k, k + 8)) for k in range(24, SAMPLES, 8)]
    epochs = [rows, [list(range(k, k + 8)) for k in range(0, SAMPLES, 8)]]
    reference = _reference(
        tmp_path, epochs, {"REFERENCE_LOSS": "mean", "LR_CHANGE": f"2:{0.01 * 2 / 3!r}"}
    )
    assert first["iterations"] == reference["iterations"] == 11
    for got, want in zip(first["weights"], reference["weights"]):
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)


def test_every_worker_drained_at_once_ends_the_job_cleanly(tmp_path):
    # a launcher (or Kubernetes) stopping the whole job sends every worker SIGTERM
    procs, _outs, logs = _start(tmp_path, 3, {"STEP_SLEEP": "0.3", "PRINT_STEPS": "1"})
    try:
        deadline = time.monotonic() + 60
        while "step 2 done" not in logs[0].read_text(errors="replace"):
            assert time.monotonic() < deadline and procs[0].poll() is None, logs[0].read_text()
            time.sleep(0.05)
        for p in procs:
            p.send_signal(signal.SIGTERM)
        codes = _wait(procs, {0, 1, 2}, time.monotonic() + 30)
    finally:
        _reap(procs)
    texts = [log.read_text(errors="replace") for log in logs]
    assert codes == {0: 0, 1: 0, 2: 0}, "\n---\n".join(t[-3000:] for t in texts)
    for rank, text in enumerate(texts):
        assert f"worker:{rank} drained after step" in text


# -- the agreement and the door, in one process --------------------------------------------


def _doors(n: int) -> tuple[list[door_lib.Door], tuple[str, ...]]:
    security = SecurityConfig(token="t" * 20)
    ports = [pick_free_port() for _ in range(n)]
    addresses = tuple(f"127.0.0.1:{p}" for p in ports)
    return [door_lib.Door(a, security, f"worker:{i}") for i, a in enumerate(addresses)], addresses


def test_a_request_of_an_older_generation_is_refused_with_a_typed_error():
    doors, addresses = _doors(2)
    try:
        doors[0].set_generation(3)
        view = View(2, (0, 1), addresses)
        with pytest.raises(StaleGenerationError, match="generation 3"):
            agree(doors[1], view, 1, Position(5), window=1.0)
    finally:
        for d in doors:
            d.close()


def test_a_ring_link_of_an_older_generation_is_refused():
    from psflow.collective.peer_link import PeerLinks

    doors, addresses = _doors(2)
    try:
        doors[1].set_generation(1)
        links = PeerLinks(
            0, addresses, doors[0].security, generation=0, incoming=doors[0].take_ring
        )
        with pytest.raises(pf.errors.AbortedError, match="generation 0"):
            links._dial_right(time.monotonic() + 5)
        links.close()
    finally:
        for d in doors:
            d.close()


def test_an_unauthenticated_join_is_refused_and_queues_nothing():
    import socket

    from psflow.transport.dataplane import auth, frames

    doors, _ = _doors(1)
    try:
        host, port = "127.0.0.1", int(doors[0]._listener.getsockname()[1])
        with socket.create_connection((host, port), timeout=5) as s:
            hello = auth.hello(SecurityConfig(token="w" * 20), "join:1/gen:0")
            s.sendall(frames.pack(frames.Kind.HELLO, header_len=len(hello)) + hello)
            head = frames.unpack(s.recv(frames.FIXED.size), max_header=4096, max_payload=0)
            assert head.kind is frames.Kind.ERROR
        assert doors[0].take_joins(0.5) == []
    finally:
        doors[0].close()


def test_elastic_options_are_validated_naming_the_bad_value():
    with pytest.raises(pf.errors.InvalidArgumentError, match="min_workers"):
        pf.distribute.experimental.ElasticOptions(min_workers=0)
    with pytest.raises(pf.errors.InvalidArgumentError, match="batch_policy"):
        pf.distribute.experimental.ElasticOptions(batch_policy="sometimes")


def test_psflow_local_elastic_keeps_the_survivors_of_a_killed_worker(tmp_path):
    out = subprocess.run(
        [
            sys.executable, "-m", "chief.local", "--mode", "multi-worker", "--workers", "3",
            "--elastic", str(ROOT / "examples" / "multi_worker_elastic.py"),
            "--kill-rank", "1", "--kill-step", "5",
        ],
        env=child_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "worker:1 was lost (status 137); the others go on" in out.stderr
    lines = out.stdout.splitlines()
    for rank in (0, 2):
        assert (
            f"[worker:{rank}] worker {rank}: generation 1: members [0, 2] (lost), 2 replicas, "
            "resuming at step 5" in lines
        )
    # 5 steps of 24 examples, the epoch's other 120 in steps of 16; then 15 steps of 16
    assert (
        "[worker:0] worker 0: epoch 1: loss sum" in out.stdout and "28 steps so far" in out.stdout
    )
    sums = {ln.split("weights checksum ")[1] for ln in lines if "weights checksum" in ln}
    assert len(sums) == 1, lines


def _scale(cluster_dir: pathlib.Path, workers: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "chief.scale", "--workers", str(workers),
         "--cluster-dir", str(cluster_dir), "--timeout", "30"],
        env=child_env(), cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_psflow_scale_adds_a_worker_to_a_running_group_and_drains_it(tmp_path):
    """psflow local --workers-max: psflow scale --workers starts a worker that the group
    admits, then drains it (SIGTERM, exit 0); a count above the maximum changes nothing."""
    control, log = tmp_path / "control", tmp_path / "local.log"
    with open(log, "wb") as f:
        launcher = subprocess.Popen(
            [
                sys.executable, "-m", "chief.local", "--mode", "multi-worker", "--workers", "2",
                "--elastic", "--workers-max", "3", "--cluster-dir", str(control),
                str(ROOT / "examples" / "multi_worker_elastic.py"),
                # 30 steps of 0.5 s: the join and the drain come within the first
                # few steps; the rest is margin for a slow start on a loaded host
                "--epochs", "2", "--step-sleep", "0.5",
            ],
            env=child_env(), cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        _wait_for(log, "[worker:1] worker 1: 2 replicas", launcher, 60)
        over = _scale(control, 4)
        assert over.returncode == 2 and "above the cluster's --workers-max 3" in over.stderr
        up = _scale(control, 3)
        assert up.returncode == 0 and "started worker:2" in up.stdout, up.stdout + up.stderr
        _wait_for(log, "generation 1: members [0, 1, 2] (joined), 3 replicas", launcher, 90)
        down = _scale(control, 2)
        assert down.returncode == 0 and "asked worker:2 to drain" in down.stdout, down.stderr
        assert launcher.wait(180) == 0, log.read_text()[-4000:]
    finally:
        _reap([launcher])
    text = log.read_text(errors="replace")
    assert "worker:2 exited with status 0" in text, text[-4000:]
    assert "[worker:2] worker 2: 3 replicas, global batch 16" in text  # the group's batch
    for rank in (0, 1):
        assert f"[worker:{rank}] worker {rank}: generation 2: members [0, 1] (drained)" in text
    sums = {ln.split("weights checksum ")[1] for ln in text.splitlines() if "checksum" in ln}
    assert len(sums) == 1, text[-4000:]
    assert not control.exists()  # the launcher removed its control directory

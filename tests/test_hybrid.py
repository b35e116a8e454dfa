"""Hybrid mode: MultiWorkerMirroredStrategy with ``ps`` tasks keeps its embedding table on the PS.

Real processes on 127.0.0.1: one ``ps_server`` and two workers running
``tests/hybrid_scenario.py`` (a DynamicEmbedding on the PS under a mirrored
dense tower, Adam).  Each case checks against one process with the table in
process that trains on the same per-step global batches:

* the dense weights and every table row agree to ``atol=1e-6, rtol=1e-5``:
  the workers sum each id's gradient rows per replica, then over replicas,
  one process over the whole batch at once (a few float32 ulps per step);
* a worker SIGKILLed in elastic mode (in its forward pass, or after its
  update while the survivor's next collective fails: the step is dropped
  and redone on other examples, so a push issued before the commit would
  leave the first try's gradient applied; once the group committed a step,
  before or after it pushed its part of that step's table gradient) leaves
  the survivor to finish, every example trained once per epoch, and the
  rows equal to the reference's: a part pushed twice, or lost, or from the
  dropped try, moves them by a whole Adam step;
* a worker killed and started again joins the running elastic hybrid group:
  it takes the group's run id with its state, trains with it, and the rows
  equal the reference's over the same membership;
* a PS that dies for good ends every worker with a typed error, not a hang;
* the PS tasks resized 1 -> 2 -> 1 between steps (every worker calls
  ``resize_parameter_servers`` at the same boundary, worker 0 moves the rows)
  leave the rows equal to the reference's, and the task removed drains; a
  resize naming a PS that is not running fails on every worker, typed, within
  its timeout, and the group trains on over the old task; a worker restarted
  after the group resized takes the group's PS tasks with its state.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import psflow as pf
from tests.conftest import ROOT, child_env, pick_free_port
from tests.multi_worker_util import TOKEN, replay_reference
from tests.test_local_cluster import launch  # noqa: F401  (a fixture)

SCENARIO = ROOT / "tests" / "hybrid_scenario.py"
ATOL, RTOL = 1e-6, 1e-5
SAMPLES = 48


def _start_worker(
    tmp: pathlib.Path, cluster: dict, i: int, env: dict[str, str], mode: str, name: str
) -> tuple:
    out, log = tmp / f"{name}.json", tmp / f"{name}.log"
    extra = {
        "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}}),
        "PSFLOW_AUTH_TOKEN": TOKEN,
        "PSFLOW_NUM_CPU_DEVICES": "1",
        "SCENARIO_SEED": str(1 + i),  # worker 0's initial values must win
        **env,
    }
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, str(SCENARIO), mode, str(out)],
            env=child_env(extra),
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
    return proc, out, log


def _cluster(ps: list[str], workers: int) -> dict:
    return {"worker": [f"127.0.0.1:{pick_free_port()}" for _ in range(workers)], "ps": ps}


def _start_workers(
    tmp: pathlib.Path, ps: list[str], workers: int, env: dict[str, str], mode: str = "train"
) -> tuple:
    cluster = _cluster(ps, workers)
    started = [_start_worker(tmp, cluster, i, env, mode, f"w{i}") for i in range(workers)]
    procs, outs, logs = (list(x) for x in zip(*started))
    return procs, outs, logs


def _finish(procs: list, timeout: float) -> list[int | None]:
    deadline = time.monotonic() + timeout
    codes: list[int | None] = []
    for p in procs:
        try:
            codes.append(p.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    for p in procs:  # every child reaped, whatever happened
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            p.wait()
    return codes


def _reference(tmp: pathlib.Path, epochs: list, env: dict[str, str] | None = None) -> dict:
    return replay_reference(SCENARIO, tmp, epochs, env)


def _check(tmp: pathlib.Path, results: list[dict], logs: str) -> None:
    first = results[0]
    for r in results[1:]:
        assert r["dense"] == first["dense"], "workers hold different dense weights"
        assert r["epochs"] == first["epochs"]
    for epoch in first["epochs"]:
        assert sorted(i for step in epoch for i in step) == list(range(SAMPLES)), logs
    want = _reference(tmp, first["epochs"])
    assert first["init"] == want["init"], "the workers did not start from worker 0's values"
    for got, ref in zip(first["dense"], want["dense"]):
        np.testing.assert_allclose(got, ref, atol=ATOL, rtol=RTOL)
    for r in results:  # every worker reads the same rows from the PS
        np.testing.assert_allclose(r["rows"], want["rows"], atol=ATOL, rtol=RTOL)


def _await_survivor_alone(procs: list, logs: list[pathlib.Path]) -> None:
    """Waits (60 s at most) until worker 0 re-formed the group without worker 1."""
    deadline = time.monotonic() + 60
    while "generation 1: members [0]" not in logs[0].read_text(errors="replace"):
        assert time.monotonic() < deadline and procs[0].poll() is None, _logs(logs)
        time.sleep(0.1)


def _one_worker_strategy(ps_address: str) -> pf.distribute.MultiWorkerMirroredStrategy:
    """A hybrid strategy in this process: the group's only worker, one PS task."""
    resolver = pf.distribute.cluster_resolver.SimpleClusterResolver(
        pf.distribute.cluster_resolver.ClusterSpec(
            {"worker": [f"127.0.0.1:{pick_free_port()}"], "ps": [ps_address]}
        ),
        task_type="worker",
        task_id=0,
    )
    return pf.distribute.MultiWorkerMirroredStrategy(resolver)


def _logs(logs: list[pathlib.Path]) -> str:
    return "\n".join(p.read_text(errors="replace")[-3000:] for p in logs)


def test_two_workers_and_a_ps_train_as_one_process_on_the_global_batch(tmp_path, start_ps):
    ps = start_ps(env={"PSFLOW_AUTH_TOKEN": TOKEN})
    procs, outs, logs = _start_workers(tmp_path, [ps.address], 2, {})
    codes = _finish(procs, 90)
    assert codes == [0, 0], _logs(logs) + ps.log_tail()
    results = [json.loads(o.read_text()) for o in outs]
    assert results[0]["replicas"] == 2
    _check(tmp_path, results, _logs(logs))


def test_keras_fit_in_hybrid_mode_trains_as_one_process_on_the_global_batch(tmp_path, start_ps):
    ps = start_ps(env={"PSFLOW_AUTH_TOKEN": TOKEN})
    procs, outs, logs = _start_workers(tmp_path, [ps.address], 2, {}, mode="fit")
    codes = _finish(procs, 90)
    assert codes == [0, 0], _logs(logs) + ps.log_tail()
    results = [json.loads(o.read_text()) for o in outs]
    assert results[0]["dense"] == results[1]["dense"]
    batches = [list(range(k, k + 12)) for k in range(0, SAMPLES, 12)]
    want = _reference(tmp_path, [batches, batches], {"REFERENCE_LOSS": "mean"})
    for got, ref in zip(results[0]["dense"], want["dense"]):
        np.testing.assert_allclose(got, ref, atol=ATOL, rtol=RTOL)
    for r in results:
        np.testing.assert_allclose(r["rows"], want["rows"], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("fault", ["forward", "after_apply", "before_push", "after_push"])
def test_a_worker_killed_in_elastic_hybrid_mode_loses_no_table_update(tmp_path, start_ps, fault):
    # two PS tasks: worker r pushes what task r holds, so the lost worker had a part to push
    ps = [start_ps(env={"PSFLOW_AUTH_TOKEN": TOKEN}) for _ in range(2)]
    env = {"ELASTIC": "1", "FAULT": fault, "FAULT_RANK": "1", "FAULT_STEP": "2"}
    procs, outs, logs = _start_workers(tmp_path, [p.address for p in ps], 2, env)
    codes = _finish(procs, 120)
    assert codes[0] == 0 and codes[1] == -signal.SIGKILL, _logs(logs)
    survivor = json.loads(outs[0].read_text())
    assert [c["reason"] for c in survivor["changes"]] == ["lost"]
    assert survivor["replicas"] == 1
    _check(tmp_path, [survivor], _logs(logs))


def test_a_restarted_worker_rejoins_an_elastic_hybrid_group_and_its_pushes_apply_once(
    tmp_path, start_ps
):
    # two PS tasks: in the group of two the joiner (rank 1) pushes what task 1 holds
    ps = [start_ps(env={"PSFLOW_AUTH_TOKEN": TOKEN}) for _ in range(2)]
    cluster = _cluster([p.address for p in ps], 2)
    # ALONE_SLEEP: the survivor, alone, still trains when the restarted worker is up
    env = {"ELASTIC": "1", "SCENARIO_TIMEOUT": "10", "ALONE_SLEEP": "1.0"}
    fault = {"FAULT": "forward", "FAULT_RANK": "1", "FAULT_STEP": "1"}
    first = [
        _start_worker(tmp_path, cluster, i, {**env, **fault}, "train", f"w{i}") for i in (0, 1)
    ]
    procs, outs, logs = (list(x) for x in zip(*first))
    again = None
    try:
        assert procs[1].wait(60) == -signal.SIGKILL, _logs(logs)
        _await_survivor_alone(procs, logs)
        # worker 1 again in its slot (same TF_CONFIG), as a restarted pod, with its own
        # initial values: the group's state must replace them
        again = _start_worker(tmp_path, cluster, 1, {**env, "SCENARIO_SEED": "99"}, "train", "w1b")
        codes = _finish([procs[0], again[0]], 120)
    finally:
        _finish([*procs, *([again[0]] if again else [])], 1)
    text = _logs([*logs, again[2]])
    assert codes == [0, 0], text
    survivor, joiner = json.loads(outs[0].read_text()), json.loads(again[1].read_text())
    assert [c["reason"] for c in survivor["changes"]] == ["lost", "joined"], text
    assert [c["members"] for c in survivor["changes"]] == [[0], [0, 1]]
    (joined,) = joiner["changes"]
    assert joined["reason"] == "joined"
    assert joined["resumed_step"] == survivor["changes"][1]["resumed_step"]
    assert sum(len(e) for e in joiner["epochs"]) >= 1, text  # it trained with the group
    assert survivor["replicas"] == joiner["replicas"] == 2
    # its pushes carry the group's request ids (a re-push after a re-form is answered once)
    assert joiner["run_id"] == survivor["run_id"]
    # every example once per epoch; the rows equal one process on the same global batches
    # (a part of the joiner's pushed twice or lost moves them by a whole Adam step)
    _check(tmp_path, [survivor], text)
    assert joiner["dense"] == survivor["dense"]
    assert joiner["rows"] == survivor["rows"]


def test_a_ps_that_dies_for_good_ends_every_worker_with_a_typed_error(tmp_path, start_ps):
    ps = start_ps(env={"PSFLOW_AUTH_TOKEN": TOKEN})
    env = {"STEP_SLEEP": "0.3", "SCENARIO_TIMEOUT": "5"}
    procs, outs, logs = _start_workers(tmp_path, [ps.address], 2, env)
    deadline = time.monotonic() + 60
    while "step 2 done" not in logs[0].read_text(errors="replace"):
        assert time.monotonic() < deadline and procs[0].poll() is None, _logs(logs)
        time.sleep(0.05)
    ps.proc.send_signal(signal.SIGKILL)
    started = time.monotonic()
    codes = _finish(procs, 60)
    assert codes == [3, 3], _logs(logs)
    assert time.monotonic() - started < 40
    for out in outs:
        result = json.loads(out.read_text())
        # the worker that failed at the PS names it; its peer may see the ring break first
        assert result["error"] in ("UnavailableError", "DeadlineExceededError", "AbortedError")
        assert issubclass(getattr(pf.errors, result["error"]), pf.errors.OpError)
    messages = " ".join(json.loads(o.read_text())["message"] for o in outs)
    assert "ps:0" in messages or ps.address in messages, messages


def test_the_hybrid_example_trains_the_same_on_both_workers(tmp_path, start_ps):
    ps = start_ps(env={"PSFLOW_AUTH_TOKEN": TOKEN})
    ports = [pick_free_port() for _ in range(2)]
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports], "ps": [ps.address]}
    procs = []
    for i in range(2):
        task = {"type": "worker", "index": i}
        env = {"TF_CONFIG": json.dumps({"cluster": cluster, "task": task})}
        procs.append(
            subprocess.Popen(
                [sys.executable, str(ROOT / "examples" / "multi_worker_hybrid.py")],
                env=child_env({**env, "PSFLOW_AUTH_TOKEN": TOKEN, "PSFLOW_NUM_CPU_DEVICES": "1"}),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                text=True,
            )
        )
    try:
        outputs = [p.communicate(timeout=90)[0] for p in procs]
    finally:
        _finish(procs, 1)
    assert [p.returncode for p in procs] == [0, 0], outputs
    lines = [
        [line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("worker ")]
        for out in outputs
    ]
    assert lines[0] == lines[1] and len(lines[0]) == 4, outputs  # 3 epochs' losses and a row
    losses = [float(line.split()[-1]) for line in lines[0][:3]]
    assert losses[2] < losses[0], outputs


def test_a_table_gradient_without_aggregation_is_refused_naming_the_table(start_ps, monkeypatch):
    from psflow import config

    monkeypatch.setenv("PSFLOW_AUTH_TOKEN", TOKEN)
    # two local replicas: without aggregation each would push its own rows
    monkeypatch.setenv("PSFLOW_NUM_CPU_DEVICES", "2")
    monkeypatch.setattr(config, "_logical", {})
    monkeypatch.setattr(config, "_visible", {})
    ps = start_ps(env={"PSFLOW_AUTH_TOKEN": TOKEN})
    strategy = _one_worker_strategy(ps.address)
    try:
        with strategy.scope():
            table = pf.keras.layers.DynamicEmbedding(2, table_name="refused", seed=1)
            opt = pf.keras.optimizers.SGD(1.0)
        ids = np.array([3, 10**12])
        before = np.asarray(table(ids, training=False))

        def step(aggregate: bool) -> None:
            with pf.GradientTape() as tape:
                loss = pf.reduce_sum(table(ids, training=True))
            grads = tape.gradient(loss, table.trainable_variables)
            opt.apply_gradients(
                zip(grads, table.trainable_variables), experimental_aggregate_gradients=aggregate
            )

        with pytest.raises(pf.errors.UnimplementedError, match="refused"):
            strategy.run(step, args=(False,))
        np.testing.assert_array_equal(table(ids, training=False), before)  # nothing pushed
        assert strategy.num_replicas_in_sync == 2
        strategy.run(step, args=(True,))  # both replicas' rows summed, applied once
        np.testing.assert_allclose(table(ids, training=False), before - 2.0, rtol=1e-6)
    finally:
        strategy.hybrid.session.close()
        pf.distribute.ps.session.set_default(None)


def test_a_joiner_whose_state_came_without_a_run_id_gets_a_typed_error(start_ps, monkeypatch):
    from psflow.collective.cross_host import CrossHostRing
    from psflow.distribute.elastic.state import TrainingState
    from psflow.distribute.hybrid import HybridTables

    monkeypatch.setenv("PSFLOW_AUTH_TOKEN", TOKEN)
    ps = start_ps(env={"PSFLOW_AUTH_TOKEN": TOKEN})
    tables = HybridTables([ps.address], "worker:1", timeout=5)
    try:
        state = TrainingState()  # a group that put no run id into its hand-over
        state.broadcast(CrossHostRing(None), 0, pending=True)
        with pytest.raises(pf.errors.InternalError, match=HybridTables.RUN_ID_KEY):
            tables.take_run_id(state)
        state.extra[HybridTables.RUN_ID_KEY] = "0123456789abcdef"
        state.broadcast(CrossHostRing(None), 0, pending=True)  # the source's extra travels
        tables.take_run_id(state)
        assert tables.run_id == "0123456789abcdef"
    finally:
        tables.session.close()
        pf.distribute.ps.session.set_default(None)


def _resize_workers(tmp: pathlib.Path, ps: list[str], env: dict[str, str]) -> tuple:
    """Two workers resolving their cluster from a file that starts with ``ps[:1]``."""
    from psflow.distribute.cluster_resolver.cluster_file import write_cluster_file

    cluster = _cluster(ps[:1], 2)
    path = tmp / "cluster.json"
    write_cluster_file(str(path), cluster)
    env = {**env, "PSFLOW_CLUSTER_FILE": str(path), "RESIZE_PS": json.dumps(ps)}
    started = [_start_worker(tmp, cluster, i, env, "train", f"w{i}") for i in range(2)]
    return tuple(list(x) for x in zip(*started))


@pytest.mark.parametrize("elastic", ["", "1"], ids=["fixed", "elastic"])
def test_hybrid_workers_resize_the_ps_tasks_between_steps_and_train_as_one_process(
    tmp_path, start_ps, elastic
):
    ps = [start_ps(env={"PSFLOW_AUTH_TOKEN": TOKEN}) for _ in range(2)]
    # 8 steps: 3 on ps:0, 3 on ps:0 and ps:1 (each worker pushes one task's part), 2 on ps:0;
    # elastic: the step before each resize is staged, pushed at the resize's barrier
    env = {"RESIZE": "3:2,6:1", "RESIZE_TIMEOUT": "30", "ELASTIC": elastic}
    procs, outs, logs = _resize_workers(tmp_path, [p.address for p in ps], env)
    codes = _finish(procs, 90)
    assert codes == [0, 0], _logs(logs) + ps[0].log_tail() + ps[1].log_tail()
    results = [json.loads(o.read_text()) for o in outs]
    for r in results:
        assert r["resize_errors"] == [] and r["ps_counts"] == [2, 1], r
    assert ps[1].proc.wait(30) == 0  # the task removed drained and exited
    # a row applied under the wrong map, or a part pushed twice or lost, is off by an Adam step
    _check(tmp_path, results, _logs(logs))


def test_a_hybrid_resize_to_a_ps_that_is_not_running_fails_on_every_worker_and_training_goes_on(
    tmp_path, start_ps
):
    ps = start_ps(env={"PSFLOW_AUTH_TOKEN": TOKEN})
    dead = f"127.0.0.1:{pick_free_port()}"  # listed, never started
    env = {"RESIZE": "3:2", "RESIZE_TIMEOUT": "2"}
    procs, outs, logs = _resize_workers(tmp_path, [ps.address, dead], env)
    codes = _finish(procs, 90)
    assert codes == [0, 0], _logs(logs) + ps.log_tail()
    results = [json.loads(o.read_text()) for o in outs]
    for r in results:
        (failed,) = r["resize_errors"]
        assert failed["error"] in ("PSUnavailableError", "UnavailableError"), failed
        assert "ps:1" in failed["message"], failed
        assert failed["seconds"] < 2 + 10, failed
        assert r["ps_counts"] == [1], r  # still on the old task
    # it trained on over ps:0 alone: the rows equal one process's
    _check(tmp_path, results, _logs(logs))


def test_a_hybrid_resize_refuses_bad_input_naming_it_and_changes_nothing(start_ps, monkeypatch):
    monkeypatch.setenv("PSFLOW_AUTH_TOKEN", TOKEN)
    ps = start_ps(env={"PSFLOW_AUTH_TOKEN": TOKEN})
    strategy = _one_worker_strategy(ps.address)
    try:
        with strategy.scope():
            table = pf.keras.layers.DynamicEmbedding(2, table_name="resize_refused", seed=1)
        ids = np.array([3, 10**12])
        before = np.asarray(table(ids, training=False))
        session = strategy.hybrid.session
        assert strategy.hybrid.watch is None  # a resolver given: no view is followed, no file read
        with pytest.raises(pf.errors.InvalidArgumentError, match="got 0"):
            strategy.resize_parameter_servers(0)
        with pytest.raises(pf.errors.InvalidArgumentError, match="got True"):
            strategy.resize_parameter_servers(True)
        with pytest.raises(pf.errors.InvalidArgumentError, match=r"num_ps=2.*lists 1 ps task"):
            strategy.resize_parameter_servers(2)
        with pytest.raises(pf.errors.InvalidArgumentError, match="timeout -1"):
            strategy.resize_parameter_servers(1, timeout=-1)
        with pytest.raises(pf.errors.FailedPreconditionError, match=r"\(3\).*inside"):
            strategy.run(lambda: strategy.resize_parameter_servers(3))
        assert [c.address for c in session.connections] == [ps.address]
        np.testing.assert_array_equal(table(ids, training=False), before)
        report = strategy.resize_parameter_servers(1, timeout=10)  # the same tasks: a no-op
        assert (report.old_num_ps, report.new_num_ps) == (1, 1)
        np.testing.assert_array_equal(table(ids, training=False), before)
    finally:
        strategy.hybrid.session.close()
        pf.distribute.ps.session.set_default(None)
    mirrored = pf.distribute.MultiWorkerMirroredStrategy()  # no ps tasks: no tables to move
    with pytest.raises(pf.errors.FailedPreconditionError, match="hybrid mode"):
        mirrored.resize_parameter_servers(1)


def test_a_worker_restarted_after_a_hybrid_resize_takes_the_groups_ps_tasks(tmp_path, start_ps):
    ps = [start_ps(env={"PSFLOW_AUTH_TOKEN": TOKEN}) for _ in range(2)]
    addresses = [p.address for p in ps]
    # resized 1 -> 2 -> 1 (ps:1 drained and gone, the file still lists it), then worker 1
    # killed in its forward pass and started again: it must hash over ps:0 alone
    env = {"ELASTIC": "1", "SCENARIO_TIMEOUT": "10", "ALONE_SLEEP": "1.0", "RESIZE_TIMEOUT": "30"}
    fault = {"FAULT": "forward", "FAULT_RANK": "1", "FAULT_STEP": "3", "RESIZE": "2:2,3:1"}
    procs, outs, logs = _resize_workers(tmp_path, addresses, {**env, **fault})
    again = None
    try:
        assert procs[1].wait(60) == -signal.SIGKILL, _logs(logs)
        assert ps[1].proc.wait(30) == 0, _logs(logs)  # drained by the resize back to 1
        _await_survivor_alone(procs, logs)
        view = tmp_path / "cluster.json"  # as worker 0 published it: both PS tasks
        joiner_env = {**env, "SCENARIO_SEED": "99", "RESIZE_FILE": "1"}
        joiner_env["PSFLOW_CLUSTER_FILE"] = str(view)
        cluster = json.loads(view.read_text())["cluster"]
        again = _start_worker(tmp_path, cluster, 1, joiner_env, "train", "w1b")
        codes = _finish([procs[0], again[0]], 120)
    finally:
        _finish([*procs, *([again[0]] if again else [])], 1)
    text = _logs([*logs, again[2]])
    assert codes == [0, 0], text
    survivor, joiner = json.loads(outs[0].read_text()), json.loads(again[1].read_text())
    assert survivor["ps_counts"] == [2, 1] and survivor["resize_errors"] == [], survivor
    assert [c["reason"] for c in survivor["changes"]] == ["lost", "joined"], text
    assert joiner["replicas"] == 2 and sum(len(e) for e in joiner["epochs"]) >= 1, text
    _check(tmp_path, [survivor], text)
    assert joiner["rows"] == survivor["rows"] and joiner["dense"] == survivor["dense"]


# -- psflow local --ps-max and psflow scale --ps: the launcher resizes a hybrid job -------
def _scale(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "chief.scale", *args],
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=ROOT,
        timeout=90,
    )


def _view_ps(cdir: pathlib.Path) -> int:
    return len(json.loads((cdir / "cluster.json").read_text())["cluster"]["ps"])


@pytest.mark.parametrize("elastic", ["", "1"], ids=["fixed", "elastic"])
def test_psflow_scale_resizes_a_running_hybrid_job_1_2_1_and_it_trains_as_one_process(
    launch,  # noqa: F811
    tmp_path,
    elastic,
):
    from tests.conftest import free_port_range
    from tests.test_local_cluster import _env

    cdir = tmp_path / "control"
    base = free_port_range(4)  # worker:0, worker:1, ps:0, ps:1 (a reserved slot)
    # elastic: worker 0's news rides the commit's barrier (before the step), not the push's
    env = {"PSFLOW_NUM_CPU_DEVICES": "1", "GATES": "2,5", "GATE_DIR": str(tmp_path)}
    env = _env({**env, "ELASTIC": elastic})
    launcher = launch(
        "--mode", "multi-worker", "--ps", "1", "--ps-max", "2", "--workers", "2",
        "--port-base", str(base), "--cluster-dir", str(cdir), "--drain-timeout", "60",
        str(SCENARIO), "train", str(tmp_path / "w{rank}.json"), env=env,
    )  # fmt: skip
    for rank in (0, 1):
        launcher.wait_for(rf"^\[worker:{rank}\] gate 2$", timeout=90)
    over = _scale("--ps", "3", "--cluster-dir", str(cdir))
    assert over.returncode == 2 and "--ps 3 is above the cluster's --ps-max 2" in over.stderr
    # ps:1's port taken: its server cannot start; the job stays on ps:0 and says why
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", base + 3))
        squatter.listen()
        failed = _scale("--ps", "2", "--cluster-dir", str(cdir))
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "ps:1 exited with status" in failed.stderr and "still lists 1 PS" in failed.stderr
    assert _view_ps(cdir) == 1
    up = _scale("--ps", "2", "--cluster-dir", str(cdir))
    assert up.returncode == 0 and "started ps:1" in up.stdout, up.stdout + up.stderr
    assert _view_ps(cdir) == 2
    (tmp_path / "gate2").write_text("")  # step 3's barrier carries the news to every worker
    for rank in (0, 1):
        launcher.wait_for(rf"^\[worker:{rank}\] gate 5$", timeout=60)
    down = subprocess.Popen(  # answers once ps:1 drained: after the workers resized
        [sys.executable, "-m", "chief.scale", "--ps", "1", "--cluster-dir", str(cdir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
        cwd=ROOT,
    )
    try:
        deadline = time.monotonic() + 30
        while _view_ps(cdir) != 1:
            assert time.monotonic() < deadline and down.poll() is None, down.communicate()
            time.sleep(0.05)
        time.sleep(0.6)  # worker 0 looks at the view at most every 0.5 s: the next step sees it
        (tmp_path / "gate5").write_text("")
        out, err = down.communicate(timeout=60)
    finally:
        if down.poll() is None:
            down.kill()
            down.wait()
    assert down.returncode == 0 and "drained 1 PS; the view lists 1 PS" in out, out + err
    assert launcher.finish(timeout=90) == 0, launcher.output
    text = launcher.output
    assert "ps:1 drained: exited 0 (PSFLOW_DRAINED); not restarting it" in text, text
    assert re.search(r"^\[ps:1\] PSFLOW_DRAINED task=ps:1 ", text, re.M), text
    results = [json.loads((tmp_path / f"w{rank}.json").read_text()) for rank in (0, 1)]
    # the same PS tasks at the same steps on both workers: step 3's update (elastic: its
    # barrier) carried the news, the next strategy.run (fixed: the scenario's gather of the
    # step's ids; elastic: the step's own) resized first
    for r in results:
        assert r["step_ps"] == [1, 1, 2, 2, 2, 1, 1, 1], (r["step_ps"], text)
    _check(tmp_path, results, text)


def test_worker_0s_view_watch_reports_a_changed_ps_count_at_most_every_interval(tmp_path):
    from psflow.distribute.cluster_resolver import ClusterFileResolver, write_cluster_file
    from psflow.distribute.hybrid import ViewWatch

    path = str(tmp_path / "cluster.json")
    cluster = {"worker": ["127.0.0.1:5000"], "ps": ["127.0.0.1:5001"]}
    write_cluster_file(path, cluster)
    watch = ViewWatch(ClusterFileResolver(path, "worker", 0), interval=0.3)
    assert watch.news() == 0  # the view the strategy started from is no news
    write_cluster_file(path, {**cluster, "ps": ["127.0.0.1:5001", "127.0.0.1:5002"]})
    assert watch.news() == 0  # looked 0.3 s ago at most: not again yet
    time.sleep(0.35)
    assert watch.news() == 2
    time.sleep(0.35)
    assert watch.news() == 0  # unchanged since
    (tmp_path / "cluster.json").write_text("{not json")  # a broken view keeps the old one
    time.sleep(0.35)
    assert watch.news() == 0 and watch.resolver.cluster_spec().num_tasks("ps") == 2
    write_cluster_file(path, cluster)
    time.sleep(0.35)
    assert watch.news() == 1
    watch.forget()  # after a re-form: reported again, unchanged as it is, at once
    assert watch.news() == 1

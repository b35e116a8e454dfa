"""MultiWorkerMirroredStrategy with real worker processes on 127.0.0.1.

Each case starts N processes of ``tests/multi_worker_scenario.py`` with their
TF_CONFIG (see :mod:`tests.multi_worker_util`: bounded, every child reaped)
and compares what they computed with one process, NumPy, or TensorFlow's
documented behaviour.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest

import psflow as pf
from psflow.collective.cross_host import CrossHostRing
from psflow.collective.peer_link import PeerLinks
from psflow.distribute.cluster_resolver import SimpleClusterResolver
from psflow.security.config import SecurityConfig
from tests.conftest import ROOT, child_env
from tests.multi_worker_util import (
    LOST_PEER_FAULTS,
    assert_survivors_name_the_lost_peer,
    ring_links,
    run_reference,
    run_workers,
)

# a ring thread that dies with an exception fails the test that left it behind
pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")

# Summing a gradient over replicas in another order than one process does changes float32
# results by a few ulps per step; 2 epochs of 3 steps keep them within this.
ATOL, RTOL = 1e-6, 1e-5


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    return run_reference(tmp_path_factory.mktemp("reference"))


def _ok(codes: list, logs: list[str]) -> None:
    assert codes == [0] * len(codes), "\n---\n".join(log[-3000:] for log in logs)


@pytest.mark.parametrize(("workers", "devices"), [(2, 1), (3, 1), (2, 2), (3, 2)])
def test_custom_loop_trains_like_one_process_on_the_global_batch(
    tmp_path, reference, workers, devices
):
    codes, results, logs = run_workers(tmp_path, "train", workers, devices=devices)
    _ok(codes, logs)
    for rank, result in enumerate(results):
        assert result["task"] == ["worker", rank]
        assert result["replicas"] == workers * devices
        assert result["should_checkpoint"] is (rank == 0)
        # every worker holds the same bits (each sum is computed once, then copied)
        assert result["weights"] == results[0]["weights"]
        assert result["losses"] == results[0]["losses"]
    # workers started from different seeds: worker 0's broadcast made them equal to the reference
    for got, want in zip(results[0]["weights"], reference["weights"]):
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(results[0]["losses"], reference["losses"], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(("workers", "devices"), [(2, 1), (2, 2), (3, 1)])
def test_sparse_gradients_are_gathered_and_train_like_one_process(tmp_path, workers, devices):
    # Adam on IndexedSlices updates only the rows a step touched (as one process does);
    # densifying the embedding gradient would move the others too.  The dense gradients
    # ride in the rows' gather and are summed by each worker: the same bits on every one
    reference = run_reference(tmp_path, "sparse_reference")
    codes, results, logs = run_workers(tmp_path, "sparse", workers, devices=devices)
    _ok(codes, logs)
    assert results[0]["kinds"] == reference["kinds"] == ["IndexedSlices"]
    assert all(r["weights"] == results[0]["weights"] for r in results)
    for got, want in zip(results[0]["weights"], reference["weights"]):
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)


def test_a_chief_task_is_worker_0_of_the_group(tmp_path, reference):
    codes, results, logs = run_workers(tmp_path, "train", 2, chief=True)
    _ok(codes, logs)
    assert [r["task"] for r in results] == [["chief", 0], ["worker", 0]]
    assert [r["should_checkpoint"] for r in results] == [True, False]
    assert results[0]["replicas"] == 2 and results[0]["weights"] == results[1]["weights"]
    # the chief's seed is the reference's: its initial weights were broadcast
    for got, want in zip(results[0]["weights"], reference["weights"]):
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)


# PSFLOW_SHM: on one host the workers' all-reduce goes through shared memory, unless off
@pytest.mark.parametrize(("workers", "shm"), [(2, "1"), (3, "1"), (3, "0")])
def test_all_reduce_matches_a_float64_numpy_sum(tmp_path, workers, shm):
    codes, results, logs = run_workers(tmp_path, "allreduce", workers, env={"PSFLOW_SHM": shm})
    _ok(codes, logs)
    for k in range(4):  # sizes 0, 1, 7 and 1 MB
        want = sum(np.asarray(r["inputs"][k], np.float64) for r in results)
        got = [np.asarray(r["sums"][k], np.float32) for r in results]
        assert got[0].shape == want.shape
        np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5 * workers)
        assert all(np.array_equal(g, got[0]) for g in got)


def test_auto_shard_data_gives_each_worker_its_slice_of_every_global_batch(tmp_path):
    # TF: DATA rebatches each global batch of 4 into per-replica batches of 4/2 and
    # worker w keeps piece w: step k of both workers covers global batch k exactly
    codes, results, logs = run_workers(tmp_path, "shard_data", 2)
    _ok(codes, logs)
    assert results[0]["steps"] == [[[0, 1]], [[4, 5]], [[8, 9]], [[12, 13]]]
    assert results[1]["steps"] == [[[2, 3]], [[6, 7]], [[10, 11]], [[14, 15]]]


def test_auto_shard_off_gives_every_worker_the_whole_dataset(tmp_path):
    # TF: OFF shards nothing; the per-replica batch is still 4 / 2 replicas
    codes, results, logs = run_workers(tmp_path, "shard_off", 2)
    _ok(codes, logs)
    expected = [[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]]]
    assert results[0]["steps"] == expected
    assert results[1]["steps"] == expected


def test_uneven_last_batch_ends_the_epoch_on_every_worker(tmp_path):
    codes, results, logs = run_workers(tmp_path, "uneven", 2)
    _ok(codes, logs)
    # range(10).batch(4): the last global batch [8, 9] is cut 1 + 1
    assert results[0]["steps"] == [[[0, 1]], [[4, 5]], [[8]]]
    assert results[1]["steps"] == [[[2, 3]], [[6, 7]], [[9]]]
    # datasets of 3 and 1 batches: the short worker feeds empty batches until both are done
    assert results[0]["from_function"] == [[[0, 1]], [[2, 3]], [[4, 5]]]
    assert results[1]["from_function"] == [[[0, 1]], [[]], [[]]]


@pytest.mark.parametrize(("fault", "errors_allowed"), LOST_PEER_FAULTS)
def test_a_lost_worker_gives_every_survivor_a_typed_error_naming_it(
    tmp_path, fault, errors_allowed
):
    timeout = 4.0
    codes, results, logs = run_workers(
        tmp_path,
        "kill",
        3,
        env={"KILL_RANK": "1", "KILL_SIGNAL": fault, "SCENARIO_TIMEOUT": str(timeout)},
        timeout=60,
        wait_for={0, 2},
    )
    assert_survivors_name_the_lost_peer(codes, results, logs, errors_allowed, timeout + 5)


def test_cross_replica_collectives_span_every_worker(tmp_path):
    codes, results, logs = run_workers(tmp_path, "collectives", 2, devices=2)
    _ok(codes, logs)
    assert results[0]["ids"] == [0.0, 1.0] and results[1]["ids"] == [2.0, 3.0]
    for r in results:
        assert r["all_gather"] == [[float(i)] * 2 for i in range(4)]
        assert r["all_reduce_mean"] == [1.5] * 3
        # replica i's value: i + 1 copies of i, concatenated in replica order
        assert r["gather"] == [float(i) for i in range(4) for _ in range(i + 1)]
        assert r["reduce_mean_axis0"] == pytest.approx(20 / 10)
        assert r["reduce_sum"] == 6.0


def test_peers_run_with_the_blas_threads_their_launcher_planned(tmp_path):
    # psflow local hands each peer PSFLOW_BLAS_THREADS; the user's script applies no budget
    # itself, so the strategy must (two peers on 2 cores with 2 spinning OpenBLAS threads
    # each trained 4x slower)
    unset = dict.fromkeys(("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"), "")
    codes, results, logs = run_workers(
        tmp_path, "connect", 2, env={**unset, "PSFLOW_BLAS_THREADS": "1"}
    )
    _ok(codes, logs)
    assert [r["blas_threads"] for r in results] == [1, 1]


def test_a_wrong_token_is_refused_with_unauthenticated(tmp_path):
    codes, results, logs = run_workers(
        tmp_path,
        "connect",
        2,
        env={"SCENARIO_TIMEOUT": "8"},
        per_worker_env={1: {"PSFLOW_AUTH_TOKEN": "some-other-token-abcdefghijklmnop"}},
    )
    assert codes == [3, 3], logs
    assert results[0]["error"] == results[1]["error"] == "UnauthenticatedError"
    assert "worker:1 at 127.0.0.1:" in results[0]["message"]
    assert "invalid token" in results[0]["message"]


# -- in one process ----------------------------------------------------------------------


def test_a_silent_peer_fails_the_collective_at_its_deadline_naming_it():
    links = ring_links(2)
    try:
        ring = CrossHostRing(links[0], timeout=0.5)  # worker 1 never joins the call
        with pytest.raises(pf.errors.DeadlineExceededError, match=r"worker:1 at 127\.0\.0\.1:"):
            ring.all_reduce([np.ones(10, np.float32)])
        # the ring stays broken: the next call fails at once with the same error
        with pytest.raises(pf.errors.DeadlineExceededError, match="worker:1"):
            ring.all_reduce([np.ones(10, np.float32)])
    finally:
        for lk in links:
            lk.close()


def test_all_gather_with_agreed_lengths_skips_their_round_and_checks_them():
    links = ring_links(2)
    try:
        rings = [CrossHostRing(lk, timeout=10.0) for lk in links]
        parts = [np.arange(6, dtype=np.uint8).reshape(3, 2), np.full((1, 2), 9, np.uint8)]
        out: list = [None, None]

        def gather(i: int) -> None:
            out[i] = rings[i].all_gather(parts[i], 0, lengths=[3, 1])

        threads = [threading.Thread(target=gather, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
        for got in out:
            np.testing.assert_array_equal(got, np.concatenate(parts))
        # a length that is not this worker's own size is refused before anything is sent
        with pytest.raises(pf.errors.InvalidArgumentError, match=r"lengths \[2, 1\]"):
            rings[0].all_gather(parts[0], 0, lengths=[2, 1])
    finally:
        for lk in links:
            lk.close()


def test_without_tf_config_it_is_a_single_worker_strategy(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    strategy = pf.distribute.MultiWorkerMirroredStrategy()
    assert strategy.num_replicas_in_sync == 1
    assert strategy.extended.should_checkpoint and strategy.extended.should_save_summary
    with strategy.scope():
        v = pf.Variable([1.0, 2.0])
    assert isinstance(v, pf.distribute.MirroredVariable)
    assert float(strategy.reduce("SUM", strategy.run(lambda: v * 2), axis=None)[1]) == 4.0
    assert pf.distribute.experimental.MultiWorkerMirroredStrategy is type(strategy)
    comm = pf.distribute.experimental.CollectiveCommunication
    assert comm is pf.distribute.experimental.CommunicationImplementation
    assert comm.RING.name == "RING"


def test_a_cluster_with_ps_tasks_runs_the_hybrid_mode_with_its_tables_there():
    resolver = SimpleClusterResolver(
        pf.distribute.cluster_resolver.ClusterSpec(
            {"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:2", "127.0.0.1:3"]}
        ),
        task_type="worker",
        task_id=0,
    )
    strategy = pf.distribute.MultiWorkerMirroredStrategy(resolver)
    try:
        assert [c.address for c in strategy.hybrid.session.connections] == [
            "127.0.0.1:2",
            "127.0.0.1:3",
        ]
        assert strategy.num_replicas_in_sync == 1
    finally:
        strategy.hybrid.session.close()
        pf.distribute.ps.session.set_default(None)


def test_a_ps_job_with_a_missing_task_is_refused_naming_it():
    resolver = SimpleClusterResolver(
        pf.distribute.cluster_resolver.ClusterSpec(
            {"worker": ["127.0.0.1:1"], "ps": {1: "127.0.0.1:2"}}
        ),
        task_type="worker",
        task_id=0,
    )
    with pytest.raises(pf.errors.InvalidArgumentError, match="'ps' has no task 0"):
        pf.distribute.MultiWorkerMirroredStrategy(resolver)


def test_a_task_missing_from_the_cluster_is_refused(monkeypatch):
    config = {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "task": {"type": "ps"}}
    monkeypatch.setenv("TF_CONFIG", json.dumps({**config, "task": {"type": "ps", "index": 0}}))
    with pytest.raises(pf.errors.OpError, match="ps"):
        pf.distribute.MultiWorkerMirroredStrategy()


def _part_files(directory: pathlib.Path, files: int, lines: int = 4) -> pathlib.Path:
    directory.mkdir()
    for f in range(files):
        (directory / f"part-{f}.txt").write_text("".join(f"f{f}-{j}\n" for j in range(lines)))
    return directory


@pytest.mark.parametrize("mode", ["shard_file", "shard_file_auto"])
def test_auto_shard_file_gives_each_worker_every_other_file(tmp_path, mode):
    # TF's FILE policy (AUTO too, when the pipeline reads files): a shard(2, worker) before
    # the reader's input, so of 4 sorted files worker 0 reads part-0 and part-2, worker 1
    # part-1 and part-3; each worker's batches of 4 are then cut into 4 / 2 replicas
    data = _part_files(tmp_path / "data", 4)
    codes, results, logs = run_workers(tmp_path, mode, 2, env={"SCENARIO_FILES": str(data)})
    _ok(codes, logs)
    for worker, files in ((0, (0, 2)), (1, (1, 3))):
        want = [[[f"f{f}-{j}", f"f{f}-{j + 1}"]] for f in files for j in (0, 2)]
        assert results[worker]["steps"] == want, worker


def test_auto_shard_auto_with_fewer_files_than_workers_falls_back_to_data(tmp_path):
    # one file, 2 workers: AUTO shards by DATA (each worker its slice of every global batch)
    data = _part_files(tmp_path / "data", 1, lines=8)
    env = {"SCENARIO_FILES": str(data)}
    codes, results, logs = run_workers(tmp_path, "shard_file_auto", 2, env=env)
    _ok(codes, logs)
    assert results[0]["steps"] == [[["f0-0", "f0-1"]], [["f0-4", "f0-5"]]]
    assert results[1]["steps"] == [[["f0-2", "f0-3"]], [["f0-6", "f0-7"]]]


def test_auto_shard_file_with_fewer_files_than_workers_is_a_typed_error(tmp_path):
    from psflow.data.files import shard_by_files

    data = _part_files(tmp_path / "data", 1)
    names = pf.data.Dataset.list_files(str(data / "*.txt"))
    dataset = names.interleave(pf.data.TextLineDataset, cycle_length=1)
    with pytest.raises(pf.errors.InvalidArgumentError, match="1 input files for 2 workers"):
        shard_by_files(dataset, 2, 0)
    reader = pf.data.TextLineDataset([str(data / "part-0.txt")])
    with pytest.raises(pf.errors.InvalidArgumentError, match="1 input files for 3 workers"):
        shard_by_files(reader.batch(2), 3, 1)


def test_file_shards_of_unseeded_shuffled_names_are_disjoint(tmp_path):
    # every worker shuffles its names with its own entropy: the cut is below the shuffle
    from psflow.data.files import shard_by_files

    data = _part_files(tmp_path / "data", 5, lines=1)
    dataset = pf.data.Dataset.list_files(str(data / "*.txt")).flat_map(pf.data.TextLineDataset)
    shards = [sorted(x.numpy() for x in shard_by_files(dataset, 2, w)) for w in range(2)]
    assert shards == [["f0-0", "f2-0", "f4-0"], ["f1-0", "f3-0"]]


def test_file_shards_equal_tensorflows_auto_shard(tmp_path):
    # the reference: TensorFlow's own auto-shard rewrite of the same pipeline, per worker
    tf = pytest.importorskip("tensorflow")
    from tensorflow.python.data.experimental.ops.distribute import _AutoShardDataset

    from psflow.data.files import shard_by_files

    data = _part_files(tmp_path / "data", 5, lines=3)
    pattern = str(data / "part-*.txt")
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.FILE
    for workers in (2, 3):
        for shuffle in (False, True):  # unseeded: TF cuts below the shuffle too
            ours = pf.data.Dataset.list_files(pattern, shuffle=shuffle)
            ours = ours.interleave(pf.data.TextLineDataset, cycle_length=1)
            theirs = tf.data.Dataset.list_files(pattern, shuffle=shuffle)
            theirs = theirs.interleave(tf.data.TextLineDataset, cycle_length=1)
            for w in range(workers):
                got = [x.numpy() for x in shard_by_files(ours, workers, w)]
                want = [
                    x.decode()
                    for x in _AutoShardDataset(
                        theirs.with_options(options), workers, w
                    ).as_numpy_iterator()
                ]
                assert (sorted(got) if shuffle else got) == (sorted(want) if shuffle else want)


def test_auto_shard_file_raises_not_found_as_tensorflow(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    strategy = pf.distribute.MultiWorkerMirroredStrategy()
    options = pf.data.Options()
    options.experimental_distribute.auto_shard_policy = pf.data.experimental.AutoShardPolicy.FILE
    dataset = pf.data.Dataset.range(4).batch(2).with_options(options)
    with pytest.raises(pf.errors.NotFoundError, match="FILE"):
        strategy.experimental_distribute_dataset(dataset)


def test_an_unreplaced_shard_hint_is_a_typed_error():
    hint = pf.data.experimental.SHARD_HINT
    dataset = pf.data.Dataset.range(4).shard(hint, hint)
    with pytest.raises(pf.errors.InvalidArgumentError, match="SHARD_HINT"):
        list(dataset)


def test_auto_shard_hint_replaces_the_placeholder_by_the_worker_shard(tmp_path):
    # TF: shard(SHARD_HINT, SHARD_HINT) becomes shard(2, worker); each worker's batches of
    # 4 are then rebatched into per-replica batches of 4 / 2 replicas
    codes, results, logs = run_workers(tmp_path, "shard_hint", 2)
    _ok(codes, logs)
    assert results[0]["steps"] == [[[0, 2]], [[4, 6]], [[8, 10]], [[12, 14]]]
    assert results[1]["steps"] == [[[1, 3]], [[5, 7]], [[9, 11]], [[13, 15]]]


@pytest.mark.parametrize(
    ("devices", "samples"),
    [(1, 36), (2, 36), (2, 30)],  # 30: the last global batch of 6 is cut 2 + 2 + 2 + 0
)
def test_keras_fit_trains_like_one_process_and_only_the_chief_checkpoints(
    tmp_path, devices, samples
):
    ref_dir, dirs = tmp_path / "reference", [tmp_path / "w0", tmp_path / "w1"]
    data_env = {"SCENARIO_SAMPLES": str(samples)}
    reference = run_reference(tmp_path, "fit_reference", env={"CKPT_DIR": str(ref_dir), **data_env})
    codes, results, logs = run_workers(
        tmp_path,
        "fit",
        2,
        devices=devices,
        env=data_env,
        per_worker_env={i: {"CKPT_DIR": str(d)} for i, d in enumerate(dirs)},
    )
    _ok(codes, logs)
    assert results[0]["weights"] == results[1]["weights"]
    for got, want in zip(results[0]["weights"], reference["weights"]):
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)
    # the logs are every worker's metric states summed: the same numbers as one process
    for result in results:
        for name, values in reference["history"].items():
            np.testing.assert_allclose(result["history"][name], values, rtol=RTOL)
        for name, value in reference["evaluate"].items():
            assert result["evaluate"][name] == pytest.approx(value, rel=RTOL)
        # predict gives every worker the whole global batch, in order
        np.testing.assert_allclose(result["predictions"], reference["predictions"], atol=1e-5)
    assert sorted(p.name for p in dirs[0].iterdir()) == sorted(p.name for p in ref_dir.iterdir())
    assert not dirs[1].exists() or not any(dirs[1].iterdir())


# -- psflow local --mode multi-worker ----------------------------------------------------


def _local(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "chief.local", *args],
        env=child_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_psflow_local_runs_the_example_as_peer_workers_with_prefixed_logs(tmp_path):
    out = _local(
        "--mode",
        "multi-worker",
        "--workers",
        "2",
        "--devices-per-worker",
        "2",
        str(ROOT / "examples" / "multi_worker_custom_loop.py"),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert "[worker:0] task ('worker', 0): 4 replicas in sync" in lines
    assert "[worker:1] task ('worker', 1): 4 replicas in sync" in lines
    sums = {ln.split("] ", 1)[0]: ln for ln in lines if "weights checksum" in ln}
    assert sums["[worker:0"].split("] ")[1] == sums["[worker:1"].split("] ")[1]
    assert [ln for ln in lines if "chief saved" in ln][0].startswith("[worker:0]")
    assert not any(ln.startswith("[worker:1] chief saved") for ln in lines)


def test_psflow_local_returns_the_status_of_the_worker_that_failed(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(
        "import json, os, sys\n"
        "sys.exit(7 if json.loads(os.environ['TF_CONFIG'])['task']['index'] == 1 else 0)\n"
    )
    out = _local("--mode", "multi-worker", "--workers", "2", str(script), timeout=60)
    assert out.returncode == 7, out.stdout + out.stderr
    assert "worker:1 exited with status 7" in out.stderr


def test_psflow_local_multi_worker_refuses_a_bad_ps_max_naming_it():
    out = _local("--mode", "multi-worker", "--ps-max", "2", "--workers", "2", "x.py", timeout=60)
    assert out.returncode == 2, out.stderr
    assert "--ps-max 2 needs --ps K >= 1, got --ps 0" in out.stderr
    args = ("--mode", "multi-worker", "--ps", "2", "--ps-max", "1", "--workers", "2", "x.py")
    out = _local(*args, timeout=60)
    assert out.returncode == 2 and "--ps-max 1 must be at least --ps 2" in out.stderr, out.stderr
    args = ("--mode", "multi-worker", "--elastic", "--ps", "1", "--ps-max", "2", "--workers")
    out = _local(*args, "2", "--workers-max", "3", "x.py", timeout=60)
    assert out.returncode == 2, out.stderr
    assert "--ps-max 2 and --workers-max 3 are not combined" in out.stderr
    out = _local("--mode", "multi-worker", "--ps", "-1", "--workers", "2", "x.py", timeout=60)
    assert out.returncode == 2, out.stderr
    assert "--ps must be an integer >= 0, got -1" in out.stderr


def test_psflow_local_multi_worker_starts_ps_tasks_for_the_hybrid_example():
    example = str(ROOT / "examples" / "multi_worker_hybrid.py")
    out = _local("--mode", "multi-worker", "--ps", "2", "--workers", "2", example, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert sum(ln.startswith("[ps:") and "PSFLOW_READY ps" in ln for ln in lines) == 2
    rows = {ln.split("] ", 1)[1].split(": ", 1)[1] for ln in lines if "row of user" in ln}
    assert len(rows) == 1, lines  # both workers read the same row from the PS tasks
    losses = [ln for ln in lines if "epoch 2 loss" in ln]
    assert len(losses) == 2 and len({ln.split("loss")[1] for ln in losses}) == 1
    assert "2 parameter servers on 127.0.0.1:" in out.stderr


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="finds the PS through /proc")
def test_a_ps_task_that_dies_for_good_fails_the_hybrid_group_with_its_status(tmp_path):
    script = tmp_path / "kills_ps.py"
    script.write_text(
        "import json, os, signal, sys\n"
        "import numpy as np\n"
        "import psflow as pf\n"
        "strategy = pf.distribute.MultiWorkerMirroredStrategy()\n"
        "with strategy.scope():\n"
        "    table = pf.keras.layers.DynamicEmbedding(4, table_name='t', seed=1)\n"
        "    table(np.arange(4))\n"
        "if strategy.cluster_resolver.task_id == 0:  # ps:0 dies for good\n"
        "    port = json.loads(os.environ['TF_CONFIG'])['cluster']['ps'][0].rsplit(':', 1)[1]\n"
        "    for pid in filter(str.isdigit, os.listdir('/proc')):\n"
        "        try:\n"
        "            argv = open(f'/proc/{pid}/cmdline', 'rb').read().split(b'\\0')\n"
        "        except OSError:\n"
        "            continue\n"
        "        if b'ps_server' in argv and port.encode() in argv:\n"
        "            os.kill(int(pid), signal.SIGKILL)\n"
        "try:\n"
        "    for _ in range(200):\n"
        "        strategy.run(lambda: table(np.arange(4)))\n"
        "        strategy.reduce('SUM', strategy.run(lambda: pf.constant(1.0)), axis=None)\n"
        "except pf.errors.OpError as e:\n"
        "    print('failed', type(e).__name__)\n"
        "    sys.exit(3)\n"
    )
    args = ("--mode", "multi-worker", "--ps", "1", "--workers", "2", "--grace", "5")
    out = _local(*args, str(script), timeout=120)
    assert out.returncode == 128 + signal.SIGKILL, out.stdout + out.stderr
    assert "ps:0 exited with status 137" in out.stderr
    assert "[worker:0] failed" in out.stdout or "[worker:1] failed" in out.stdout


@pytest.mark.parametrize("shm", ["0", "1"])  # the TCP ring's frames, or the barriers', on TLS
def test_the_ring_runs_over_mutual_tls_and_refuses_a_rogue_certificate(tmp_path, shm, monkeypatch):
    monkeypatch.setenv("PSFLOW_SHM", shm)
    from tests.test_auth_tls import make_pki, tls

    pki = make_pki(tmp_path)
    good = tls(pki)
    rng = np.random.default_rng(3)
    inputs = [rng.standard_normal(300_001).astype(np.float32) for _ in range(2)]
    results: list = [None, None]

    def pair(configs: list[SecurityConfig], work: bool) -> list:
        listeners = []
        for _ in range(2):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen(4)
            listeners.append(s)
        addresses = [f"127.0.0.1:{s.getsockname()[1]}" for s in listeners]
        outcomes: list = [None, None]

        def worker(i: int) -> None:
            links = PeerLinks(i, addresses, configs[i], listener=listeners[i])
            try:
                links.connect(5.0)
                if work:
                    results[i] = CrossHostRing(links, 10.0).all_reduce([inputs[i]])[0]
            except pf.errors.OpError as e:
                outcomes[i] = e
            finally:
                links.close()

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        return outcomes

    assert pair([good, good], work=True) == [None, None]
    assert np.array_equal(results[0], results[1])
    np.testing.assert_allclose(results[0], inputs[0].astype(np.float64) + inputs[1], rtol=1e-6)
    # worker 1 presents a certificate of another CA: both sides refuse the link
    outcomes = pair([good, tls(pki, cert="rogue")], work=False)
    assert all(isinstance(e, pf.errors.OpError) for e in outcomes), outcomes
    assert any(isinstance(e, pf.errors.UnauthenticatedError) for e in outcomes), outcomes


def _on_both(links: list[PeerLinks], calls: list) -> list:
    """Runs ``calls[i](CrossHostRing(links[i]))`` on two threads; returns results or errors."""
    out: list = [None, None]

    def run(i: int) -> None:
        try:
            out[i] = calls[i](CrossHostRing(links[i], timeout=5.0))
        except pf.errors.OpError as e:
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_packed_all_reduce_equals_the_float32_sum_bit_for_bit():
    rng = np.random.default_rng(5)
    xs = [[rng.standard_normal(n).astype(np.float32) for n in (5, 0, 33, 1000)] for _ in range(2)]
    links = ring_links(2)
    try:
        packed = _on_both(
            links, [lambda r, i=i: r.all_reduce(xs[i], bytes_per_pack=64) for i in (0, 1)]
        )
        whole = _on_both(links, [lambda r, i=i: r.all_reduce(xs[i]) for i in (0, 1)])
    finally:
        for lk in links:
            lk.close()
    for k in range(4):
        want = xs[0][k] + xs[1][k]  # two workers: one float32 addition per element
        for got in (packed[0][k], packed[1][k], whole[0][k], whole[1][k]):
            assert got.dtype == np.float32 and np.array_equal(got, want)


@pytest.mark.parametrize("shm", ["1", "0"])  # through shared memory, or the TCP ring
def test_a_large_array_is_summed_as_it_arrives_and_its_input_is_left_alone(shm, monkeypatch):
    monkeypatch.setenv("PSFLOW_SHM", shm)
    # one array of several receive pieces (and a ragged last one) takes the path that reads
    # the caller's array in place and sums each piece as it arrives: the inputs must come
    # back unchanged, the sums exact (two workers: one float32 addition per element)
    rng = np.random.default_rng(9)
    xs = [rng.standard_normal(300_007).astype(np.float32) for _ in range(2)]
    kept = [x.copy() for x in xs]
    links = ring_links(2)
    try:
        got = _on_both(links, [lambda r, i=i: r.all_reduce([xs[i]])[0] for i in (0, 1)])
        mean = _on_both(links, [lambda r, i=i: r.all_reduce([xs[i]], divisor=2)[0] for i in (0, 1)])
    finally:
        for lk in links:
            lk.close()
    for x, k in zip(xs, kept):
        assert np.array_equal(x, k)
    want = xs[0] + xs[1]
    for g in got:
        assert g.dtype == np.float32 and np.array_equal(g, want)
        assert not np.shares_memory(g, xs[0]) and not np.shares_memory(g, xs[1])
    assert np.array_equal(mean[0], mean[1])
    assert np.array_equal(mean[0], want / np.float32(2))


def test_workers_calling_different_collectives_fail_with_internal_error():
    links = ring_links(2)
    try:
        out = _on_both(
            links,
            [
                lambda r: r.all_reduce([np.ones(10, np.float32)]),
                lambda r: r.all_reduce([np.ones(12, np.float32)]),
            ],
        )
    finally:
        for lk in links:
            lk.close()
    assert all(isinstance(e, pf.errors.InternalError) for e in out), out
    assert any("different collectives" in str(e) for e in out)


def test_psflow_local_restarts_the_whole_group_on_failure(tmp_path):
    script = tmp_path / "flaky.py"
    script.write_text(
        "import json, os, pathlib, sys\n"
        "import psflow as pf\n"
        "index = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
        "opts = pf.distribute.experimental.CommunicationOptions(timeout_seconds=20)\n"
        "strategy = pf.distribute.MultiWorkerMirroredStrategy(communication_options=opts)\n"
        f"marker = pathlib.Path({str(tmp_path)!r}) / f'ran-{{index}}'\n"
        "first = not marker.exists()\n"
        "marker.touch()\n"
        "if first and index == 1:\n"
        "    sys.exit(5)  # the first generation loses worker 1\n"
        "try:\n"
        "    total = strategy.reduce('SUM', strategy.run(lambda: pf.constant(1.0)), axis=None)\n"
        "except pf.errors.UnavailableError as e:\n"
        "    print('lost', e.task)\n"
        "    sys.exit(0)  # so that the launcher's status is worker 1's, whoever is reaped first\n"
        "print('sum', float(total))\n"
    )
    out = _local(
        "--mode", "multi-worker", "--workers", "2", "--restart", "on-failure",
        "--max-restarts", "1", "--grace", "5", str(script),
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "restarting all of them in their slots (restart 1 of 1)" in out.stderr
    assert "[worker:0] lost worker:1" in out.stdout
    assert "[worker:0] sum 2.0" in out.stdout and "[worker:1] sum 2.0" in out.stdout
    # without restarts the same failure ends the run with worker 1's status
    for marker in tmp_path.glob("ran-*"):
        marker.unlink()
    out = _local("--mode", "multi-worker", "--workers", "2", "--grace", "5", str(script))
    assert out.returncode == 5, out.stdout + out.stderr


def test_intruders_are_refused_and_do_not_keep_the_neighbour_out():
    from psflow.proto import dataplane_pb2
    from psflow.transport.dataplane import auth, frames

    listeners = []
    for _ in range(2):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        listeners.append(s)
    addresses = [f"127.0.0.1:{s.getsockname()[1]}" for s in listeners]
    security = SecurityConfig(token="t" * 20)
    silent = socket.create_connection(listeners[0].getsockname(), timeout=10)  # says nothing
    wrong = socket.create_connection(listeners[0].getsockname(), timeout=10)
    hello = auth.hello(SecurityConfig(token="w" * 20), "worker:1")
    wrong.sendall(frames.pack(frames.Kind.HELLO, header_len=len(hello)) + hello)
    links = [PeerLinks(i, addresses, security, listener=listeners[i]) for i in range(2)]
    threads = [threading.Thread(target=lk.connect, args=(20.0,)) for lk in links]
    try:
        for t in threads:
            t.start()
        raw = wrong.recv(4096)
        head = frames.unpack(raw[: frames.FIXED.size], max_header=4096, max_payload=0)
        status = dataplane_pb2.DataPlaneStatus.FromString(raw[frames.FIXED.size :])
        assert head.kind is frames.Kind.ERROR and status.code == "UNAUTHENTICATED"
        for t in threads:
            t.join(30)
        out = _on_both(links, [lambda r: r.all_reduce([np.ones(3, np.float32)])] * 2)
        assert all(np.array_equal(o[0], np.full(3, 2, np.float32)) for o in out), out
    finally:
        silent.close()
        wrong.close()
        for lk in links:
            lk.close()


def test_the_multi_worker_keras_tutorial_runs_on_two_workers(tmp_path):
    out = _local(
        "--mode", "multi-worker", "--workers", "2",
        str(ROOT / "examples" / "multi_worker_keras_tutorial.py"),
        "--epochs", "2", "--workdir", str(tmp_path), "--min-accuracy", "0.6",
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    finals = {ln.split("] ", 1)[1] for ln in out.stdout.splitlines() if "final training" in ln}
    assert len(finals) == 1  # both workers report the same (all-worker) accuracy
    # the chief wrote the model; the other worker's temporary copy is gone, and so is the backup
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keras-model.keras"]

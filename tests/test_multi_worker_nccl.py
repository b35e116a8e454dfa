"""MultiWorkerMirroredStrategy with NCCL across worker processes, on strict fake GPUs.

Each worker process installs the strict CuPy double with its NCCL double
(tests/strict_cupy.py, tests/strict_nccl.py): NCCL's rules are enforced (one
id, ranks 0..n-1 once each, one rank per GPU, the same collective, count and
type on every rank, device pointers only) and the reduction is done in NumPy
by the id's root in worker 0's process.  These check psflow's cross-host NCCL
path (the id over the authenticated ring, one communicator per GPU, deadlines
and abort); a real GPU run is benchmarks/gpu_check.py's ``gpu/nccl_cross_host``.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tests import strict_cupy
from tests.multi_worker_util import run_reference, run_workers

# The NCCL double sums the W*L replicas' gradients in rank order; the TCP ring sums each
# worker's local replicas first, then across workers: float32 sums in another order,
# so the weights agree to float32 rounding over 6 steps, not bit for bit.
RTOL, ATOL = 1e-5, 1e-6


def _ok(codes: list, logs: list) -> None:
    assert codes == [0] * len(codes), "\n".join(log[-3000:] for log in logs)


def _gpus(local: int, impl: str, **extra: str) -> dict[str, str]:
    return {"SCENARIO_GPUS": str(local), "SCENARIO_IMPL": impl, **extra}


@pytest.mark.parametrize("local", [1, 2])
def test_nccl_across_workers_trains_to_the_weights_of_the_tcp_ring(tmp_path, local):
    (tmp_path / "nccl").mkdir()
    (tmp_path / "ring").mkdir()
    codes, nccl, logs = run_workers(tmp_path / "nccl", "train", 2, env=_gpus(local, "NCCL"))
    _ok(codes, logs)
    codes, ring, logs = run_workers(tmp_path / "ring", "train", 2, env=_gpus(local, "RING"))
    _ok(codes, logs)
    reference = run_reference(tmp_path)
    assert [r["nccl"] for r in nccl] == [True, True]
    assert [r["nccl"] for r in ring] == [False, False]
    assert [r["replicas"] for r in nccl] == [2 * local] * 2
    # every worker ends with the same bits
    assert nccl[0]["weights"] == nccl[1]["weights"]
    assert nccl[0]["losses"] == nccl[1]["losses"]
    for got, want, ref in zip(nccl[0]["weights"], ring[0]["weights"], reference["weights"]):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(got, ref, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(nccl[0]["losses"], reference["losses"], rtol=RTOL)


def test_nccl_all_gather_and_mean_span_every_gpu_of_every_worker(tmp_path):
    codes, results, logs = run_workers(tmp_path, "collectives", 2, env=_gpus(2, "NCCL"))
    _ok(codes, logs)
    assert results[0]["ids"] == [0.0, 1.0] and results[1]["ids"] == [2.0, 3.0]
    for r in results:
        assert r["nccl"]
        assert r["all_gather"] == [[float(i)] * 2 for i in range(4)]
        assert r["all_reduce_mean"] == [1.5] * 3
        assert r["gather"] == [float(i) for i in range(4) for _ in range(i + 1)]
        assert r["reduce_sum"] == 6.0


@pytest.mark.parametrize(
    ("fault", "error", "limit"),
    [
        ("SIGKILL", "UnavailableError", 3.0),  # its connections close: seen at once
        ("SIGSTOP", "DeadlineExceededError", 9.0),  # frozen: the deadline, then the ring's
    ],
)
def test_a_peer_lost_inside_an_nccl_collective_is_named_within_the_deadline(
    tmp_path, fault, error, limit
):
    timeout = 3.0
    codes, results, logs = run_workers(
        tmp_path,
        "kill",
        2,
        env=_gpus(1, "NCCL", KILL_RANK="1", KILL_SIGNAL=fault, SCENARIO_TIMEOUT=str(timeout)),
        timeout=60,
        wait_for={0},
    )
    assert codes[0] == 3, logs[0][-3000:]
    result = results[0]
    assert result["error"] == error, result
    assert "NCCL all-reduce across the NCCL group" in result["message"], result
    assert "worker:1 at 127.0.0.1:" in result["message"], result
    # from the strategy's creation: SIGKILL before the 3 s deadline (0.4 s measured),
    # SIGSTOP within the deadline and the ring's silence bound (6.8 s measured)
    assert result["seconds"] < limit, result


def test_the_unique_id_travels_only_to_authenticated_workers(tmp_path):
    codes, results, logs = run_workers(
        tmp_path,
        "connect",
        2,
        env=_gpus(1, "NCCL", SCENARIO_TIMEOUT="8"),
        per_worker_env={1: {"PSFLOW_AUTH_TOKEN": "some-other-token-abcdefghijklmnop"}},
    )
    assert codes == [3, 3], logs
    assert results[0]["error"] == results[1]["error"] == "UnauthenticatedError"
    assert "worker:1 at 127.0.0.1:" in results[0]["message"]


def test_explicit_nccl_names_the_worker_without_gpus_and_auto_keeps_the_ring(tmp_path):
    (tmp_path / "nccl").mkdir()
    (tmp_path / "auto").mkdir()
    cpu = {1: {"SCENARIO_GPUS": ""}}  # worker 1 has no GPU
    codes, results, logs = run_workers(
        tmp_path / "nccl", "connect", 2, env=_gpus(1, "NCCL"), per_worker_env=cpu
    )
    assert codes == [3, 3], logs
    for r in results:
        assert r["error"] == "FailedPreconditionError", r
        assert "worker:1 at 127.0.0.1:" in r["message"], r
        assert "has no CuPy with NCCL" in r["message"], r
    codes, results, logs = run_workers(
        tmp_path / "auto", "train", 2, env=_gpus(1, "AUTO", SCENARIO_LOG="1"), per_worker_env=cpu
    )
    _ok(codes, logs)
    assert [r["nccl"] for r in results] == [False, False]
    assert results[0]["weights"] == results[1]["weights"]
    for log in logs:  # one line says why
        assert log.count("the TCP ring, not NCCL (worker:1 at 127.0.0.1:") == 1, log


def test_explicit_nccl_without_cupy_is_a_typed_error_naming_it(tmp_path):
    codes, results, logs = run_workers(tmp_path, "connect", 2, env={"SCENARIO_IMPL": "NCCL"})
    assert codes == [3, 3], logs
    for r in results:
        assert r["error"] == "FailedPreconditionError", r
        assert "CuPy with NCCL" in r["message"], r


# -- the NCCL double keeps NCCL's rules -------------------------------------------------------
def _ranks(nccl, uid, n, ranks_devices):
    """Communicators of ``ranks_devices`` [(rank, gpu)], created at once (each blocks)."""
    import cupy

    comms, failures = {}, []

    def create(rank, gpu):
        try:
            with cupy.cuda.Device(gpu):
                comms[rank] = nccl.NcclCommunicator(n, uid, rank)
        except Exception as e:
            failures.append(e)

    threads = [threading.Thread(target=create, args=rd) for rd in ranks_devices]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return comms, failures


def test_the_nccl_double_refuses_what_nccl_refuses(monkeypatch):
    from tests import strict_nccl

    # the rank left alone by a refused one waits for it (for good in NCCL): 1 s here
    monkeypatch.setattr(strict_nccl, "INIT_SECONDS", 1.0)
    with strict_cupy.installed(devices=2, nccl=True):
        import cupy
        from cupy.cuda import nccl

        uid = nccl.get_unique_id()
        assert len(uid) == 128
        with pytest.raises(nccl.NcclError, match="rank 2 is not in"):
            nccl.NcclCommunicator(2, uid, 2)
        forged = (*uid[:20], (uid[20] + 1) % 128, *uid[21:])
        with pytest.raises(nccl.NcclError, match=r"cannot reach|not the one"):
            nccl.NcclCommunicator(2, forged, 0)
        _, failures = _ranks(nccl, uid, 2, [(0, 0), (1, 0)])  # two ranks on GPU 0
        assert any("Duplicate GPU" in str(e) for e in failures), failures
        assert any("not every rank joined" in str(e) for e in failures), failures

        uid = nccl.get_unique_id()
        comms, failures = _ranks(nccl, uid, 2, [(0, 0), (1, 1)])
        assert not failures
        with cupy.cuda.Device(0):
            host = np.ones(4, np.float32)
            dev = cupy.asarray(host)
            out = cupy.empty_like(dev)
            with pytest.raises(nccl.NcclError, match="not live device memory"):
                comms[0].allReduce(host.ctypes.data, out.data.ptr, 4, nccl.NCCL_FLOAT32, 0, 0)
        with cupy.cuda.Device(1):
            other = cupy.ones(4, np.float32)
        with pytest.raises(nccl.NcclError, match="on GPU 1; the communicator is on GPU 0"):
            comms[0].allReduce(other.data.ptr, out.data.ptr, 4, nccl.NCCL_FLOAT32, 0, 0)
        # one thread driving both ranks outside a group: NCCL would deadlock
        with cupy.cuda.Device(0):
            comms[0].allReduce(dev.data.ptr, out.data.ptr, 4, nccl.NCCL_FLOAT32, 0, 0)
            pending = cupy.cuda.Event()
            pending.record()
            assert not pending.done  # rank 1 has not called: asynchronous, as on a GPU
            with pytest.raises(RuntimeError, match="has not finished"):
                out.get()
        with cupy.cuda.Device(1), pytest.raises(nccl.NcclError, match="would deadlock"):
            comms[1].allReduce(other.data.ptr, other.data.ptr, 4, nccl.NCCL_FLOAT32, 0, 0)
        # rank 1 sums 3 elements where rank 0 summed 4: the stream's work fails loudly
        with cupy.cuda.Device(1):
            done = threading.Event()

            def rank1():
                with cupy.cuda.Device(1):
                    comms[1].allReduce(other.data.ptr, other.data.ptr, 3, 7, 0, 0)
                done.set()

            threading.Thread(target=rank1).start()
            assert done.wait(10)
        with cupy.cuda.Device(0), pytest.raises(RuntimeError, match="different collectives"):
            pending.synchronize()
        # abort ends pending work without a result
        with cupy.cuda.Device(0):
            comms[0].allReduce(dev.data.ptr, out.data.ptr, 4, nccl.NCCL_FLOAT32, 0, 0)
            waiting = cupy.cuda.Event()
            waiting.record()
            assert not waiting.done
            comms[0].abort()
            assert waiting.done
            with pytest.raises(nccl.NcclError, match="aborted"):
                comms[0].allReduce(dev.data.ptr, out.data.ptr, 4, nccl.NCCL_FLOAT32, 0, 0)


_GPU_CHECK_PEER = """
import sys
sys.path.insert(0, "benchmarks")
from tests import strict_cupy
import gpu_check
with strict_cupy.installed(devices=1, nccl=True):
    sys.exit(gpu_check.cross_host_peer(4099, 2))
"""


def test_gpu_checks_cross_host_peer_runs_under_the_double():
    """benchmarks/gpu_check.py's gpu/nccl_cross_host workers, on the strict double."""
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT, child_env, pick_free_port
    from tests.multi_worker_util import TOKEN, tf_config

    ports = [pick_free_port() for _ in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _GPU_CHECK_PEER],
            env=child_env({"TF_CONFIG": tf_config(ports, i), "PSFLOW_AUTH_TOKEN": TOKEN}),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for i in range(2)
    ]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-3000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    assert [o["nccl"] for o in outs] == [True, True]
    assert outs[0]["digest"] == outs[1]["digest"]
    assert max(o["rel_err"] for o in outs) <= 1e-6

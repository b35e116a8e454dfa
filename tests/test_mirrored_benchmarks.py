"""The MirroredStrategy and multi-worker benchmarks and the GPU check run and print the shared JSON format."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT, child_env

pytestmark = pytest.mark.slow


def run_script(name: str, *args: str, timeout: float = 240) -> tuple[int, list[dict], str]:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env({"CUDA_VISIBLE_DEVICES": ""}),  # no GPU, even on a machine with one
        cwd=ROOT,
    )
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    return proc.returncode, records, proc.stderr


def test_gpu_check_without_a_gpu_runs_the_cpu_checks_and_says_it_skipped() -> None:
    code, records, stderr = run_script("gpu_check.py", "--quick")
    assert code == 0, stderr
    assert all(r["bench"] == "gpu_check" for r in records)
    checks = {r["case"]: r for r in records if r["metric"] == "check"}
    assert set(checks) == {
        *("cpu/assign_host_values", "cpu/train_step", "cpu/fit_arrays", "cpu/metrics"),
        *("cpu/ps_worker", "cpu/mirrored", "cpu/ring"),
    }
    assert all(r["value"] == "pass" for r in checks.values()), checks
    assert checks["cpu/ring"]["busbw_GBps"] > 0 and checks["cpu/ring"]["copy_GBps"] > 0
    skipped = [r for r in records if r["metric"] == "skipped"]
    assert [r["case"] for r in skipped] == ["gpu"]
    assert records[-1]["case"] == "summary" and records[-1]["failed"] == []


def test_mirrored_train_benchmark_prints_throughput_and_ratios() -> None:
    code, records, stderr = run_script(
        "mirrored_train.py",
        *("--no-tf", "--devices", "1,2", "--batches", "8", "--steps", "2", "--warmup", "1"),
        *("--repeats", "1"),
    )
    assert code == 0, stderr
    by_case = {r["case"]: r for r in records}
    assert by_case["tensorflow"]["metric"] == "skipped"
    for n in (1, 2):
        r = by_case[f"psflow/devices={n}/batch=8"]
        assert r["metric"] == "throughput" and r["unit"] == "steps/s" and r["value"] > 0
    ratio = by_case["psflow_scaling/devices=2/batch=8"]
    assert ratio["metric"] == "ratio" and ratio["value"] > 0
    # the same seeded training on 1 and 2 devices ends at the same loss
    assert by_case["psflow/devices=1/batch=8"]["final_loss"] == pytest.approx(
        by_case["psflow/devices=2/batch=8"]["final_loss"], rel=1e-4
    )


def test_multi_worker_benchmark_prints_bandwidths_and_training_against_the_stream() -> None:
    # without TensorFlow (this venv) and the veth link: psflow's rows, the bare streams,
    # and one "skipped" line per side left out
    code, records, stderr = run_script(
        "multi_worker.py", "--quick", "--no-tf", "--no-veth", "--steps", "10"
    )
    assert code == 0, stderr
    assert all(r["bench"] == "multi_worker" for r in records)
    skipped = {r["case"] for r in records if r["metric"] == "skipped"}
    assert skipped == {"tensorflow"}
    bus = {r["case"]: r for r in records if r["metric"] == "busbw"}
    ours = {c: r for c, r in bus.items() if c.startswith("allreduce/")}
    # on loopback psflow twice: its default (the same-host shared memory) and the TCP ring
    assert set(ours) == {
        f"allreduce/loopback/workers=2/{mb}MB/{side}"
        for mb in (1, 16)
        for side in ("psflow", "psflow-tcp")
    }
    for r in ours.values():  # busbw = algbw * 2(N-1)/N, N = 2
        assert r["value"] > 0 and r["value"] == pytest.approx(r["algbw_GBps"], rel=1e-3)
    # the bare ring stream: the same 2 processes each send 2(N-1)/N * S = S right
    rings = {c: r for c, r in bus.items() if c.startswith("ring_stream/")}
    assert set(rings) == {f"ring_stream/loopback/workers=2/{mb}MB" for mb in (1, 16)}
    for mb in (1, 16):
        r = rings[f"ring_stream/loopback/workers=2/{mb}MB"]
        want = (mb << 20) / r["seconds"] / 1e9  # the value is rounded to 4 decimals
        assert r["value"] == pytest.approx(want, rel=1e-3, abs=1e-4)
    vs_ring = [r for r in records if r["case"].startswith("psflow_vs_ring_stream/")]
    assert len(vs_ring) == 2 and all(r["value"] > 0 for r in vs_ring)
    tcp_vs_ring = [r for r in records if r["case"].startswith("psflow_tcp_vs_ring_stream/")]
    assert len(tcp_vs_ring) == 2 and all(r["value"] > 0 for r in tcp_vs_ring)
    # rank 0's CPU per call on both sides, and their ratio
    assert all(r["cpu_ms_per_call"] > 0 for r in [*ours.values(), *rings.values()])
    vs_cpu = [r for r in records if r["case"].startswith("psflow_vs_ring_stream_cpu/")]
    assert len(vs_cpu) == 2 and all(r["value"] > 0 for r in vs_cpu)
    streams = [r for r in records if r["case"].startswith("stream/loopback/")]
    assert len(streams) == 2 and all(r["value"] > 0 for r in streams)
    shares = [r for r in records if r["case"].startswith("host_share/")]
    assert len(shares) == 4 and all(r["value"] > 0 for r in shares)  # psflow, psflow-tcp
    train = {r["case"]: r for r in records if r["case"].startswith("train/")}
    assert set(train) == {
        f"train/mlp/workers=2/batch={b}/{side}"
        for b in (64, 256)
        for side in ("psflow", "psflow-tcp")
    }
    assert all(r["value"] > 0 and r["cpu_ms_per_step"] > 0 for r in train.values())

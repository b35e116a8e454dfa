"""The local-training benchmark runs and speaks BENCHMARKS.md's JSON format."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_train_local_benchmark_prints_json_lines_and_a_table() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "train_local.py"),
            "--quick",
            "--no-tf",
            "--reps",
            "1",
            "--batches",
            "32",
            "--threads",
            "1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    assert all(r["bench"] == "train_local" for r in records)
    assert {"case": "tf.keras", "metric": "skipped"}.items() <= records[0].items()
    by_case: dict[str, dict[str, dict]] = {}
    products: dict[str, dict] = {}
    for r in records[1:]:
        if r["case"].startswith("products/"):
            products[r["side"]] = r
        else:
            by_case.setdefault(r["case"], {})[r["metric"]] = r
    assert set(by_case) == {
        "fit/mlp-784-512-512-10/b32",
        "fit/cnn-conv32-pool-dense64-10-28x28/b32",
    }
    # the MLP step's products alone, both ways; no share of a budget without tf.keras
    assert set(products) == {"psflow kernels", "numpy blas"}
    for r in products.values():
        assert r["case"] == "products/mlp-784-512-512-10/b32" and r["metric"] == "ms_per_step"
        assert r["value"] > 0 and r["n"] == 1
    for by_metric in by_case.values():
        assert set(by_metric) == {"steps_per_s", "examples_per_s"}
        steps, examples = by_metric["steps_per_s"], by_metric["examples_per_s"]
        assert steps["side"] == "psflow" and steps["unit"] == "steps/s"
        assert steps["value"] > 0 and steps["n"] == 1
        assert examples["value"] == pytest.approx(steps["value"] * 32)
        assert steps["steps_per_epoch"] == 128 and steps["final_loss"] > 0
    assert "examples/s" in proc.stderr and "cnn" in proc.stderr and "mlp" in proc.stderr


def test_the_products_share_is_the_faster_products_over_a_step_one_and_a_half_times_tfs(
    capsys,
) -> None:
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import train_local
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    floors = {64: [{"kernels_ms": 2.0, "blas_ms": 1.5}, {"kernels_ms": 1.0, "blas_ms": 1.7}]}
    table = [("mlp", 64, "psflow", 400.0, 25600.0), ("mlp", 64, "tf.keras", 250.0, 16000.0)]
    rows = train_local._floor_records(floors, table)
    # medians 1.5 and 1.6 ms; tf.keras 4 ms a step, so a 1.5x step has 8/3 ms
    assert rows == [(64, 1.5, 1.6, 4.0, pytest.approx(8 / 3), pytest.approx(1.5 * 3 / 8))]
    share = [json.loads(line) for line in capsys.readouterr().out.splitlines()][-1]
    assert share["metric"] == "share_of_1.5x_budget" and share["value"] == pytest.approx(0.5625)
    assert train_local._floor_records(floors, table[:1]) == []  # no tf.keras: no share

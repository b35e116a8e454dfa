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
    for r in records[1:]:
        by_case.setdefault(r["case"], {})[r["metric"]] = r
    assert set(by_case) == {
        "fit/mlp-784-512-512-10/b32",
        "fit/cnn-conv32-pool-dense64-10-28x28/b32",
    }
    for by_metric in by_case.values():
        assert set(by_metric) == {"steps_per_s", "examples_per_s"}
        steps, examples = by_metric["steps_per_s"], by_metric["examples_per_s"]
        assert steps["side"] == "psflow" and steps["unit"] == "steps/s"
        assert steps["value"] > 0 and steps["n"] == 1
        assert examples["value"] == pytest.approx(steps["value"] * 32)
        assert steps["steps_per_epoch"] == 128 and steps["final_loss"] > 0
    assert "examples/s" in proc.stderr and "cnn" in proc.stderr and "mlp" in proc.stderr

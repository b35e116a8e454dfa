"""The CTR workload: the Criteo-shaped generator, exact AUC, and DeepFM on a local cluster."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from psflow.errors import InvalidArgumentError
from psflow.keras.datasets import ctr
from tests.conftest import child_env

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_generator_is_deterministic_and_criteo_shaped():
    a, ya, la = ctr.load_data(3000, seed=5)
    b, yb, lb = ctr.load_data(3000, seed=5)
    assert a["cat"].tobytes() == b["cat"].tobytes() and ya.tobytes() == yb.tobytes()
    assert la.tobytes() == lb.tobytes()
    assert a["dense"].shape == (3000, 13) and a["cat"].shape == (3000, 26)
    # Fields never share ids; ids spread over the whole int64 range.
    per_field = [set(a["cat"][:, f].tolist()) for f in range(26)]
    assert all(per_field[0].isdisjoint(s) for s in per_field[1:])
    assert a["cat"].min() < -(2**60) and a["cat"].max() > 2**60
    # Zipf: the most frequent id of a field covers a large share, most ids are rare.
    _, counts = np.unique(a["cat"][:, 0], return_counts=True)
    assert counts.max() > 0.05 * 3000 and np.mean(counts == 1) > 0.5
    # Another seed draws other examples (under the same hidden truth).
    c, _, _ = ctr.load_data(3000, seed=6)
    assert not np.array_equal(a["cat"], c["cat"])
    assert 0.1 < ya.mean() < 0.6


def test_roc_auc_equals_the_pairwise_definition():
    rng = np.random.default_rng(0)
    labels = rng.random(300) < 0.3
    scores = np.round(rng.random(300), 1)  # many ties
    pos, neg = scores[labels], scores[~labels]
    pairs = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    assert ctr.roc_auc(labels, scores) == pytest.approx(pairs / (pos.size * neg.size), abs=1e-12)
    with pytest.raises(InvalidArgumentError, match="both"):
        ctr.roc_auc(np.ones(3), np.arange(3))
    with pytest.raises(InvalidArgumentError, match="zipf_s"):
        ctr.load_data(10, zipf_s=1.0)


@pytest.mark.slow
def test_deepfm_example_trains_on_a_local_cluster_to_a_useful_auc():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "chief.local",
            "--ps",
            "2",
            "--workers",
            "2",
            "examples/ctr_deepfm.py",
            "--examples",
            "12000",
            "--test-examples",
            "4000",
            "--epochs",
            "2",  # one asynchronous epoch ends anywhere in AUC 0.62-0.68; two in 0.72-0.74
            "--learning-rate",
            "0.1",
            "--min-auc",
            "0.65",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=child_env(),
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads(
        next(
            line[len("[chief] ") :]
            for line in out.stdout.splitlines()
            if line.startswith("[chief] {")
        )
    )
    assert report["auc"] >= 0.65 and report["oracle_auc"] > report["auc"]
    assert len(report["rows"]) == 2 and min(report["rows"]) > 0.4 * max(report["rows"])

"""The shipped digits dataset and the digits example program."""

from __future__ import annotations

import hashlib
import importlib.resources
import importlib.util
import os
import re
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import psflow as pf
from psflow import errors
from psflow.keras.datasets import digits

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "digits_classifier.py")


def _data_file(name: str) -> Any:
    return importlib.resources.files("psflow.keras.datasets").joinpath("data", name)


def test_default_split_shapes_types_and_ranges() -> None:
    (x_train, y_train), (x_test, y_test) = digits.load_data()
    assert x_train.shape == (1437, 8, 8) and x_test.shape == (360, 8, 8)
    assert y_train.shape == (1437,) and y_test.shape == (360,)
    assert x_train.dtype == np.float32 and y_train.dtype == np.uint8
    for x in (x_train, x_test):
        assert x.min() == 0 and x.max() == 16 and (x == np.round(x)).all()
    for y in (y_train, y_test):
        assert set(np.unique(y).tolist()) == set(range(10))
    counts = np.bincount(np.concatenate([y_train, y_test]), minlength=10)
    assert counts.tolist() == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]


def test_split_is_a_deterministic_permutation_of_the_file() -> None:
    a, b = digits.load_data(), digits.load_data()
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u[0], v[0])
        np.testing.assert_array_equal(u[1], v[1])
    (x_tr, y_tr), (x_te, y_te) = a
    everything, labels = digits._read()
    rows = lambda x, y: sorted(map(bytes, np.concatenate([x.reshape(-1, 64), y[:, None]], 1)))  # noqa: E731
    assert rows(np.concatenate([x_tr, x_te]), np.concatenate([y_tr, y_te])) == rows(
        everything, labels
    )
    (x_other, _), _ = digits.load_data(seed=7)
    assert not np.array_equal(x_other, x_tr)
    # The file's first image is a 0 beginning 0,0,5,13,9,1,0,0 (UCI optdigits.tes).
    assert everything[0, 0].tolist() == [0, 0, 5, 13, 9, 1, 0, 0] and labels[0] == 0


@pytest.mark.parametrize(("split", "n_test"), [(0.5, 899), (0.0, 0), (0.25, 450)])
def test_test_split_sizes(split: float, n_test: int) -> None:
    (x_train, _), (x_test, y_test) = digits.load_data(test_split=split)
    assert len(x_test) == len(y_test) == n_test and len(x_train) == 1797 - n_test


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"test_split": 1.0}, "1.0"),
        ({"test_split": -0.1}, "-0.1"),
        ({"test_split": "half"}, "'half'"),
        ({"seed": -1}, "-1"),
        ({"seed": 1.5}, "1.5"),
    ],
)
def test_bad_arguments_name_the_value(kwargs: dict[str, Any], pattern: str) -> None:
    with pytest.raises(errors.InvalidArgumentError, match=re.escape(pattern)):
        digits.load_data(**kwargs)


def test_the_data_file_is_the_one_the_notice_describes() -> None:
    notice = _data_file("NOTICE.txt").read_text()
    assert "CC BY 4.0" in notice and "Alpaydin" in notice
    digest = hashlib.sha256(_data_file("digits.csv.gz").read_bytes()).hexdigest()
    assert f"SHA-256: {digest}" in notice


def test_the_digits_are_reachable_as_keras_datasets() -> None:
    assert pf.keras.datasets.digits is digits


# -- the example ---------------------------------------------------------------------------


def _example_module() -> Any:
    spec = importlib.util.spec_from_file_location("digits_classifier", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_exposes_build_model_load_and_main() -> None:
    example = _example_module()
    (x_train, y_train), (x_test, _) = example.load()
    assert x_train.max() == 1.0 and x_train.dtype == np.float32 and len(x_test) == 360
    model = example.build_model()
    assert model.compiled and model.count_params() == 64 * 64 + 64 + 64 * 10 + 10
    assert model.predict(x_train[:5], verbose=0).shape == (5, 10)
    assert callable(example.main) and y_train.dtype == np.uint8


def _run_example(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, EXAMPLE, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.slow
def test_example_reaches_95_percent_test_accuracy() -> None:
    proc = _run_example("--epochs", "20", "--seed", "0", "--min-accuracy", "0.95")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Epoch 20/20" in proc.stdout  # progress is shown
    match = re.search(r"^test accuracy: (\d\.\d{4}) \(360 digits\)$", proc.stdout, re.M)
    assert match, proc.stdout
    assert float(match.group(1)) >= 0.95


@pytest.mark.slow
def test_example_exits_non_zero_below_min_accuracy() -> None:
    proc = _run_example("--epochs", "1", "--verbose", "0", "--min-accuracy", "1.01")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "below --min-accuracy 1.01" in proc.stdout

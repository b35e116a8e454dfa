"""Seeded randomness: ``psflow.random.set_seed`` makes training reproducible bit for bit."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import psflow as pf

ROOT = Path(__file__).resolve().parents[1]


def train(seed: int | None = 0, steps: int = 5) -> bytes:
    """A small seeded training loop (random init, shuffling, dropout, SGD); the final weights."""
    if seed is not None:
        pf.random.set_seed(seed)
    w1 = pf.Variable(pf.random.truncated_normal([8, 16], stddev=0.3), name="w1")
    b1 = pf.Variable(pf.random.uniform([16], -0.1, 0.1), name="b1")
    w2 = pf.Variable(pf.random.normal([16, 3], stddev=0.3, seed=7), name="w2")
    x = pf.random.normal([32, 8])
    y = pf.random.uniform([32], 0, 3, dtype=pf.int32)
    for _ in range(steps):
        order = pf.random.shuffle(pf.range(32))
        xb, yb = pf.gather(x, order), pf.gather(y, order)
        with pf.GradientTape() as tape:
            h = pf.nn.dropout(pf.nn.relu(pf.matmul(xb, w1) + b1), rate=0.3)
            logits = pf.matmul(h, w2)
            loss = pf.reduce_mean(pf.nn.sparse_softmax_cross_entropy_with_logits(yb, logits))
        for v, g in zip((w1, b1, w2), tape.gradient(loss, [w1, b1, w2])):
            v.assign_sub(0.1 * g)
    return b"".join(v.numpy().tobytes() for v in (w1, b1, w2))


def _train_in_subprocess() -> bytes:
    code = "import sys; from tests.test_random import train; sys.stdout.buffer.write(train())"
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr.decode()
    return proc.stdout


def test_set_seed_makes_training_bit_identical_in_process() -> None:
    first, second = train(0), train(0)
    assert len(first) == (8 * 16 + 16 + 16 * 3) * 4
    assert first == second
    assert train(1) != first


@pytest.mark.slow
def test_set_seed_makes_training_bit_identical_across_processes() -> None:
    a, b = _train_in_subprocess(), _train_in_subprocess()
    assert hashlib.sha256(a).hexdigest() == hashlib.sha256(b).hexdigest()
    assert a == train(0)


def test_unseeded_runs_differ() -> None:
    pf.random.set_seed(None)
    assert pf.random.get_global_seed() is None
    assert train(None, steps=1) != train(None, steps=1)


def test_op_seed_gives_its_own_reproducible_stream() -> None:
    pf.random.set_seed(3)
    a1, a2 = pf.random.normal([4], seed=1), pf.random.normal([4], seed=1)
    pf.random.set_seed(3)
    b1 = pf.random.normal([4], seed=1)
    assert not np.array_equal(a1.numpy(), a2.numpy())  # successive calls differ
    np.testing.assert_array_equal(a1.numpy(), b1.numpy())
    pf.random.set_seed(4)
    assert not np.array_equal(pf.random.normal([4], seed=1).numpy(), a1.numpy())


def test_distributions_have_the_requested_dtype_range_and_moments() -> None:
    pf.random.set_seed(0)
    n = pf.random.normal([20000], mean=2.0, stddev=3.0, dtype=pf.float64).numpy()
    assert n.dtype == np.float64 and abs(n.mean() - 2.0) < 0.1 and abs(n.std() - 3.0) < 0.1
    t = pf.random.truncated_normal([20000], stddev=2.0).numpy()
    assert t.dtype == np.float32 and np.abs(t).max() <= 4.0
    u = pf.random.uniform([20000], 1.0, 3.0).numpy()
    assert u.min() >= 1.0 and u.max() < 3.0 and abs(u.mean() - 2.0) < 0.05
    i = pf.random.uniform([1000], 0, 5, dtype=pf.int64).numpy()
    assert i.dtype == np.int64 and set(i.tolist()) == {0, 1, 2, 3, 4}
    s = pf.random.shuffle(pf.range(100)).numpy()
    assert sorted(s.tolist()) == list(range(100)) and s.tolist() != list(range(100))
    c = pf.random.categorical(pf.constant([[0.0, 50.0, 0.0]]), 5).numpy()
    assert c.tolist() == [[1] * 5]


@pytest.mark.parametrize(
    ("make", "pattern"),
    [
        (lambda: pf.random.set_seed("abc"), r"'abc'"),
        (lambda: pf.random.normal([2, -3]), r"-3"),
        (lambda: pf.random.normal([2], dtype=pf.int32), r"int32"),
        (lambda: pf.random.uniform([2], dtype=pf.int32), r"maxval"),
        (lambda: pf.random.uniform([2], 5, 2, dtype=pf.int32), r"2.*5"),
        (lambda: pf.random.shuffle(pf.constant(1.0)), r"rank"),
    ],
)
def test_bad_random_arguments_raise_naming_the_value(make: object, pattern: str) -> None:
    with pytest.raises(pf.errors.InvalidArgumentError, match=pattern):
        make()  # type: ignore[operator]

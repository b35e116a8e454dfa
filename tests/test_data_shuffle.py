"""shuffle: TF's buffer algorithm, seeding rules and reproducibility."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import psflow as pf
from psflow.data import Dataset
from psflow.data.shuffle import buffer_shuffle


def values(ds):
    return [int(x) for x in ds.as_numpy_iterator()]


def test_buffer_of_one_is_the_identity():
    assert values(Dataset.range(20).shuffle(1, seed=5)) == list(range(20))
    assert values(Dataset.range(20).shuffle(1)) == list(range(20))


def test_full_buffer_gives_a_permutation():
    out = values(Dataset.range(50).shuffle(50, seed=2))
    assert sorted(out) == list(range(50)) and out != list(range(50))
    bigger = values(Dataset.range(50).shuffle(1000, seed=2))
    assert sorted(bigger) == list(range(50))


@pytest.mark.parametrize("buffer", [2, 5, 17])
def test_small_buffer_preserves_elements_and_bounds_displacement(buffer):
    out = values(Dataset.range(200).shuffle(buffer, seed=9))
    assert sorted(out) == list(range(200))
    # An element enters the buffer only after the previous ones: output i is
    # drawn from a buffer holding inputs up to i + buffer - 1.
    assert all(v < i + buffer for i, v in enumerate(out))
    assert out != list(range(200))


def test_algorithm_swaps_the_front_into_the_drawn_slot():
    class Draws:
        """A generator stand-in replaying chosen draws (for the algorithm, not psflow parts)."""

        def __init__(self, draws):
            self.draws = draws

        def integers(self, lo, hi, n, dtype):
            return np.array(self.draws + [0] * (n - len(self.draws)), dtype=dtype)[::-1].copy()

    # Buffer of 3 over 0..4: [0,1,2] draw 1 -> 1, front 0 moves into slot -> [_,0,2] + 3
    # -> queue [0,2,3]; draw 2 -> 3; queue [2,0]+4 -> [2,0,4]; draw 0 -> 2; then 0, 4.
    out = list(buffer_shuffle(iter(range(5)), 3, Draws([1, 2, 0, 0, 0])))
    assert out == [1, 3, 2, 0, 4]


def test_first_position_is_uniform_with_a_full_buffer():
    counts = np.zeros(5)
    for seed in range(2000):
        counts[values(Dataset.range(5).shuffle(5, seed=seed))[0]] += 1
    assert np.all(np.abs(counts / 2000 - 0.2) < 0.04), counts


def test_op_seed_is_reproducible_across_datasets():
    a = values(Dataset.range(30).shuffle(10, seed=42))
    b = values(Dataset.range(30).shuffle(10, seed=42))
    c = values(Dataset.range(30).shuffle(10, seed=43))
    assert a == b and a != c


def test_global_seed_makes_runs_reproducible():
    def run():
        pf.random.set_seed(7)
        return [values(Dataset.range(30).shuffle(30)) for _ in range(2)]

    first, second = run(), run()
    assert first == second
    assert first[0] != first[1]  # two shuffles after one set_seed differ, as in TF


def test_global_and_op_seed_combine():
    pf.random.set_seed(1)
    a = values(Dataset.range(30).shuffle(30, seed=5))
    pf.random.set_seed(2)
    b = values(Dataset.range(30).shuffle(30, seed=5))
    assert a != b


def test_reshuffle_each_iteration():
    ds = Dataset.range(30).shuffle(30, seed=3)
    epochs = [values(ds) for _ in range(3)]
    assert len({tuple(e) for e in epochs}) == 3
    again = Dataset.range(30).shuffle(30, seed=3)
    assert [values(again) for _ in range(3)] == epochs  # deterministically different

    fixed = Dataset.range(30).shuffle(30, seed=3, reshuffle_each_iteration=False)
    assert values(fixed) == values(fixed) == epochs[0]


def test_shuffle_then_repeat_reshuffles_each_epoch():
    out = values(Dataset.range(10).shuffle(10, seed=4).repeat(3))
    epochs = [out[i : i + 10] for i in range(0, 30, 10)]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 3


def test_repeat_then_shuffle_mixes_epochs():
    out = values(Dataset.range(10).repeat(2).shuffle(15, seed=4))
    assert sorted(out) == sorted(list(range(10)) * 2)
    assert sorted(out[:10]) != list(range(10))


@pytest.mark.parametrize("buffer", [1, 3, 10, 64])
def test_plan_and_element_paths_agree(buffer):
    src = Dataset.from_tensor_slices(np.arange(40) * 10)
    fast = src.shuffle(buffer, seed=11).repeat(2)
    slow = src.map(lambda x: x).shuffle(buffer, seed=11).repeat(2)
    assert fast._has_plan() and not slow._has_plan()
    assert values(fast) == values(slow)


def test_unknown_cardinality_buffer_means_whole_input():
    out = values(Dataset.range(20).shuffle(pf.data.UNKNOWN_CARDINALITY, seed=1))
    assert sorted(out) == list(range(20))
    filtered = Dataset.range(20).filter(lambda x: x < 10)
    assert sorted(values(filtered.shuffle(-2, seed=1))) == list(range(10))
    with pytest.raises(pf.errors.InvalidArgumentError, match="infinite"):
        Dataset.range(3).repeat().shuffle(-2)


@pytest.mark.parametrize("bad", [0, -1, -3])
def test_bad_buffer_sizes(bad):
    with pytest.raises(pf.errors.InvalidArgumentError, match=str(bad)):
        Dataset.range(3).shuffle(bad)


def test_shuffle_keeps_cardinality_and_batches():
    ds = Dataset.from_tensor_slices((np.arange(10), np.arange(10) * 2)).shuffle(10, seed=0).batch(4)
    assert int(ds.cardinality()) == 3
    for x, y in ds:
        np.testing.assert_array_equal(y.numpy(), x.numpy() * 2)


_SCRIPT = textwrap.dedent(
    """
    import psflow as pf
    pf.random.set_seed(123)
    ds = pf.data.Dataset.range(40).shuffle(16).batch(8)
    other = pf.data.Dataset.range(9).shuffle(9)
    print([b.numpy().tolist() for b in ds], list(other.as_numpy_iterator()))
    """
)


def test_global_seed_reproducible_across_processes():
    root = str(pathlib.Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    outs = []
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=60, env=env
        )
        assert proc.returncode == 0, proc.stderr
        outs.append(proc.stdout)
    assert outs[0] == outs[1] and outs[0].strip()

"""Sharded variables and sparse embedding updates on parameter servers."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

import psflow as pf
from tests.conftest import ROOT, child_env


def _sharded_strategy(n: int = 2):
    return pf.distribute.ParameterServerStrategy(
        variable_partitioner=pf.distribute.experimental.partitioners.FixedShardsPartitioner(n)
    )


def test_partitioned_variables_split_rows_the_div_way():
    strategy = _sharded_strategy(5)
    with strategy.scope():
        v = pf.Variable(np.arange(13 * 2, dtype=np.float32).reshape(13, 2), name="table")
    assert [s.shape[0] for s in v.variables] == [3, 3, 3, 2, 2]
    assert [s.name for s in v.variables][:2] == ["table/part_0:0", "table/part_1:0"]
    np.testing.assert_array_equal(v.numpy(), np.arange(26, dtype=np.float32).reshape(13, 2))


def test_a_sharded_kernel_reads_whole_and_its_gradient_reaches_every_shard():
    strategy = _sharded_strategy(2)
    with strategy.scope():
        w = pf.Variable(np.arange(8, dtype=np.float32).reshape(4, 2), name="kernel")
    x = pf.constant([[1.0, 2.0, 3.0, 4.0]])
    with pf.GradientTape() as tape:
        y = pf.reduce_sum(pf.matmul(x, w))
    grads = tape.gradient(y, w.variables)
    assert float(y) == float((x.numpy() @ np.arange(8).reshape(4, 2)).sum())
    np.testing.assert_array_equal(
        np.concatenate([g.numpy() for g in grads]),
        np.repeat([[1.0], [2.0], [3.0], [4.0]], 2, axis=1),
    )


def test_embedding_lookup_on_shards_gives_sparse_row_gradients_equal_to_dense():
    strategy = _sharded_strategy(2)
    table = np.random.default_rng(0).normal(size=(10, 3)).astype(np.float32)
    with strategy.scope():
        e = pf.Variable(table, name="emb")
    ids = pf.constant([7, 1, 7, 4])
    weights = pf.constant(np.arange(12, dtype=np.float32).reshape(4, 3))
    with pf.GradientTape() as tape:
        loss = pf.reduce_sum(pf.nn.embedding_lookup(e, ids) * weights)
    grads = tape.gradient(loss, e.variables)
    assert all(isinstance(g, pf.IndexedSlices) for g in grads)
    dense = np.concatenate([pf.convert_to_tensor(g).numpy() for g in grads])
    expected = np.zeros_like(table)
    np.add.at(expected, [7, 1, 7, 4], weights.numpy())
    np.testing.assert_array_equal(dense, expected)


def test_embedding_example_learns_and_pulls_only_touched_rows_embedded():
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "ps_embedding_ctr.py"), "--min-auc", "0.75"],
        capture_output=True,
        text=True,
        timeout=300,
        env=child_env(),
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    _check_report(out.stdout)


def _check_report(stdout: str) -> None:
    auc = float(re.search(r"test AUC (\d\.\d+)", stdout).group(1))
    table_mb = float(re.search(r"table size ([\d.]+) MB", stdout).group(1))
    sent_mb = float(
        re.search(r"sent \(all pulls, dense layers included\): ([\d.]+) MB", stdout).group(1)
    )
    assert auc >= 0.75
    # 1,125 steps each pulling the 32 MB table would move ~36 GB; the rows a batch uses
    # (and the small dense layer) move less than the table holds, for the whole run.
    assert sent_mb < table_mb, (sent_mb, table_mb)


@pytest.mark.slow
def test_embedding_example_on_a_local_cluster_of_two_ps_and_two_workers():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "chief.local",
            "--ps",
            "2",
            "--workers",
            "2",
            "examples/ps_embedding_ctr.py",
            "--min-auc",
            "0.75",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=child_env(),
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    chief = "\n".join(
        line[len("[chief] ") :] for line in out.stdout.splitlines() if line.startswith("[chief] ")
    )
    assert "2 shards on ps tasks [0, 1]" in chief
    _check_report(chief)

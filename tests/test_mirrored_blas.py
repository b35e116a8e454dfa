"""Replicas on logical CPU devices share the cores: each replica's BLAS gets its share of them."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import psflow as pf
from psflow.distribute import replica_pool
from tests.conftest import ROOT, child_env
from tests.test_mirrored_training import logical_cpus


@pytest.mark.parametrize("replicas", [2, 4])
def test_replica_threads_use_their_share_of_blas_threads(replicas: int) -> None:
    found = replica_pool._blas_local_setter()
    if found is None or found[1] is None:
        pytest.skip("the loaded BLAS has no per-thread thread count (not OpenBLAS or MKL)")
    _, blas_threads = found
    share = max(1, replica_pool.available_cores() // replicas)
    with logical_cpus(replicas):
        strategy = pf.distribute.MirroredStrategy()
        per_replica = strategy.run(lambda: pf.constant(blas_threads()))
        seen = [int(n) for n in strategy.experimental_local_results(per_replica)]
    assert len(seen) == replicas
    assert all(1 <= n <= share for n in seen), (seen, share)


def test_limit_is_a_no_op_without_a_known_blas(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(replica_pool, "_blas_found", [None])
    assert replica_pool.limit_blas_threads_in_this_thread(1) is False
    np.ones((4, 4)) @ np.ones((4, 4))  # BLAS still works


# A worker process with a BLAS budget: its replicas split the budget, not the machine's cores.
BUDGETED_REPLICAS = """
import json
import psflow as pf
from psflow import thread_budget
from psflow.distribute import replica_pool

thread_budget.start_process_budget("worker")
found = replica_pool._blas_local_setter()
if found is None or found[1] is None:
    print(json.dumps(None))
else:
    strategy = pf.distribute.MirroredStrategy()
    per_replica = strategy.run(lambda: pf.constant(found[1]()))
    print(json.dumps([int(n) for n in strategy.experimental_local_results(per_replica)]))
"""


@pytest.mark.parametrize(("budget", "replicas", "share"), [(4, 2, 2), (1, 2, 1), (6, 3, 2)])
def test_replicas_split_the_process_budget(budget: int, replicas: int, share: int) -> None:
    env = child_env({"PSFLOW_BLAS_THREADS": str(budget), "PSFLOW_NUM_CPU_DEVICES": str(replicas)})
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.pop(name, None)
    run = subprocess.run(
        [sys.executable, "-c", BUDGETED_REPLICAS],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    seen = json.loads(run.stdout.splitlines()[-1])
    if seen is None:
        pytest.skip("the loaded BLAS has no per-thread thread count (not OpenBLAS or MKL)")
    assert seen == [share] * replicas

"""psflow.memory: the allocator tuning applies when training starts (a tape or an
all-reduce), never on import."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_PROBE = """
import psflow, psflow.memory as m
before = m._TUNED
with psflow.GradientTape():
    pass
print(before, m._TUNED)
"""


def _probe(script: str = _PROBE, **env: str) -> str:
    full = {k: v for k, v in os.environ.items() if k != "PSFLOW_MALLOC_TUNING"}
    full.update(env)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=full
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_first_tape_tunes_malloc_and_import_does_not():
    assert _probe() == "False True"


def test_env_var_keeps_glibc_defaults():
    assert _probe(PSFLOW_MALLOC_TUNING="0") == "False False"


_ALL_REDUCE_PROBE = """
import numpy as np
import psflow.collective as c, psflow.memory as m
before = m._TUNED
c.RingAllReduce().all_reduce([[np.ones(4)], [np.ones(4)]])
print(before, m._TUNED)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_first_all_reduce_tunes_malloc():
    assert _probe(_ALL_REDUCE_PROBE) == "False True"

"""Runs one program under TensorFlow or psflow in a child process and returns its result.

The optional TensorFlow reference tests write a program that imports ``tensorflow``
or ``psflow`` as ``tf`` by its first argument and prints ``RESULT <json>``; both
sides run in fresh processes so neither framework's state leaks into the other.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import child_env


def run_reference_program(program: str, framework: str, timeout: float = 240) -> dict:
    """Runs ``program`` with ``framework`` ("tf" or "psflow") and returns its RESULT document."""
    proc = subprocess.run(
        [sys.executable, "-c", program, framework],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env({"TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])

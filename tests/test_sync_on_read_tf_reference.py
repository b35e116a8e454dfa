"""TensorFlow runs the sync-on-read program; psflow must print the same (and the record).

Optional: runs only where TensorFlow is installed. TensorFlow runs in its own
process (logical devices are fixed per process, and TensorFlow stays out of
the test process).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

import psflow as pf
from tests.conftest import ROOT, child_env
from tests.sync_on_read_scenario import scenario
from tests.test_mirrored_training import logical_cpus
from tests.test_sync_on_read import TF_2_21

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("tensorflow") is None, reason="TensorFlow is not installed"
    ),
]

PROGRAM = r"""
import json
import tensorflow as tf
from tests.sync_on_read_scenario import scenario

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
print("RESULT " + json.dumps(scenario(tf, tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]))))
"""


def test_psflow_and_the_record_match_tensorflow_run_now() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", PROGRAM],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env=child_env({"TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    theirs = json.loads(line[len("RESULT ") :])
    assert theirs == TF_2_21
    with logical_cpus(2):
        ours = scenario(pf, pf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]))
    for key, want in theirs.items():
        assert ours[key] == want, key

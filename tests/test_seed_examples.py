"""The spec's six examples run with only ``import tensorflow as tf`` changed, printing what it shows."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT, child_env

SEEDS = ROOT / "examples" / "seeds"

# TensorFlow's code from the spec pages (shared/seeds/*.ru.txt), per example.
TF_SOURCES = {
    "mirrored_num_replicas.py": (
        "strategy = tf.distribute.MirroredStrategy()\nprint(strategy.num_replicas_in_sync)"
    ),
    "mirrored_run.py": "res = strategy.run(lambda x: x + 1, args=(t,))",
    "ps_num_replicas.py": "strategy = tf.distribute.ParameterServerStrategy(resolver)",
    "ps_variable.py": "v = tf.Variable([1, 2, 3, 4, 5], name='weights')",
    "ps_fit.py": "history = model.fit(x, y, epochs=5, verbose=0)\nprint(history.history['loss'][-1])",
    "mirrored_fit.py": (
        "dist_dataset = strategy.experimental_distribute_dataset(dataset)\n\n"
        "model.fit(dist_dataset, epochs=1)"
    ),
}

EXPECTED = {
    "mirrored_num_replicas.py": r"^1$",
    "mirrored_fit.py": r"^2/2 \[==============================\] - \d+s \d+(us|ms|s)/step - loss: \d+\.\d{4}$",
    "mirrored_run.py": r"^psflow\.Tensor\(\[2 3 4 5 6\], shape=\(5,\), dtype=int32\)$",
    "ps_num_replicas.py": r"^1$",
    "ps_variable.py": re.escape(
        "<psflow.Variable 'weights:0' shape=(5,) dtype=int32, numpy=array([1, 2, 3, 4, 5], dtype=int32)>"
    ),
    "ps_fit.py": r"^\d+\.\d+$",
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_seed_example_prints_what_the_spec_shows(name: str, tmp_path: pathlib.Path) -> None:
    env = child_env({"TF_CONFIG": "", "PSFLOW_NUM_CPU_DEVICES": "1"})
    env.pop("TF_CONFIG")
    out = subprocess.run(
        [sys.executable, str(SEEDS / name)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, out.stdout
    assert re.match(EXPECTED[name], lines[0]), lines[0]


@pytest.mark.parametrize("name", sorted(TF_SOURCES))
def test_seed_example_is_tensorflow_code_but_for_the_import(name: str) -> None:
    text = (SEEDS / name).read_text()
    code = [line for line in text.splitlines() if not line.startswith("#")]
    imports = [line for line in code if line.startswith("import ")]
    assert imports == ["import psflow as tf"]
    assert TF_SOURCES[name] in text
    assert "psflow" not in "\n".join(line for line in code if not line.startswith("import "))

"""Restart and resume with real processes: a program killed or ended, run again, continues.

(a) A MirroredStrategy custom loop (2 logical CPU devices, GradientTape,
    ``CheckpointManager``) is SIGKILLed after a checkpoint and run again: the
    rerun restores into a model not built yet (built by its first
    ``strategy.run``), continues from the saved step, and ends with the
    weights of an uninterrupted run, bit for bit.
(b) A ParameterServerStrategy ``fit`` under ``psflow local`` saves and ends;
    a new ``psflow local`` cluster (fresh, empty PS tasks, another number of
    them) restores the checkpoint: right after the restore the weights, the
    step and the evaluated loss are the saved ones, and fit continues from there.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.conftest import ROOT, child_env
from tests.test_local_cluster import _env, _Launcher

MIRRORED = """
import json, os, sys, time
import numpy as np
import psflow as pf

ckpt_dir, total, slow = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "slow"
strategy = pf.distribute.MirroredStrategy()
assert strategy.num_replicas_in_sync == 2, strategy.num_replicas_in_sync
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 5)).astype("float32")
y = (np.sin(x) @ rng.normal(size=(5, 1))).astype("float32")
GLOBAL_BATCH = 16
init = pf.keras.initializers.GlorotUniform
with strategy.scope():
    model = pf.keras.Sequential([
        pf.keras.layers.Dense(8, activation="relu", kernel_initializer=init(seed=1)),
        pf.keras.layers.Dense(1, kernel_initializer=init(seed=2)),
    ])
    optimizer = pf.keras.optimizers.Adam(0.01)
ckpt = pf.train.Checkpoint(model=model, optimizer=optimizer)
manager = pf.train.CheckpointManager(ckpt, ckpt_dir, max_to_keep=2)
status = ckpt.restore(manager.latest_checkpoint)
start = int(optimizer.iterations)
print("START", start, "BUILT", model.built, flush=True)
ds = pf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(GLOBAL_BATCH).skip(start)
batches = iter(strategy.experimental_distribute_dataset(ds))

def train_step(xb, yb):
    with pf.GradientTape() as tape:
        loss = pf.reduce_sum(pf.square(model(xb, training=True) - yb)) / GLOBAL_BATCH
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss

for step in range(start, total):
    strategy.run(train_step, args=next(batches))
    if step == start and manager.latest_checkpoint:
        status.assert_consumed()  # built and stepped: every saved value (slots too) is in
        print("CONSUMED", flush=True)
    if (step + 1) % 4 == 0:
        manager.save()
        print("SAVED", step + 1, flush=True)
    if slow:
        time.sleep(0.2)
print("RESULT", json.dumps([w.tolist() for w in model.get_weights()]), flush=True)
"""


def _mirrored(script, directory, total: int, slow: bool = False) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(script), str(directory), str(total), "slow" if slow else "fast"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=child_env({"PSFLOW_NUM_CPU_DEVICES": "2"}),
        cwd=ROOT,
    )


def _finish(proc: subprocess.Popen, timeout: float = 120) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    assert proc.returncode == 0, out[-4000:]
    return out


def _weights(out: str) -> list[np.ndarray]:
    match = re.search(r"^RESULT (.*)$", out, re.M)
    assert match, out[-4000:]
    return [np.asarray(w, dtype=np.float32) for w in json.loads(match.group(1))]


def test_a_killed_mirrored_custom_loop_resumes_to_the_uninterrupted_weights(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(MIRRORED)
    total = 16
    reference = _weights(_finish(_mirrored(script, tmp_path / "ref", total)))

    first = _mirrored(script, tmp_path / "ckpt", total, slow=True)
    lines = []
    try:
        deadline = time.monotonic() + 120
        for line in first.stdout:  # bounded: the program ends by itself after `total` steps
            lines.append(line)
            if line.startswith("SAVED 8") or time.monotonic() > deadline:
                break
        first.send_signal(signal.SIGKILL)  # killed for good mid-run, after a checkpoint
    finally:
        first.kill()
        first.communicate(timeout=30)
    assert any(line.startswith("SAVED 8") for line in lines), "".join(lines)[-4000:]
    assert first.returncode == -signal.SIGKILL

    out = _finish(_mirrored(script, tmp_path / "ckpt", total))
    start = int(re.search(r"^START (\d+) BUILT False$", out, re.M).group(1))
    assert 8 <= start < total  # continued from a checkpoint, model built after the restore
    assert "CONSUMED" in out
    for got, want in zip(_weights(out), reference, strict=True):
        np.testing.assert_array_equal(got, want)  # tolerance: none, bit for bit


PSS_FIT = """
import json, sys
import numpy as np
import psflow as pf

ckpt_dir, mode = sys.argv[1], sys.argv[2]
rng = np.random.default_rng(0)
x = rng.normal(size=(256, 6)).astype("float32")
y = (x @ rng.normal(size=(6, 1))).astype("float32")
strategy = pf.distribute.ParameterServerStrategy()
init = pf.keras.initializers.GlorotUniform
with strategy.scope():
    model = pf.keras.Sequential([
        pf.keras.layers.Dense(4, input_shape=(6,), kernel_initializer=init(seed=1)),
        pf.keras.layers.Dense(1, kernel_initializer=init(seed=2)),
    ])
    model.compile(optimizer=pf.keras.optimizers.SGD(0.05, momentum=0.5), loss="mse")
ckpt = pf.train.Checkpoint(model=model)
manager = pf.train.CheckpointManager(ckpt, ckpt_dir, max_to_keep=2)

def report(tag):
    state = {"weights": [w.tolist() for w in model.get_weights()],
             "iterations": int(model.optimizer.iterations),
             "loss": float(model.evaluate(x, y, batch_size=64, verbose=0))}
    print(tag, json.dumps(state), flush=True)

if mode == "first":
    report("INITIAL")
    model.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    manager.save()
    report("SAVED")
else:
    ckpt.restore(manager.latest_checkpoint).assert_consumed()
    report("RESTORED")
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    report("RESUMED")
"""


@pytest.fixture
def launch():
    started: list[_Launcher] = []

    def start(*args: str) -> _Launcher:
        launcher = _Launcher(list(args), _env())
        started.append(launcher)
        return launcher

    try:
        yield start
    finally:
        for launcher in started:
            launcher.reap()


def _state(out: str, tag: str) -> dict:
    match = re.search(rf"^(?:\[chief\] )?{tag} (\{{.*\}})$", out, re.M)
    assert match, out[-5000:]
    return json.loads(match.group(1))


@pytest.mark.slow
def test_a_new_psflow_local_cluster_resumes_a_ps_fit_from_its_checkpoint(launch, tmp_path):
    script = tmp_path / "fit.py"
    script.write_text(PSS_FIT)
    ckpt = str(tmp_path / "ckpt")
    first = launch("--ps", "2", "--workers", "1", str(script), ckpt, "first")
    assert first.finish(timeout=180) == 0, first.output[-5000:]
    initial, saved = _state(first.output, "INITIAL"), _state(first.output, "SAVED")
    assert saved["iterations"] == 3 * 8 and saved["loss"] < 0.5 * initial["loss"]

    # fresh PS tasks (three now) know nothing: everything comes from the checkpoint
    second = launch("--ps", "3", "--workers", "1", str(script), ckpt, "resume")
    assert second.finish(timeout=180) == 0, second.output[-5000:]
    restored, resumed = _state(second.output, "RESTORED"), _state(second.output, "RESUMED")
    assert restored["iterations"] == saved["iterations"]
    for got, want in zip(restored["weights"], saved["weights"], strict=True):
        np.testing.assert_array_equal(np.float32(got), np.float32(want))
    assert restored["loss"] == pytest.approx(saved["loss"], rel=1e-6)
    assert resumed["iterations"] == saved["iterations"] + 8  # continued, not started over
    assert resumed["loss"] <= restored["loss"]

"""BackupAndRestore with dynamic embedding tables: a chief killed mid-fit resumes
from the backup with every table row, slot and counter as the backup holds them.

The chief is a real process killed with SIGKILL after a few steps of an epoch
have changed the table; the restarted chief restores the last backup, and the
table it then trains from must equal the table files of that backup (and differ
from what the killed chief left on the parameter servers).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from psflow.ps.tables import TableRegistry

from .conftest import ROOT, child_env

pytestmark = pytest.mark.slow

CHIEF = textwrap.dedent(
    """
    import glob, json, os, shutil, sys, time
    import numpy as np
    import psflow as pf
    from psflow.distribute.cluster_resolver import ClusterSpec, SimpleClusterResolver

    ps, worker, backup, out = sys.argv[1].split(","), sys.argv[2].split(","), *sys.argv[3:5]
    spec = ClusterSpec({"ps": ps, "worker": worker, "chief": ["127.0.0.1:1"]})
    strategy = pf.distribute.ParameterServerStrategy(
        SimpleClusterResolver(spec, task_type="chief", task_id=0))
    with strategy.scope():
        model = pf.keras.Sequential([
            pf.keras.layers.DynamicEmbedding(4, seed=9, input_shape=(3,), name="emb"),
            pf.keras.layers.Flatten(),
            pf.keras.layers.Dense(1),
        ])
        model.compile(optimizer=pf.keras.optimizers.Adagrad(0.1), loss="mse")
    rng = np.random.default_rng(0)
    x = (rng.zipf(1.3, size=(192, 3)) * 7919).astype(np.int64)
    x[96:] += np.arange(96)[:, None] * 10**9  # ids no earlier step has seen
    y = rng.normal(size=(192, 1)).astype("float32")
    table = model.layers[0].table

    def backups():
        return [d for d in glob.glob(os.path.join(backup, "backup-*"))
                if os.path.exists(os.path.join(d, "checkpoint.json"))]

    class Watch(pf.keras.callbacks.Callback):
        resuming = False
        def on_train_begin(self, logs=None):  # before fit restores a backup
            self.resuming = bool(backups())
            if self.resuming:
                table.save_external(os.path.join(out, "before_restore"))
        def on_epoch_begin(self, epoch, logs=None):
            if self.resuming:  # just restored: keep what it read and what the table holds
                latest = max(backups(), key=lambda d: int(d.rsplit("-", 1)[1]))
                where = json.load(open(os.path.join(latest, "checkpoint.json")))["external"]
                shutil.copytree(os.path.join(latest, next(iter(where.values()))),
                                os.path.join(out, "backup"))
                table.save_external(os.path.join(out, "after_restore"))
            self.resuming = False
            print("EPOCH", epoch, flush=True)
        def on_train_batch_end(self, batch, logs=None):
            print("BATCH", batch, flush=True)
            time.sleep(0.01)

    model.fit(x, y, batch_size=16, epochs=5, verbose=0, shuffle=False,
              callbacks=[pf.keras.callbacks.BackupAndRestore(backup), Watch()])
    print("DONE", flush=True)
    """
)


def _table(directory) -> dict[str, np.ndarray]:
    registry = TableRegistry("reader")
    registry.restore(str(directory), 0, 1)
    state = registry.table("emb").export_state()
    order = np.argsort(state["ids"])
    return {k: (v[order] if v.ndim and v.shape[0] == order.size else v) for k, v in state.items()}


def test_chief_killed_mid_fit_resumes_with_every_table_row_and_slot(start_cluster, tmp_path):
    cluster = start_cluster(num_ps=2, num_workers=1)
    script = tmp_path / "chief.py"
    script.write_text(CHIEF)
    args = [
        sys.executable,
        str(script),
        ",".join(p.address for p in cluster.ps),
        ",".join(w.address for w in cluster.workers),
        str(tmp_path / "backup"),
        str(tmp_path / "out"),
    ]
    log = open(tmp_path / "first.err", "w")  # noqa: SIM115 (closed below)
    first = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=log, text=True, env=child_env(), cwd=ROOT
    )
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 120
        for line in first.stdout:
            seen.append(line.strip())
            # two steps of epoch 3 have changed the table since the last backup
            if seen[-3:-2] == ["EPOCH 3"] or time.monotonic() > deadline:
                break
        first.send_signal(signal.SIGKILL)
    finally:
        first.kill()
        first.wait(30)
        first.stdout.close()
        log.close()
    assert seen[-3:-2] == ["EPOCH 3"], (seen, (tmp_path / "first.err").read_text()[-3000:])
    resumed = subprocess.run(
        args, capture_output=True, text=True, env=child_env(), cwd=ROOT, timeout=120
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    epochs = [line for line in resumed.stdout.splitlines() if line.startswith("EPOCH")]
    assert epochs[0] in ("EPOCH 2", "EPOCH 3") and epochs[-1] == "EPOCH 4", epochs

    backup, restored = (
        _table(tmp_path / "out" / "backup"),
        _table(tmp_path / "out" / "after_restore"),
    )
    before = _table(tmp_path / "out" / "before_restore")
    assert sorted(restored) == sorted(backup) and "slot/accumulator" in backup
    for key in backup:  # ids, rows, slots, last touch, traffic, counters, step
        np.testing.assert_array_equal(restored[key], backup[key], err_msg=key)
    # the killed chief's last steps had moved the table away from the backup
    assert int(before["step"]) > int(backup["step"])
    assert not np.array_equal(before["rows"], backup["rows"])

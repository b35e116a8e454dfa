"""A parameter server lost mid-``fit`` under a model with a dynamic embedding table.

Real PS and worker processes on loopback; the chief is this test process.  A PS
killed with SIGKILL mid-epoch and restarted in its slot comes back empty; the
chief's recovery rolls every PS back to the last backup: the dense variables
AND the table shards (rows, slots, admission counts, ttl clocks), from the same
checkpoint, so training continues from one consistent state.  Killed for good,
the PS makes ``fit`` fail with a typed error naming it, within the recovery
timeout.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import threading
import time

import numpy as np
import pytest

import psflow as pf
from psflow.io.safetensors import load_file
from psflow.ps.key_index import shard_of

pytestmark = pytest.mark.slow

SLACK = 20.0
"""Seconds past the recovery timeout a failing fit may take on a loaded 2-core machine."""


def _model(strategy, optimizer="sgd"):
    with strategy.scope():
        model = pf.keras.Sequential(
            [
                pf.keras.layers.DynamicEmbedding(
                    4, seed=9, input_shape=(3,), name="emb", min_count=5, ttl_steps=40
                ),
                pf.keras.layers.Flatten(),
                pf.keras.layers.Dense(
                    1, kernel_initializer=pf.keras.initializers.GlorotUniform(seed=2)
                ),
            ]
        )
        opt = pf.keras.optimizers.SGD(0.05) if optimizer == "sgd" else optimizer
        model.compile(optimizer=opt, loss="mse")
    return model


def _data(n: int = 192) -> tuple[np.ndarray, np.ndarray]:
    """Zipf ids; the first half of every epoch's batches reach ps:0's shard only, so
    the two table shards take different numbers of steps (each must get its own back)."""
    rng = np.random.default_rng(0)
    x = (rng.zipf(1.3, size=(n, 3)) * 7919).astype(np.int64)
    mine = x[: n // 2]
    while (wrong := shard_of(mine, 2) != 0).any():  # redraw until ps:0 owns them
        mine[wrong] = (rng.zipf(1.3, size=int(wrong.sum())) * 7919).astype(np.int64)
    y = rng.normal(size=(n, 1)).astype(np.float32)
    return x, y


def _table(directory: str) -> dict[int, dict[str, np.ndarray]]:
    """Each PS shard's table state as its task wrote it (the files, not a merge), ids sorted."""
    shards = {}
    for path in glob.glob(os.path.join(directory, "*.tables.json")):
        with open(path) as f:
            manifest = json.load(f)
        arrays = load_file(os.path.join(directory, manifest["data"]), checksums=manifest["sha256"])
        state = {k.partition("\x00")[2]: v for k, v in arrays.items() if k.startswith("emb\x00")}
        order = np.argsort(state["ids"])
        shards[manifest["tables"]["emb"]["shard"]] = {
            k: (v[order] if v.ndim and v.shape[0] == order.size else v) for k, v in state.items()
        }
    assert sorted(shards) == [0, 1], (directory, sorted(shards))
    return shards


class _Watch(pf.keras.callbacks.Callback):
    """Keeps the dense weights and the table at each epoch end (the backups' state),
    kills ps:1 at step ``at``, and keeps what fit trains from after the recovery."""

    def __init__(self, out: str, at: int, kill) -> None:
        super().__init__()
        self.out, self.at, self.kill = out, at, kill
        self.steps = 0
        self.killed = False
        self.after: list[tuple[int, list[np.ndarray], str]] = []
        self.ends: dict[int, tuple[list[np.ndarray], str]] = {}
        self.epochs: list[int] = []

    def _dump(self, name: str) -> str:
        where = os.path.join(self.out, name)
        self.model.layers[0].table.save_external(where)
        return where

    def on_epoch_begin(self, epoch, logs=None):
        self.epochs.append(epoch)
        if self.killed and not self.after:  # fit recovered: what it trains from now
            self.after.append((epoch, self.model.get_weights(), self._dump("after")))

    def on_epoch_end(self, epoch, logs=None):
        self.ends[epoch] = (self.model.get_weights(), self._dump(f"end-{epoch}"))

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        if self.steps == self.at:
            self.killed = True
            self.kill()
        time.sleep(0.005)


def test_restarted_ps_gets_its_table_shard_back_from_the_checkpoint_of_the_dense_variables(
    start_cluster, tmp_path
):
    cluster = start_cluster(num_ps=2, num_workers=1)
    strategy = pf.distribute.ParameterServerStrategy(cluster.resolver())
    model = _model(strategy)
    x, y = _data()

    def kill_ps():
        os.kill(cluster.ps[1].proc.pid, signal.SIGKILL)
        threading.Timer(0.5, lambda: cluster.restart_ps(1)).start()

    watch = _Watch(str(tmp_path), at=28, kill=kill_ps)  # epoch 2 of 4 (12 steps each)
    history = model.fit(
        x,
        y,
        batch_size=16,
        epochs=4,
        verbose=0,
        shuffle=False,
        callbacks=[pf.keras.callbacks.BackupAndRestore(str(tmp_path / "backup")), watch],
    )
    assert len(history.history["loss"]) == 4  # training finished
    assert watch.after, watch.epochs
    epoch, weights, after = watch.after[0]
    assert epoch == 2, watch.epochs  # the last backup was taken at the end of epoch 1
    saved_weights, saved_table = watch.ends[epoch - 1]
    for got, want in zip(weights, saved_weights):  # the dense variables of that backup
        np.testing.assert_array_equal(got, want)
    restored, saved = _table(after), _table(saved_table)
    for shard in (0, 1):  # ... and its table, on the restarted shard and on the other
        assert sorted(restored[shard]) == sorted(saved[shard])
        for key in saved[shard]:  # ids, rows, slots, touched, traffic, candidates, step
            np.testing.assert_array_equal(
                restored[shard][key], saved[shard][key], err_msg=f"ps:{shard} {key}"
            )
    assert saved[1]["ids"].size > 0 and saved[1]["candidate_ids"].size > 0
    assert int(saved[1]["step"]) < int(saved[0]["step"])  # the shards stepped unevenly
    assert np.isfinite(history.history["loss"]).all()


def test_ps_lost_for_good_fails_fit_typed_naming_it_within_the_timeout(
    start_cluster, tmp_path, monkeypatch
):
    timeout = 4.0
    monkeypatch.setenv("PSFLOW_PS_RECOVERY_TIMEOUT", str(timeout))
    monkeypatch.setenv("PSFLOW_PS_PROBE_TIMEOUT", "1")
    cluster = start_cluster(num_ps=2, num_workers=1)
    strategy = pf.distribute.ParameterServerStrategy(cluster.resolver())
    model = _model(strategy)
    x, y = _data()
    killed: list[float] = []

    def kill_ps():
        os.kill(cluster.ps[1].proc.pid, signal.SIGKILL)
        killed.append(time.monotonic())

    watch = _Watch(str(tmp_path), at=16, kill=kill_ps)
    with pytest.raises(pf.errors.PSUnavailableError) as info:
        model.fit(
            x,
            y,
            batch_size=16,
            epochs=20,
            verbose=0,
            shuffle=False,
            callbacks=[pf.keras.callbacks.BackupAndRestore(str(tmp_path / "backup")), watch],
        )
    assert time.monotonic() - killed[0] < timeout + SLACK
    assert info.value.task == "ps:1" and "ps:1" in str(info.value)

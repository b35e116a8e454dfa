"""A chief killed mid-``fit`` and run again ends with the weights of a run never interrupted.

Real processes: two PS tasks, one worker, a chief script.  The
reference run trains uninterrupted on its own fresh cluster; the other chief
kills itself (SIGKILL) in the middle of an epoch, and the same script run again
resumes from its ``BackupAndRestore`` backup.  With one worker and one closure
in flight (``PSFLOW_CLOSURES_IN_FLIGHT=1``) closures run in the order they are
scheduled, so the two runs must agree bit for bit:
dense variables and every table row, slot and counter.  That needs the resumed
run to see each epoch's batches in the same order (the shuffle of epoch ``e``
depends on ``e``, not on how many epochs this process has run) and, with an
integer ``save_freq``, to resume after the last saved step of the epoch, not at
its start (TensorFlow's documented semantics for ``BackupAndRestore``).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import psflow as pf

from .conftest import ROOT, child_env

CHIEF = textwrap.dedent(
    """
    import os, signal, sys
    import numpy as np
    import psflow as pf
    from psflow.distribute.cluster_resolver import ClusterSpec, SimpleClusterResolver

    ps, worker, backup, out = sys.argv[1].split(","), sys.argv[2].split(","), *sys.argv[3:5]
    kill_at, save_freq, optimizer = int(sys.argv[5]), sys.argv[6], sys.argv[7]
    save_freq = save_freq if save_freq == "epoch" else int(save_freq)
    pf.random.set_seed(0)
    spec = ClusterSpec({"ps": ps, "worker": worker, "chief": ["127.0.0.1:1"]})
    strategy = pf.distribute.ParameterServerStrategy(
        SimpleClusterResolver(spec, task_type="chief", task_id=0))
    with strategy.scope():
        model = pf.keras.Sequential([
            pf.keras.layers.DynamicEmbedding(4, seed=9, input_shape=(3,), name="emb",
                                             min_count=2, ttl_steps=30),
            pf.keras.layers.Flatten(),
            pf.keras.layers.Dense(8, activation="tanh"),
            pf.keras.layers.Dense(1),
        ])
        opt = (pf.keras.optimizers.SGD(0.05) if optimizer == "sgd"
               else pf.keras.optimizers.Adam(0.01))
        model.compile(optimizer=opt, loss="mse")
    rng = np.random.default_rng(0)
    x = (rng.zipf(1.3, size=(160, 3)) * 7919).astype(np.int64)
    y = rng.normal(size=(160, 1)).astype("float32")

    class Die(pf.keras.callbacks.Callback):
        steps = 0
        def on_train_batch_end(self, batch, logs=None):
            self.steps += 1
            if self.steps == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    model.fit(x, y, batch_size=16, epochs=4, verbose=0,
              callbacks=[pf.keras.callbacks.BackupAndRestore(backup, save_freq=save_freq), Die()])
    model.layers[0].table.save_external(os.path.join(out, "table"))
    np.savez(os.path.join(out, "weights.npz"), *model.get_weights(),
             iterations=int(model.optimizer.iterations))
    print("DONE", flush=True)
    """
)


def _run(cluster, tmp_path, name: str, kill_at: int, save_freq: str, optimizer: str):
    script = tmp_path / "chief.py"
    script.write_text(CHIEF)
    out = tmp_path / name
    out.mkdir(exist_ok=True)
    args = [
        sys.executable,
        str(script),
        ",".join(p.address for p in cluster.ps),
        ",".join(w.address for w in cluster.workers),
        str(tmp_path / f"{name}-backup"),
        str(out),
        str(kill_at),
        save_freq,
        optimizer,
    ]
    # one closure in flight: the worker runs them in the order they were scheduled (with
    # two, the default, the next one waits on the worker and the two may swap)
    env = child_env({"PSFLOW_CLOSURES_IN_FLIGHT": "1"})
    return subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120), out


def _state(out) -> dict[str, np.ndarray]:
    from psflow.ps.tables import TableRegistry

    weights = dict(np.load(out / "weights.npz"))
    for s in range(2):
        registry = TableRegistry(f"ps:{s}")
        registry.restore(str(out / "table"), s, 2)
        for key, value in registry.table("emb").export_state().items():
            weights[f"table{s}/{key}"] = value
    return weights


@pytest.mark.slow
@pytest.mark.parametrize(
    ("save_freq", "kill_at", "optimizer"),
    # epoch 2 of 4 (10 steps each); with "4", 3 steps after a save. (Adam, whose table
    # shards must each continue from their own step: tests/test_resume_steps.py)
    [("epoch", 25, "sgd"), ("4", 27, "sgd")],
)
def test_resumed_fit_ends_with_the_weights_of_an_uninterrupted_one_with_one_worker(
    start_cluster, tmp_path, save_freq, kill_at, optimizer
):
    reference = start_cluster(num_ps=2, num_workers=1)
    ran, ref_out = _run(reference, tmp_path, "reference", 0, save_freq, optimizer)
    assert ran.returncode == 0 and "DONE" in ran.stdout, ran.stderr[-3000:]
    cluster = start_cluster(num_ps=2, num_workers=1)
    killed, out = _run(cluster, tmp_path, "resumed", kill_at, save_freq, optimizer)
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed, out = _run(cluster, tmp_path, "resumed", 0, save_freq, optimizer)
    assert resumed.returncode == 0 and "DONE" in resumed.stdout, resumed.stderr[-3000:]
    want, got = _state(ref_out), _state(out)
    assert sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


class _Interrupt(pf.keras.callbacks.Callback):
    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.steps = at, 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        if self.steps == self.at:
            raise RuntimeError("interrupted")


def _local_fit(backup, interrupt_at: int | None = None):
    pf.random.set_seed(0)
    model = pf.keras.Sequential(
        [pf.keras.layers.Dense(8, activation="tanh", input_shape=(3,)), pf.keras.layers.Dense(1)]
    )
    model.compile(optimizer=pf.keras.optimizers.SGD(0.05), loss="mse")
    rng = np.random.default_rng(1)
    x = rng.normal(size=(80, 3)).astype(np.float32)
    y = np.tanh(x).sum(axis=1, keepdims=True)

    def fit(callbacks):
        backups = pf.keras.callbacks.BackupAndRestore(str(backup), save_freq=3)
        return model.fit(
            x, y, batch_size=16, epochs=3, verbose=0, shuffle=False, callbacks=[backups, *callbacks]
        )

    if interrupt_at is not None:
        with pytest.raises(RuntimeError, match="interrupted"):
            fit([_Interrupt(interrupt_at)])
    steps = _Interrupt(0)  # counts the steps the (resumed) fit trains
    fit([steps])
    return model.get_weights(), steps.steps


def test_local_fit_resumes_after_the_last_backed_up_batch_of_its_epoch(tmp_path):
    want, steps = _local_fit(tmp_path / "reference")
    got, resumed_steps = _local_fit(tmp_path / "resumed", interrupt_at=8)  # epoch 1, batch 2
    assert (steps, resumed_steps) == (15, 9)  # a backup after 6 steps: 9 of 15 left
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)

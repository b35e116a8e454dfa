"""Surviving failures with real processes: lost workers, lost parameter servers, a restarted chief,
checkpoints across layouts, and crashes while a checkpoint is written."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import psflow as pf
from tests.conftest import ROOT, child_env

pytestmark = pytest.mark.slow


def _data(n: int = 768, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype(np.float32)
    y = (x @ rng.normal(size=(6, 1)) + 0.1).astype(np.float32)
    return x, y


def _model(strategy):
    with strategy.scope():
        model = pf.keras.Sequential(
            [
                pf.keras.layers.Dense(
                    16,
                    activation="tanh",
                    input_shape=(6,),
                    kernel_initializer=pf.keras.initializers.GlorotUniform(seed=1),
                ),
                pf.keras.layers.Dense(
                    1, kernel_initializer=pf.keras.initializers.GlorotUniform(seed=2)
                ),
            ]
        )
        model.compile(optimizer=pf.keras.optimizers.SGD(0.02), loss="mse")
    return model


class _StepCounter(pf.keras.callbacks.Callback):
    def __init__(self, at: int | None = None, action=None) -> None:
        super().__init__()
        self.steps = 0
        self.at, self.action = at, action

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        if self.steps == self.at and self.action is not None:
            self.action()


def test_killed_worker_is_replaced_and_updates_are_applied_once(start_cluster):
    cluster = start_cluster(num_ps=2, num_workers=2)
    strategy = pf.distribute.ParameterServerStrategy(cluster.resolver())
    model = _model(strategy)
    x, y = _data()

    def kill_and_restart():
        os.kill(cluster.workers[1].proc.pid, signal.SIGKILL)
        # The survivor keeps training while the slot restarts (the chief waits here);
        # the rest of the run is long enough for the replacement to take part.
        cluster.restart_worker(1)
        # ... and until the coordinator uses it again: the rest of the run may take less
        # than one health probe's round, and then the replacement would get no closure.
        # The coordinator may see the loss only now (a failed closure or a probe), so
        # wait for it to count the slot down first, then up again: a loaded machine
        # takes seconds for each (CI once counted "2 up" before it saw the loss).
        coordinator = strategy.extended.coordinator
        start = time.monotonic()
        seen_down = False
        while time.monotonic() - start < 120:
            up = coordinator.counters()["workers_up"]
            seen_down = seen_down or up < 2
            if up == 2 and (seen_down or time.monotonic() - start > 20):
                break
            time.sleep(0.05)
        assert coordinator.counters()["workers_up"] == 2, "the replacement was not taken back"

    counter = _StepCounter(at=20, action=kill_and_restart)
    history = model.fit(x, y, batch_size=16, epochs=4, verbose=0, callbacks=[counter])
    assert len(history.history["loss"]) == 4
    from psflow.distribute.coordinator.workers import GrpcWorker

    replacement = GrpcWorker(1, cluster.workers[1].address)
    # The replacement's first closure imports the model's modules (seconds on a loaded
    # machine) while the survivor may run every step left: train on, a bounded number
    # of epochs, until it has finished one.
    for _ in range(20):
        if replacement.status().closures_run > 0:
            break
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[counter])
    stats = strategy.ps_stats()
    for s in stats:  # every step pushes once to each PS task; retries are deduplicated
        assert s["pushes_applied"] == counter.steps, (s, counter.steps)
    status = replacement.status()
    assert status.pid == cluster.workers[1].proc.pid
    assert status.closures_run > 0  # the replacement worker took part again
    replacement.close()


def _ps_fit(cluster, backup_dir, epochs=4, kill=None):
    pf.random.set_seed(0)
    strategy = pf.distribute.ParameterServerStrategy(cluster.resolver())
    model = _model(strategy)
    x, y = _data()
    callbacks = [pf.keras.callbacks.BackupAndRestore(backup_dir)]
    if kill is not None:
        callbacks.append(_StepCounter(at=kill[0], action=kill[1]))
    history = model.fit(
        x, y, batch_size=32, epochs=epochs, verbose=0, shuffle=False, callbacks=callbacks
    )
    return history.history["loss"], model


def test_killed_parameter_server_rolls_back_to_the_last_backup_and_training_completes(
    start_cluster, tmp_path
):
    reference = start_cluster(num_ps=2, num_workers=1)
    ref_losses, _ = _ps_fit(reference, str(tmp_path / "ref"))
    from psflow.distribute.coordinator.cluster_coordinator import shutdown_all

    shutdown_all()
    cluster = start_cluster(num_ps=2, num_workers=1)

    def kill_ps():
        os.kill(cluster.ps[1].proc.pid, signal.SIGKILL)
        threading.Timer(0.5, lambda: cluster.restart_ps(1)).start()

    losses, _ = _ps_fit(
        cluster, str(tmp_path / "run"), kill=(40, kill_ps)
    )  # epoch 2 of 4 (24 steps each)
    assert len(losses) == 4
    assert abs(losses[-1] - ref_losses[-1]) <= 0.05 * ref_losses[-1], (losses, ref_losses)


def test_lost_parameter_server_without_recovery_raises_naming_it(start_cluster):
    cluster = start_cluster(num_ps=2, num_workers=1)
    strategy = pf.distribute.ParameterServerStrategy(cluster.resolver())
    model = _model(strategy)
    x, y = _data()
    counter = _StepCounter(at=5, action=lambda: os.kill(cluster.ps[0].proc.pid, signal.SIGKILL))
    with pytest.raises(pf.errors.UnavailableError) as info:
        model.fit(x, y, batch_size=32, epochs=3, verbose=0, callbacks=[counter])
    assert "ps:0" in str(info.value)
    from psflow.exit_codes import ExitCode, exit_code_for

    assert exit_code_for(info.value) == ExitCode.RETRYABLE


CHIEF_SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np
    import psflow as pf
    from psflow.distribute.cluster_resolver import ClusterSpec, SimpleClusterResolver

    ps, worker, backup = sys.argv[1].split(","), sys.argv[2].split(","), sys.argv[3]
    resolver = SimpleClusterResolver(ClusterSpec({"ps": ps, "worker": worker, "chief": ["127.0.0.1:1"]}),
                                     task_type="chief", task_id=0)
    strategy = pf.distribute.ParameterServerStrategy(resolver)
    with strategy.scope():
        model = pf.keras.Sequential([pf.keras.layers.Dense(1, input_shape=(6,))])
        model.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 6)).astype("float32"); y = x.sum(axis=1, keepdims=True)

    class Slow(pf.keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            print("EPOCH", epoch, flush=True)
        def on_train_batch_end(self, batch, logs=None):
            import time; time.sleep(0.01)

    model.fit(x, y, batch_size=32, epochs=6, verbose=0,
              callbacks=[pf.keras.callbacks.BackupAndRestore(backup), Slow()])
    print("DONE", flush=True)
    """
)


def test_restarted_chief_completes_the_requested_epochs_in_total(start_cluster, tmp_path):
    cluster = start_cluster(num_ps=2, num_workers=2)
    script = tmp_path / "chief.py"
    script.write_text(CHIEF_SCRIPT)
    args = [
        sys.executable,
        str(script),
        ",".join(p.address for p in cluster.ps),
        ",".join(w.address for w in cluster.workers),
        str(tmp_path / "backup"),
    ]
    first = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=child_env(), cwd=ROOT)
    seen = []
    try:
        deadline = time.monotonic() + 120
        for line in first.stdout:
            seen.append(line.strip())
            if line.startswith("EPOCH 3") or time.monotonic() > deadline:
                break
        first.send_signal(signal.SIGKILL)
    finally:
        first.kill()
        first.wait(30)
        first.stdout.close()
    assert "EPOCH 3" in seen, seen
    second = subprocess.run(
        args, capture_output=True, text=True, env=child_env(), cwd=ROOT, timeout=180
    )
    assert second.returncode == 0, second.stderr[-3000:]
    epochs = [line for line in second.stdout.splitlines() if line.startswith("EPOCH")]
    assert epochs[0] in ("EPOCH 2", "EPOCH 3"), epochs  # resumed after the last complete epoch
    assert epochs[-1] == "EPOCH 5" and "DONE" in second.stdout
    assert not (tmp_path / "backup").exists()  # deleted once fit completed


def _read_all(directory: str) -> dict[str, dict[str, np.ndarray]]:
    """Every variable of a checkpoint, partitioned ones joined: {base: {value|slot:...: array}}."""
    from psflow.train import reshard

    out: dict[str, dict[str, list]] = {}
    for name, (_, arrays) in sorted(
        reshard.read_entries(directory).items(), key=lambda kv: reshard._split_name(kv[0])
    ):
        base, _ = reshard._split_name(name)
        for k, a in arrays.items():
            out.setdefault(base, {}).setdefault(k, []).append(a)
    return {b: {k: np.concatenate(v, axis=0) for k, v in d.items()} for b, d in out.items()}


def _embedding_model(strategy):
    with strategy.scope():
        model = pf.keras.Sequential(
            [
                pf.keras.layers.Embedding(50, 4, input_shape=(3,)),
                pf.keras.layers.Flatten(),
                pf.keras.layers.Dense(1),
            ]
        )
        model.compile(optimizer=pf.keras.optimizers.Adam(0.05), loss="mse")
    return model


def test_checkpoint_from_two_ps_restores_into_three_bit_for_bit(start_cluster, tmp_path):
    rng = np.random.default_rng(1)
    x = rng.integers(0, 50, size=(256, 3))
    y = rng.normal(size=(256, 1)).astype(np.float32)
    pf.keras.backend.clear_session()
    two = start_cluster(num_ps=2, num_workers=1)
    strategy = pf.distribute.ParameterServerStrategy(
        two.resolver(),
        variable_partitioner=pf.distribute.experimental.partitioners.FixedShardsPartitioner(2),
    )
    model = _embedding_model(strategy)
    model.fit(x, y, batch_size=32, epochs=2, verbose=0)
    saved = pf.train.Checkpoint(model=model).write(str(tmp_path / "two"))
    before = _read_all(saved)

    from psflow.distribute.coordinator.cluster_coordinator import shutdown_all

    shutdown_all()
    pf.keras.backend.clear_session()  # a new chief process would name its layers the same way
    three = start_cluster(num_ps=3, num_workers=1)
    strategy3 = pf.distribute.ParameterServerStrategy(
        three.resolver(),
        variable_partitioner=pf.distribute.experimental.partitioners.FixedShardsPartitioner(3),
    )
    model3 = _embedding_model(strategy3)
    assert len(model3.layers[0].embeddings.variables) == 3
    pf.train.Checkpoint(model=model3).restore(saved).assert_consumed()
    after = _read_all(pf.train.Checkpoint(model=model3).write(str(tmp_path / "three")))
    assert sorted(before) == sorted(after)
    for base in before:
        assert sorted(before[base]) == sorted(after[base])  # values and the same Adam slots
        for k in before[base]:
            np.testing.assert_array_equal(before[base][k], after[base][k], err_msg=f"{base} {k}")


SAVER = textwrap.dedent(
    """
    import sys
    import numpy as np
    import psflow as pf
    rng = np.random.default_rng(0)
    v = pf.Variable(rng.normal(size=(1_000_000,)).astype("float32"))
    manager = pf.train.CheckpointManager(pf.train.Checkpoint(v=v), sys.argv[1], max_to_keep=2)
    for i in range(1000):
        v.assign_add(np.ones(1_000_000, np.float32))
        manager.save()
        print("SAVED", i, flush=True)
    """
)


def test_a_crash_while_saving_leaves_the_previous_checkpoint_restorable(tmp_path):
    script = tmp_path / "saver.py"
    script.write_text(SAVER)
    directory = tmp_path / "ckpts"
    rng = np.random.default_rng(7)
    for _ in range(4):
        proc = subprocess.Popen(
            [sys.executable, str(script), str(directory)],
            stdout=subprocess.PIPE,
            text=True,
            env=child_env(),
            cwd=ROOT,
        )
        try:
            for line in proc.stdout:
                if line.startswith("SAVED 2"):
                    break
            time.sleep(float(rng.uniform(0, 0.05)))
        finally:
            proc.kill()
            proc.wait(30)
            proc.stdout.close()
        latest = pf.train.latest_checkpoint(str(directory))
        assert latest is not None
        v = pf.Variable(np.zeros(1_000_000, np.float32))
        pf.train.Checkpoint(v=v).restore(latest).assert_consumed()
        first = v.numpy()
        base = np.random.default_rng(0).normal(size=(1_000_000,)).astype("float32")
        steps = first[0] - base[0]
        np.testing.assert_allclose(first - base, np.full_like(first, steps), atol=1e-3)

"""One worker of a hybrid-mode test: ``python tests/hybrid_scenario.py MODE OUT.json``.

TF_CONFIG (``worker`` and ``ps`` tasks) and PSFLOW_AUTH_TOKEN come from the test.  Modes:

  train      a custom loop (strategy.run + GradientTape + Adam) of a model with a
             DynamicEmbedding (on the PS) and a dense tower (mirrored), 2 epochs of 48
             examples in global batches of 12; ``ELASTIC=1`` adds ElasticOptions, and
             ``FAULT`` (forward, after_apply, before_push, after_push) SIGKILLs worker
             ``FAULT_RANK`` at step ``FAULT_STEP``: in its forward pass, after its update
             (the others' next collective fails: the step is redone), or once the group
             committed the step, before or after this worker pushed its part of the
             table gradient; a worker started again with the same TF_CONFIG joins the
             running group (``ALONE_SLEEP``: seconds a survivor alone waits after each
             step, time for it to start)
             ``RESIZE`` ("3:2,6:1") resizes the PS tasks after the given global steps
             (every worker at the same boundary; worker 0 first publishes ``RESIZE_PS``,
             a JSON list, in the cluster file ``PSFLOW_CLUSTER_FILE`` the workers
             resolve their cluster from, as a launcher would); ``RESIZE_TIMEOUT``
             bounds each; a resize that fails is recorded under ``"resize_errors"``
             and training goes on; ``RESIZE_FILE=1`` alone: the cluster from that file, no
             resize (a worker restarted after the group resized)
             ``GATES`` ("2,5"): after each of those global steps every worker prints
             ``gate N`` and waits (up to 60 s) for the file ``GATE_DIR/gateN``: a test
             resizes the cluster from outside (``psflow scale``) meanwhile; each
             worker records the PS tasks every step ran on (``"step_ps"``)
  fit        the same model and data through Keras ``fit`` (no elastic, no fault)
  reference  one process (no strategy, the table in process) replaying the per-step
             global batches in ``SCHEDULE`` (a JSON file); ``REFERENCE_LOSS=mean``: the
             batch's mean squared error, as ``fit`` computes it

``OUT.json`` may hold ``{rank}`` (every worker of ``psflow local`` gets the same
arguments).  A worker writes the global batches it trained (example ids per step), its dense weights
and the rows of every id of the data, or ``{"error", "message"}`` when a psflow error
ended it (exit code 3).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np

import psflow as pf

GLOBAL_BATCH = 12
SAMPLES = 48
EPOCHS = 2
FIELDS = 2
DIM = 4


def data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(11)
    # ids far apart in int64 (no vocabulary), a few repeated within and across batches
    keys = rng.integers(0, 20, (SAMPLES, FIELDS)) * 7_919_000_003 + 5
    y = rng.standard_normal((SAMPLES, 1)).astype(np.float32)
    return keys.astype(np.int64), y, np.arange(SAMPLES, dtype=np.int64)


def all_keys() -> np.ndarray:
    return np.unique(data()[0])


class Model(pf.keras.Model):
    """A table of ``DIM``-wide rows (on the PS in hybrid mode) under a dense tower."""

    def __init__(self) -> None:
        super().__init__()
        self.table = pf.keras.layers.DynamicEmbedding(DIM, seed=5, table_name="hybrid_ids")
        self.hidden = pf.keras.layers.Dense(4, activation="tanh")
        self.out = pf.keras.layers.Dense(1)

    def call(self, keys: pf.Tensor, training: bool = False) -> pf.Tensor:
        rows = self.table(keys, training=training)
        return self.out(self.hidden(pf.reshape(rows, (-1, FIELDS * DIM))))


def make_model() -> Model:
    pf.random.set_seed(int(os.environ.get("SCENARIO_SEED", "1")))
    model = Model()
    model(np.zeros((1, FIELDS), np.int64), training=False)
    return model


def _optimizer() -> pf.keras.optimizers.Optimizer:
    if os.environ.get("OPTIMIZER") == "sgd":
        return pf.keras.optimizers.SGD(0.1)
    return pf.keras.optimizers.Adam(0.05)


def _loss(model: Model, keys: pf.Tensor, labels: pf.Tensor) -> pf.Tensor:
    per_example = pf.keras.losses.MeanSquaredError(reduction="none")(
        labels, model(keys, training=True)
    )
    return pf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)


def _rows(model: Model) -> list:
    return np.asarray(model.table.table.lookup(all_keys(), training=False)).tolist()


def _dense(model: Model) -> list:
    return [np.asarray(v.numpy()).tolist() for v in (*model.hidden.weights, *model.out.weights)]


def reference(schedule_path: str) -> dict:
    """One process, no strategy, trained on the global batches the group trained on."""
    keys, y, _ = data()
    with open(schedule_path) as f:
        schedule = json.load(f)
    model = make_model()
    opt = _optimizer()
    init = _dense(model)
    for epoch in schedule:
        for ids in epoch:
            idx = np.asarray(ids, np.int64)
            with pf.GradientTape() as tape:
                if os.environ.get("REFERENCE_LOSS") == "mean":  # Keras fit: the batch's mean
                    loss = pf.keras.losses.MeanSquaredError()(
                        pf.constant(y[idx]), model(pf.constant(keys[idx]), training=True)
                    )
                else:
                    loss = _loss(model, pf.constant(keys[idx]), pf.constant(y[idx]))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
    return {"dense": _dense(model), "rows": _rows(model), "init": init}


def _install_push_fault(rank: int) -> None:
    """SIGKILLs this worker when the group commits step ``FAULT_STEP``, before or after its push."""
    kind = os.environ.get("FAULT", "")
    if kind not in ("before_push", "after_push") or rank != int(os.environ.get("FAULT_RANK", "1")):
        return
    from psflow.distribute.hybrid import HybridTables

    step = int(os.environ.get("FAULT_STEP", "2"))
    push = HybridTables.push

    def hooked(self, staged, parts):  # type: ignore[no-untyped-def]
        if staged.step == step and kind == "before_push":
            os.kill(os.getpid(), signal.SIGKILL)
        push(self, staged, parts)
        if staged.step == step and kind == "after_push":
            os.kill(os.getpid(), signal.SIGKILL)

    HybridTables.push = hooked  # type: ignore[method-assign]


def train(strategy: pf.distribute.Strategy, rank: int) -> dict:
    keys, y, ids = data()
    elastic = strategy.elastic is not None
    _install_push_fault(rank)
    with strategy.scope():
        model = make_model()
        opt = _optimizer()
    init = _dense(model)
    victim = rank == int(os.environ.get("FAULT_RANK", "1"))
    kill_forward = victim and os.environ.get("FAULT") == "forward"
    kill_applied = victim and os.environ.get("FAULT") == "after_apply"

    def train_step(inputs: tuple) -> pf.Tensor:
        features, labels, _ = inputs
        if kill_forward and strategy.elastic.completed == int(os.environ.get("FAULT_STEP", "2")):
            os.kill(os.getpid(), signal.SIGKILL)
        with pf.GradientTape() as tape:
            loss = _loss(model, features, labels)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    dataset = pf.data.Dataset.from_tensor_slices((keys, y, ids)).batch(GLOBAL_BATCH)
    dist = strategy.experimental_distribute_dataset(dataset)
    epochs: list[list[list[int]]] = []
    done = 0
    resizes = dict(
        (int(at), int(n))
        for at, n in (p.split(":") for p in os.environ.get("RESIZE", "").split(",") if p)
    )
    resize_errors: list[dict] = []
    ps_counts: list[int] = []
    step_ps: list[int] = []
    gates = {int(g) for g in os.environ.get("GATES", "").split(",") if g}
    # a worker that joined a running group starts in the group's epoch
    for _ in range(strategy.elastic.initial_epoch if elastic else 0, EPOCHS):
        steps: dict[int, list[int]] = {}
        for batch in dist:
            strategy.run(train_step, args=(batch,))
            if kill_applied and strategy.elastic.completed == int(os.environ["FAULT_STEP"]):
                os.kill(os.getpid(), signal.SIGKILL)  # the others fail in the gather below
            seen = strategy.gather(strategy.run(lambda b: b[2], args=(batch,)), axis=0)
            # a step the group took again (after a change) replaces the first record
            key = strategy.elastic.completed if elastic else len(steps)
            steps[key] = np.asarray(seen).tolist()
            done += 1
            step_ps.append(len(strategy.hybrid.session.connections))
            print(f"step {done} done", flush=True)
            if done in gates:
                _gate(done)
            time.sleep(float(os.environ.get("STEP_SLEEP", "0")))
            if done in resizes:
                _resize(strategy, rank, resizes[done], resize_errors)
                ps_counts.append(len(strategy.hybrid.session.connections))
            if strategy.num_replicas_in_sync == 1:  # a survivor alone: time for a joiner
                time.sleep(float(os.environ.get("ALONE_SLEEP", "0")))
        epochs.append([steps[k] for k in sorted(steps)])
    if elastic:  # the last step is committed at the last epoch's end barrier (pushed there)
        assert strategy.hybrid._staged is None
    return {
        "epochs": epochs,
        "dense": _dense(model),
        "init": init,
        "rows": _rows(model),
        "replicas": strategy.num_replicas_in_sync,
        "changes": [c.as_logs() for c in strategy.elastic.changes] if elastic else [],
        "run_id": strategy.hybrid.run_id,
        "resize_errors": resize_errors,
        "ps_counts": ps_counts,
        "step_ps": step_ps,
    }


def _gate(step: int) -> None:
    """Waits (bounded) for the test to open gate ``step`` (a file in ``GATE_DIR``)."""
    path = os.path.join(os.environ["GATE_DIR"], f"gate{step}")
    print(f"gate {step}", flush=True)
    deadline = time.monotonic() + 60
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise pf.errors.DeadlineExceededError(f"gate {step} was not opened within 60s")
        time.sleep(0.02)


def _resize(strategy: pf.distribute.Strategy, rank: int, num_ps: int, failed: list) -> None:
    """Every worker: the PS tasks resized to ``num_ps`` between two steps."""
    from psflow.distribute.cluster_resolver.cluster_file import write_cluster_file

    if rank == 0:  # the launcher's part: the view lists the tasks started
        cluster = strategy.cluster_resolver.cluster_spec().as_dict()
        write_cluster_file(
            os.environ["PSFLOW_CLUSTER_FILE"],
            {**cluster, "ps": json.loads(os.environ["RESIZE_PS"])},
        )
    started = time.monotonic()
    try:
        strategy.resize_parameter_servers(num_ps, timeout=float(os.environ["RESIZE_TIMEOUT"]))
    except pf.errors.OpError as e:
        failed.append(
            {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - started}
        )


def fit(strategy: pf.distribute.Strategy) -> dict:
    """The same model and data through Keras ``compile`` / ``fit`` (mean squared error)."""
    keys, y, _ = data()
    with strategy.scope():
        model = make_model()
        model.compile(optimizer=_optimizer(), loss="mse")
    dataset = pf.data.Dataset.from_tensor_slices((keys, y)).batch(GLOBAL_BATCH)
    history = model.fit(dataset, epochs=EPOCHS, verbose=0)
    return {
        "dense": _dense(model),
        "rows": _rows(model),
        "replicas": strategy.num_replicas_in_sync,
        "loss": history.history["loss"],
    }


def main() -> int:
    mode, out_path = sys.argv[1], sys.argv[2]
    if mode == "reference":
        with open(out_path, "w") as f:
            json.dump(reference(os.environ["SCHEDULE"]), f)
        return 0
    timeout = float(os.environ.get("SCENARIO_TIMEOUT", "20"))
    rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    out_path = out_path.replace("{rank}", str(rank))
    options = pf.distribute.experimental.CommunicationOptions(timeout_seconds=timeout)
    elastic = None
    if os.environ.get("ELASTIC"):
        elastic = pf.distribute.experimental.ElasticOptions(min_workers=1, rendezvous_seconds=3.0)
    resolver = None
    if os.environ.get("RESIZE") or os.environ.get("RESIZE_FILE"):
        from psflow.distribute.cluster_resolver.cluster_file import ClusterFileResolver

        resolver = ClusterFileResolver.from_environment()
    try:
        strategy = pf.distribute.MultiWorkerMirroredStrategy(
            resolver, communication_options=options, elastic=elastic
        )
        result = fit(strategy) if mode == "fit" else train(strategy, rank)
    except pf.errors.OpError as e:
        with open(out_path, "w") as f:
            json.dump({"error": type(e).__name__, "message": str(e)}, f)
        return 3
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One worker of an elastic multi-worker test: ``python tests/elastic_scenario.py MODE OUT.json``.

TF_CONFIG, PSFLOW_AUTH_TOKEN come from the test.  Modes:

  train      a custom loop (strategy.run + GradientTape + Adam, then strategy.gather of the
             step's example ids) under ``ElasticOptions``, 2 epochs of 48 examples in global
             batches of 12; ``FAULT`` (forward, allreduce, reduce, sigstop, drain) hits worker
             ``FAULT_RANK`` at step ``FAULT_STEP``; ``join_broadcast``: that worker, joining a
             running group, dies (SIGKILL) as the group starts sending it its state
  fit        the same model and data through Keras ``fit``, a callback logging membership changes
  reference  one process replaying the per-step global batches in ``SCHEDULE`` (a JSON file)

A worker writes what it trained (per epoch, per step, the global batch's example ids), its
weights, the membership changes and step timestamps, or ``{"error", "message"}`` when a psflow
error ended it (exit code 3).
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


def data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((SAMPLES, 5)).astype(np.float32)
    y = (x @ rng.standard_normal((5, 1)) + 0.1).astype(np.float32)
    return x, y, np.arange(SAMPLES, dtype=np.int64)


def make_model() -> pf.keras.Model:
    pf.random.set_seed(int(os.environ.get("SCENARIO_SEED", "1")))
    model = pf.keras.Sequential(
        [pf.keras.layers.Dense(4, activation="tanh"), pf.keras.layers.Dense(1)]
    )
    model.build((None, 5))
    return model


def _loss(model: pf.keras.Model, features: pf.Tensor, labels: pf.Tensor) -> pf.Tensor:
    per_example = pf.keras.losses.MeanSquaredError(reduction="none")(
        labels, model(features, training=True)
    )
    # the constant denominator of the starting global batch, as TF's custom-loop tutorial
    return pf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)


def reference(schedule_path: str) -> dict:
    """One process, no strategy, trained on the global batches the group trained on."""
    x, y, _ = data()
    with open(schedule_path) as f:
        schedule = json.load(f)
    model = make_model()
    opt = pf.keras.optimizers.Adam(0.01)
    change = os.environ.get("LR_CHANGE")  # "STEP:LR": the rate a callback set from that step
    step = 0
    for epoch in schedule:
        for ids in epoch:
            if change and step == int(change.split(":")[0]):
                opt.learning_rate = float(change.split(":")[1])
            step += 1
            idx = np.asarray(ids, np.int64)
            with pf.GradientTape() as tape:
                if os.environ.get("REFERENCE_LOSS") == "mean":  # Keras fit: the batch's mean
                    loss = pf.keras.losses.MeanSquaredError()(
                        pf.constant(y[idx]), model(pf.constant(x[idx]), training=True)
                    )
                else:
                    loss = _loss(model, pf.constant(x[idx]), pf.constant(y[idx]))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
    return {"weights": [w.tolist() for w in model.get_weights()], "iterations": int(opt.iterations)}


class _Fault:
    """Hits this worker at step ``FAULT_STEP`` (of the whole run) when it is ``FAULT_RANK``."""

    def __init__(self, rank: int) -> None:
        self.kind = os.environ.get("FAULT", "")
        self.armed = self.kind != "" and rank == int(os.environ.get("FAULT_RANK", "1"))
        self.step = int(os.environ.get("FAULT_STEP", "2"))
        self.at_send = False
        self.sends = 0

    def hit(self, where: str, step: int) -> None:
        if not self.armed or step != self.step or where != self.kind:
            return
        self.armed = False
        if where in ("forward", "reduce"):
            os.kill(os.getpid(), signal.SIGKILL)
        elif where == "sigstop":
            os.kill(os.getpid(), signal.SIGSTOP)  # the test sends SIGCONT once the others are done
        elif where == "drain":
            os.kill(os.getpid(), signal.SIGTERM)
        elif where == "allreduce":
            self.at_send = True  # it dies inside the all-reduce that follows

    def install_send_hook(self) -> None:
        from psflow.collective.peer_link import PeerLinks

        send = PeerLinks.send
        fault = self

        def hooked(links, buffers, deadline):  # type: ignore[no-untyped-def]
            done = send(links, buffers, deadline)
            if fault.at_send:
                fault.sends += 1
                # the 5th send of the update is the first of the gradient's all-reduce (after
                # the 4 of the one that agrees which gradients are sparse): die with it on the wire
                if fault.sends == 5:
                    done.wait(5)
                    os.kill(os.getpid(), signal.SIGKILL)
            return done

        PeerLinks.send = hooked  # type: ignore[method-assign]


def _hold_for_admits(controller: object) -> None:
    """After step ``HOLD_AT``: the group waits until rank 0 holds ``HOLD_ADMITS`` queued
    requests to join, so where the joiners come in does not depend on how long their
    processes take to start (seconds on a loaded machine); rank 0 tells the others by
    creating the file ``HOLD_FILE``.  Bounded: 120 s, then the worker fails."""
    gate = os.environ["HOLD_FILE"]
    want = int(os.environ.get("HOLD_ADMITS", "1"))
    door = controller.door  # type: ignore[attr-defined]
    deadline = time.monotonic() + 120
    while not os.path.exists(gate):
        if controller.rank == 0:  # type: ignore[attr-defined]
            with door._cond:  # the door's queue of requests to join (read only)
                queued = len(door._admits)
            if queued >= want:
                with open(gate, "w"):
                    pass
                break
        if time.monotonic() > deadline:
            raise pf.errors.DeadlineExceededError(f"no {want} requests to join in 120 s")
        time.sleep(0.05)


def train(strategy: pf.distribute.Strategy, rank: int) -> dict:
    x, y, ids = data()
    fault = _Fault(rank)
    if fault.armed and fault.kind == "allreduce":
        fault.install_send_hook()
    with strategy.scope():
        model = make_model()
        opt = pf.keras.optimizers.Adam(0.01)

    def train_step(inputs: tuple) -> pf.Tensor:
        features, labels, _ = inputs
        fault.hit("forward", strategy.elastic.completed)
        with pf.GradientTape() as tape:
            loss = _loss(model, features, labels)
        grads = tape.gradient(loss, model.trainable_variables)
        fault.hit("allreduce", strategy.elastic.completed)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    dataset = pf.data.Dataset.from_tensor_slices((x, y, ids)).batch(GLOBAL_BATCH)
    dist = strategy.experimental_distribute_dataset(dataset)
    handler = None
    if os.environ.get("PREEMPTION_DIR"):  # TensorFlow's API: save when a worker is preempted
        with strategy.scope():  # where TensorFlow's guide creates it
            handler = pf.distribute.experimental.PreemptionCheckpointHandler(
                strategy.cluster_resolver,
                pf.train.Checkpoint(model=model, optimizer=opt),
                os.environ["PREEMPTION_DIR"],
            )
    epochs: list[dict[str, list[int]]] = []
    step_times: list[float] = []
    held = strategy.elastic.changes != []  # a joiner never holds the group
    # a worker that joined a running group starts in the group's epoch
    for _ in range(strategy.elastic.initial_epoch, EPOCHS):
        steps: dict[str, list[int]] = {}
        for batch in dist:
            if handler is not None:
                losses = handler.run(strategy.run, train_step, args=(batch,))
            else:
                losses = strategy.run(train_step, args=(batch,))
            fault.hit("reduce", strategy.elastic.completed)
            fault.hit("sigstop", strategy.elastic.completed)
            fault.hit("drain", strategy.elastic.completed)
            strategy.reduce("SUM", losses, axis=None)
            seen = strategy.gather(strategy.run(lambda b: b[2], args=(batch,)), axis=0)
            # a step the group took again (after a change) replaces the first record
            steps[str(strategy.elastic.completed)] = np.asarray(seen).tolist()
            step_times.append(time.time())
            if os.environ.get("PRINT_STEPS"):
                print(f"step {strategy.elastic.completed + 1} done", flush=True)
            time.sleep(float(os.environ.get("STEP_SLEEP", "0")))
            if not held and strategy.elastic.completed + 1 == int(os.environ.get("HOLD_AT", 0)):
                held = True
                _hold_for_admits(strategy.elastic)
        epochs.append(steps)
    return {
        "epochs": [[s[k] for k in sorted(s, key=int)] for s in epochs],
        "weights": [w.tolist() for w in model.get_weights()],
        "iterations": int(opt.iterations),
        "changes": [c.as_logs() for c in strategy.elastic.changes],
        "step_times": step_times,
        "replicas": strategy.num_replicas_in_sync,
        "pid": os.getpid(),
        "preemption_saves": None if handler is None else handler.saves,
        "run_calls": None if handler is None else handler.total_run_calls,
    }


class _Recorder(pf.keras.callbacks.Callback):
    """Kills this worker at a step (when it is the fault's target); logs membership changes."""

    def __init__(self, fault: _Fault) -> None:
        super().__init__()
        self.fault = fault
        self.changes: list[dict] = []
        self.step = 0
        self.lr_seen: list[float] = []

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        self.fault.hit("forward", self.step)
        self.step += 1

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        time.sleep(float(os.environ.get("STEP_SLEEP", "0")))

    def on_membership_change(self, logs: dict | None = None) -> None:
        self.changes.append(dict(logs or {}))
        # the documented use: the learning rate follows the global batch
        lr = float(self.model.optimizer.learning_rate) * logs["global_batch_scale"]
        self.model.optimizer.learning_rate = lr
        self.lr_seen.append(lr)


def fit(strategy: pf.distribute.Strategy, rank: int) -> dict:
    x, y, _ = data()
    with strategy.scope():
        model = make_model()
        model.compile(optimizer=pf.keras.optimizers.Adam(0.01), loss="mse")
    recorder = _Recorder(_Fault(rank))
    dataset = pf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    history = model.fit(dataset, epochs=EPOCHS, verbose=0, callbacks=[recorder])
    return {
        "weights": [w.tolist() for w in model.get_weights()],
        "iterations": int(model.optimizer.iterations),
        "changes": recorder.changes,
        "lr_seen": recorder.lr_seen,
        "steps_run": recorder.step,
        "pid": os.getpid(),
        "loss": history.history["loss"],
    }


def main() -> int:
    mode, out_path = sys.argv[1], sys.argv[2]
    if mode == "reference":
        with open(out_path, "w") as f:
            json.dump(reference(os.environ["SCHEDULE"]), f)
        return 0
    timeout = float(os.environ.get("SCENARIO_TIMEOUT", "30"))
    rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    options = pf.distribute.experimental.CommunicationOptions(timeout_seconds=timeout)
    elastic = pf.distribute.experimental.ElasticOptions(
        min_workers=int(os.environ.get("MIN_WORKERS", "1")),
        max_workers=int(os.environ["MAX_WORKERS"]) if "MAX_WORKERS" in os.environ else None,
        rendezvous_seconds=5.0,
        batch_policy=os.environ.get("BATCH_POLICY", "keep_per_replica"),
    )
    if os.environ.get("FAULT") == "join_broadcast" and rank == int(os.environ["FAULT_RANK"]):
        from psflow.distribute.elastic.state import TrainingState

        receive = TrainingState.broadcast

        def dying(self, ring, root, *, pending=False):  # type: ignore[no-untyped-def]
            if pending:  # this worker was admitted: the members are sending it their state
                os.kill(os.getpid(), signal.SIGKILL)
            return receive(self, ring, root, pending=pending)

        TrainingState.broadcast = dying  # type: ignore[method-assign]
    try:
        strategy = pf.distribute.MultiWorkerMirroredStrategy(
            communication_options=options, elastic=elastic
        )
        result = (fit if mode == "fit" else train)(strategy, rank)
    except pf.errors.OpError as e:
        result = {"error": type(e).__name__, "message": str(e)}
        with open(out_path, "w") as f:
            json.dump(result, f)
        return 3
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())

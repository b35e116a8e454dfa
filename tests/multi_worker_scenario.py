"""One worker of a multi-worker test: ``python tests/multi_worker_scenario.py MODE OUT.json``.

TF_CONFIG (and PSFLOW_NUM_CPU_DEVICES, PSFLOW_AUTH_TOKEN) come from the test;
SCENARIO_IMPL picks the implementation (AUTO, RING, NCCL); SCENARIO_GPUS=L gives
the worker L strict fake GPUs with NCCL (tests/strict_cupy.py);
the worker writes what it computed to OUT.json, or ``{"error": class, "message"}``
when the strategy raised a psflow error (exit code 3).

Modes:
  train      custom loop (GradientTape + strategy.run + apply_gradients) of a Dense model
  allreduce  ReplicaContext.all_reduce of seeded random float32 arrays (sizes 0, 1, 7, 1 MB)
  shard_data / shard_off / uneven   the elements each replica saw per step
  kill       all-reduces in a loop; worker KILL_RANK SIGKILLs itself at step 3
  connect    only builds the strategy (a wrong token is refused there)
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import signal
import sys
import time

import numpy as np

import psflow as pf
from psflow.thread_budget import current_blas_threads

GLOBAL_BATCH = 12
STEPS_DATA = 36  # 3 global batches
SIZES = (0, 1, 7, 262144)  # 262144 float32 = 1 MB


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    samples = int(os.environ.get("SCENARIO_SAMPLES", STEPS_DATA))  # 30: an uneven last batch
    x = rng.standard_normal((samples, 5)).astype(np.float32)
    y = (x @ rng.standard_normal((5, 1)) + 0.1).astype(np.float32)
    return x, y


def make_model() -> pf.keras.Model:
    """The model, with weights from a fixed seed (then each worker's are overwritten by
    worker 0's broadcast; the test gives worker 0 the seed the reference uses)."""
    pf.random.set_seed(int(os.environ.get("SCENARIO_SEED", "1")))
    model = pf.keras.Sequential(
        [pf.keras.layers.Dense(4, activation="tanh"), pf.keras.layers.Dense(1)]
    )
    model.build((None, 5))
    return model


def train(strategy: pf.distribute.Strategy | None, epochs: int = 2) -> dict:
    x, y = data()
    scope = strategy.scope() if strategy is not None else None
    if scope is not None:
        scope.__enter__()
    model = make_model()
    opt = pf.keras.optimizers.SGD(0.1)
    if scope is not None:
        scope.__exit__(None, None, None)
    loss_object = pf.keras.losses.MeanSquaredError(reduction="none")

    def train_step(inputs: tuple) -> pf.Tensor:
        features, labels = inputs
        with pf.GradientTape() as tape:
            per_example = loss_object(labels, model(features, training=True))
            loss = pf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    dataset = pf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    losses = []
    for _ in range(epochs):
        if strategy is None:
            for batch in dataset:
                losses.append(float(train_step(batch)))
            continue
        for batch in strategy.experimental_distribute_dataset(dataset):
            per_replica = strategy.run(train_step, args=(batch,))
            losses.append(float(strategy.reduce("SUM", per_replica, axis=None)))
    return {"weights": [w.tolist() for w in model.get_weights()], "losses": losses}


def fit(strategy: pf.distribute.Strategy | None, checkpoint_dir: str) -> dict:
    """Keras compile/fit on the global batch, checkpointing every epoch."""
    x, y = data()
    scope = strategy.scope() if strategy is not None else None
    if scope is not None:
        scope.__enter__()
    model = make_model()
    model.compile(optimizer=pf.keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
    if scope is not None:
        scope.__exit__(None, None, None)
    dataset = pf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    checkpoint = pf.keras.callbacks.ModelCheckpoint(
        os.path.join(checkpoint_dir, "ckpt-{epoch}.weights.h5")
    )
    callbacks: list = [checkpoint]
    if importlib.util.find_spec("tensorboard") is not None:  # the optional extra
        callbacks.append(pf.keras.callbacks.TensorBoard(os.path.join(checkpoint_dir, "tb")))
    history = model.fit(dataset, epochs=2, verbose=0, callbacks=callbacks)
    predictions = model.predict(pf.data.Dataset.from_tensor_slices(x).batch(GLOBAL_BATCH))
    evaluation = model.evaluate(dataset, verbose=0, return_dict=True)
    return {
        "evaluate": evaluation,
        "weights": [w.tolist() for w in model.get_weights()],
        "history": history.history,
        "predictions": np.asarray(predictions).tolist(),
    }


def train_sparse(strategy: pf.distribute.Strategy | None) -> dict:
    """An embedding model (sparse gradients) with Adam, custom loop, on the global batch."""
    rng = np.random.default_rng(11)
    ids = rng.integers(0, 50, size=(36, 3)).astype(np.int64)
    y = rng.standard_normal((36, 1)).astype(np.float32)
    scope = strategy.scope() if strategy is not None else None
    if scope is not None:
        scope.__enter__()
    pf.random.set_seed(int(os.environ.get("SCENARIO_SEED", "1")))
    model = pf.keras.Sequential(
        [pf.keras.layers.Embedding(50, 4), pf.keras.layers.Flatten(), pf.keras.layers.Dense(1)]
    )
    model.build((None, 3))
    opt = pf.keras.optimizers.Adam(0.05)
    if scope is not None:
        scope.__exit__(None, None, None)

    def step(inputs: tuple) -> pf.Tensor:
        features, labels = inputs
        with pf.GradientTape() as tape:
            per_example = pf.keras.losses.MeanSquaredError(reduction="none")(
                labels, model(features, training=True)
            )
            loss = pf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        grads = tape.gradient(loss, model.trainable_variables)
        kinds.add(type(grads[0]).__name__)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    kinds: set = set()
    dataset = pf.data.Dataset.from_tensor_slices((ids, y)).batch(GLOBAL_BATCH)
    for _ in range(2):
        if strategy is None:
            for batch in dataset:
                step(batch)
        else:
            for batch in strategy.experimental_distribute_dataset(dataset):
                strategy.run(step, args=(batch,))
    return {"weights": [w.tolist() for w in model.get_weights()], "kinds": sorted(kinds)}


def seen(strategy: pf.distribute.Strategy, dataset: pf.data.Dataset) -> list:
    """Per step, the elements each local replica got."""
    steps = []
    for batch in strategy.experimental_distribute_dataset(dataset):
        parts = strategy.experimental_local_results(batch)
        steps.append([np.asarray(p).tolist() for p in parts])
    return steps


def main() -> int:
    mode, out_path = sys.argv[1], sys.argv[2]
    if os.environ.get("SCENARIO_LOG"):  # psflow's INFO lines into the worker's log
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if mode in ("reference", "fit_reference", "sparse_reference"):
        if mode == "reference":
            result = train(None)
        elif mode == "sparse_reference":
            result = train_sparse(None)
        else:
            result = fit(None, os.environ["CKPT_DIR"])
        with open(out_path, "w") as f:
            json.dump(result, f)
        return 0
    timeout = float(os.environ.get("SCENARIO_TIMEOUT", "30"))
    options = pf.distribute.experimental.CommunicationOptions(
        timeout_seconds=timeout, implementation=os.environ.get("SCENARIO_IMPL", "AUTO")
    )
    started = time.monotonic()
    try:
        strategy = pf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
        resolver = strategy.cluster_resolver
        result: dict = {
            "task": [resolver.task_type, resolver.task_id],
            "replicas": strategy.num_replicas_in_sync,
            "should_checkpoint": strategy.extended.should_checkpoint,
            "blas_threads": current_blas_threads(),
        }
        if mode == "train":
            result.update(train(strategy))
        elif mode == "sparse":
            result.update(train_sparse(strategy))
        elif mode == "fit":
            result.update(fit(strategy, os.environ["CKPT_DIR"]))
        elif mode == "allreduce":
            ctx_id = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
            rng = np.random.default_rng(100 + ctx_id)
            arrays = [rng.standard_normal(n).astype(np.float32) for n in SIZES]

            def step() -> list:
                ctx = pf.distribute.get_replica_context()
                return ctx.all_reduce("SUM", [pf.constant(a) for a in arrays])

            reduced = strategy.run(step)
            result["sums"] = [np.asarray(r).tolist() for r in reduced]
            result["inputs"] = [a.tolist() for a in arrays]
        elif mode == "collectives":

            def ids() -> pf.Tensor:
                ctx = pf.distribute.get_replica_context()
                rid = pf.cast(ctx.replica_id_in_sync_group, "float32")
                # replica r contributes r + 1 rows of value r
                mine = pf.fill([1, 2], rid)
                gathered = ctx.all_gather(mine, axis=0)
                mean = ctx.all_reduce("MEAN", pf.fill([3], rid))
                return rid, gathered, mean

            rid, gathered, mean = strategy.run(ids)
            values = strategy.experimental_distribute_values_from_function(
                lambda ctx: (
                    pf.fill([ctx.replica_id_in_sync_group + 1], 1.0)
                    * float(ctx.replica_id_in_sync_group)
                )
            )
            result["ids"] = [float(v) for v in strategy.experimental_local_results(rid)]
            result["all_gather"] = np.asarray(
                strategy.experimental_local_results(gathered)[0]
            ).tolist()
            result["all_reduce_mean"] = np.asarray(
                strategy.experimental_local_results(mean)[-1]
            ).tolist()
            result["gather"] = np.asarray(strategy.gather(values, axis=0)).tolist()
            result["reduce_mean_axis0"] = float(strategy.reduce("MEAN", values, axis=0))
            result["reduce_sum"] = float(strategy.reduce("SUM", rid, axis=None))
        elif mode == "shard_data":
            result["steps"] = seen(strategy, pf.data.Dataset.range(16).batch(4))
        elif mode == "shard_off":
            options_off = pf.data.Options()
            options_off.experimental_distribute.auto_shard_policy = (
                pf.data.experimental.AutoShardPolicy.OFF
            )
            result["steps"] = seen(
                strategy, pf.data.Dataset.range(8).batch(4).with_options(options_off)
            )
        elif mode == "shard_hint":
            options_hint = pf.data.Options()
            options_hint.experimental_distribute.auto_shard_policy = (
                pf.data.experimental.AutoShardPolicy.HINT
            )
            hint = pf.data.experimental.SHARD_HINT
            dataset = pf.data.Dataset.range(16).shard(hint, hint).batch(4)
            result["steps"] = seen(strategy, dataset.with_options(options_hint))
        elif mode in ("shard_file", "shard_file_auto"):
            # SCENARIO_FILES: a directory of part-*.txt; FILE, or AUTO (FILE when there are
            # at least as many files as workers, else DATA)
            pattern = os.path.join(os.environ["SCENARIO_FILES"], "part-*.txt")
            names = pf.data.Dataset.list_files(pattern, shuffle=False)
            dataset = names.interleave(pf.data.TextLineDataset, cycle_length=1).batch(4)
            if mode == "shard_file":
                options_file = pf.data.Options()
                options_file.experimental_distribute.auto_shard_policy = (
                    pf.data.experimental.AutoShardPolicy.FILE
                )
                dataset = dataset.with_options(options_file)
            result["steps"] = seen(strategy, dataset)
        elif mode == "uneven":
            result["steps"] = seen(strategy, pf.data.Dataset.range(10).batch(4))

            def per_worker(ctx: pf.distribute.InputContext) -> pf.data.Dataset:
                # worker 0 gets 3 batches, the others 1: the epoch still ends together
                count = 3 if ctx.input_pipeline_id == 0 else 1
                return pf.data.Dataset.range(count * 2).batch(2)

            dist = strategy.distribute_datasets_from_function(per_worker)
            result["from_function"] = [
                [np.asarray(p).tolist() for p in strategy.experimental_local_results(b)]
                for b in dist
            ]
        elif mode == "kill":
            kill_rank = int(os.environ["KILL_RANK"])
            me = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
            fault = getattr(signal, os.environ.get("KILL_SIGNAL", "SIGKILL"))
            for i in range(1000):
                if i == 3 and me == kill_rank:
                    os.kill(os.getpid(), fault)  # SIGSTOP: frozen, for good
                strategy.run(
                    lambda: pf.distribute.get_replica_context().all_reduce("SUM", pf.ones([64]))
                )
                time.sleep(0.05)
        result["seconds"] = time.monotonic() - started
        result["nccl"] = getattr(strategy, "nccl", None) is not None
    except pf.errors.OpError as e:
        with open(out_path, "w") as f:
            json.dump(
                {
                    "error": type(e).__name__,
                    "message": str(e),
                    "seconds": time.monotonic() - started,
                },
                f,
            )
        return 3
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


def main_on_gpus() -> int:
    """``main`` with SCENARIO_GPUS strict fake GPUs per worker, NCCL included
    (tests/strict_cupy.py, tests/strict_nccl.py)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests import strict_cupy

    with strict_cupy.installed(devices=int(os.environ["SCENARIO_GPUS"]), nccl=True):
        return main()


if __name__ == "__main__":
    sys.exit(main_on_gpus() if os.environ.get("SCENARIO_GPUS") else main())

"""Elastic synchronous training: a custom loop that goes on when a worker is lost.

Run it on three peer workers, one of which kills itself (SIGKILL) at step 5::

    psflow local --mode multi-worker --workers 3 --elastic \\
        examples/multi_worker_elastic.py --kill-rank 1 --kill-step 5

The two survivors agree on generation 1 (members 0 and 2), redo the
interrupted step and finish both epochs; every example is trained once per
epoch (the per-replica batch is kept, so the global batch shrinks from 24 to
16 examples).  ``kill -TERM`` a worker instead to drain it at the next step.
Without ``TF_CONFIG`` it trains alone.

Grow and shrink the group while it trains (the launcher reserves the slots)::

    psflow local --mode multi-worker --workers 2 --elastic --workers-max 3 \
        examples/multi_worker_elastic.py --step-sleep 0.5 &
    psflow scale --workers 3    # worker:2 starts and is admitted at a step boundary
    psflow scale --workers 2    # worker:2 drains at the next step boundary
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import numpy as np

import psflow as pf

PER_REPLICA = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--kill-rank", type=int, default=-1, help="this worker dies (SIGKILL)")
    parser.add_argument("--kill-step", type=int, default=5, help="... at this step")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds after each step")
    args = parser.parse_args()

    strategy = pf.distribute.MultiWorkerMirroredStrategy(
        elastic=pf.distribute.experimental.ElasticOptions(min_workers=1)
    )
    task = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {})
    rank = task.get("index", 0)
    # the batch of the group as it started (a worker that joined later cuts the same one)
    starting = strategy.num_replicas_in_sync
    if strategy.elastic is not None:
        starting = strategy.elastic.initial_replicas
    global_batch = PER_REPLICA * starting
    print(f"worker {rank}: {strategy.num_replicas_in_sync} replicas, global batch {global_batch}")

    rng = np.random.default_rng(0)
    x = rng.standard_normal((240, 10)).astype(np.float32)
    y = (x @ rng.standard_normal((10, 1))).astype(np.float32)
    with strategy.scope():
        pf.random.set_seed(1)
        model = pf.keras.Sequential([pf.keras.layers.Dense(16, "relu"), pf.keras.layers.Dense(1)])
        model.build((None, 10))
        optimizer = pf.keras.optimizers.SGD(0.05)
    mse = pf.keras.losses.MeanSquaredError(reduction="none")

    def train_step(inputs: tuple) -> pf.Tensor:
        features, labels = inputs
        with pf.GradientTape() as tape:
            loss = pf.nn.compute_average_loss(
                mse(labels, model(features, training=True)), global_batch_size=global_batch
            )
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    elastic = strategy.elastic
    if elastic is not None:
        elastic.add_listener(
            lambda c: print(
                f"worker {rank}: generation {c.generation}: members {list(c.members)} "
                f"({c.reason}), {c.num_replicas_in_sync} replicas, resuming at step "
                f"{c.resumed_step}"
            )
        )
    dataset = pf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch)
    dist = strategy.experimental_distribute_dataset(dataset)
    step = 0
    # a worker that joined a running group starts in the group's epoch
    for epoch in range(elastic.initial_epoch if elastic is not None else 0, args.epochs):
        total = 0.0
        for batch in dist:
            if rank == args.kill_rank and step == args.kill_step:
                os.kill(os.getpid(), signal.SIGKILL)
            total += float(strategy.reduce("SUM", strategy.run(train_step, args=(batch,)), None))
            step = elastic.completed + 1 if elastic is not None else step + 1
            time.sleep(args.step_sleep)
        print(f"worker {rank}: epoch {epoch}: loss sum {total:.4f}, {step} steps so far")
    checksum = sum(float(np.abs(w).sum()) for w in model.get_weights())
    print(f"worker {rank}: weights checksum {checksum:.6f}")


if __name__ == "__main__":
    main()

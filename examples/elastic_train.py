"""Training while the parameter servers are resized: ``psflow local --ps-max`` + ``psflow scale``.

A small regression model trained with a custom loop; the chief follows the
cluster view of ``psflow local --ps-max`` (``PSFLOW_CLUSTER_FILE``) with a
``ClusterWatch``, which resizes the parameter servers whenever ``psflow scale``
changes it.  In one terminal::

    psflow local --ps-max 3 --ps 2 --workers 2 examples/elastic_train.py --seconds 60

and in another, while it trains::

    psflow scale --ps 3      # ps:2 starts; the chief moves a share of the variables to it
    psflow scale --ps 1      # the chief moves everything to ps:0; ps:1 and ps:2 exit 0

Without ``PSFLOW_CLUSTER_FILE`` (plain ``python examples/elastic_train.py``) it
trains embedded and nothing is resized.  It stops after ``--steps`` steps, or
``--seconds``, or when the file ``--stop-file`` appears, whichever is first,
and prints the final loss, which must be below the first.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import numpy as np

import psflow as pf
from psflow.distribute.cluster_resolver import CLUSTER_FILE_ENV, ClusterFileResolver
from psflow.distribute.coordinator.elastic_watch import ClusterWatch


def main() -> int:
    """Trains until told to stop; returns 0 when the loss went down."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100_000, help="most steps to run")
    parser.add_argument("--seconds", type=float, default=120.0, help="most seconds to train")
    parser.add_argument("--stop-file", help="stop once this file exists")
    parser.add_argument("--units", type=int, default=64, help="hidden units (variable sizes)")
    parser.add_argument("--watch-interval", type=float, default=0.5, help="seconds between polls")
    parser.add_argument(
        "--watch",
        choices=("step", "thread"),
        default="thread",
        help="resize from the watch's own thread while training goes on (thread: async mode "
        "moves variables under per-batch fences), or between steps in this thread (step)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")

    elastic = bool(os.environ.get(CLUSTER_FILE_ENV))
    resolver = ClusterFileResolver.from_environment() if elastic else None
    strategy = pf.distribute.ParameterServerStrategy(resolver)
    coordinator = pf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 16)).astype("float32")
    y = (x @ rng.normal(size=(16, 1)) + 0.1).astype("float32")
    with strategy.scope():
        model = pf.keras.Sequential(
            [
                pf.keras.layers.Dense(args.units, activation="relu"),
                pf.keras.layers.Dense(args.units, activation="relu"),
                pf.keras.layers.Dense(1),
            ]
        )
        model.build((None, 16))
        optimizer = pf.keras.optimizers.SGD(learning_rate=0.01)

    def step(xb, yb):
        with pf.GradientTape() as tape:
            loss = pf.reduce_mean(pf.square(model(xb) - yb))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    watch = ClusterWatch(coordinator, interval=args.watch_interval) if elastic else None
    if watch is not None and args.watch == "thread":
        watch.start()
    start, losses, steps = time.monotonic(), [], 0
    while steps < args.steps and time.monotonic() - start < args.seconds:
        if args.stop_file and os.path.exists(args.stop_file):
            break
        batch = [(steps + i) * 32 % 512 for i in range(8)]
        results = [coordinator.schedule(step, args=(x[b : b + 32], y[b : b + 32])) for b in batch]
        coordinator.join()
        losses.append(float(np.mean([r.fetch() for r in results])))
        steps += len(batch)
        if watch is not None and args.watch == "step":
            watch.at_step_boundary()  # between steps, in this thread
        if len(losses) % 10 == 1:
            num_ps = len(strategy.placement().addresses)
            print(f"elastic_train step {steps} loss {losses[-1]:.4f} ps {num_ps}", flush=True)
    if watch is not None and args.watch == "thread":
        watch.stop()
    resizes = len(watch.reports) if watch is not None else 0
    print(
        f"elastic_train done: {steps} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
        f"{resizes} resizes",
        flush=True,
    )
    return 0 if losses[-1] < losses[0] else 1


if __name__ == "__main__":
    sys.exit(main())

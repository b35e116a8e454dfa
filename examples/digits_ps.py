"""The README's main job: the UCI digits trained with ParameterServerStrategy.

Run on a local cluster of separate processes (2 parameter servers, 2 workers,
this script as the chief)::

    psflow local --ps 2 --workers 2 examples/digits_ps.py

or anywhere with an embedded PS: ``python examples/digits_ps.py``. The model's
variables live on the PS tasks; every training step is a closure the
coordinator schedules on a worker, which pulls the weights, computes gradients
and pushes them; each PS applies Adam next to its variables. The chief prints
Keras's progress line per epoch, then the test accuracy.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import psflow as tf
from psflow.keras.datasets import digits


def main(argv: Sequence[str] | None = None) -> int:
    """Trains on the workers, evaluates on the chief, prints the test accuracy."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--mode", choices=("async", "sync", "bounded"), default="async")
    parser.add_argument("--staleness", type=int, default=None, help="with --mode bounded")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-accuracy", type=float, default=0.0, help="exit 1 below this")
    args = parser.parse_args(argv)

    tf.random.set_seed(args.seed)
    (x_train, y_train), (x_test, y_test) = digits.load_data()
    x_train, x_test = x_train / 16.0, x_test / 16.0

    strategy = tf.distribute.ParameterServerStrategy(mode=args.mode, staleness=args.staleness)
    print(f"strategy: {strategy}", flush=True)
    with strategy.scope():
        model = tf.keras.Sequential(
            [
                tf.keras.layers.Flatten(input_shape=(8, 8)),
                tf.keras.layers.Dense(64, activation="relu"),
                tf.keras.layers.Dense(digits.NUM_CLASSES),
            ]
        )
        model.compile(
            optimizer=tf.keras.optimizers.Adam(0.01),
            loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    start = time.perf_counter()
    model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs, verbose=2)
    seconds = time.perf_counter() - start
    loss, accuracy = model.evaluate(x_test, y_test, batch_size=256, verbose=0)
    print(
        f"trained {args.epochs} epochs in {seconds:.1f}s; test loss {loss:.4f}, test accuracy {accuracy:.4f}"
    )
    return 0 if accuracy >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())

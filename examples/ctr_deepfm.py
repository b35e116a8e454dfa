"""DeepFM on Criteo-shaped click logs, with dynamic embedding tables on the PS.

The data (``psflow.keras.datasets.ctr``): 13 dense and 26 categorical features
whose ids are Zipf-distributed over an unbounded int64 space, labels from a
hidden logistic model, so the best reachable AUC is known.  The model keeps
two dynamic tables (``DynamicEmbedding``): 8-float rows for the factorisation
machine and the deep tower, 1-float rows for the first-order (wide) term.  No
vocabulary is declared: a row is created the first time its id is seen, on the
PS task its hash names, and only the rows a batch uses travel.

Run embedded with ``python examples/ctr_deepfm.py`` or on a cluster with
``psflow local --ps 2 --workers 2 examples/ctr_deepfm.py``.
"""

from __future__ import annotations

import argparse
import json
import sys

import psflow as pf
from psflow.keras.datasets import ctr

DIM = 8


class DeepFM(pf.keras.Model):
    """First-order weights + pairwise factorisation machine + an MLP, summed into one logit."""

    def __init__(self, min_count: int = 1) -> None:
        super().__init__()
        self.first = pf.keras.layers.DynamicEmbedding(
            1, initializer="zeros", table_name="ctr_first", min_count=min_count
        )
        self.factors = pf.keras.layers.DynamicEmbedding(
            DIM, init_scale=0.01, table_name="ctr_factors", min_count=min_count, seed=7
        )
        self.dense_in = pf.keras.layers.Dense(1)
        self.hidden = pf.keras.layers.Dense(64, activation="relu")
        self.deep_out = pf.keras.layers.Dense(1)

    def call(self, inputs, training=None):
        cat, dense = inputs["cat"], inputs["dense"]
        first = pf.reduce_sum(self.first(cat), axis=1)  # (batch, 1)
        e = self.factors(cat)  # (batch, 26, DIM)
        summed = pf.reduce_sum(e, axis=1)
        pairs = 0.5 * pf.reduce_sum(
            pf.square(summed) - pf.reduce_sum(pf.square(e), axis=1), axis=1, keepdims=True
        )
        flat = pf.reshape(e, (-1, ctr.NUM_CATEGORICAL * DIM))
        deep = self.deep_out(self.hidden(pf.concat([flat, dense], axis=1)))
        return pf.sigmoid(first + pairs + deep + self.dense_in(dense))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", type=int, default=100_000)
    p.add_argument("--test-examples", type=int, default=20_000)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--learning-rate", type=float, default=0.05)
    p.add_argument("--min-count", type=int, default=1)
    p.add_argument("--min-auc", type=float, default=0.0)
    args = p.parse_args(argv)

    pf.random.set_seed(0)
    x, y, _ = ctr.load_data(args.examples, seed=1)
    x_test, y_test, logit_test = ctr.load_data(args.test_examples, seed=2)

    strategy = pf.distribute.ParameterServerStrategy()
    with strategy.scope():
        model = DeepFM(args.min_count)
        model.compile(
            optimizer=pf.keras.optimizers.Adagrad(args.learning_rate),
            loss="binary_crossentropy",
        )
    model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, verbose=2)
    scores = model.predict(x_test, batch_size=4096, verbose=0)
    got = ctr.roc_auc(y_test, scores)
    best = ctr.roc_auc(y_test, logit_test)
    stats = model.factors.table.backend.client.stats()
    rows = [s["ctr_factors"].rows for s in stats]
    print(f"dynamic table ctr_factors: rows per PS task {rows}")
    print(f"test AUC {got:.4f} (the hidden model's logits give {best:.4f})")
    print(json.dumps({"auc": got, "oracle_auc": best, "rows": rows}))
    return 0 if got >= args.min_auc else 1


if __name__ == "__main__":
    sys.exit(main())

"""Click-through prediction with a 1M-row embedding table sharded over the parameter servers.

Synthetic clicks with a known ground truth: each user has a hidden bias, each
impression a few dense features; a click happens with probability
``sigmoid(user_bias + features @ w)``. The model learns one embedding row per
user (a 1,000,000 x 8 table split into 2 shards by ``FixedShardsPartitioner``)
and a dense layer. Only the rows a batch touches are pulled from the PS and
only their gradients pushed back: the byte counters printed at the end show it.

Run embedded with ``python examples/ps_embedding_ctr.py`` or on a cluster with
``psflow local --ps 2 --workers 2 examples/ps_embedding_ctr.py``.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import psflow as tf

NUM_USERS = 1_000_000
DIM = 8


def make_data(n: int, active_users: int, seed: int) -> tuple[dict, np.ndarray, np.ndarray]:
    """Impressions of ``active_users`` users (spread over the whole id space) and their clicks."""
    rng = np.random.default_rng(seed)
    users = rng.choice(NUM_USERS, size=active_users, replace=False)
    bias = rng.normal(0.0, 1.5, size=active_users)
    w = rng.normal(0.0, 1.0, size=4)
    who = rng.integers(0, active_users, size=n)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    logit = bias[who] + x @ w
    clicks = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    return {"user": users[who].astype(np.int64), "x": x}, clicks.reshape(-1, 1), logit


class CTRModel(tf.keras.Model):
    """A user embedding and dense features into one logistic unit."""

    def __init__(self) -> None:
        super().__init__()
        self.user = tf.keras.layers.Embedding(NUM_USERS, DIM, embeddings_initializer="zeros")
        self.out = tf.keras.layers.Dense(1, activation="sigmoid")

    def call(self, inputs, training=None):
        e = self.user(inputs["user"])
        return self.out(tf.concat([e, inputs["x"]], axis=1))


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Exact ROC AUC by ranks (ties averaged)."""
    labels = labels.ravel().astype(bool)
    order = np.argsort(scores.ravel(), kind="mergesort")
    ranks = np.empty(len(order))
    ranks[order] = np.arange(1, len(order) + 1)
    s = scores.ravel()[order]
    i = 0
    while i < len(s):  # average ranks over ties
        j = i
        while j + 1 < len(s) and s[j + 1] == s[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j + 2) / 2
        i = j + 1
    pos = labels.sum()
    return float((ranks[labels].sum() - pos * (pos + 1) / 2) / (pos * (len(labels) - pos)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", type=int, default=120_000)
    p.add_argument("--users", type=int, default=4_000)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--min-auc", type=float, default=0.0)
    args = p.parse_args(argv)

    tf.random.set_seed(0)
    features, labels, true_logit = make_data(args.examples, args.users, seed=1)
    cut = int(0.8 * args.examples)
    train = ({k: v[:cut] for k, v in features.items()}, labels[:cut])
    test = ({k: v[cut:] for k, v in features.items()}, labels[cut:])

    strategy = tf.distribute.ParameterServerStrategy(
        variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(2)
    )
    with strategy.scope():
        model = CTRModel()
        model.compile(optimizer=tf.keras.optimizers.Adagrad(0.5), loss="binary_crossentropy")
    model.fit(train[0], train[1], batch_size=args.batch_size, epochs=args.epochs, verbose=2)

    scores = model.predict(test[0], batch_size=4096, verbose=0)
    got = auc(test[1], scores)
    best = auc(test[1], true_logit[cut:])
    table = model.user.embeddings
    shards = table.variables
    stats = strategy.ps_stats()
    pulled = sum(s["bytes_out"] for s in stats)
    touched = len(np.unique(train[0]["user"])) * DIM * 4
    print(
        f"table: {table.shape[0]:,} x {DIM} in {len(shards)} shards on ps tasks {[s.ps_index for s in shards]}"
    )
    print(
        f"table size {table.shape[0] * DIM * 4 / 1e6:.1f} MB; rows touched by training {touched / 1e6:.2f} MB"
    )
    print(
        f"bytes the parameter servers sent (all pulls, dense layers included): {pulled / 1e6:.2f} MB"
    )
    print(f"test AUC {got:.4f} (ground-truth logits give {best:.4f})")
    return 0 if got >= args.min_auc else 1


if __name__ == "__main__":
    sys.exit(main())

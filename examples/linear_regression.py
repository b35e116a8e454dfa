"""Linear regression with a custom training loop, written the TensorFlow way.

Variables, ``GradientTape``, ``tape.gradient`` and a hand-written SGD update
(``w.assign_sub(lr * g)``) recover known weights from noisy data:

    python examples/linear_regression.py [--steps 200] [--lr 0.1]

Replace ``import psflow as tf`` with ``import tensorflow as tf`` and the same
program runs on TensorFlow.
"""

from __future__ import annotations

import argparse
import logging

import numpy as np

import psflow as tf

log = logging.getLogger("linear_regression")

TRUE_W = [[2.0], [-3.4], [0.5]]
TRUE_B = 4.2


def make_data(n: int = 512, noise: float = 0.01, seed: int = 0) -> tuple[tf.Tensor, tf.Tensor]:
    """``n`` examples ``x`` (n, 3) and targets ``y = x @ TRUE_W + TRUE_B + noise``."""
    tf.random.set_seed(seed)
    x = tf.random.normal([n, len(TRUE_W)])
    y = tf.matmul(x, tf.constant(TRUE_W)) + TRUE_B
    return x, y + tf.random.normal([n, 1], stddev=noise)


def train(
    steps: int = 200, lr: float = 0.1, batch: int = 64, seed: int = 0, report_every: int = 50
) -> tuple[np.ndarray, float, float]:
    """Fits ``w`` and ``b`` by minibatch SGD; returns the weights, bias and final loss."""
    x, y = make_data(seed=seed)
    w = tf.Variable(tf.zeros([len(TRUE_W), 1]), name="w")
    b = tf.Variable(0.0, name="b")
    n = x.shape[0]
    loss = tf.constant(0.0)
    for step in range(steps):
        start = (step * batch) % n
        xb, yb = x[start : start + batch], y[start : start + batch]
        with tf.GradientTape() as tape:
            pred = tf.matmul(xb, w) + b
            loss = tf.reduce_mean(tf.square(pred - yb))
        dw, db = tape.gradient(loss, [w, b])
        w.assign_sub(lr * dw)
        b.assign_sub(lr * db)
        if step % report_every == 0 or step == steps - 1:
            log.info("step %4d  loss %.6f", step, float(loss))
    return w.numpy().ravel(), float(b.numpy()), float(loss)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: trains, prints progress and the recovered weights."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    w, b, loss = train(args.steps, args.lr, seed=args.seed)
    log.info("true weights    %s  bias %.4f", np.ravel(TRUE_W), TRUE_B)
    log.info("learned weights %s  bias %.4f  (final loss %.6f)", np.round(w, 4), b, loss)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

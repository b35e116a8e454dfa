"""Training the digits with compressed pushes ends where uncompressed training does."""

from __future__ import annotations

import numpy as np
import pytest

import psflow as pf
from psflow.errors import InvalidArgumentError
from psflow.keras.datasets import digits

pytestmark = pytest.mark.slow


def _train(cluster, compression, prefix: str, steps: int = 60, batch: int = 64):
    """Final training loss and weights of a digits MLP trained on the cluster (sync, 1 worker)."""
    (x, y), _ = digits.load_data()
    x = (x.reshape(len(x), -1) / 16.0).astype(np.float32)
    y = y.astype(np.int64)
    pf.random.set_seed(0)
    strategy = pf.distribute.ParameterServerStrategy(
        cluster.resolver(), mode="sync", compression=compression
    )
    with strategy.scope():
        init = pf.keras.initializers.GlorotUniform
        model = pf.keras.Sequential(
            [
                pf.keras.layers.Dense(
                    32,
                    activation="relu",
                    input_shape=(64,),
                    kernel_initializer=init(seed=1),
                    name=f"{prefix}hidden",
                ),
                pf.keras.layers.Dense(10, kernel_initializer=init(seed=2), name=f"{prefix}out"),
            ]
        )
        optimizer = pf.keras.optimizers.SGD(0.2)
    coordinator = pf.distribute.coordinator.ClusterCoordinator(strategy)
    dataset = pf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch)
    iterator = iter(coordinator.create_per_worker_dataset(lambda: dataset))

    def step(it):
        xb, yb = next(it)

        def replica(xb, yb):
            with pf.GradientTape() as tape:
                logits = model(xb, training=True)
                loss = pf.reduce_mean(pf.nn.sparse_softmax_cross_entropy_with_logits(yb, logits))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        return strategy.run(replica, args=(xb, yb))

    for _ in range(steps):
        coordinator.schedule(step, args=(iterator,))
    coordinator.join()
    weights = [w.numpy() for w in model.weights]
    logits = model(pf.constant(x)).numpy()
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    loss = float(-log_probs[np.arange(len(y)), y].mean())
    coordinator.shutdown()
    return loss, weights


def test_bf16_pushes_with_error_feedback_reach_the_uncompressed_loss(start_cluster):
    cluster = start_cluster(num_ps=1, num_workers=1)
    loss_plain, w_plain = _train(cluster, None, "plain_")
    loss_bf16, w_bf16 = _train(cluster, "bf16", "bf16_")
    # the codec really acted (bf16 cannot reproduce float32 sums bit for bit) ...
    assert any(not np.array_equal(a, b) for a, b in zip(w_plain, w_bf16, strict=True))
    # ... and the training went where it goes without it
    assert loss_plain < 1.0, loss_plain  # it learned something (ln 10 = 2.30 at start)
    assert abs(loss_bf16 - loss_plain) <= 0.01 * loss_plain, (loss_bf16, loss_plain)


def test_strategy_rejects_an_unknown_codec_before_touching_the_cluster():
    with pytest.raises(InvalidArgumentError, match="'int3'"):
        pf.distribute.ParameterServerStrategy(compression="int3")
    with pytest.raises(InvalidArgumentError, match="mapping"):
        pf.distribute.ParameterServerStrategy(compression=16)

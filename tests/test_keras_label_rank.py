"""Compiled losses take labels ``(n,)`` against predictions ``(n, k)`` as Keras does: as ``(n, 1)``.

TensorFlow's parameter-server tutorial fits ``Dense(10)`` with ``loss="mse"`` on
labels of shape ``(batch,)``; Keras expands them to a column that broadcasts
over the outputs. One SGD step must match that gradient, computed in NumPy.
"""

from __future__ import annotations

import numpy as np
import pytest

import psflow as pf


def test_mse_on_a_label_vector_broadcasts_it_over_the_outputs_as_keras_does():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 3)).astype(np.float32)
    y = rng.normal(size=(8,)).astype(np.float32)
    w0 = rng.normal(size=(3, 4)).astype(np.float32)
    model = pf.keras.Sequential([pf.keras.layers.Dense(4, use_bias=False, input_shape=(3,))])
    model.set_weights([w0])
    model.compile(optimizer=pf.keras.optimizers.SGD(0.1), loss="mse")
    loss = model.train_on_batch(x, y)
    residual = x @ w0 - y[:, None]  # (8, 4): the label is compared with every output
    assert loss == pytest.approx(float(np.mean(residual**2)), rel=1e-5)
    grad = x.T @ (2 * residual / residual.size)
    np.testing.assert_allclose(model.get_weights()[0], w0 - 0.1 * grad, rtol=1e-5, atol=1e-6)


def test_labels_of_another_length_are_still_rejected():
    model = pf.keras.Sequential([pf.keras.layers.Dense(4, input_shape=(3,))])
    model.compile(optimizer="sgd", loss="mse")
    before = model.get_weights()
    with pytest.raises(pf.errors.InvalidArgumentError, match=r"\[4, 1\].*\[5, 4\]"):
        model.train_on_batch(np.ones((5, 3), np.float32), np.ones((4,), np.float32))
    for got, want in zip(model.get_weights(), before):
        np.testing.assert_array_equal(got, want)

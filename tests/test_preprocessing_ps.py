"""Preprocessing layers inside a ``dataset_fn`` on parameter-server workers (real processes).

The pipeline is the one of TensorFlow's parameter-server tutorial: raw string
features and labels go through ``StringLookup`` layers in ``Dataset.map`` on
each worker, feeding an embedding model whose variables live on the PS. One
asynchronous worker must train exactly as the same pipeline trains locally.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import psflow as pf

pytestmark = pytest.mark.slow

FEATURE_VOCAB = ["avenger", "ironman", "batman", "hulk", "spiderman", "kingkong", "wonder_woman"]
LABEL_VOCAB = ["yes", "no"]
BATCH, STEPS = 8, 5


def _raw_examples() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    words = np.array([*FEATURE_VOCAB, "unknown_hero"])
    features = words[rng.integers(0, len(words), size=(BATCH * STEPS, 3))]
    labels = np.where(rng.random(BATCH * STEPS) < 0.5, "yes", "no")
    return {"features": features, "label": labels}


def _lookups() -> tuple[Any, Any]:
    features = pf.keras.layers.StringLookup(vocabulary=FEATURE_VOCAB)
    labels = pf.keras.layers.StringLookup(vocabulary=LABEL_VOCAB, num_oov_indices=0)
    return features, labels


def _dataset(feature_lookup: Any, label_lookup: Any) -> Any:
    def preprocess(example: dict[str, Any]) -> tuple[Any, Any]:
        return feature_lookup(example["features"]), label_lookup(example["label"])

    return pf.data.Dataset.from_tensor_slices(_raw_examples()).batch(BATCH).map(preprocess)


def _model() -> Any:
    return pf.keras.Sequential(
        [
            pf.keras.layers.Embedding(
                len(FEATURE_VOCAB) + 1,
                4,
                input_length=3,
                embeddings_initializer=pf.keras.initializers.RandomUniform(seed=1),
            ),
            pf.keras.layers.Flatten(),
            pf.keras.layers.Dense(
                1,
                activation="sigmoid",
                kernel_initializer=pf.keras.initializers.GlorotUniform(seed=2),
            ),
        ]
    )


def _loss(model: Any, x: Any, y: Any) -> Any:
    pred = model(x, training=True)
    labels = pf.cast(pf.reshape(y, [-1, 1]), "float32")
    return pf.reduce_mean(pf.keras.losses.binary_crossentropy(labels, pred))


def _local_weights() -> list[list[np.ndarray]]:
    feature_lookup, label_lookup = _lookups()
    pf.random.set_seed(0)
    model = _model()
    model.build((None, 3))
    optimizer = pf.keras.optimizers.SGD(0.5)
    history = [[w.numpy() for w in model.weights]]
    for x, y in _dataset(feature_lookup, label_lookup):
        with pf.GradientTape() as tape:
            loss = _loss(model, x, y)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        history.append([w.numpy() for w in model.weights])
    return history


def test_string_lookup_dataset_fn_on_a_ps_worker_trains_like_local(start_cluster: Any) -> None:
    reference = _local_weights()
    assert len(reference) == STEPS + 1
    cluster = start_cluster(num_ps=1, num_workers=1)
    strategy = pf.distribute.ParameterServerStrategy(cluster.resolver())
    feature_lookup, label_lookup = _lookups()  # outside the scope: no PS state, as in TF
    pf.random.set_seed(0)
    with strategy.scope():
        model = _model()
        model.build((None, 3))
        optimizer = pf.keras.optimizers.SGD(0.5)
    coordinator = pf.distribute.coordinator.ClusterCoordinator(strategy)

    def dataset_fn(_: Any = None) -> Any:
        return _dataset(feature_lookup, label_lookup)

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    for got, want in zip(model.weights, reference[0]):
        np.testing.assert_array_equal(got.numpy(), want)

    def step(iterator: Any) -> Any:
        x, y = next(iterator)

        def replica(x: Any, y: Any) -> Any:
            with pf.GradientTape() as tape:
                loss = _loss(model, x, y)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        return strategy.run(replica, args=(x, y))

    for s in range(STEPS):
        loss = coordinator.schedule(step, args=(iterator,))
        coordinator.join()
        assert np.isfinite(float(loss.fetch()))
        for got, want in zip(model.weights, reference[s + 1]):
            np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-7)

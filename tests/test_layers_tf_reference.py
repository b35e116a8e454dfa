"""Convolution, pooling and normalization layers against tf.keras (optional: needs TensorFlow).

For every configuration of a grid, a tf.keras layer and the psflow layer of the
same arguments get the same weights and the same random float32 input; their
outputs, and the gradients of ``sum(u * output)`` for a random ``u`` with
respect to the input and every trainable weight, must agree within 1e-5
(relative and absolute). Run with ``PYTHONPATH=$PWD /work/tfvenv/bin/python -m pytest``.
"""

from __future__ import annotations

import os
import zlib
from typing import Any

import numpy as np
import pytest

import psflow as pf

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow")

TOL = 1e-5

CASES: list[tuple[str, dict[str, Any], tuple[int, ...], bool | None]] = [
    *(
        (
            "Conv2D",
            dict(filters=4, kernel_size=k, strides=s, padding=p, dilation_rate=d, **extra),
            (2, 9, 8, 3),
            None,
        )
        for k in (3, (2, 3))
        for s, d in ((1, 1), (2, 1), (1, 2), ((1, 3), 1))
        for p in ("valid", "same")
        for extra in ({}, {"activation": "relu", "use_bias": False})
    ),
    *(
        (
            "Conv1D",
            dict(filters=3, kernel_size=k, strides=s, padding=p, dilation_rate=d),
            (2, 11, 4),
            None,
        )
        for k in (2, 3)
        for s, d in ((1, 1), (2, 1), (1, 2))
        for p in ("valid", "same", "causal")
    ),
    *(
        (cls, dict(pool_size=k, strides=s, padding=p), (2, 9, 7, 3), None)
        for cls in ("MaxPooling2D", "AveragePooling2D")
        for k, s in ((2, None), (3, 2), ((2, 3), 1), (3, 3))
        for p in ("valid", "same")
    ),
    *(
        (cls, dict(pool_size=k, strides=s, padding=p), (2, 10, 3), None)
        for cls in ("MaxPooling1D", "AveragePooling1D")
        for k, s in ((2, None), (3, 2))
        for p in ("valid", "same")
    ),
    *(
        (cls, dict(keepdims=kd), shape, None)
        for cls, shape in (
            ("GlobalAveragePooling2D", (2, 5, 4, 3)),
            ("GlobalMaxPooling2D", (2, 5, 4, 3)),
            ("GlobalAveragePooling1D", (2, 6, 3)),
            ("GlobalMaxPooling1D", (2, 6, 3)),
        )
        for kd in (False, True)
    ),
    *(
        ("BatchNormalization", dict(axis=axis, momentum=0.9, center=c, scale=sc), shape, training)
        for axis, shape in ((-1, (8, 5)), (-1, (4, 3, 3, 2)), (1, (4, 3, 5)))
        for c, sc in ((True, True), (False, True), (True, False))
        for training in (True, False)
    ),
    *(
        ("LayerNormalization", dict(axis=axis, epsilon=eps), shape, None)
        for axis, shape in ((-1, (4, 6)), (-1, (2, 3, 5)), ([1, 2], (2, 3, 4)), (1, (3, 4, 2)))
        for eps in (1e-3, 1e-6)
    ),
]


def _grads(module: Any, layer: Any, x: np.ndarray, u: np.ndarray, training: Any) -> list:
    xt = module.constant(x)
    with module.GradientTape() as tape:
        tape.watch(xt)
        y = layer(xt, training=training) if training is not None else layer(xt)
        loss = module.reduce_sum(y * module.constant(u))
    grads = tape.gradient(loss, [xt, *layer.trainable_weights])
    return [np.asarray(y), *(np.asarray(g) for g in grads)]


@pytest.mark.parametrize(("cls", "kwargs", "shape", "training"), CASES, ids=str)
def test_layer_output_and_gradients_equal_tf_keras(
    cls: str, kwargs: dict[str, Any], shape: tuple[int, ...], training: bool | None
) -> None:
    rng = np.random.default_rng(zlib.crc32(f"{cls}{kwargs}{shape}{training}".encode()))
    x = rng.standard_normal(shape).astype(np.float32)
    theirs = getattr(tf.keras.layers, cls)(**kwargs)
    ours = getattr(pf.keras.layers, cls)(**kwargs)
    theirs(x)
    ours(x)
    # random weights (positive variances) so scale, shift and statistics all take part
    weights = [rng.uniform(0.5, 1.5, w.shape).astype(np.float32) for w in theirs.get_weights()]
    theirs.set_weights(weights)
    ours.set_weights(weights)
    u = rng.standard_normal(tuple(theirs.compute_output_shape(shape))).astype(np.float32)
    want = _grads(tf, theirs, x, u, training)
    got = _grads(pf, ours, x, u, training)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape, (i, a.shape, b.shape)
        np.testing.assert_allclose(a, b, rtol=TOL, atol=TOL, err_msg=f"output/grad {i}")
    # the moving statistics moved (or not) the same way
    for a, b in zip(ours.get_weights(), theirs.get_weights()):
        np.testing.assert_allclose(a, b, rtol=TOL, atol=TOL)


# -- preprocessing -------------------------------------------------------------------------

TEXT = np.array([["a", "b", "c", "a"], ["d", "a", "", "b"], ["hello", "x", "zz", "ä"]])
INTS = np.array([[12, 1138, 42, 0], [7, 12, 12, -5]], dtype=np.int64)

PREPROCESSING: list[tuple[str, dict[str, Any], np.ndarray, bool]] = [
    *(
        ("StringLookup", dict(output_mode=m, **kw), TEXT, True)
        for m in ("int", "multi_hot", "count")
        for kw in ({}, {"mask_token": "", "num_oov_indices": 3}, {"max_tokens": 4})
    ),
    ("StringLookup", dict(output_mode="one_hot"), TEXT[:, :1], True),
    *(
        ("IntegerLookup", dict(output_mode=m, **kw), INTS, True)
        for m in ("int", "count")
        for kw in ({}, {"mask_token": 0, "num_oov_indices": 2})
    ),
    *(
        ("Hashing", dict(num_bins=n, **kw), data, False)
        for n in (1, 3, 17)
        for kw in ({}, {"salt": 42}, {"salt": [3, 9]}, {"mask_value": "a"})
        for data in (TEXT,)
    ),
    ("Hashing", dict(num_bins=9), INTS, False),
    ("Hashing", dict(num_bins=9, output_mode="multi_hot"), INTS, False),
    ("CategoryEncoding", dict(num_tokens=5, output_mode="count"), np.array([[0, 4], [3, 3]]), False),
    ("CategoryEncoding", dict(num_tokens=5, output_mode="one_hot"), np.array([[1], [4]]), False),
    ("Discretization", dict(num_bins=5), np.linspace(-3, 7, 37).reshape(1, -1), True),
    ("Discretization", dict(bin_boundaries=[-1.0, 0.0, 2.5]), np.array([[-2.0, 0.0, 2.5, 9.0]]), False),
    ("Normalization", dict(), np.random.default_rng(1).normal(size=(20, 4)) * 3 + 1, True),
    ("Normalization", dict(axis=None), np.random.default_rng(2).normal(size=(20, 4)), True),
]  # fmt: skip


@pytest.mark.parametrize(("cls", "kwargs", "data", "adapt"), PREPROCESSING, ids=str)
def test_preprocessing_layer_equals_tf_keras(
    cls: str, kwargs: dict[str, Any], data: np.ndarray, adapt: bool
) -> None:
    if data.dtype.kind == "f":
        data = data.astype(np.float32)
    theirs = getattr(tf.keras.layers, cls)(**kwargs)
    ours = getattr(pf.keras.layers, cls)(**kwargs)
    if adapt:
        theirs.adapt(data)
        ours.adapt(data)
    if hasattr(theirs, "get_vocabulary"):
        want_vocab = [v.decode() if isinstance(v, bytes) else v for v in theirs.get_vocabulary()]
        assert ours.get_vocabulary() == want_vocab
    want = np.asarray(theirs(data))
    got = ours(data).numpy()
    assert got.shape == want.shape
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=TOL, atol=TOL)

"""Convolution on a GPU through cuDNN (``psflow/ops/conv_gpu.py``), on the strict doubles.

The strict CuPy double (``tests/strict_cupy.py``) with its cuDNN double
(``tests/strict_cudnn.py``, cuDNN's NCHW/OIHW functions computed from their
definition) stands in for a GPU: psflow's layout changes, padding and VJP are
checked against the CPU path (float64, to 1e-12) and against finite differences
of the same CPU op. Each test asserts which path ran, so none can pass on the
im2col path by accident. A real GPU runs the same comparison in
``benchmarks/gpu_check.py`` (``gpu/conv_cudnn``) when one is lent.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

import psflow as pf
from psflow import backend, settings
from psflow.ops import conv_gpu, conv_ops
from tests import strict_cudnn, strict_cupy

# (input hw, kernel hw, stride, padding, dilation): SAME with an odd total pads one more
# pixel after (asymmetric, applied to the input), SAME with an even total pads alike
GEOMETRY = [
    ((7, 6), (3, 2), 1, "VALID", 1),
    ((7, 6), (3, 3), 1, "SAME", 1),  # symmetric: cuDNN's own padding
    ((8, 8), (3, 3), 2, "SAME", 1),  # asymmetric: 1 after, 0 before
    ((9, 7), (2, 3), 1, "SAME", 2),
    ((10, 9), (3, 3), 3, "VALID", 1),
]


@pytest.fixture
def gpu_with_cudnn() -> Iterator[None]:
    """One strict fake GPU whose CuPy has cuDNN."""
    strict_cudnn.reset_counts()
    with strict_cupy.installed(devices=1, cudnn=True):
        yield


@pytest.fixture
def gpu_without_cudnn() -> Iterator[None]:
    """One strict fake GPU whose CuPy has no cuDNN (``cupyx.cudnn`` does not import)."""
    strict_cudnn.reset_counts()
    with strict_cupy.installed(devices=1, cudnn=False):
        yield


def _layer_and_grads(x, w, b, stride, padding, dil, relu, u):
    """The fused layer's output and its gradients for the input, kernel and bias, on the host."""
    xv, wv = pf.constant(x), pf.constant(w)
    bv = None if b is None else pf.constant(b)
    with pf.GradientTape() as tape:
        tape.watch([v for v in (xv, wv, bv) if v is not None])
        y = conv_ops.conv_layer(xv, wv, bv, 2, (stride, stride), padding, (dil, dil), relu)
    sources = [v for v in (xv, wv, bv) if v is not None]
    grads = tape.gradient(y, sources, output_gradients=pf.constant(u))
    return [backend.to_numpy(t._array()) for t in (y, *grads)]


def _case(hw, khw, cin, cout, stride, padding, dil, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, *hw, cin))
    w = rng.standard_normal((*khw, cin, cout))
    b = rng.standard_normal(cout)
    with pf.device("/cpu:0"):
        shape = conv_ops.conv_layer(
            pf.constant(x), pf.constant(w), None, 2, (stride,) * 2, padding, (dil,) * 2, False
        ).shape
    u = rng.standard_normal(tuple(shape))
    return x, w, b, u


@pytest.mark.parametrize(("hw", "khw", "stride", "padding", "dil"), GEOMETRY)
@pytest.mark.parametrize("cin", (1, 3))
@pytest.mark.parametrize(("relu", "bias"), [(True, True), (False, False)])
def test_cudnn_conv_and_its_gradients_equal_the_cpu_path(
    gpu_with_cudnn, hw, khw, stride, padding, dil, cin, relu, bias
):
    x, w, b, u = _case(hw, khw, cin, 4, stride, padding, dil, seed=cin + 10 * stride + dil)
    b = b if bias else None
    got = _layer_and_grads(x, w, b, stride, padding, dil, relu, u)
    assert strict_cudnn.CALLS == {"forward": 1, "backward_filter": 1, "backward_data": 1}
    with pf.device("/cpu:0"):
        want = _layer_and_grads(x, w, b, stride, padding, dil, relu, u)
    assert len(got) == len(want) == (4 if bias else 3)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=1e-12, atol=1e-12)


def test_cudnn_conv_gradients_match_finite_differences(gpu_with_cudnn):
    x, w, b, u = _case((6, 5), (3, 3), 2, 3, 2, "SAME", 1, seed=5)
    _, dx, dw, db = _layer_and_grads(x, w, b, 2, "SAME", 1, False, u)

    def loss(xa, wa, ba):
        with pf.device("/cpu:0"):
            y = conv_ops.conv_layer(
                pf.constant(xa), pf.constant(wa), pf.constant(ba), 2, (2, 2), "SAME", (1, 1), False
            )
            return float(np.sum(y.numpy() * u))

    eps = 1e-6
    for arr, grad, which in ((x, dx, 0), (w, dw, 1), (b, db, 2)):
        for index in [(0,) * arr.ndim, tuple(s - 1 for s in arr.shape)]:
            args = [x.copy(), w.copy(), b.copy()]
            args[which][index] += eps
            up = loss(*args)
            args[which][index] -= 2 * eps
            down = loss(*args)
            assert grad[index] == pytest.approx((up - down) / (2 * eps), rel=1e-6, abs=1e-8)


def test_the_same_seeded_cudnn_step_gives_the_same_bits(gpu_with_cudnn):
    x, w, b, u = _case((8, 8), (3, 3), 3, 5, 1, "SAME", 1, seed=1)
    x, w, b, u = (a.astype(np.float32) for a in (x, w, b, u))
    one = _layer_and_grads(x, w, b, 1, "SAME", 1, True, u)
    two = _layer_and_grads(x, w, b, 1, "SAME", 1, True, u)
    for a, c in zip(one, two):
        assert a.dtype == np.float32
        np.testing.assert_array_equal(a, c)


def test_without_cudnn_the_gpu_keeps_the_im2col_path(gpu_without_cudnn):
    assert conv_gpu.cudnn_or_none("float32") is None
    x, w, b, u = _case((7, 6), (3, 3), 2, 4, 2, "SAME", 1, seed=3)
    got = _layer_and_grads(x, w, b, 2, "SAME", 1, True, u)
    assert strict_cudnn.CALLS == {"forward": 0, "backward_filter": 0, "backward_data": 0}
    with pf.device("/cpu:0"):
        want = _layer_and_grads(x, w, b, 2, "SAME", 1, True, u)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=1e-12, atol=1e-12)


def test_psflow_cudnn_0_keeps_the_im2col_path(gpu_with_cudnn, monkeypatch):
    monkeypatch.setenv(settings.ENV_CUDNN, "0")
    x, w, b, u = _case((7, 6), (3, 3), 1, 2, 1, "VALID", 1, seed=4)
    _layer_and_grads(x, w, b, 1, "VALID", 1, False, u)
    assert strict_cudnn.CALLS["forward"] == 0
    monkeypatch.delenv(settings.ENV_CUDNN)
    _layer_and_grads(x, w, b, 1, "VALID", 1, False, u)
    assert strict_cudnn.CALLS["forward"] == 1


def test_a_cudnn_that_fails_is_given_up_once_with_a_warning_and_the_result_is_right(
    gpu_with_cudnn, monkeypatch, caplog
):
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("CUDNN_STATUS_NOT_INITIALIZED")

    import cupyx.cudnn

    monkeypatch.setattr(cupyx.cudnn, "convolution_forward", broken)
    x, w, b, u = _case((7, 6), (3, 3), 2, 4, 1, "SAME", 1, seed=6)
    with caplog.at_level("WARNING", logger="psflow.ops.conv_gpu"):
        got = _layer_and_grads(x, w, b, 1, "SAME", 1, True, u)
        again = _layer_and_grads(x, w, b, 1, "SAME", 1, True, u)
    assert len(calls) == 1  # given up after the first failure
    warnings = [r for r in caplog.records if "CUDNN_STATUS_NOT_INITIALIZED" in r.getMessage()]
    assert len(warnings) == 1
    with pf.device("/cpu:0"):
        want = _layer_and_grads(x, w, b, 1, "SAME", 1, True, u)
    for g, a, r in zip(got, again, want):
        np.testing.assert_allclose(g, r, rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(g, a)


def test_an_integer_input_is_refused_with_a_typed_error_before_cudnn(gpu_with_cudnn):
    x = np.ones((1, 5, 5, 1), dtype=np.int32)
    w = np.ones((3, 3, 1, 2), dtype=np.float32)
    with pytest.raises(pf.errors.InvalidArgumentError, match="int32"):
        pf.nn.conv2d(pf.constant(x), pf.constant(w), 1, "VALID")
    assert strict_cudnn.CALLS["forward"] == 0


def test_the_tutorial_cnn_fits_on_a_gpu_with_cudnn_like_on_the_cpu(gpu_with_cudnn):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 12, 12, 1)).astype(np.float32)
    y = rng.integers(0, 10, 16).astype(np.int64)

    def fit() -> tuple[list[float], list[np.ndarray]]:
        pf.random.set_seed(7)
        L = pf.keras.layers
        model = pf.keras.Sequential(
            [
                pf.keras.Input((12, 12, 1)),
                L.Conv2D(8, 3, activation="relu"),
                L.MaxPooling2D(),
                L.Flatten(),
                L.Dense(16, activation="relu"),
                L.Dense(10),
            ]
        )
        model.compile(
            optimizer=pf.keras.optimizers.SGD(0.05),
            loss=pf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        return history.history["loss"], [np.array(v) for v in model.get_weights()]

    loss_gpu, weights_gpu = fit()
    assert strict_cudnn.CALLS["forward"] >= 4 and strict_cudnn.CALLS["backward_filter"] >= 4
    with pf.device("/cpu:0"):
        loss_cpu, weights_cpu = fit()
    np.testing.assert_allclose(loss_gpu, loss_cpu, rtol=1e-5)
    for g, c in zip(weights_gpu, weights_cpu):
        np.testing.assert_allclose(g, c, rtol=1e-4, atol=1e-6)

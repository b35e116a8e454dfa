"""A convolution and the max pool after it as one op (``conv_ops.conv_layer_max_pool``;
``Sequential`` runs a ``Conv2D`` and the ``MaxPooling2D`` after it through it).

Reference: the two ops one after the other (``conv_layer``, then ``max_pool2d``),
run in the same test on the same values; each is checked against its definition
in tests/test_conv_ops.py and tests/test_conv_kernels.py. The fused op claims the
same bits, values and gradients, on every CPU: a maximum, a comparison and a
product by 0 or 1 are exact, and the products run on the same chunks of images (the one
exception, a zero maximum's sign where a window holds -0.0 and nothing above it, is
NumPy's ReLU's choice on non-x86 CPUs; the inputs here have no -0.0).
The unhappy paths: NaN, infinities and ties in the input; windows that leave
rows out; every case the op does not fuse (overlapping windows, a padded pool,
one chunk, the compiled loops off, GPU arrays) runs the two ops.
"""

from __future__ import annotations

import numpy as np
import pytest

import psflow as pf
from psflow.keras.engine import functional, sequential
from psflow.keras.layers.convolutional import conv_then_max_pool
from psflow.ops import compiled, conv_cpu, conv_ops, pool_ops
from tests.test_compiled_kernels import _cnn_weights

pytest.importorskip("numba")


@pytest.fixture(scope="module", autouse=True)
def ready():
    """The compiled loops loaded before the tests (the op fuses only once they are)."""
    assert compiled.wait_ready(120) is not None


@pytest.fixture
def chunks(monkeypatch):
    """Small batches cut into several chunks of images (the fused op's precondition), and
    compiled loops for arrays of any size; yields a list that counts the fused passes."""
    monkeypatch.setattr(conv_cpu, "IMAGE_CHUNK_BYTES", 8 << 10)
    monkeypatch.setattr(compiled, "MIN_ELEMENTS", 0)
    fused: list[int] = []
    forward = conv_cpu.ChunkedConv.forward_max_pool

    def counted(self, *args, **kwargs):
        fused.append(1)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(conv_cpu.ChunkedConv, "forward_max_pool", counted)
    return fused


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(np.uint32 if a.dtype == np.float32 else np.uint64)


def _grid(rng, shape, dtype, specials=True):
    """Values on a coarse grid (ties within windows, exact sums), NaN and infinities; no
    ``-0.0`` (the sign of a zero maximum is the CPU's choice in NumPy's ReLU, not here)."""
    a = np.round(rng.standard_normal(shape) * 2) / 2 + 0.0  # -0.0 + 0.0 is +0.0
    if specials:
        flat = a.reshape(-1)
        picks = rng.choice(flat.size, size=3, replace=False)
        flat[picks] = [np.nan, np.inf, -np.inf]
    return a.astype(dtype)


def _both(x, w, b, conv_padding, relu, pool, g):
    """``(values, dx, dw, db)`` of the fused op and of the two ops, the same gradient ``g``."""
    k, s, pool_padding = pool
    results, made = [], {}
    for fused in (True, False):
        xv, wv, bv = pf.Variable(x), pf.Variable(w), pf.Variable(b)
        with pf.GradientTape() as tape:
            if fused:
                y = conv_ops.conv_layer_max_pool(
                    xv, wv, bv, (1, 1), conv_padding, (1, 1), relu, k, s, pool_padding
                )
            else:
                z = conv_ops.conv_layer(xv, wv, bv, 2, (1, 1), conv_padding, (1, 1), relu)
                y = pool_ops.max_pool2d(z, k, s, pool_padding)
        dy = made.setdefault(tuple(y.shape), g(tuple(y.shape)))  # one gradient for both
        grads = tape.gradient(y, [xv, wv, bv], output_gradients=pf.constant(dy))
        results.append([y.numpy(), *(t.numpy() for t in grads)])
    return results


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize(
    ("size", "conv_padding", "pool"),
    [
        (12, "valid", ((2, 2), (2, 2), "VALID")),  # 10x10 output: 2x2 windows tile it
        (13, "valid", ((2, 2), (2, 2), "VALID")),  # 11x11: a row and a column in no window
        (12, "same", ((3, 3), (3, 3), "VALID")),  # the general loops, tiled
        (12, "valid", ((2, 2), (3, 3), "VALID")),  # gaps between windows
        (12, "valid", ((2, 2), (2, 2), "SAME")),  # an even size: SAME pads nothing
    ],
)
def test_the_fused_op_gives_the_two_ops_bits(chunks, dtype, relu, size, conv_padding, pool):
    rng = np.random.default_rng(5)
    x = _grid(rng, (7, size, size, 2), dtype)
    w = _grid(rng, (3, 3, 2, 6), dtype, specials=False)
    b = _grid(rng, (6,), dtype, specials=False)
    with np.errstate(invalid="ignore"):  # inf - inf in the sums, inf * 0 in the gradients
        fused, apart = _both(x, w, b, conv_padding, relu, pool, lambda s: _grid(rng, s, dtype))
    assert len(chunks) == 1
    for f, a in zip(fused, apart):
        np.testing.assert_array_equal(_bits(f), _bits(a))
    y, dx, dw, _ = fused
    assert np.isnan(y).any() and np.isnan(dw).any()  # the unhappy values got through
    assert (dx == 0).any() and (dx != 0).any()
    if relu:
        assert (y == 0).any()  # windows with nothing above zero


@pytest.mark.parametrize(
    ("batch", "pool", "switch"),
    [
        (7, ((2, 2), (1, 1), "VALID"), "1"),  # overlapping windows
        (7, ((2, 2), (2, 2), "SAME"), "1"),  # an odd size: SAME pads a row and a column
        (1, ((2, 2), (2, 2), "VALID"), "1"),  # one chunk of images
        (7, ((2, 2), (2, 2), "VALID"), "0"),  # the compiled loops switched off
    ],
)
def test_where_it_cannot_fuse_the_two_ops_run(chunks, monkeypatch, batch, pool, switch):
    monkeypatch.setenv("PSFLOW_COMPILED_KERNELS", switch)
    rng = np.random.default_rng(6)
    x = _grid(rng, (batch, 13, 13, 2), np.float32)
    w = _grid(rng, (3, 3, 2, 6), np.float32, specials=False)
    b = np.zeros(6, np.float32)
    with np.errstate(invalid="ignore"):
        fused, apart = _both(x, w, b, "valid", True, pool, lambda s: np.ones(s, np.float32))
    assert chunks == []
    for f, a in zip(fused, apart):
        np.testing.assert_array_equal(_bits(f), _bits(a))


def test_bad_pool_arguments_get_the_pools_error_and_train_nothing(chunks):
    x, w, b = pf.ones([4, 8, 8, 1]), pf.Variable(np.ones((3, 3, 1, 2), np.float32)), None
    with pytest.raises(pf.errors.InvalidArgumentError, match="padding"):
        conv_ops.conv_layer_max_pool(x, w, b, (1, 1), "valid", (1, 1), True, 2, 2, "FULL")
    with pytest.raises(pf.errors.InvalidArgumentError, match="ksize"):
        conv_ops.conv_layer_max_pool(x, w, b, (1, 1), "valid", (1, 1), True, (0, 2), 2, "VALID")
    np.testing.assert_array_equal(w.numpy(), 1)


@pytest.mark.parametrize("optimizer", ["SGD", "Adam"])
def test_a_seeded_sequential_cnn_fits_to_the_same_bits_fused_or_not(chunks, monkeypatch, optimizer):
    fused = _cnn_weights(monkeypatch, "1", optimizer)
    assert chunks  # the fit went through the fused op
    chunks.clear()
    monkeypatch.setattr(sequential, "conv_then_max_pool", lambda *args: None)
    apart = _cnn_weights(monkeypatch, "1", optimizer)
    assert chunks == []
    for a, b in zip(fused, apart):
        np.testing.assert_array_equal(_bits(a), _bits(b))


def _functional_cnn(monkeypatch, fuse: bool, also_read: bool) -> list[np.ndarray]:
    """A functional CNN's weights after a seeded fit; with ``also_read``, the convolution's
    output is read by a second layer too (and so is never fused)."""
    pair = conv_then_max_pool if fuse else (lambda *args: None)
    monkeypatch.setattr(functional, "conv_then_max_pool", pair)
    L = pf.keras.layers
    pf.random.set_seed(13)
    rng = np.random.default_rng(13)
    x = rng.standard_normal((64, 12, 12, 1), dtype=np.float32)
    y = rng.integers(0, 4, 64)
    inputs = pf.keras.Input((12, 12, 1))
    z = L.Conv2D(8, 3, activation="relu")(inputs)
    h = L.Flatten()(L.MaxPooling2D()(z))
    if also_read:
        h = L.Concatenate()([h, L.Flatten()(L.AveragePooling2D()(z))])
    model = pf.keras.Model(inputs, L.Dense(4)(h))
    model.compile(
        optimizer="sgd", loss=pf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    model.fit(x, y, batch_size=32, epochs=2, verbose=0)
    return model.get_weights()


@pytest.mark.parametrize("also_read", [False, True])
def test_a_functional_cnn_fits_to_the_same_bits_fused_or_not(chunks, monkeypatch, also_read):
    """The pair fuses where the pool is the convolution's only reader, not where another
    layer reads the convolution's output too."""
    fused = _functional_cnn(monkeypatch, True, also_read)
    assert bool(chunks) is not also_read
    chunks.clear()
    apart = _functional_cnn(monkeypatch, False, also_read)
    assert chunks == []
    for a, b in zip(fused, apart):
        np.testing.assert_array_equal(_bits(a), _bits(b))


def test_only_a_plain_conv2d_with_relu_or_no_activation_and_a_max_pool_fuse(chunks):
    L = pf.keras.layers

    class MyConv(L.Conv2D):
        pass

    x = pf.ones([4, 8, 8, 1])

    def pair(conv, pool):
        conv.build((None, 8, 8, 1))
        pool.build((None, 6, 6, 2))
        return conv_then_max_pool(conv, pool, x)

    assert pair(L.Conv2D(2, 3, activation="relu"), L.MaxPooling2D()) is not None
    assert pair(L.Conv2D(2, 3), L.MaxPooling2D()) is not None
    assert pair(L.Conv2D(2, 3, activation="tanh"), L.MaxPooling2D()) is None
    assert pair(MyConv(2, 3, activation="relu"), L.MaxPooling2D()) is None
    assert pair(L.Conv2D(2, 3, activation="relu"), L.AveragePooling2D()) is None
    assert conv_then_max_pool(L.Conv2D(2, 3), L.MaxPooling2D(), x) is None  # not built
    symbolic = pf.keras.Input((8, 8, 1))
    conv, pool = L.Conv2D(2, 3), L.MaxPooling2D()
    conv.build((None, 8, 8, 1))
    pool.build((None, 6, 6, 2))
    assert conv_then_max_pool(conv, pool, symbolic) is None


def test_gpu_arrays_run_the_two_ops(chunks):
    """On a GPU worker (the strict CuPy double, which refuses host conversions) the pair
    runs as two ops on the device and gives the CPU's results; only NumPy goes to Numba."""
    from tests import strict_cupy

    rng = np.random.default_rng(7)
    x = rng.standard_normal((7, 10, 10, 2)).astype(np.float32)
    w = rng.standard_normal((3, 3, 2, 4)).astype(np.float32)
    g = rng.standard_normal((7, 4, 4, 4)).astype(np.float32)

    def run(put, get):
        xv, wv = pf.Variable(put(x)), pf.Variable(put(w))
        with pf.GradientTape() as tape:
            y = conv_ops.conv_layer_max_pool(
                xv, wv, None, (1, 1), "valid", (1, 1), True, (2, 2), (2, 2), "VALID"
            )
        dx, dw = tape.gradient(y, [xv, wv], output_gradients=pf.constant(put(g)))
        return [get(y.numpy()), get(dx.numpy()), get(dw.numpy())]

    cpu = run(lambda a: a, np.asarray)
    assert len(chunks) == 1
    with strict_cupy.installed(devices=1):
        import cupy

        on_gpu = run(cupy.asarray, cupy.asnumpy)
    assert len(chunks) == 1
    for a, b in zip(on_gpu, cpu):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)

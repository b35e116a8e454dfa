"""The compiled CPU kernels (psflow/ops/compiled.py, Numba): the same bits as NumPy's calls.

Reference: the NumPy path each kernel replaces, run in the same test with
``PSFLOW_COMPILED_KERNELS=0``; the NumPy path itself is checked against its
definitions in tests/test_conv_kernels.py (first-maximum routing) and
tests/test_conv_ops.py. Bit equality holds on every CPU: a maximum, a
comparison and a product by 0 or 1 are exact. The unhappy paths: Numba missing,
a compile that fails, the switch off; values that are NaN, infinite, tied or
negative zero.
"""

from __future__ import annotations

import logging
import sys

import numpy as np
import pytest

import psflow as pf
from psflow import update_rules
from psflow.ops import compiled

pytest.importorskip("numba")


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32 if a.dtype == np.float32 else np.uint64)


@pytest.fixture(scope="module", autouse=True)
def ready():
    """The kernels compiled (or loaded) before the tests that compare them with NumPy."""
    assert compiled.wait_ready(120) is not None


@pytest.fixture
def every_size(monkeypatch):
    """Compiled kernels for arrays of any size (the tests' arrays are small)."""
    monkeypatch.setattr(compiled, "MIN_ELEMENTS", 0)


@pytest.fixture
def fresh(monkeypatch):
    """A process that has not looked for Numba yet (what the test does is undone after)."""
    monkeypatch.setattr(compiled, "_built", None)
    monkeypatch.setattr(compiled, "_failed", False)
    monkeypatch.setattr(compiled, "_building", None)
    monkeypatch.setattr(compiled, "MIN_ELEMENTS", 0)


def _pool_both_ways(monkeypatch, x, make_g, k, s, padding):
    """(forward, input gradient) of max pooling, compiled and on NumPy (one output gradient,
    ``make_g(shape)``, for both)."""
    results = []
    grads: dict[tuple[int, ...], np.ndarray] = {}

    def g(shape: tuple[int, ...]) -> np.ndarray:
        return grads[shape] if shape in grads else grads.setdefault(shape, make_g(shape))

    for switch in ("1", "0"):
        monkeypatch.setenv("PSFLOW_COMPILED_KERNELS", switch)
        xv = pf.constant(x)
        with pf.GradientTape() as tape:
            tape.watch(xv)
            y = pf.nn.max_pool2d(xv, k, s, padding)
        grad = tape.gradient(y, xv, output_gradients=pf.constant(g(tuple(y.shape))))
        results.append((y.numpy(), grad.numpy()))
    return results


def _special(rng, shape, dtype, negative_zeros=True):
    """Normal values with ties (a coarse grid), NaN, infinities and zeros sprinkled in."""
    a = np.round(rng.standard_normal(shape) * 2) / 2  # many equal values in a window
    flat = a.reshape(-1)
    picks = rng.choice(flat.size, size=max(5, flat.size // 50), replace=False)
    for i, v in zip(picks, [np.nan, np.inf, -np.inf, -0.0, 0.0] * flat.size):
        flat[i] = v
    if not negative_zeros:
        a[a == 0] = 0.0
    return a.astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    ("k", "s", "padding"),
    [
        (2, 2, "VALID"),  # Keras's default: the unrolled 2x2 kernels, windows tile the input
        (2, 2, "SAME"),  # an odd size: a padded row and column of -inf
        (3, 3, "VALID"),  # the general kernels
        (2, 3, "VALID"),  # gaps between windows: positions in no window keep a zero gradient
        ((1, 2), (1, 2), "VALID"),
    ],
)
def test_max_pool_gives_numpys_bits_on_ties_nans_infinities_and_zeros(
    every_size, monkeypatch, dtype, k, s, padding
) -> None:
    rng = np.random.default_rng(3)
    # no -0.0 in the pooled input: which of +0 and -0 NumPy's maximum gives is the CPU's choice
    x = _special(rng, (3, 9, 11, 5), dtype, negative_zeros=False)
    with np.errstate(invalid="ignore"):  # NumPy's path multiplies infinities by 0
        (yc, gc), (yn, gn) = _pool_both_ways(
            monkeypatch, x, lambda shape: _special(rng, shape, dtype), k, s, padding
        )
    np.testing.assert_array_equal(_bits(yc), _bits(yn))
    np.testing.assert_array_equal(_bits(gc), _bits(gn))
    assert np.isnan(yc).any() and np.isnan(gc).any() and (np.signbit(gc) & (gc == 0)).any()


def test_max_pool_in_chunks_over_the_kernel_threads_gives_the_same_bits(
    monkeypatch,
) -> None:
    """A batch large enough to be compiled by default (no fixture), cut into chunks of one
    image each, so the kernel threads run the compiled loops at once."""
    from psflow.ops import pool_ops

    monkeypatch.setattr(pool_ops, "POOL_CHUNK_BYTES", 1)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((16, 26, 26, 32), dtype=np.float32)
    assert x.size >= compiled.MIN_ELEMENTS
    (yc, gc), (yn, gn) = _pool_both_ways(
        monkeypatch, x, lambda shape: rng.standard_normal(shape, dtype=np.float32), 2, 2, "VALID"
    )
    np.testing.assert_array_equal(_bits(yc), _bits(yn))
    np.testing.assert_array_equal(_bits(gc), _bits(gn))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(7,), (5, 6), (2, 3, 4)])
def test_relu_grad_gives_numpys_bits(every_size, dtype, shape) -> None:
    rng = np.random.default_rng(len(shape))
    g, z = _special(rng, shape, dtype), _special(rng, shape, dtype)
    got = compiled.relu_grad(g, z)
    assert (np.signbit(g) & (g == 0)).any() and np.isnan(g).any()
    assert compiled.kernels(dtype, g.size) is not None
    with np.errstate(invalid="ignore"):
        want = np.multiply(g, z > 0, dtype=dtype)
    np.testing.assert_array_equal(_bits(got), _bits(want))


def test_relu_grad_of_strided_or_mixed_arrays_takes_numpys_path(every_size) -> None:
    rng = np.random.default_rng(1)
    g = rng.standard_normal((6, 8))
    z = rng.standard_normal((8, 6)).T  # not C-contiguous
    np.testing.assert_array_equal(compiled.relu_grad(g, z), g * (z > 0))
    z32 = z.astype(np.float32)  # another dtype than the gradient's
    np.testing.assert_array_equal(compiled.relu_grad(g, z32), g * (z32 > 0))


def test_a_small_array_never_imports_numba(fresh, monkeypatch) -> None:
    monkeypatch.setattr(compiled, "MIN_ELEMENTS", 1 << 16)
    monkeypatch.setattr(compiled, "_start_build", lambda: pytest.fail("built for a small array"))
    g = np.ones((64, 512), dtype=np.float32)
    np.testing.assert_array_equal(compiled.relu_grad(g, g), g)


def test_the_first_call_does_not_wait_for_the_compile(fresh, monkeypatch) -> None:
    """The first large array starts the compile in the background and takes NumPy's path at
    once (a PS's apply under its mirror's seqlock must not wait seconds for Numba)."""
    import threading

    gate = threading.Event()
    real = compiled._build
    monkeypatch.setattr(compiled, "_build", lambda: (gate.wait(60), real()))
    g = np.arange(-3.0, 3.0, dtype=np.float32)
    assert compiled.kernels(np.float32, g.size) is None  # compiling: NumPy meanwhile
    np.testing.assert_array_equal(compiled.relu_grad(g, g), g * (g > 0))
    gate.set()
    assert compiled.wait_ready(120) is not None
    assert compiled.kernels(np.float32, g.size) is not None


def test_the_switch_off_keeps_numpy(monkeypatch) -> None:
    monkeypatch.setenv("PSFLOW_COMPILED_KERNELS", "0")
    assert compiled.kernels(np.float32, 1 << 20) is None
    monkeypatch.setenv("PSFLOW_COMPILED_KERNELS", "1")
    assert compiled.kernels(np.float32, 1 << 20) is not None
    assert compiled.kernels(np.int32, 1 << 20) is None  # a dtype the loops do not take


def test_without_numba_numpy_runs_and_says_so_once(fresh, monkeypatch, caplog) -> None:
    monkeypatch.setitem(sys.modules, "numba", None)  # import numba raises ImportError
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 6, 6, 3), dtype=np.float32)
    with caplog.at_level(logging.INFO, logger=compiled.__name__):
        y = pf.nn.max_pool2d(pf.constant(x), 2, 2, "VALID").numpy()
        compiled.relu_grad(x, x)
        assert compiled.wait_ready(60) is None
        compiled.relu_grad(x, x)
    np.testing.assert_array_equal(y, x.reshape(2, 3, 2, 3, 2, 3).max(axis=(2, 4)))
    assert compiled.kernels(np.float32, x.size) is None
    said = [r for r in caplog.records if "Numba is not installed" in r.getMessage()]
    assert len(said) == 1


def test_a_compile_that_fails_is_given_up_with_one_warning(fresh, monkeypatch, caplog) -> None:
    import numba

    def broken(**kwargs):
        def decorate(fn):
            raise RuntimeError("no usable LLVM here")

        return decorate

    monkeypatch.setattr(numba, "njit", broken)
    g = np.arange(-3.0, 3.0).reshape(2, 3)
    with caplog.at_level(logging.WARNING, logger=compiled.__name__):
        np.testing.assert_array_equal(compiled.relu_grad(g, g), g * (g > 0))
        assert compiled.wait_ready(60) is None
        np.testing.assert_array_equal(compiled.relu_grad(g, -g), g * (g < 0))
    warned = [r for r in caplog.records if "no usable LLVM here" in r.getMessage()]
    assert len(warned) == 1 and compiled.kernels(np.float64, g.size) is None


def test_without_a_writable_cache_the_kernels_compile_in_the_process(fresh, monkeypatch, caplog):
    import numba

    real = numba.njit

    def no_cache(**kwargs):
        if kwargs.get("cache"):
            raise RuntimeError("cannot cache function: no locator available")
        return real(**kwargs)

    monkeypatch.setattr(numba, "njit", no_cache)
    # one kernel compiled, not all of them for both dtypes: ~15 s of CPU on a loaded runner
    monkeypatch.setattr(
        compiled,
        "_compile",
        lambda k: k.relu_grad(*[np.ones((1, 1))] * 2, k.factors("f8"), np.ones((1, 1))),
    )
    g = np.arange(-3.0, 3.0).reshape(2, 3)
    with caplog.at_level(logging.INFO, logger=compiled.__name__):
        np.testing.assert_array_equal(compiled.relu_grad(g, g), g * (g > 0))
        assert compiled.wait_ready(120) is not None
    assert compiled.kernels(np.float64, g.size) is not None
    assert any("compiled per process" in r.getMessage() for r in caplog.records)


RULES = {
    "sgd": update_rules.SGD(learning_rate=0.1),
    "momentum": update_rules.SGD(learning_rate=0.1, momentum=0.9),
    "nesterov": update_rules.SGD(learning_rate=0.1, momentum=0.9, nesterov=True),
    "adam": update_rules.Adam(learning_rate=0.01),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rule", sorted(RULES))
def test_update_rules_give_numpys_bits_over_steps(every_size, monkeypatch, rule, dtype) -> None:
    """Three steps of each rule on the same variable and gradients, compiled and on NumPy;
    a value that changes every step (the gradient), slots carried between steps."""
    rng = np.random.default_rng(9)
    start = rng.standard_normal(1000).astype(dtype)
    grads = [rng.standard_normal(1000).astype(dtype) for _ in range(3)]
    grads[1][:5] = [0.0, -0.0, 1e-30, -1e30, 3.0]
    ends = []
    for switch in ("1", "0"):
        monkeypatch.setenv("PSFLOW_COMPILED_KERNELS", switch)
        var = start.copy()
        slots = {n: np.zeros_like(var) for n in RULES[rule].slot_names}
        with np.errstate(over="ignore", invalid="ignore"):  # -1e30 squared: inf, then NaN
            for step, g in enumerate(grads, start=1):
                RULES[rule]._update(var, g, slots, step)
        ends.append((var, slots))
    (vc, sc), (vn, sn) = ends
    np.testing.assert_array_equal(_bits(vc), _bits(vn))
    for name in sc:
        np.testing.assert_array_equal(_bits(sc[name]), _bits(sn[name]))


def test_update_rules_on_views_or_mixed_dtypes_take_numpys_path(every_size) -> None:
    rule = RULES["adam"]
    var = np.ones((8, 6), dtype=np.float32)
    column = var[:, 2]  # a strided view: updated in place all the same
    slots = {n: np.zeros_like(column) for n in rule.slot_names}
    rule._update(column, np.full(8, 0.5, dtype=np.float32), slots, 1)
    assert (var[:, 2] < 1).all() and (var[:, [0, 1, 3, 4, 5]] == 1).all()
    assert not compiled.sgd_update(var, var.astype(np.float64), np.float32(0.1))


def test_gpu_arrays_never_reach_the_compiled_loops(every_size, monkeypatch) -> None:
    """On a GPU worker (the strict CuPy double, which refuses host conversions) the ReLU's
    gradient, max pooling and the SGD and Adam updates take CuPy's path and give the CPU's
    results; only NumPy arrays go to Numba."""
    from tests import strict_cupy

    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 6, 6, 3)).astype(np.float32)
    g = rng.standard_normal((2, 3, 3, 3)).astype(np.float32)
    start, grad = rng.standard_normal(500).astype(np.float32), rng.standard_normal(500)
    grad = grad.astype(np.float32)

    def run(put, get):
        xv = pf.constant(put(x))
        with pf.GradientTape() as tape:
            tape.watch(xv)
            y = pf.nn.max_pool2d(pf.nn.relu(xv), 2, 2, "VALID")
        dx = tape.gradient(y, xv, output_gradients=pf.constant(put(g)))
        out = [get(y.numpy() if hasattr(y, "numpy") else y), get(dx.numpy())]
        for rule in ("momentum", "adam"):
            var = put(start.copy())
            slots = {n: put(np.zeros_like(start)) for n in RULES[rule].slot_names}
            RULES[rule]._update(var, put(grad), slots, 1)
            out.append(get(var))
        return out

    cpu = run(lambda a: a, np.asarray)
    asked: list[int] = []  # a GPU's arrays never even ask (a GPU process never loads Numba)
    real = compiled.kernels
    monkeypatch.setattr(
        compiled, "kernels", lambda dtype, size: asked.append(size) or real(dtype, size)
    )
    with strict_cupy.installed(devices=1):
        import cupy

        on_gpu = run(cupy.asarray, cupy.asnumpy)
    assert asked == []
    for a, b in zip(on_gpu, cpu):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def _cnn_weights(monkeypatch, switch: str, optimizer: str) -> list[np.ndarray]:
    monkeypatch.setenv("PSFLOW_COMPILED_KERNELS", switch)
    pf.random.set_seed(11)
    rng = np.random.default_rng(11)
    x = rng.standard_normal((64, 12, 12, 1), dtype=np.float32)
    y = rng.integers(0, 4, 64)
    model = pf.keras.Sequential(
        [
            pf.keras.Input((12, 12, 1)),
            pf.keras.layers.Conv2D(8, 3, activation="relu"),
            pf.keras.layers.MaxPooling2D(),
            pf.keras.layers.Flatten(),
            pf.keras.layers.Dense(16, activation="relu"),
            pf.keras.layers.Dense(4),
        ]
    )
    model.compile(
        optimizer=pf.keras.optimizers.get({"class_name": optimizer, "config": {}}),
        loss=pf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(x, y, batch_size=32, epochs=2, verbose=0)
    return model.get_weights()


@pytest.mark.parametrize("optimizer", ["SGD", "Adam"])
def test_a_seeded_cnn_fit_ends_with_the_same_bits_compiled_or_not(
    every_size, monkeypatch, optimizer
):
    compiled_run = _cnn_weights(monkeypatch, "1", optimizer)
    numpy_run = _cnn_weights(monkeypatch, "0", optimizer)
    for a, b in zip(compiled_run, numpy_run):
        np.testing.assert_array_equal(_bits(a), _bits(b))

"""Op values, gradient conventions at kinks and ties, and bad-input errors.

The optional reference tests run the same computation in TensorFlow (when it
is installed) and compare values and gradients.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import psflow as pf


def grads(f: Callable[..., Any], *values: Any, dtype: Any = pf.float64) -> list[Any]:
    """Gradients of ``sum(f(*xs))`` w.r.t. each input, as NumPy arrays (``None`` kept)."""
    xs = [pf.constant(v, dtype=dtype) for v in values]
    with pf.GradientTape() as tape:
        tape.watch(xs)
        y = f(*xs)
    out = tape.gradient(y, xs)
    return [None if g is None else pf.convert_to_tensor(g).numpy() for g in out]


# -- values ------------------------------------------------------------------------------


def test_elementwise_values_match_numpy() -> None:
    rng = np.random.default_rng(0)
    a, b = rng.uniform(0.5, 2, (3, 4)), rng.uniform(0.5, 2, (4,))
    x, y = pf.constant(a), pf.constant(b)
    checks = {
        "add": (pf.add(x, y), a + b),
        "pow": (pf.pow(x, y), a**b),
        "squared_difference": (pf.math.squared_difference(x, y), (a - b) ** 2),
        "rsqrt": (pf.rsqrt(x), 1 / np.sqrt(a)),
        "sigmoid": (pf.sigmoid(x), 1 / (1 + np.exp(-a))),
        "softplus": (pf.math.softplus(x), np.log1p(np.exp(a))),
        "softmax": (pf.nn.softmax(x), np.exp(a) / np.exp(a).sum(1, keepdims=True)),
        "log_softmax": (pf.nn.log_softmax(x), a - np.log(np.exp(a).sum(1, keepdims=True))),
        "logsumexp": (pf.reduce_logsumexp(x, axis=0), np.log(np.exp(a).sum(0))),
        "cumsum": (pf.cumsum(x, axis=1, exclusive=True), np.cumsum(a, 1) - a),
        "elu": (pf.nn.elu(x - 1.0), np.where(a > 1, a - 1, np.expm1(a - 1))),
        "l2_loss": (pf.nn.l2_loss(x), (a**2).sum() / 2),
        "reduce_std": (pf.reduce_std(x, axis=1), a.std(1)),
    }
    for name, (got, want) in checks.items():
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, err_msg=name)
        assert got.dtype == pf.float64, name


def test_float32_stays_float32_through_every_op_of_an_mlp_step() -> None:
    x = pf.constant(np.ones((2, 3), np.float32))
    w = pf.Variable(np.full((3, 4), 0.5, np.float32))
    with pf.GradientTape() as tape:
        h = pf.nn.relu(pf.matmul(x, w) * np.float64(2.0) + 1.0)
        loss = pf.reduce_mean(pf.nn.sparse_softmax_cross_entropy_with_logits([1, 2], h)) / 3
    assert h.dtype == pf.float32 and loss.dtype == pf.float32
    assert tape.gradient(loss, w).dtype == pf.float32


def test_integer_mean_truncates_and_integer_division_gives_floats() -> None:
    assert int(pf.reduce_mean(pf.constant([1, 2]))) == 1
    q = pf.constant([1, 2]) / pf.constant([2, 2])
    assert q.dtype == pf.float64
    np.testing.assert_array_equal(q.numpy(), [0.5, 1.0])
    np.testing.assert_array_equal((pf.constant([7, -7]) // 2).numpy(), [3, -4])
    np.testing.assert_array_equal((pf.constant([7, -7]) % 3).numpy(), [1, 2])


def test_one_hot_values_and_no_gradient() -> None:
    np.testing.assert_array_equal(
        pf.one_hot([0, 2, 5], 3).numpy(), [[1, 0, 0], [0, 0, 1], [0, 0, 0]]
    )
    assert pf.one_hot([1], 2, on_value=5, off_value=-1, dtype=pf.int32).numpy().tolist() == [
        [-1, 5]
    ]
    x = pf.constant([1.0, 2.0, 3.0])
    with pf.GradientTape() as tape:
        tape.watch(x)
        hot = pf.one_hot(pf.cast(x, pf.int32), 4)
    assert tape.gradient(hot, x) is None


@pytest.mark.parametrize("op", [pf.math.floor, pf.math.ceil, pf.round, pf.argmax])
def test_piecewise_constant_ops_have_no_gradient(op: Callable[..., Any]) -> None:
    assert grads(op, [0.3, 1.7]) == [None]


def test_sign_gradient_is_zero() -> None:
    np.testing.assert_array_equal(grads(pf.sign, [-2.0, 3.0])[0], [0.0, 0.0])


# -- gradient conventions where no derivative exists -------------------------------------


def test_relu_and_abs_have_zero_gradient_at_zero() -> None:
    np.testing.assert_array_equal(grads(pf.nn.relu, [-1.0, 0.0, 2.0])[0], [0, 0, 1])
    np.testing.assert_array_equal(grads(pf.abs, [-1.0, 0.0, 2.0])[0], [-1, 0, 1])


def test_maximum_and_minimum_ties_go_to_the_first_argument() -> None:
    gx, gy = grads(pf.maximum, [1.0, 2.0, 3.0], [1.0, 5.0, 0.0])
    np.testing.assert_array_equal(gx, [1, 0, 1])
    np.testing.assert_array_equal(gy, [0, 1, 0])
    gx, gy = grads(pf.minimum, [1.0, 2.0, 3.0], [1.0, 5.0, 0.0])
    np.testing.assert_array_equal(gx, [1, 1, 0])
    np.testing.assert_array_equal(gy, [0, 0, 1])


def test_reduce_max_splits_the_gradient_between_ties() -> None:
    np.testing.assert_array_equal(grads(pf.reduce_max, [[3.0, 1.0, 3.0]])[0], [[0.5, 0, 0.5]])
    g = grads(lambda x: pf.reduce_min(x, axis=0), [[1.0, 2.0], [1.0, 0.0]])[0]
    np.testing.assert_array_equal(g, [[0.5, 0], [0.5, 1]])


def test_clip_by_value_passes_the_gradient_inside_the_closed_range() -> None:
    g = grads(lambda x: pf.clip_by_value(x, -1.0, 1.0), [-2.0, -1.0, 0.0, 1.0, 2.0])[0]
    np.testing.assert_array_equal(g, [0, 1, 1, 1, 0])


def test_reduce_prod_gradient_with_zeros_is_the_product_of_the_others() -> None:
    g = grads(lambda x: pf.reduce_prod(x, axis=1), [[2.0, 0.0, 3.0], [0.0, 0.0, 4.0]])[0]
    np.testing.assert_array_equal(g, [[0, 6, 0], [0, 0, 0]])
    assert np.isfinite(grads(pf.reduce_prod, [[0.0, 1.0]])[0]).all()


def test_divide_no_nan_gradient_is_zero_where_the_denominator_is_zero() -> None:
    gx, gy = grads(pf.math.divide_no_nan, [1.0, 2.0], [0.0, 4.0])
    np.testing.assert_array_equal(gx, [0, 0.25])
    np.testing.assert_array_equal(gy, [0, -2.0 / 16])


def test_pow_gradient_for_the_exponent_is_zero_at_non_positive_bases() -> None:
    gx, gy = grads(pf.pow, [0.0, -2.0, 2.0], [2.0, 2.0, 3.0])
    np.testing.assert_array_equal(gx, [0, -4, 12])
    np.testing.assert_allclose(gy, [0, 0, 8 * np.log(2)])


def test_softmax_cross_entropy_is_stable_for_large_logits() -> None:
    logits = pf.constant([[1000.0, 0.0], [-1000.0, 0.0]])
    loss = pf.nn.sparse_softmax_cross_entropy_with_logits([0, 0], logits)
    np.testing.assert_allclose(loss.numpy(), [0.0, 1000.0])
    s = pf.nn.sigmoid_cross_entropy_with_logits(
        labels=pf.ones([2]), logits=pf.constant([-100.0, 100.0])
    )
    np.testing.assert_allclose(s.numpy(), [100.0, 0.0], atol=1e-6)
    assert np.isfinite(grads(lambda x: pf.nn.softmax(x), [[1000.0, 0.0]])[0]).all()


def test_dropout_keeps_expectation_and_reuses_its_mask_in_the_gradient() -> None:
    pf.random.set_seed(0)
    x = pf.ones([200, 50])
    with pf.GradientTape() as tape:
        tape.watch(x)
        y = pf.nn.dropout(x, rate=0.25)
    kept = y.numpy() != 0
    assert 0.7 < kept.mean() < 0.8
    np.testing.assert_allclose(y.numpy()[kept], 1 / 0.75)
    np.testing.assert_array_equal(tape.gradient(y, x).numpy(), y.numpy())


# -- bad input: typed errors that name the offending value -------------------------------

BAD_INPUTS: list[Any] = [
    ("add-shapes", lambda: pf.ones([2, 3]) + pf.ones([4]), pf.errors.InvalidArgumentError,
     r"\[2, 3\].*\[4\]"),
    ("add-dtypes", lambda: pf.add(pf.ones([2]), pf.constant([1, 2])),
     pf.errors.InvalidArgumentError, r"float32.*int32"),
    ("int-plus-fraction", lambda: pf.constant([1]) + 1.5, pf.errors.InvalidArgumentError,
     r"1\.5.*int32"),
    ("matmul-inner", lambda: pf.matmul(pf.ones([2, 3]), pf.ones([2, 3])),
     pf.errors.InvalidArgumentError, r"\[2, 3\] and \[2, 3\]"),
    ("matmul-rank", lambda: pf.matmul(pf.ones([3]), pf.ones([3, 2])),
     pf.errors.InvalidArgumentError, r"\[3\]"),
    ("reshape", lambda: pf.reshape(pf.ones([2, 3]), [4, 2]), pf.errors.InvalidArgumentError,
     r"6 elements.*\[4, 2\]"),
    ("concat", lambda: pf.concat([pf.ones([2, 3]), pf.ones([2, 4])], 0),
     pf.errors.InvalidArgumentError, r"\[2, 3\] and \[2, 4\]"),
    ("stack", lambda: pf.stack([pf.ones([2]), pf.ones([3])]), pf.errors.InvalidArgumentError,
     r"\[2\] and \[3\]"),
    ("where", lambda: pf.where(pf.constant([True, False]), pf.ones([2]), pf.ones([3])),
     pf.errors.InvalidArgumentError, r"\[3\]"),
    ("reduce-axis", lambda: pf.reduce_sum(pf.ones([2]), axis=3), pf.errors.InvalidArgumentError,
     r"axis 3"),
    ("gather-index", lambda: pf.gather(pf.ones([4, 2]), [1, 7]), pf.errors.InvalidArgumentError,
     r"index 7"),
    ("gather-float-index", lambda: pf.gather(pf.ones([4]), pf.constant([0.0])),
     pf.errors.InvalidArgumentError, r"float32"),
    ("sparse-ce-label", lambda: pf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=[0, 3], logits=pf.ones([2, 3])), pf.errors.InvalidArgumentError, r"label 3"),
    ("sparse-ce-shape", lambda: pf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=[0], logits=pf.ones([2, 3])), pf.errors.InvalidArgumentError, r"\[1\]"),
    ("softmax-ce-shape", lambda: pf.nn.softmax_cross_entropy_with_logits(
        pf.ones([2, 3]), pf.ones([2, 4])), pf.errors.InvalidArgumentError, r"\[2, 4\]"),
    ("softmax-int", lambda: pf.nn.softmax(pf.constant([1, 2])), pf.errors.InvalidArgumentError,
     r"int32"),
    ("exp-int", lambda: pf.exp(pf.constant([1, 2])), pf.errors.InvalidArgumentError, r"int32"),
    ("transpose-perm", lambda: pf.transpose(pf.ones([2, 3]), [0, 0]),
     pf.errors.InvalidArgumentError, r"\[0, 0\]"),
    ("split", lambda: pf.split(pf.ones([5]), 2), pf.errors.InvalidArgumentError, r"size 5"),
    ("tile", lambda: pf.tile(pf.ones([5]), [2, 2]), pf.errors.InvalidArgumentError,
     r"\[2, 2\]"),
    ("squeeze", lambda: pf.squeeze(pf.ones([5, 1]), axis=0), pf.errors.InvalidArgumentError,
     r"size 5"),
    ("index", lambda: pf.ones([2])[5], pf.errors.InvalidArgumentError, r"5"),
    ("clip-bounds", lambda: pf.clip_by_value(pf.ones([2]), 2.0, 1.0),
     pf.errors.InvalidArgumentError, r"2\.0.*1\.0"),
    ("dropout-rate", lambda: pf.nn.dropout(pf.ones([2]), rate=1.5), pf.errors.InvalidArgumentError,
     r"1\.5"),
    ("unknown-dtype", lambda: pf.zeros([2], dtype="floaty"), TypeError, r"floaty"),
    ("cast-unknown-dtype", lambda: pf.cast(pf.ones([2]), "int33"), TypeError, r"int33"),
    ("object-dtype", lambda: pf.constant([1], dtype=object), TypeError, r"object"),
    ("string-cast", lambda: pf.cast(pf.constant("abc"), "float32"), TypeError, r"'abc'"),
    ("string-operand", lambda: pf.ones([2]) + "abc", TypeError, r"'abc'"),
    ("object", lambda: pf.constant({"a": 1}), TypeError, r"\{'a': 1\}"),
    ("none", lambda: pf.constant(None), TypeError, r"None"),
    ("ragged", lambda: pf.constant([[1, 2], [3]]), pf.errors.InvalidArgumentError,
     r"\[\[1, 2\], \[3\]\]"),
    ("ragged-operand", lambda: pf.add(pf.ones([2]), [[1.0], [2.0, 3.0]]), ValueError,
     r"\[\[1\.0\], \[2\.0, 3\.0\]\]"),
    ("float-to-int", lambda: pf.constant([1.0, 2.5], dtype=pf.int32), TypeError,
     r"\[1\.0, 2\.5\].*int32"),
    ("int-out-of-range", lambda: pf.constant(300, dtype=pf.uint8), TypeError, r"300.*uint8"),
    ("huge-int", lambda: pf.constant(2**70), TypeError, str(2**70)),
    ("complex", lambda: pf.constant(1j), TypeError, r"1j"),
    ("zeros-negative", lambda: pf.zeros([2, -1]), pf.errors.InvalidArgumentError, r"-1"),
    ("constant-shape", lambda: pf.constant([1, 2, 3], shape=(2, 2)),
     pf.errors.InvalidArgumentError, r"\(2, 2\).*3 elements"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("make", "error", "pattern"), [pytest.param(*c[1:], id=c[0]) for c in BAD_INPUTS]
)
def test_bad_input_raises_a_typed_error_naming_the_value(
    make: Callable[[], Any], error: type, pattern: str
) -> None:
    with pytest.raises(error) as info:
        make()
    assert re.search(pattern, str(info.value)), str(info.value)


def test_invalid_argument_error_is_a_value_error_with_its_grpc_code() -> None:
    with pytest.raises(ValueError) as info:
        pf.ones([2]) + pf.ones([3])
    assert info.value.code == pf.errors.Code.INVALID_ARGUMENT


# -- optional: the same computations in TensorFlow ---------------------------------------

REFERENCE = {
    "sparse_ce": (
        lambda m, x: m.nn.sparse_softmax_cross_entropy_with_logits(labels=[2, 0, 2], logits=x),
        [(3, 4)],
    ),
    "softmax_ce": (
        lambda m, y, x: m.nn.softmax_cross_entropy_with_logits(
            labels=m.nn.softmax(y), logits=x
        ),
        [(3, 4), (3, 4)],
    ),
    "sigmoid_ce": (
        lambda m, y, x: m.nn.sigmoid_cross_entropy_with_logits(labels=m.sigmoid(y), logits=x),
        [(3, 4), (3, 4)],
    ),
    "embedding_sharded": (
        lambda m, a, b: m.nn.embedding_lookup([a, b], [[4, 0], [3, 3]]),
        [(3, 2), (2, 2)],
    ),
    "gather_axis1": (lambda m, x: m.gather(x, [[2, 0], [2, 2]], axis=1), [(2, 3)]),
    "gather_nd": (lambda m, x: m.gather_nd(x, [[0, 1], [1, 2], [0, 1]]), [(2, 3)]),
    "boolean_mask": (lambda m, x: m.boolean_mask(x, [True, False, True]), [(3, 2)]),
    # ties and kinks at exact points: x against a constant copy of itself
    "reduce_max_ties": (lambda m, x: m.reduce_max(m.concat([x, m.stop_gradient(x)], 0), 0),
                        [(2, 3)]),
    "maximum_ties": (lambda m, x, y: m.maximum(x, m.stop_gradient(x))
                     + m.minimum(m.stop_gradient(y), y), [(2, 3), (2, 3)]),
    "relu_at_zero": (lambda m, x: m.nn.relu(x - m.stop_gradient(x)) + m.abs(x - m.stop_gradient(x)),
                     [(3,)]),
    "elu_selu_gelu": (
        lambda m, x: m.nn.elu(x) + m.nn.selu(x) + m.nn.gelu(x) + m.nn.gelu(x, approximate=True),
        [(3, 4)],
    ),
    "leaky_relu": (lambda m, x: m.nn.leaky_relu(x), [(3, 4)]),
    "l2_normalize": (lambda m, x: m.nn.l2_normalize(x, axis=1), [(3, 4)]),
    "logsumexp": (lambda m, x: m.reduce_logsumexp(x, axis=[0, 1], keepdims=True), [(2, 3)]),
    "cumsum": (lambda m, x: m.cumsum(x, axis=1, exclusive=True, reverse=True), [(2, 3)]),
    "reduce_prod": (lambda m, x: m.reduce_prod(x * m.constant([1.0, 0.0, 1.0], m.float64), 1),
                    [(2, 3)]),
    "clip_global_norm": (lambda m, x: m.clip_by_global_norm([x], 0.5)[0][0], [(2, 3)]),
    "clip_by_norm": (lambda m, x: m.clip_by_norm(x, 0.5, axes=[1]), [(2, 3)]),
    "moments": (lambda m, x: m.nn.moments(x, axes=[0])[1], [(4, 3)]),
    "matmul_bcast": (lambda m, x, y: m.matmul(x, y, transpose_b=True), [(2, 3, 4), (5, 4)]),
    "pad_tile": (lambda m, x: m.tile(m.pad(x, [[1, 0], [0, 2]]), [2, 1]), [(2, 3)]),
    "slicing": (lambda m, x: x[1:, ::2], [(3, 5)]),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_values_and_gradients_match_tensorflow(name: str) -> None:
    tf = pytest.importorskip("tensorflow")
    fn, shapes = REFERENCE[name]
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal(s) for s in shapes]
    results = []
    for m in (pf, tf):
        xs = [m.constant(a) for a in arrays]
        with m.GradientTape() as tape:
            tape.watch(xs)
            y = fn(m, *xs)
        gs = tape.gradient(y, xs)
        results.append(
            (np.asarray(y), [np.asarray(m.convert_to_tensor(g)) for g in gs if g is not None])
        )
    (y_pf, g_pf), (y_tf, g_tf) = results
    # TensorFlow keeps LeakyRelu's alpha as a float32 attribute and its Gelu kernels
    # round at ~1e-9; psflow computes both in float64.
    rtol = 1e-7 if name in ("leaky_relu", "elu_selu_gelu") else 1e-10
    np.testing.assert_allclose(y_pf, y_tf, rtol=rtol, atol=1e-12)
    assert len(g_pf) == len(g_tf)
    for a, b in zip(g_pf, g_tf):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=1e-12)

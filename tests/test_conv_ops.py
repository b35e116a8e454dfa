"""Convolution and pooling ops: gradients against finite differences, forward against NumPy loops.

The reference forward pass is a direct loop over output positions in float64
(no im2col, no strides tricks), so the BLAS path is checked against the
definition; gradients are checked by central differences (tests/gradcheck.py).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import psflow as pf
from tests.gradcheck import check_gradients


def _same_pads(size: int, extent: int, stride: int) -> tuple[int, int]:
    n_out = -(-size // stride)
    total = max((n_out - 1) * stride + extent - size, 0)
    return total // 2, total - total // 2


def _reference_conv2d(x: np.ndarray, w: np.ndarray, stride: int, padding: str, dil: int):
    kh, kw, _, f = w.shape
    eh, ew = (kh - 1) * dil + 1, (kw - 1) * dil + 1
    if padding == "SAME":
        ph, pw = _same_pads(x.shape[1], eh, stride), _same_pads(x.shape[2], ew, stride)
    else:
        ph = pw = (0, 0)
    xp = np.pad(x, ((0, 0), ph, pw, (0, 0)))
    oh = (xp.shape[1] - eh) // stride + 1
    ow = (xp.shape[2] - ew) // stride + 1
    out = np.zeros((x.shape[0], oh, ow, f))
    for i, j in itertools.product(range(oh), range(ow)):
        win = xp[:, i * stride : i * stride + eh : dil, j * stride : j * stride + ew : dil, :]
        out[:, i, j, :] = np.tensordot(win, w, axes=([1, 2, 3], [0, 1, 2]))
    return out


def _reference_pool(x: np.ndarray, k: int, stride: int, padding: str, kind: str):
    if padding == "SAME":
        ph, pw = _same_pads(x.shape[1], k, stride), _same_pads(x.shape[2], k, stride)
    else:
        ph = pw = (0, 0)
    xp = np.pad(x, ((0, 0), ph, pw, (0, 0)), constant_values=np.nan)
    oh = (xp.shape[1] - k) // stride + 1
    ow = (xp.shape[2] - k) // stride + 1
    reduce = np.nanmax if kind == "max" else np.nanmean
    out = np.zeros((x.shape[0], oh, ow, x.shape[3]))
    for i, j in itertools.product(range(oh), range(ow)):
        win = xp[:, i * stride : i * stride + k, j * stride : j * stride + k, :]
        out[:, i, j, :] = reduce(win, axis=(1, 2))
    return out


CONV_GRID = [
    (stride, padding, dil)
    for stride in (1, 2, 3)
    for padding in ("SAME", "VALID")
    for dil in (1, 2)
    if stride == 1 or dil == 1
]


@pytest.mark.parametrize(("stride", "padding", "dil"), CONV_GRID)
def test_conv2d_matches_the_direct_loop_and_finite_differences(
    stride: int, padding: str, dil: int
) -> None:
    rng = np.random.default_rng(stride * 10 + dil)
    x = rng.standard_normal((2, 7, 6, 3))
    w = rng.standard_normal((3, 2, 3, 4))
    got = pf.nn.conv2d(x, w, stride, padding, dilations=dil).numpy()
    np.testing.assert_allclose(got, _reference_conv2d(x, w, stride, padding, dil), rtol=1e-12)
    check_gradients(lambda a, b: pf.nn.conv2d(a, b, stride, padding, dilations=dil), x, w)


@pytest.mark.parametrize(
    ("k", "stride", "padding"),
    [(2, 2, "VALID"), (3, 2, "SAME"), (3, 1, "SAME"), (2, 1, "VALID"), (3, 3, "SAME")],
)
@pytest.mark.parametrize("kind", ["max", "avg"])
def test_pool2d_matches_the_direct_loop_and_finite_differences(
    k: int, stride: int, padding: str, kind: str
) -> None:
    op = pf.nn.max_pool2d if kind == "max" else pf.nn.avg_pool2d
    rng = np.random.default_rng(k * 7 + stride)
    x = rng.standard_normal((2, 7, 5, 3))
    np.testing.assert_allclose(
        op(x, k, stride, padding).numpy(), _reference_pool(x, k, stride, padding, kind), rtol=1e-12
    )
    check_gradients(lambda a: op(a, k, stride, padding), x)


def test_max_pool_sends_a_tied_window_gradient_to_its_first_maximum() -> None:
    x = pf.constant(np.ones((1, 2, 2, 1)))
    with pf.GradientTape() as tape:
        tape.watch(x)
        y = pf.nn.max_pool2d(x, 2, 2, "VALID")
    g = tape.gradient(y, x).numpy()
    np.testing.assert_array_equal(g[0, :, :, 0], [[1.0, 0.0], [0.0, 0.0]])


@pytest.mark.parametrize("padding", ["VALID", "SAME", "CAUSAL", [[1, 2]]])
def test_conv1d_equals_conv2d_of_height_one(padding: object) -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 9, 3))
    w = rng.standard_normal((3, 3, 2))
    got = pf.nn.conv1d(x, w, 1, padding, dilations=2).numpy()
    pads = {"CAUSAL": [[0, 0], [0, 0], [4, 0], [0, 0]]}.get(str(padding))
    if isinstance(padding, list):
        pads = [[0, 0], [0, 0], padding[0], [0, 0]]
    want = pf.nn.conv2d(
        x[:, None], w[None], 1, pads if pads is not None else padding, dilations=2
    ).numpy()[:, 0]
    np.testing.assert_allclose(got, want, rtol=1e-12)
    check_gradients(lambda a, b: pf.nn.conv1d(a, b, 1, padding, dilations=2), x, w)


def test_causal_conv1d_output_ignores_later_inputs() -> None:
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, 8, 2))
    w = rng.standard_normal((3, 2, 1))
    y1 = pf.nn.conv1d(x, w, 1, "CAUSAL").numpy()
    x2 = x.copy()
    x2[:, 5:] += 10.0
    y2 = pf.nn.conv1d(x2, w, 1, "CAUSAL").numpy()
    assert y1.shape == (1, 8, 1)
    np.testing.assert_array_equal(y1[:, :5], y2[:, :5])
    assert not np.allclose(y1[:, 5:], y2[:, 5:])


@pytest.mark.parametrize("kind", ["max", "avg"])
def test_pool1d_gradients(kind: str) -> None:
    op = pf.nn.max_pool1d if kind == "max" else pf.nn.avg_pool1d
    x = np.random.default_rng(5).standard_normal((2, 7, 3))
    assert op(x, 3, 2, "SAME").shape == (2, 4, 3)
    check_gradients(lambda a: op(a, 3, 2, "SAME"), x)
    np.testing.assert_allclose(
        pf.nn.max_pool(x, 2, 2, "VALID").numpy(), pf.nn.max_pool1d(x, 2, 2, "VALID").numpy()
    )


def test_float32_conv_keeps_its_dtype_and_strides_in_tf_form() -> None:
    x = np.random.default_rng(6).standard_normal((1, 6, 6, 2)).astype(np.float32)
    w = np.ones((2, 2, 2, 3), np.float32)
    y = pf.nn.conv2d(x, w, [1, 2, 2, 1], "VALID")
    assert y.dtype == pf.float32 and y.shape == (1, 3, 3, 3)
    np.testing.assert_allclose(y.numpy(), pf.nn.conv2d(x, w, 2, "VALID").numpy())


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda: pf.nn.conv2d(np.ones((1, 4, 4, 2)), np.ones((3, 3, 3, 1)), 1, "VALID"), "3"),
        (lambda: pf.nn.conv2d(np.ones((4, 4, 2)), np.ones((3, 3, 2, 1)), 1, "VALID"), "rank 4"),
        (lambda: pf.nn.conv2d(np.ones((1, 4, 4, 1)), np.ones((3, 3, 1, 1)), 0, "VALID"), "[0, 0]"),
        (lambda: pf.nn.conv2d(np.ones((1, 4, 4, 1)), np.ones((3, 3, 1, 1)), 1, "FULL"), "FULL"),
        (lambda: pf.nn.conv2d(np.ones((1, 2, 2, 1)), np.ones((3, 3, 1, 1)), 1, "VALID"), "size 2"),
        (
            lambda: pf.nn.conv2d(
                np.ones((1, 4, 4, 1), np.float32), np.ones((3, 3, 1, 1)), 1, "VALID"
            ),
            "float64",
        ),
        (
            lambda: pf.nn.conv2d(np.ones((1, 4, 4, 1), np.int32), np.ones((1, 1, 1, 1)), 1, "SAME"),
            "int32",
        ),
        (
            lambda: pf.nn.conv2d(np.ones((1, 4, 4, 1)), np.ones((1, 1, 1, 1)), 1, "SAME", "NCHW"),
            "NCHW",
        ),
        (lambda: pf.nn.max_pool2d(np.ones((1, 4, 4, 1)), 5, 1, "VALID"), "size 4"),
        (lambda: pf.nn.max_pool2d(np.ones((1, 4, 4, 1)), 2, [2, 2, 2], "VALID"), "[2, 2, 2]"),
        (lambda: pf.nn.avg_pool2d(np.ones((1, 4, 4, 1)), 2, 2, [[0, 0]] * 4), "padding"),
        (
            lambda: pf.nn.conv1d(np.ones((1, 4, 1)), np.ones((2, 1, 1)), 1, [[1, 1], [1, 1]]),
            "[[1, 1], [1, 1]]",
        ),
        (lambda: pf.nn.max_pool(np.ones((4, 4)), 2, 2, "VALID"), "rank 2"),
    ],
)
def test_bad_arguments_raise_invalid_argument_naming_the_value(call, fragment: str) -> None:
    with pytest.raises(pf.errors.InvalidArgumentError, match=None) as info:
        call()
    assert fragment in str(info.value)


def test_batch_normalization_op_matches_numpy_and_finite_differences() -> None:
    rng = np.random.default_rng(8)
    x = rng.standard_normal((4, 3))
    mean, var = rng.standard_normal(3), rng.uniform(0.5, 2, 3)
    offset, scale = rng.standard_normal(3), rng.standard_normal(3)
    got = pf.nn.batch_normalization(x, mean, var, offset, scale, 1e-3).numpy()
    np.testing.assert_allclose(got, scale * (x - mean) / np.sqrt(var + 1e-3) + offset, rtol=1e-12)
    check_gradients(
        lambda *a: pf.nn.batch_normalization(*a, variance_epsilon=1e-3), x, mean, var, offset, scale
    )

"""Every differentiable op's gradient against central finite differences (float64).

One table row per op and configuration: a function of psflow tensors and the
float64 points to check it at. Points stay away from kinks (relu and abs at 0,
ties of max/min, clip bounds, floormod's jumps), where no derivative exists.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import psflow as pf
from psflow.ops import nn_ops
from tests.gradcheck import check_gradients, tape_vjp, upstreams

Inputs = Callable[[np.random.Generator], list[np.ndarray]]
CASES: list[Any] = []


def case(name: str, fn: Callable[..., Any], inputs: Inputs, **kw: Any) -> None:
    """Adds one row to the table."""
    CASES.append(pytest.param(fn, inputs, kw, id=name))


def n(*shape: int) -> Inputs:
    """Standard normal points."""
    return lambda r: [r.standard_normal(shape)]


def pos(*shape: int) -> Inputs:
    """Points in [0.5, 2): the domain of log, sqrt, pow's base."""
    return lambda r: [r.uniform(0.5, 2.0, shape)]


def away(*shape: int) -> Inputs:
    """Points with 0.2 <= |x| < 1.5: away from the kink at 0."""
    return lambda r: [r.choice([-1.0, 1.0], shape) * r.uniform(0.2, 1.5, shape)]


def many(*makers: Inputs) -> Inputs:
    """Inputs drawn by several makers, in order."""
    return lambda r: [m(r)[0] for m in makers]


# -- arithmetic with broadcasting --------------------------------------------------------
BROADCASTS = {
    "same": ((3, 4), (3, 4)),
    "both": ((3, 1), (1, 4)),
    "size1": ((2, 1, 4), (3, 4)),
    "rank": ((4,), (2, 3, 4)),
    "scalar_x": ((), (3, 4)),
    "scalar_y": ((3, 4), ()),
    "scalars": ((), ()),
}
for bname, (sx, sy) in BROADCASTS.items():
    case(f"add-{bname}", pf.add, many(n(*sx), n(*sy)))
    case(f"subtract-{bname}", pf.subtract, many(n(*sx), n(*sy)))
    case(f"multiply-{bname}", pf.multiply, many(n(*sx), n(*sy)))
    case(f"divide-{bname}", pf.divide, many(n(*sx), away(*sy)))
    case(f"maximum-{bname}", pf.maximum, many(n(*sx), n(*sy)))
    case(f"minimum-{bname}", pf.minimum, many(n(*sx), n(*sy)))
    case(f"pow-{bname}", pf.pow, many(pos(*sx), n(*sy)))
    case(f"squared_difference-{bname}", pf.math.squared_difference, many(n(*sx), n(*sy)))
    case(f"where-{bname}", lambda x, y: pf.where(pf.greater(x, y), x, y), many(n(*sx), n(*sy)))

case("truediv", pf.truediv, many(n(3), away(3)))
case("add_n", lambda x, y: pf.add_n([x, y, x]), many(n(2, 3), n(2, 3)))
case("divide_no_nan", pf.math.divide_no_nan, many(n(2, 3), away(2, 3)))
case("op-add", lambda x, y: x + y, many(n(2, 3), n(3)))
case("op-radd", lambda x: 2.0 + x, n(2, 3))
case("op-sub", lambda x, y: x - y, many(n(2, 3), n(3)))
case("op-rsub", lambda x: 1.0 - x, n(2, 3))
case("op-mul", lambda x, y: x * y, many(n(2, 3), n(3)))
case("op-rmul", lambda x: 3.0 * x, n(2, 3))
case("op-numpy-scalar", lambda x: np.float64(3.0) * x, n(2, 3))
case("op-div", lambda x, y: x / y, many(n(2, 3), away(3)))
case("op-rdiv", lambda x: 1.0 / x, away(2, 3))
case("op-pow", lambda x, y: x**y, many(pos(2, 3), n(2, 3)))
case("op-pow-const", lambda x: x**3, n(2, 3))
case("op-rpow", lambda x: 2.0**x, n(2, 3))
case("op-neg", lambda x: -x, n(2, 3))
case("op-abs", lambda x: abs(x), away(2, 3))
case("op-matmul", lambda x, y: x @ y, many(n(2, 3), n(3, 4)))


def _floormod_points(r: np.random.Generator) -> list[np.ndarray]:
    b = r.uniform(1.0, 2.0, (2, 3)) * r.choice([-1.0, 1.0], (2, 3))
    q = r.integers(-2, 3, (2, 3)) + r.uniform(0.2, 0.8, (2, 3))  # fractional part off 0
    return [q * b, b]


case("floormod", pf.math.floormod, _floormod_points)
case("op-mod", lambda x, y: x % y, _floormod_points)

# -- matmul ------------------------------------------------------------------------------
MATMULS = {
    "plain": ((3, 4), (4, 5), {}),
    "ta": ((4, 3), (4, 5), {"transpose_a": True}),
    "tb": ((3, 4), (5, 4), {"transpose_b": True}),
    "ta-tb": ((4, 3), (5, 4), {"transpose_a": True, "transpose_b": True}),
    "adjoint": ((4, 3), (5, 4), {"adjoint_a": True, "adjoint_b": True}),
    "batched": ((2, 3, 4), (2, 4, 5), {}),
    "batched-ta-tb": ((2, 4, 3), (2, 5, 4), {"transpose_a": True, "transpose_b": True}),
    "broadcast-batch": ((2, 1, 3, 4), (3, 4, 2), {}),
    "broadcast-rank-a": ((3, 4), (2, 4, 5), {}),
    "broadcast-rank-b": ((2, 3, 4), (4, 5), {"transpose_b": False}),
    "broadcast-tb": ((2, 3, 4), (5, 4), {"transpose_b": True}),
}
for mname, (sa, sb, flags) in MATMULS.items():
    case(f"matmul-{mname}", lambda x, y, f=flags: pf.matmul(x, y, **f), many(n(*sa), n(*sb)))

# the fused layer op Dense uses: x @ kernel (+ bias) (then relu)
case("dense-relu", lambda x, w, b: nn_ops.dense(x, w, b, relu=True), many(n(3, 4), n(4, 5), n(5)))
case("dense-linear", lambda x, w, b: nn_ops.dense(x, w, b), many(n(3, 4), n(4, 5), n(5)))
case("dense-nobias", lambda x, w: nn_ops.dense(x, w, relu=True), many(n(3, 4), n(4, 5)))

case("tensordot-1", lambda x, y: pf.tensordot(x, y, 1), many(n(2, 3), n(3, 4)))
case("tensordot-2", lambda x, y: pf.tensordot(x, y, 2), many(n(2, 3, 4), n(3, 4, 2)))
case("tensordot-lists", lambda x, y: pf.tensordot(x, y, [[0], [1]]), many(n(3, 2), n(4, 3)))

# -- reductions --------------------------------------------------------------------------
REDUCTIONS = {
    "reduce_sum": (pf.reduce_sum, n),
    "reduce_mean": (pf.reduce_mean, n),
    "reduce_max": (pf.reduce_max, n),
    "reduce_min": (pf.reduce_min, n),
    "reduce_prod": (pf.reduce_prod, away),
    "reduce_logsumexp": (pf.reduce_logsumexp, n),
    "reduce_variance": (pf.reduce_variance, n),
    "reduce_std": (pf.reduce_std, n),
}
AXES = {"None": None, "0": 0, "1": 1, "-1": -1, "(0,1)": (0, 1), "[0,2]": [0, 2]}
for rname, (op, maker) in REDUCTIONS.items():
    for aname, axis in AXES.items():
        for keep in (False, True):
            case(
                f"{rname}-axis{aname}-keepdims{keep}",
                lambda x, op=op, axis=axis, keep=keep: op(x, axis=axis, keepdims=keep),
                maker(2, 3, 4),
            )
    if rname not in ("reduce_variance", "reduce_std"):  # constant (variance 0) or kinked
        case(f"{rname}-scalar", op, maker())
    case(f"{rname}-2d", lambda x, op=op: op(x, axis=1), maker(3, 4))

for ax in (0, 1, -1):
    for excl in (False, True):
        for rev in (False, True):
            case(
                f"cumsum-axis{ax}-exclusive{excl}-reverse{rev}",
                lambda x, ax=ax, e=excl, r=rev: pf.cumsum(x, axis=ax, exclusive=e, reverse=r),
                n(3, 4),
            )

# -- unary math --------------------------------------------------------------------------
UNARY = {
    "exp": (pf.exp, n),
    "log": (pf.log, pos),
    "sqrt": (pf.sqrt, pos),
    "rsqrt": (pf.rsqrt, pos),
    "square": (pf.square, n),
    "abs": (pf.abs, away),
    "negative": (pf.negative, n),
    "reciprocal": (pf.math.reciprocal, away),
    "sin": (pf.sin, n),
    "cos": (pf.cos, n),
    "tanh": (pf.tanh, n),
    "sigmoid": (pf.sigmoid, n),
    "softplus": (pf.math.softplus, n),
    "expm1": (pf.math.expm1, n),
    "log1p": (pf.math.log1p, pos),
    "nn.relu": (pf.nn.relu, away),
    "nn.relu6": (lambda x: pf.nn.relu6(x * 4.0), away),
    "nn.leaky_relu": (pf.nn.leaky_relu, away),
    "nn.leaky_relu-alpha": (lambda x: pf.nn.leaky_relu(x, alpha=0.1), away),
    "nn.elu": (pf.nn.elu, away),
    "nn.selu": (pf.nn.selu, away),
    "nn.gelu": (pf.nn.gelu, n),
    "nn.gelu-approximate": (lambda x: pf.nn.gelu(x, approximate=True), n),
    "nn.sigmoid": (pf.nn.sigmoid, n),
    "nn.tanh": (pf.nn.tanh, n),
    "nn.softplus": (pf.nn.softplus, n),
    "nn.swish": (pf.nn.swish, n),
    "nn.silu": (pf.nn.silu, n),
    "nn.l2_loss": (pf.nn.l2_loss, n),
    "identity": (pf.identity, n),
    "cast-float64": (lambda x: pf.cast(x, pf.float64), n),
    "clip_by_value": (lambda x: pf.clip_by_value(x, -0.5, 0.7), away),
    "clip_by_value-tensor-bounds": (
        lambda x: pf.clip_by_value(x, pf.constant(-0.5, pf.float64), pf.constant(0.7, pf.float64)),
        away,
    ),
    "clip_by_norm-clipping": (lambda x: pf.clip_by_norm(x, 0.5), n),
    "clip_by_norm-not-clipping": (lambda x: pf.clip_by_norm(x, 100.0), n),
    "clip_by_norm-axes": (lambda x: pf.clip_by_norm(x, 0.5, axes=[1]), n),
}
# a scalar may fall where these are flat (or axes=[1] does not exist)
FLAT_SCALARS = {"nn.relu", "nn.relu6", "clip_by_value", "clip_by_value-tensor-bounds"}
for uname, (op, maker) in UNARY.items():
    case(uname, op, maker(3, 4))
    if not uname.startswith("clip_by_norm"):  # the norm of a scalar is flat in direction
        case(f"{uname}-scalar", op, maker(), allow_zero=uname in FLAT_SCALARS)

case("sign", pf.sign, away(3), allow_zero=True)

# -- shapes, joining, slicing ------------------------------------------------------------
case("reshape", lambda x: pf.reshape(x, [4, -1]), n(2, 3, 2))
case("reshape-scalar", lambda x: pf.reshape(x, [1, 1]), n())
case("transpose", pf.transpose, n(2, 3, 4))
case("transpose-perm", lambda x: pf.transpose(x, [1, 2, 0]), n(2, 3, 4))
case("concat-axis0", lambda x, y: pf.concat([x, y, x], 0), many(n(2, 3), n(4, 3)))
case("concat-axis1", lambda x, y: pf.concat([x, y], axis=1), many(n(2, 3), n(2, 1)))
case("concat-axis-1", lambda x, y: pf.concat([x, y], axis=-1), many(n(2, 2, 3), n(2, 2, 2)))
for ax in (0, 1, -1):
    case(f"stack-axis{ax}", lambda x, y, ax=ax: pf.stack([x, y], axis=ax), many(n(2, 3), n(2, 3)))
    case(f"unstack-axis{ax}", lambda x, ax=ax: pf.unstack(x, axis=ax), n(2, 3, 2))
case("split-equal", lambda x: pf.split(x, 3, axis=1), n(2, 6))
case("split-sizes", lambda x: pf.split(x, [1, -1, 2], axis=0), n(6, 2))
case("tile", lambda x: pf.tile(x, [2, 3]), n(2, 3))
case("tile-3d", lambda x: pf.tile(x, [1, 2, 2]), n(2, 1, 3))
case("pad", lambda x: pf.pad(x, [[1, 0], [2, 3]]), n(2, 3))
case("pad-value", lambda x: pf.pad(x, [[0, 1]], constant_values=5.0), n(3))
case("getitem-slices", lambda x: x[1:, ::2], n(3, 5))
case("getitem-int", lambda x: x[1], n(3, 5))
case("getitem-negative", lambda x: x[-1, 1:-1], n(3, 5))
case("getitem-ellipsis", lambda x: x[..., 1], n(2, 3, 4))
case("getitem-newaxis", lambda x: x[None, 1:3], n(4, 2))
case("getitem-reversed", lambda x: x[::-1], n(4, 2))
case("slice", lambda x: pf.slice(x, [1, 0], [2, -1]), n(3, 4))
case("expand_dims-0", lambda x: pf.expand_dims(x, 0), n(2, 3))
case("expand_dims--1", lambda x: pf.expand_dims(x, -1), n(2, 3))
case("squeeze-all", pf.squeeze, n(1, 3, 1))
case("squeeze-axis", lambda x: pf.squeeze(x, axis=[2]), n(1, 3, 1))
case("broadcast_to", lambda x: pf.broadcast_to(x, [2, 3, 4]), n(3, 1))
case("reverse", lambda x: pf.reverse(x, [1]), n(2, 3))
case(
    "where-broadcast-cond",
    lambda x, y: pf.where(pf.constant([True, False, True]), x, y),
    many(n(2, 3), n(1)),
)

# -- gathers -----------------------------------------------------------------------------
IDX = [[2, 0], [2, 3]]  # 2-D and repeated
case("gather-axis0", lambda x: pf.gather(x, [3, 1, 3, 0]), n(4, 3))
case("gather-axis0-2d-indices", lambda x: pf.gather(x, IDX), n(4, 3))
case("gather-axis1", lambda x: pf.gather(x, [2, 0, 2], axis=1), n(2, 3, 2))
case("gather-axis1-2d-indices", lambda x: pf.gather(x, IDX, axis=1), n(2, 4))
case("gather-axis-1", lambda x: pf.gather(x, [1, 1], axis=-1), n(2, 3))
case("gather_nd-elements", lambda x: pf.gather_nd(x, [[0, 1], [2, 3], [0, 1]]), n(3, 4))
case("gather_nd-rows", lambda x: pf.gather_nd(x, [[2], [0], [2]]), n(3, 4))
case("boolean_mask", lambda x: pf.boolean_mask(x, pf.constant([True, False, True])), n(3, 2))
case("boolean_mask-2d", lambda x: pf.boolean_mask(x, x > 0.0), n(3, 4))
case("embedding_lookup", lambda p: pf.nn.embedding_lookup(p, [[1, 4], [1, 0]]), n(5, 3))
case(
    "embedding_lookup-sharded2",
    lambda a, b: pf.nn.embedding_lookup([a, b], [4, 0, 3, 3, 1]),
    many(n(3, 2), n(2, 2)),
)
case(
    "embedding_lookup-sharded3",
    lambda a, b, c: pf.nn.embedding_lookup([a, b, c], [[6, 0], [3, 3]]),
    many(n(3, 2), n(2, 2), n(2, 2)),
)

# -- nn ----------------------------------------------------------------------------------
case("softmax", pf.nn.softmax, n(3, 4))
case("softmax-axis0", lambda x: pf.nn.softmax(x, axis=0), n(3, 4))
case("math.softmax", pf.math.softmax, n(4))
case("log_softmax", pf.nn.log_softmax, n(3, 4))
case("log_softmax-axis0", lambda x: pf.nn.log_softmax(x, axis=0), n(3, 4))
case(
    "sigmoid_cross_entropy_with_logits",
    lambda y, x: pf.nn.sigmoid_cross_entropy_with_logits(labels=y, logits=x),
    lambda r: [r.uniform(0, 1, (3, 4)), r.standard_normal((3, 4)) * 3],
)


def _dist(r: np.random.Generator) -> list[np.ndarray]:
    y = r.uniform(0.1, 1.0, (3, 4))
    return [y / y.sum(axis=1, keepdims=True), r.standard_normal((3, 4))]


case(
    "softmax_cross_entropy_with_logits",
    lambda y, x: pf.nn.softmax_cross_entropy_with_logits(labels=y, logits=x),
    _dist,
)
case(
    "softmax_cross_entropy_with_logits-unnormalized",
    lambda y, x: pf.nn.softmax_cross_entropy_with_logits(labels=y, logits=x),
    lambda r: [r.uniform(0, 1, (3, 4)), r.standard_normal((3, 4))],
)
case(
    "softmax_cross_entropy_with_logits-axis0",
    lambda y, x: pf.nn.softmax_cross_entropy_with_logits(labels=y, logits=x, axis=0),
    lambda r: [r.uniform(0, 1, (4, 3)), r.standard_normal((4, 3))],
)
case(
    "sparse_softmax_cross_entropy_with_logits",
    lambda x: pf.nn.sparse_softmax_cross_entropy_with_logits(labels=[3, 0, 3], logits=x),
    n(3, 4),
)
case(
    "sparse_softmax_cross_entropy_with_logits-2d-labels",
    lambda x: pf.nn.sparse_softmax_cross_entropy_with_logits(labels=[[1, 2], [0, 0]], logits=x),
    n(2, 2, 3),
)
case(
    "sparse_softmax_cross_entropy-mean",
    lambda x: pf.reduce_mean(
        pf.nn.sparse_softmax_cross_entropy_with_logits(labels=[1, 0, 2], logits=x)
    ),
    n(3, 4),
)
case("l2_normalize", lambda x: pf.nn.l2_normalize(x, axis=1), n(3, 4))
case("l2_normalize-all", pf.math.l2_normalize, n(3, 4))
case("moments", lambda x: list(pf.nn.moments(x, axes=[0])), n(4, 3))
case("moments-keepdims", lambda x: list(pf.nn.moments(x, axes=[0, 1], keepdims=True)), n(4, 3))
case("bias_add", pf.nn.bias_add, many(n(3, 4), n(4)))
case(
    "compute_average_loss",
    lambda x: pf.nn.compute_average_loss(x, global_batch_size=8),
    n(4),
)


def _dropout(x: Any) -> Any:
    pf.random.set_seed(3)  # the same mask at every evaluation
    return pf.nn.dropout(x, rate=0.4, seed=7)


case("dropout-fixed-mask", _dropout, n(4, 5))


def _dropout_noise_shape(x: Any) -> Any:
    pf.random.set_seed(3)
    return pf.nn.dropout(x, rate=0.5, noise_shape=[4, 1], seed=2)


case("dropout-noise_shape", _dropout_noise_shape, n(4, 5))

# -- convolution, pooling, normalization (more configurations in tests/test_conv_ops.py) --
case("conv2d", lambda x, w: pf.nn.conv2d(x, w, 2, "SAME"), many(n(2, 5, 4, 2), n(3, 2, 2, 3)))
case(
    "conv1d", lambda x, w: pf.nn.conv1d(x, w, 1, "VALID", dilations=2), many(n(2, 6, 2), n(2, 2, 3))
)
case("max_pool2d", lambda x: pf.nn.max_pool2d(x, 2, 1, "SAME"), n(2, 4, 3, 2))
case("max_pool1d", lambda x: pf.nn.max_pool1d(x, 3, 2, "VALID"), n(2, 7, 2))
case("max_pool", lambda x: pf.nn.max_pool(x, 2, 2, "VALID"), n(1, 4, 4, 2))
case("avg_pool2d", lambda x: pf.nn.avg_pool2d(x, 3, 2, "SAME"), n(2, 5, 4, 2))
case("avg_pool1d", lambda x: pf.nn.avg_pool1d(x, 2, 1, "SAME"), n(2, 5, 2))
case("avg_pool", lambda x: pf.nn.avg_pool(x, 2, 1, "VALID"), n(2, 5, 2))
case(
    "batch_normalization",
    lambda x, m, v, o, g: pf.nn.batch_normalization(x, m, v, o, g, 1e-3),
    many(n(4, 3), n(3), pos(3), n(3), n(3)),
)


@pytest.mark.parametrize(("fn", "inputs", "kw"), CASES)
def test_gradient_matches_finite_differences(request: Any, fn: Any, inputs: Any, kw: Any) -> None:
    rng = np.random.default_rng(zlib.crc32(request.node.callspec.id.encode()))
    check_gradients(fn, *inputs(rng), **kw)


def test_table_covers_every_differentiable_op() -> None:
    """Every op of psflow, psflow.math and psflow.nn is in the table or known to have no grad."""
    no_gradient = {
        # integer/bool results, creation, shapes, randomness: nothing to differentiate
        "argmax", "argmin", "equal", "not_equal", "greater", "greater_equal", "less",
        "less_equal", "logical_and", "logical_not", "logical_or", "logical_xor", "reduce_all",
        "reduce_any", "count_nonzero", "one_hot", "eye", "fill", "linspace", "ones",
        "ones_like", "zeros", "zeros_like", "range", "rank", "shape", "size", "stop_gradient",
        "floor", "ceil", "round", "floordiv", "constant", "convert_to_tensor", "print",
        "clip_by_global_norm", "scale_regularization_loss", "cast",
    }  # fmt: skip
    covered = {p.id.split("-")[0].removeprefix("nn.").removeprefix("math.") for p in CASES}
    covered |= {"truediv", "mod", "tensordot", "divide_no_nan"}
    ops = set()
    for mod in (pf, pf.math, pf.nn):
        for name in dir(mod):
            obj = getattr(mod, name)
            if name.startswith("_") or not callable(obj) or isinstance(obj, type):
                continue
            if getattr(obj, "__module__", "").startswith("psflow.ops"):
                ops.add(name)
    missing = sorted(ops - covered - no_gradient)
    assert not missing, f"ops without a gradient check: {missing}"


@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_fused_dense_equals_the_composed_ops_bitwise(relu: bool, bias: bool) -> None:
    rng = np.random.default_rng(3)
    x = pf.constant(rng.standard_normal((6, 7)).astype(np.float32))
    w = pf.Variable(rng.standard_normal((7, 5)).astype(np.float32))
    b = pf.Variable(rng.standard_normal(5).astype(np.float32)) if bias else None
    sources = [x, w] + ([b] if bias else [])
    results = []
    for fused in (True, False):
        with pf.GradientTape() as tape:
            tape.watch(x)
            if fused:
                y = nn_ops.dense(x, w, b, relu=relu)
            else:
                y = pf.matmul(x, w) + b if bias else pf.matmul(x, w)
                y = pf.nn.relu(y) if relu else y
            loss = pf.reduce_sum(y * y)
        results.append([y.numpy()] + [g.numpy() for g in tape.gradient(loss, sources)])
    for a, c in zip(*results):
        np.testing.assert_array_equal(a, c)


def test_fused_dense_declines_what_it_does_not_cover() -> None:
    x3 = pf.ones((2, 3, 4))
    assert nn_ops.dense(x3, pf.ones((4, 5))) is None  # rank 3: Dense composes the ops
    assert nn_ops.dense(pf.ones((2, 4)), pf.ones((4, 5)), pf.ones(4)) is None  # bias width
    assert nn_ops.dense(pf.ones((2, 4)), pf.ones((3, 5))) is None  # inner dimensions


def test_cast_float32_gradient_comes_back_in_the_source_dtype() -> None:
    x = pf.constant([1.0, 2.0], pf.float64)
    with pf.GradientTape() as tape:
        tape.watch(x)
        y = pf.cast(x, pf.float32) * pf.constant([3.0, 4.0])
    g = tape.gradient(y, x)
    assert g.dtype == pf.float64
    np.testing.assert_array_equal(g.numpy(), [3.0, 4.0])


def test_clip_by_global_norm_gradient_matches_finite_differences() -> None:
    """The scale depends on the norm; the gradient flows through it when clipping."""

    def clipped(a: Any, b: Any) -> list[Any]:
        out, _ = pf.clip_by_global_norm([a, None, b], 0.5)
        return [out[0], out[2]]

    rng = np.random.default_rng(5)
    check_gradients(clipped, rng.standard_normal((2, 3)), rng.standard_normal(4))


def test_float32_gradients_stay_float32_and_close_to_float64() -> None:
    """The same MLP-like function in float32 gives float32 gradients near the float64 ones."""
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((4, 5)), rng.standard_normal((5, 3))]

    def f(x: Any, w: Any) -> Any:
        h = pf.nn.relu(pf.matmul(x, w))
        return pf.reduce_mean(pf.nn.softmax_cross_entropy_with_logits(pf.nn.softmax(h), h))

    us = upstreams(f, xs)
    g64 = tape_vjp(f, xs, us)
    g32 = tape_vjp(f, [x.astype(np.float32) for x in xs], [u.astype(np.float32) for u in us])
    for a, b in zip(g64, g32):
        assert b.dtype == np.float32
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)

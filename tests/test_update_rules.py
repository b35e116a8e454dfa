"""Update rules against their published formulas, recomputed here in plain Python."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from psflow.errors import InvalidArgumentError
from psflow.update_rules import (
    SGD,
    Adagrad,
    Adam,
    RMSprop,
    densify_rows,
    put_rows,
    registered_rules,
    rule_from_config,
    take_rows,
)

# Three gradient steps for a two-element variable; every step is nonzero.
W0 = [1.0, -2.0]
GRADS = [[0.5, -1.5], [0.25, 2.0], [-1.0, 0.75]]


# --- references: the formulas, one scalar at a time, in float64 -------------
def ref_sgd(w, g, st, lr, momentum=0.0, nesterov=False):
    if momentum == 0:
        return w - g * lr
    st["m"] = st.get("m", 0.0) * momentum - g * lr
    if nesterov:
        return w + st["m"] * momentum - g * lr
    return w + st["m"]


def ref_adam(w, g, st, t, lr, b1=0.9, b2=0.999, eps=1e-7, amsgrad=False):
    m = st.get("m", 0.0) * b1 + (1 - b1) * g
    v = st.get("v", 0.0) * b2 + (1 - b2) * g * g
    st["m"], st["v"] = m, v
    if amsgrad:
        st["vh"] = max(st.get("vh", 0.0), v)
        v = st["vh"]
    # The paper's bias-corrected form, algebraically equal to Keras's alpha form.
    m_hat_scale = math.sqrt(1 - b2**t) / (1 - b1**t)
    return w - lr * m_hat_scale * m / (math.sqrt(v) + eps)


def ref_adagrad(w, g, st, lr, init=0.1, eps=1e-7):
    st["a"] = st.get("a", init) + g * g
    return w - lr * g / math.sqrt(st["a"] + eps)


def ref_rmsprop(w, g, st, lr, rho=0.9, momentum=0.0, eps=1e-7, centered=False):
    st["v"] = rho * st.get("v", 0.0) + (1 - rho) * g * g
    if centered:
        st["a"] = rho * st.get("a", 0.0) + (1 - rho) * g
        denom = st["v"] - st["a"] ** 2 + eps
    else:
        denom = st["v"] + eps
    inc = lr * g / math.sqrt(denom)
    if momentum > 0:
        st["mom"] = momentum * st.get("mom", 0.0) + inc
        return w - st["mom"]
    return w - inc


def ref_ftrl(w, g, st, lr, power=-0.5, init=0.1, l1=0.0, l2=0.0, l2s=0.0, beta=0.0):
    # McMahan et al.'s per-coordinate FTRL-Proximal, in Keras's parameterisation.
    n = st.get("n", init)
    z = st.get("z", 0.0)
    n_new = n + g * g
    z += g + 2 * l2s * w - (n_new**-power - n**-power) / lr * w
    st["n"], st["z"] = n_new, z
    quadratic = n_new**-power / lr + 2 * (l2 + beta / (2 * lr))
    return (max(-l1, min(l1, z)) - z) / quadratic


CASES = [
    ("sgd", {"learning_rate": 0.1}, lambda w, g, s, t: ref_sgd(w, g, s, 0.1)),
    (
        "sgd",
        {"learning_rate": 0.1, "momentum": 0.9},
        lambda w, g, s, t: ref_sgd(w, g, s, 0.1, 0.9),
    ),
    (
        "sgd",
        {"learning_rate": 0.1, "momentum": 0.9, "nesterov": True},
        lambda w, g, s, t: ref_sgd(w, g, s, 0.1, 0.9, True),
    ),
    ("adam", {"learning_rate": 0.01}, lambda w, g, s, t: ref_adam(w, g, s, t, 0.01)),
    (
        "adam",
        {"learning_rate": 0.01, "amsgrad": True},
        lambda w, g, s, t: ref_adam(w, g, s, t, 0.01, amsgrad=True),
    ),
    ("adagrad", {"learning_rate": 0.1}, lambda w, g, s, t: ref_adagrad(w, g, s, 0.1)),
    ("rmsprop", {"learning_rate": 0.01}, lambda w, g, s, t: ref_rmsprop(w, g, s, 0.01)),
    ("ftrl", {"learning_rate": 0.1}, lambda w, g, s, t: ref_ftrl(w, g, s, 0.1)),
    (
        "ftrl",
        {
            "learning_rate": 0.1,
            "l1_regularization_strength": 0.3,
            "l2_regularization_strength": 0.2,
            "l2_shrinkage_regularization_strength": 0.05,
            "beta": 0.5,
        },
        lambda w, g, s, t: ref_ftrl(w, g, s, 0.1, l1=0.3, l2=0.2, l2s=0.05, beta=0.5),
    ),
    (
        "rmsprop",
        {"learning_rate": 0.01, "momentum": 0.5, "centered": True},
        lambda w, g, s, t: ref_rmsprop(w, g, s, 0.01, momentum=0.5, centered=True),
    ),
]


def _reference_trajectory(ref):
    out, states = [], [{}, {}]
    w = list(W0)
    for t, g in enumerate(GRADS, start=1):
        w = [ref(w[i], g[i], states[i], t) for i in range(2)]
        out.append(w)
    return out


@pytest.mark.parametrize("dtype, rtol", [(np.float64, 1e-13), (np.float32, 2e-6)])
@pytest.mark.parametrize("name, cfg, ref", CASES, ids=[f"{c[0]}-{len(c[1])}" for c in CASES])
def test_rule_matches_published_formula_for_three_steps(name, cfg, ref, dtype, rtol):
    rule = rule_from_config({"name": name, **cfg})
    var = np.array(W0, dtype=dtype)
    slots = rule.init_slots(var)
    expected = _reference_trajectory(ref)
    for t, g in enumerate(GRADS, start=1):
        rule.apply_dense(var, np.array(g, dtype=dtype), slots, step=t)
        assert var.dtype == dtype
        np.testing.assert_allclose(var, expected[t - 1], rtol=rtol, atol=0)


def test_sgd_hand_numbers():
    # w = 1, g = 0.5, lr = 0.1: 1 - 0.05 = 0.95, 0.9, 0.85 (plain SGD).
    rule = SGD(learning_rate=0.1)
    var = np.array([1.0])
    for expected in (0.95, 0.9, 0.85):
        rule.apply_dense(var, np.array([0.5]), {}, step=1)
        assert var[0] == pytest.approx(expected, abs=1e-15)


def test_adam_first_step_moves_by_learning_rate():
    # With t = 1 the bias-corrected step is lr * g / (|g| + eps') ~ lr * sign(g).
    rule = Adam(learning_rate=0.001)
    var = np.array([0.0, 0.0])
    rule.apply_dense(var, np.array([3.0, -0.2]), rule.init_slots(var), step=1)
    np.testing.assert_allclose(var, [-0.001, 0.001], rtol=1e-4)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("name, cfg, _ref", CASES, ids=[f"{c[0]}-{len(c[1])}" for c in CASES])
def test_dtype_is_preserved(name, cfg, _ref, dtype):
    rule = rule_from_config({"name": name, **cfg})
    rng = np.random.default_rng(0)
    var = rng.standard_normal((4, 3)).astype(dtype)
    slots = rule.init_slots(var)
    for t in range(1, 4):
        rule.apply_dense(var, rng.standard_normal((4, 3)).astype(dtype), slots, t)
        rule.apply_sparse(
            var, np.array([0, 2]), rng.standard_normal((2, 3)).astype(dtype), slots, t
        )
    assert var.dtype == dtype
    assert all(s.dtype == dtype for s in slots.values())
    assert np.isfinite(var).all()


def test_float32_math_stays_float32():
    # If a float64 scalar slipped in, the float32 result would differ from doing
    # the float32 arithmetic by hand.
    rule = SGD(learning_rate=0.1)
    var = np.array([1.0, 3.0], np.float32)
    grad = np.array([0.3, 0.7], np.float32)
    expected = var - grad * np.float32(0.1)
    rule.apply_dense(var, grad, {}, 1)
    assert var.tobytes() == expected.tobytes()


@pytest.mark.parametrize(
    "rule", [SGD(learning_rate=0.1), Adagrad(learning_rate=0.1)], ids=["sgd", "adagrad"]
)
def test_sparse_equals_dense_with_zero_rows(rule):
    rng = np.random.default_rng(1)
    dense_var = rng.standard_normal((6, 3)).astype(np.float32)
    sparse_var = dense_var.copy()
    dense_slots, sparse_slots = rule.init_slots(dense_var), rule.init_slots(sparse_var)
    for t in range(1, 4):
        idx = np.array([4, 1, 4, 0])
        vals = rng.standard_normal((4, 3)).astype(np.float32)
        rule.apply_dense(dense_var, densify_rows((6, 3), idx, vals), dense_slots, t)
        rule.apply_sparse(sparse_var, idx, vals, sparse_slots, t)
        assert sparse_var.tobytes() == dense_var.tobytes()
        for k in dense_slots:
            assert sparse_slots[k].tobytes() == dense_slots[k].tobytes()


@pytest.mark.parametrize(
    "rule",
    [Adam(learning_rate=0.01), SGD(learning_rate=0.1, momentum=0.9), RMSprop(centered=True)],
    ids=["adam", "momentum", "rmsprop"],
)
def test_sparse_is_lazy_only_touched_rows_change(rule):
    rng = np.random.default_rng(2)
    var = rng.standard_normal((5, 2))
    slots = rule.init_slots(var)
    rule.apply_dense(var, rng.standard_normal((5, 2)), slots, 1)  # nonzero slots
    before_var, before_slots = var.copy(), {k: s.copy() for k, s in slots.items()}
    rows = np.array([3, 1])
    vals = rng.standard_normal((2, 2))
    rule.apply_sparse(var, rows, vals, slots, 2)
    untouched = [0, 2, 4]
    np.testing.assert_array_equal(var[untouched], before_var[untouched])
    for k in slots:
        np.testing.assert_array_equal(slots[k][untouched], before_slots[k][untouched])
    # Touched rows got exactly the dense formula applied to just those rows.
    sub_var = before_var[[1, 3]].copy()
    sub_slots = {k: s[[1, 3]].copy() for k, s in before_slots.items()}
    rule.apply_dense(sub_var, vals[[1, 0]], sub_slots, 2)
    np.testing.assert_array_equal(var[[1, 3]], sub_var)


def test_duplicate_indices_are_summed_first():
    rule = Adam(learning_rate=0.01)
    a = np.ones((4, 2))
    b = a.copy()
    sa, sb = rule.init_slots(a), rule.init_slots(b)
    vals = np.array([[1.0, 2.0], [3.0, 4.0], [0.5, 0.5]])
    rule.apply_sparse(a, np.array([2, 2, 0]), vals, sa, 1)
    rule.apply_sparse(b, np.array([0, 2]), np.array([[0.5, 0.5], [4.0, 6.0]]), sb, 1)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(sa["velocity"], sb["velocity"])


@pytest.mark.parametrize("bad", [[5], [-1], [0, 7]])
def test_out_of_range_index_is_rejected_without_change(bad):
    rule = SGD(learning_rate=0.1, momentum=0.5)
    var = np.arange(10.0).reshape(5, 2)
    slots = rule.init_slots(var)
    before = var.copy()
    with pytest.raises(InvalidArgumentError, match=str(bad[-1] if bad[-1] != 0 else bad[0])):
        rule.apply_sparse(var, np.array(bad), np.ones((len(bad), 2)), slots, 1)
    np.testing.assert_array_equal(var, before)
    assert not slots["momentum"].any()


def test_bad_shapes_and_steps_are_rejected():
    rule = SGD()
    var = np.zeros((3, 2))
    with pytest.raises(InvalidArgumentError, match=r"\(2, 3\)"):
        rule.apply_dense(var, np.zeros((2, 3)), {}, 1)
    with pytest.raises(InvalidArgumentError, match="step"):
        rule.apply_dense(var, np.zeros((3, 2)), {}, 0)
    with pytest.raises(InvalidArgumentError, match=r"\(2, 3\)"):
        rule.apply_sparse(var, np.array([0, 1]), np.zeros((2, 3)), {}, 1)
    with pytest.raises(InvalidArgumentError, match="int32"):
        rule.apply_dense(np.zeros(3, np.int32), np.zeros(3, np.int32), {}, 1)
    with pytest.raises(InvalidArgumentError, match="velocity"):
        Adam().apply_dense(var, np.zeros((3, 2)), {"momentum": np.zeros((3, 2))}, 1)


@pytest.mark.parametrize(
    "cfg, match",
    [
        ({"name": "adamax"}, "adamax"),
        ({"learning_rate": 0.1}, "name"),
        ({"name": "sgd", "lr": 0.1}, "lr"),
        ({"name": "sgd", "learning_rate": -1.0}, "-1.0"),
        ({"name": "sgd", "momentum": 1.5}, "1.5"),
        ({"name": "adam", "beta_1": 1.0}, "beta_1"),
        ({"name": "adam", "amsgrad": "yes"}, "yes"),
        ({"name": "rmsprop", "rho": "0.9"}, "0.9"),
        ({"name": "adagrad", "epsilon": float("nan")}, "nan"),
        ("nope", "nope"),
        (["sgd"], "sgd"),
    ],
)
def test_bad_config_is_a_typed_error_naming_the_value(cfg, match):
    with pytest.raises(InvalidArgumentError, match=match):
        rule_from_config(cfg)


def test_config_round_trips_through_json():
    for rule in (
        SGD(0.2, 0.5, True),
        Adam(0.01, 0.8, 0.99, 1e-6, True),
        Adagrad(0.3, 0.2, 1e-5),
        RMSprop(0.1, 0.8, 0.3, 1e-6, True),
    ):
        cfg = json.loads(json.dumps(rule.get_config()))
        assert rule_from_config(cfg) == rule
    assert rule_from_config("SGD") == SGD()
    assert set(registered_rules()) == {"sgd", "adam", "adagrad", "rmsprop", "ftrl"}


def test_keras_defaults_and_slot_names():
    assert SGD() == SGD(learning_rate=0.01, momentum=0.0, nesterov=False)
    assert Adam() == Adam(0.001, 0.9, 0.999, 1e-7, False)
    assert Adagrad() == Adagrad(0.001, 0.1, 1e-7)
    assert RMSprop() == RMSprop(0.001, 0.9, 0.0, 1e-7, False)
    assert SGD().slot_names == ()
    assert SGD(momentum=0.9).slot_names == ("momentum",)
    assert Adam(amsgrad=True).slot_names == ("momentum", "velocity", "velocity_hat")
    assert RMSprop(momentum=0.1, centered=True).slot_names == (
        "velocity",
        "momentum",
        "average_gradient",
    )
    acc = Adagrad(initial_accumulator_value=0.25).init_slots(np.zeros(2, np.float16))
    assert acc["accumulator"].dtype == np.float16
    np.testing.assert_array_equal(acc["accumulator"], [0.25, 0.25])


@pytest.mark.parametrize(
    "rule",
    [SGD(learning_rate=0.1), Adagrad(learning_rate=0.1), Adam(learning_rate=0.01)],
    ids=["sgd", "adagrad", "adam"],
)
def test_apply_rows_equals_apply_sparse_bit_for_bit(rule):
    rng = np.random.default_rng(3)
    a = rng.standard_normal((50, 8)).astype(np.float32)
    b = a.copy()
    slots_a, slots_b = rule.init_slots(a), rule.init_slots(b)
    for t in range(1, 4):
        rows = rng.permutation(50)[:20]  # unique, unsorted
        vals = rng.standard_normal((20, 8)).astype(np.float32)
        rule.apply_sparse(a, rows, vals, slots_a, t)
        rule.apply_rows(b, rows, vals, slots_b, t)
        assert a.tobytes() == b.tobytes()
        for k in slots_a:
            assert slots_a[k].tobytes() == slots_b[k].tobytes()


def test_apply_rows_refuses_values_that_do_not_match_and_changes_nothing():
    rule = Adagrad(learning_rate=0.1)
    var = np.ones((4, 2), np.float32)
    slots = rule.init_slots(var)
    with pytest.raises(InvalidArgumentError, match=r"\(3, 2\)"):
        rule.apply_rows(var, np.array([0, 1]), np.ones((3, 2), np.float32), slots, 1)
    assert (var == 1).all() and (slots["accumulator"] == np.float32(0.1)).all()


def test_take_and_put_rows_equal_indexing():
    rng = np.random.default_rng(4)
    for array in (
        rng.standard_normal((30, 5)).astype(np.float32),
        rng.standard_normal((30, 5))[:, ::2],  # not contiguous: plain indexing
        rng.standard_normal(30),
    ):
        rows = rng.permutation(30)[:7]
        np.testing.assert_array_equal(take_rows(array, rows), array[rows])
        values = rng.standard_normal((7, *array.shape[1:])).astype(array.dtype)
        expected = array.copy()
        expected[rows] = values
        put_rows(array, rows, values)
        np.testing.assert_array_equal(array, expected)


def test_put_rows_refuses_what_indexing_refuses():
    """Rows are put by ``put`` on contiguous arrays, which would repeat short
    values and wrap nothing: the same errors as ``array[rows] = values``."""
    array = np.zeros((10, 4), np.float32)
    with pytest.raises(ValueError):
        put_rows(array, np.array([1, 2, 3]), np.ones((2, 4), np.float32))
    with pytest.raises(IndexError, match="20"):
        put_rows(array, np.array([1, 20]), np.ones((2, 4), np.float32))
    with pytest.raises(IndexError, match="10"):
        take_rows(array, np.array([10]))
    assert not array.any()
    put_rows(array, np.array([-1]), np.full((1, 4), 2.0))  # negative: from the end, as indexing
    np.testing.assert_array_equal(array[9], 2.0)
    put_rows(array, np.array([0, 1]), np.full((1, 4), 3.0))  # one row broadcast, as indexing
    np.testing.assert_array_equal(array[:2], 3.0)
    assert take_rows(np.zeros((5, 0)), np.array([1, 2])).shape == (2, 0)
    assert take_rows(array, np.zeros(0, np.intp)).shape == (0, 4)

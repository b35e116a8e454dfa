"""Each optimizer reproduces Keras 3's published update rule over a three-step sequence.

The references below are written from ``keras/src/optimizers/{sgd,adam,adagrad,rmsprop}.py``
and the clipping in ``base_optimizer.py``: learning rates come from the schedule
at the step count *before* the update, Adam's bias correction uses the count
after it. Variables are float64, so agreement is to ~1e-12.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import psflow as pf
from psflow import keras

W0 = np.array([[1.0, -2.0, 0.5], [3.0, 0.25, -1.5]])
GRADS = [
    np.array([[0.5, -1.0, 2.0], [0.1, 0.0, -0.3]]),
    np.array([[-0.2, 0.4, 1.0], [2.5, -0.6, 0.05]]),
    np.array([[1.5, 0.3, -0.7], [-0.4, 0.9, 0.0]]),
]


def _run(opt: keras.optimizers.Optimizer, grads: list[np.ndarray] = GRADS) -> list[np.ndarray]:
    """Applies ``grads`` one step at a time; returns the variable after each step."""
    v = pf.Variable(W0.copy(), dtype="float64")
    out = []
    for g in grads:
        opt.apply_gradients([(pf.constant(g), v)])
        out.append(v.numpy().copy())
    assert int(opt.iterations) == len(grads)
    return out


def _check(opt: keras.optimizers.Optimizer, reference: list[np.ndarray]) -> None:
    got = _run(opt)
    for step, (a, b) in enumerate(zip(got, reference), start=1):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14, err_msg=f"step {step}")


# -- NumPy references, three steps each -----------------------------------------------


def ref_sgd(lr: Callable[[int], float], momentum: float = 0.0, nesterov: bool = False):
    w, m, out = W0.copy(), np.zeros_like(W0), []
    for it, g in enumerate(GRADS):
        a = lr(it)
        if momentum:
            m = momentum * m - a * g
            w = w + (momentum * m - a * g if nesterov else m)
        else:
            w = w - a * g
        out.append(w.copy())
    return out


def ref_adam(lr: float, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-7, amsgrad=False):
    w, m, v, vhat, out = W0.copy(), np.zeros_like(W0), np.zeros_like(W0), np.zeros_like(W0), []
    for it, g in enumerate(GRADS):
        t = it + 1
        alpha = lr * np.sqrt(1 - b2**t) / (1 - b1**t)
        m = m + (g - m) * (1 - b1)
        v = v + (g * g - v) * (1 - b2)
        if amsgrad:
            vhat = np.maximum(vhat, v)
        w = w - m * alpha / (np.sqrt(vhat if amsgrad else v) + eps)
        out.append(w.copy())
    return out


def ref_adagrad(lr: float, initial: float = 0.1, eps: float = 1e-7):
    w, acc, out = W0.copy(), np.full_like(W0, initial), []
    for g in GRADS:
        acc = acc + g * g
        w = w - lr * g / np.sqrt(acc + eps)
        out.append(w.copy())
    return out


def ref_rmsprop(lr: float, rho=0.9, momentum=0.0, eps=1e-7, centered=False):
    w, vel, mom, avg, out = (W0.copy(), np.zeros_like(W0), np.zeros_like(W0), np.zeros_like(W0), [])
    for g in GRADS:
        vel = rho * vel + (1 - rho) * g * g
        if centered:
            avg = rho * avg + (1 - rho) * g
            denom = vel - avg * avg + eps
        else:
            denom = vel + eps
        inc = lr * g / np.sqrt(denom)
        if momentum > 0:
            mom = momentum * mom + inc
            w = w - mom
        else:
            w = w - inc
        out.append(w.copy())
    return out


def test_sgd_first_steps_by_hand() -> None:
    # w1 = w0 - 0.1 g1; with momentum 0.5: m1 = -0.1 g1, m2 = 0.5 m1 - 0.1 g2, w2 = w0 + m1 + m2.
    (w1, w2, _) = _run(keras.optimizers.SGD(0.1))
    np.testing.assert_allclose(w1[0, 0], 1.0 - 0.05, rtol=1e-15)
    np.testing.assert_allclose(w2[0, 0], 1.0 - 0.05 + 0.02, rtol=1e-15)
    (w1, w2, _) = _run(keras.optimizers.SGD(0.1, momentum=0.5))
    np.testing.assert_allclose(w1[0, 0], 0.95, rtol=1e-15)
    np.testing.assert_allclose(w2[0, 0], 0.95 + (0.5 * -0.05 + 0.02), rtol=1e-15)


def test_sgd_plain() -> None:
    _check(keras.optimizers.SGD(0.1), ref_sgd(lambda it: 0.1))


def test_sgd_defaults_to_keras_learning_rate() -> None:
    _check(keras.optimizers.SGD(), ref_sgd(lambda it: 0.01))


def test_sgd_momentum() -> None:
    _check(keras.optimizers.SGD(0.05, momentum=0.9), ref_sgd(lambda it: 0.05, momentum=0.9))


def test_sgd_nesterov_momentum() -> None:
    _check(
        keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
        ref_sgd(lambda it: 0.05, momentum=0.9, nesterov=True),
    )


def test_adam_without_amsgrad() -> None:
    _check(keras.optimizers.Adam(0.01, amsgrad=False), ref_adam(0.01))


def test_adam_custom_betas_and_epsilon() -> None:
    _check(
        keras.optimizers.Adam(0.2, beta_1=0.5, beta_2=0.8, epsilon=1e-3),
        ref_adam(0.2, b1=0.5, b2=0.8, eps=1e-3),
    )


def test_adam_amsgrad() -> None:
    # Large steps with beta_2 small make v shrink, so the running max matters.
    _check(
        keras.optimizers.Adam(0.1, beta_2=0.5, amsgrad=True), ref_adam(0.1, b2=0.5, amsgrad=True)
    )
    assert not np.allclose(ref_adam(0.1, b2=0.5, amsgrad=True)[2], ref_adam(0.1, b2=0.5)[2])


def test_adagrad_default_initial_accumulator() -> None:
    _check(keras.optimizers.Adagrad(0.1), ref_adagrad(0.1, initial=0.1))


def test_adagrad_custom_initial_accumulator() -> None:
    _check(
        keras.optimizers.Adagrad(0.3, initial_accumulator_value=0.5, epsilon=1e-4),
        ref_adagrad(0.3, initial=0.5, eps=1e-4),
    )


def test_rmsprop_plain() -> None:
    _check(keras.optimizers.RMSprop(0.01), ref_rmsprop(0.01))


def test_rmsprop_momentum() -> None:
    _check(
        keras.optimizers.RMSprop(0.01, rho=0.8, momentum=0.7),
        ref_rmsprop(0.01, rho=0.8, momentum=0.7),
    )


def test_rmsprop_centered() -> None:
    _check(
        keras.optimizers.RMSprop(0.02, centered=True, epsilon=1e-3),
        ref_rmsprop(0.02, centered=True, eps=1e-3),
    )


def test_rmsprop_centered_with_momentum() -> None:
    _check(
        keras.optimizers.RMSprop(0.02, rho=0.7, momentum=0.5, centered=True),
        ref_rmsprop(0.02, rho=0.7, momentum=0.5, centered=True),
    )


def test_optimizer_names_resolve_to_keras_defaults() -> None:
    sgd = keras.optimizers.get("sgd")
    assert isinstance(sgd, keras.optimizers.SGD) and sgd.learning_rate == 0.01
    adam = keras.optimizers.get("Adam")
    assert isinstance(adam, keras.optimizers.Adam) and adam.learning_rate == 0.001
    assert adam.get_config()["beta_1"] == 0.9 and adam.get_config()["epsilon"] == 1e-7


def test_adagrad_and_rmsprop_names_resolve() -> None:
    assert isinstance(keras.optimizers.get("adagrad"), keras.optimizers.Adagrad)
    assert isinstance(keras.optimizers.get("rmsprop"), keras.optimizers.RMSprop)


# -- clipping ----------------------------------------------------------------------


def _clip_norm(g: np.ndarray, c: float) -> np.ndarray:
    return g * c / max(np.sqrt((g * g).sum()), c)


def test_clipnorm_clips_each_gradient_to_its_own_norm() -> None:
    c = 1.0  # |g1| > 1, |g2| > 1, |g3| > 1: every step clips
    assert all(np.sqrt((g * g).sum()) > c for g in GRADS)
    w, out = W0.copy(), []
    for g in GRADS:
        w = w - 0.1 * _clip_norm(g, c)
        out.append(w.copy())
    _check(keras.optimizers.SGD(0.1, clipnorm=c), out)


def test_clipnorm_leaves_small_gradients_alone() -> None:
    _check(keras.optimizers.SGD(0.1, clipnorm=100.0), ref_sgd(lambda it: 0.1))


def test_clipvalue_clips_elements() -> None:
    w, out = W0.copy(), []
    for g in GRADS:
        w = w - 0.1 * np.clip(g, -0.5, 0.5)
        out.append(w.copy())
    _check(keras.optimizers.SGD(0.1, clipvalue=0.5), out)


def test_global_clipnorm_scales_all_gradients_together() -> None:
    opt = keras.optimizers.SGD(1.0, global_clipnorm=2.0)
    a = pf.Variable(np.zeros(2), dtype="float64")
    b = pf.Variable(np.zeros(3), dtype="float64")
    ga, gb = np.array([3.0, 0.0]), np.array([0.0, 4.0, 0.0])  # global norm 5
    opt.apply_gradients([(pf.constant(ga), a), (pf.constant(gb), b)])
    np.testing.assert_allclose(a.numpy(), -ga * 2.0 / 5.0, rtol=1e-14)
    np.testing.assert_allclose(b.numpy(), -gb * 2.0 / 5.0, rtol=1e-14)
    # Per-gradient clipnorm would have clipped each to norm 2 instead.
    opt2 = keras.optimizers.SGD(1.0, clipnorm=2.0)
    a2 = pf.Variable(np.zeros(2), dtype="float64")
    b2 = pf.Variable(np.zeros(3), dtype="float64")
    opt2.apply_gradients([(pf.constant(ga), a2), (pf.constant(gb), b2)])
    np.testing.assert_allclose(a2.numpy(), [-2.0, 0.0], rtol=1e-14)
    np.testing.assert_allclose(b2.numpy(), [0.0, -2.0, 0.0], rtol=1e-14)


def test_clipping_options_are_exclusive() -> None:
    with pytest.raises(ValueError, match=r"clipnorm=1\.0.*clipvalue=2\.0"):
        keras.optimizers.SGD(clipnorm=1.0, clipvalue=2.0)


def test_clipped_adam_uses_clipped_gradients_in_its_moments() -> None:
    clipped = [np.clip(g, -0.25, 0.25) for g in GRADS]
    opt = keras.optimizers.Adam(0.01, clipvalue=0.25)
    got = _run(opt)
    b1, b2, eps = 0.9, 0.999, 1e-7
    w, m, v = W0.copy(), np.zeros_like(W0), np.zeros_like(W0)
    for it, g in enumerate(clipped):
        t = it + 1
        m = m + (g - m) * (1 - b1)
        v = v + (g * g - v) * (1 - b2)
        w = w - m * (0.01 * np.sqrt(1 - b2**t) / (1 - b1**t)) / (np.sqrt(v) + eps)
        np.testing.assert_allclose(got[it], w, rtol=1e-12)


# -- learning-rate schedules -----------------------------------------------------------

S = keras.optimizers.schedules

SCHEDULES = {
    "exponential": (
        lambda: S.ExponentialDecay(0.5, decay_steps=2, decay_rate=0.1),
        lambda it: 0.5 * 0.1 ** (it / 2),
    ),
    "exponential_staircase": (
        lambda: S.ExponentialDecay(0.5, decay_steps=2, decay_rate=0.1, staircase=True),
        lambda it: 0.5 * 0.1 ** (it // 2),
    ),
    "piecewise": (
        lambda: S.PiecewiseConstantDecay([0, 1], [1.0, 0.3, 0.02]),
        lambda it: [1.0, 0.3, 0.02][0 if it <= 0 else 1 if it <= 1 else 2],
    ),
    "cosine": (
        lambda: S.CosineDecay(0.4, decay_steps=2, alpha=0.1),
        lambda it: 0.4 * (0.9 * 0.5 * (1 + np.cos(np.pi * min(it, 2) / 2)) + 0.1),
    ),
    "inverse_time": (
        lambda: S.InverseTimeDecay(0.3, decay_steps=1, decay_rate=0.5),
        lambda it: 0.3 / (1 + 0.5 * it),
    ),
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_schedule_is_evaluated_at_the_step_before_each_update(name: str) -> None:
    make, formula = SCHEDULES[name]
    assert [make()(it) for it in range(4)] == pytest.approx([formula(it) for it in range(4)])
    _check(keras.optimizers.SGD(make()), ref_sgd(formula))
    _check(keras.optimizers.SGD(make(), momentum=0.5), ref_sgd(formula, momentum=0.5))


def test_learning_rate_property_follows_the_schedule_and_can_be_set() -> None:
    opt = keras.optimizers.SGD(S.ExponentialDecay(1.0, decay_steps=1, decay_rate=0.5))
    v = pf.Variable(np.zeros(1), dtype="float64")
    lrs = []
    for _ in range(3):
        lrs.append(opt.learning_rate)
        opt.apply_gradients([(pf.constant(np.ones(1)), v)])
    assert lrs == [1.0, 0.5, 0.25]
    np.testing.assert_allclose(v.numpy(), [-1.75])
    opt.learning_rate = 0.1
    opt.apply_gradients([(pf.constant(np.ones(1)), v)])
    np.testing.assert_allclose(v.numpy(), [-1.85])


def test_schedule_config_round_trips_through_the_optimizer_config() -> None:
    opt = keras.optimizers.SGD(S.ExponentialDecay(0.5, 3, 0.2, staircase=True), momentum=0.3)
    clone = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert isinstance(clone, keras.optimizers.SGD)
    assert clone.get_config() == opt.get_config()
    assert [clone._learning_rate(i) for i in range(7)] == [opt._learning_rate(i) for i in range(7)]


# -- sparse (Embedding) gradients --------------------------------------------------------


def test_sgd_applies_sparse_rows_as_their_dense_sum() -> None:
    table = pf.Variable(W0.copy(), dtype="float64")
    opt = keras.optimizers.SGD(0.5)
    rows = pf.IndexedSlices(
        pf.constant(np.array([[1.0, 2.0, 3.0], [0.5, 0.5, 0.5]])), pf.constant([1, 1]), (2, 3)
    )
    opt.apply_gradients([(rows, table)])
    expected = W0.copy()
    expected[1] -= 0.5 * np.array([1.5, 2.5, 3.5])
    np.testing.assert_allclose(table.numpy(), expected, rtol=1e-14)


def test_adam_sparse_update_touches_only_the_given_rows() -> None:
    table = pf.Variable(np.vstack([W0, W0]), dtype="float64")
    opt = keras.optimizers.Adam(0.1)
    before = table.numpy().copy()
    g = np.array([[1.0, -1.0, 0.5]])
    opt.apply_gradients([(pf.IndexedSlices(pf.constant(g), pf.constant([2]), (4, 3)), table)])
    after = table.numpy()
    np.testing.assert_array_equal(after[[0, 1, 3]], before[[0, 1, 3]])
    # First Adam step: m = 0.1 g, v = 0.001 g^2, alpha = lr sqrt(0.001) / 0.1.
    step = 0.1 * np.sqrt(1 - 0.999) / (1 - 0.9) * (0.1 * g) / (np.sqrt(0.001 * g * g) + 1e-7)
    np.testing.assert_allclose(after[2], before[2] - step[0], rtol=1e-12)


def test_embedding_trains_through_fit_with_sparse_gradients() -> None:
    pf.random.set_seed(5)
    model = keras.Sequential(
        [
            keras.layers.Embedding(10, 4, input_shape=(3,)),
            keras.layers.Flatten(),
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    ids = np.array([[1, 2, 3], [1, 4, 4]])
    table_before = model.layers[0].embeddings.numpy().copy()
    model.fit(ids, np.array([[1.0], [-1.0]]), epochs=1, verbose=0, shuffle=False)
    changed = np.flatnonzero((model.layers[0].embeddings.numpy() != table_before).any(axis=1))
    assert changed.tolist() == [1, 2, 3, 4]


# -- a float32 three-step run against Keras itself ------------------------------------------


@pytest.fixture(scope="module")
def tf_keras() -> object:
    tf = pytest.importorskip("tensorflow")
    return tf.keras


KERAS_CASES = {
    "sgd": ({"learning_rate": 0.1}, False),
    "sgd_momentum": ({"learning_rate": 0.1, "momentum": 0.9}, False),
    "sgd_nesterov": ({"learning_rate": 0.1, "momentum": 0.9, "nesterov": True}, True),
    "adam": ({"learning_rate": 0.01}, False),
    "adam_amsgrad": ({"learning_rate": 0.05, "beta_2": 0.5, "amsgrad": True}, True),
    "adagrad": ({"learning_rate": 0.1}, True),
    "rmsprop": ({"learning_rate": 0.01}, True),
    "rmsprop_centered_momentum": (
        {"learning_rate": 0.01, "momentum": 0.5, "centered": True},
        True,
    ),
    "sgd_clipnorm": ({"learning_rate": 0.1, "clipnorm": 1.0}, False),
    "adam_global_clipnorm": ({"learning_rate": 0.01, "global_clipnorm": 0.5}, False),
}


@pytest.mark.parametrize("case", sorted(KERAS_CASES))
def test_three_float32_steps_match_keras(tf_keras: object, case: str) -> None:
    kwargs, _ = KERAS_CASES[case]
    cls_name = {"sgd": "SGD", "adam": "Adam", "adagrad": "Adagrad", "rmsprop": "RMSprop"}[
        case.split("_")[0]
    ]
    ours = getattr(keras.optimizers, cls_name)(**kwargs)
    theirs = getattr(tf_keras.optimizers, cls_name)(**kwargs)
    v_ours = pf.Variable(W0.astype(np.float32))
    v_theirs = tf_keras.Variable(W0.astype(np.float32))
    for g in GRADS:
        g32 = g.astype(np.float32)
        ours.apply_gradients([(pf.constant(g32), v_ours)])
        theirs.apply_gradients([(g32, v_theirs)])
        np.testing.assert_allclose(v_ours.numpy(), np.asarray(v_theirs), rtol=2e-6, atol=1e-6)


# -- large variables: updated in chunks on the kernel threads ------------------------------

BIG = (640, 512)  # 1.25 MiB of float32: above CHUNKED_UPDATE_MIN_BYTES, several chunks


def _big_steps(make: Callable[[], keras.optimizers.Optimizer], width: int) -> list[np.ndarray]:
    """Three updates of a large float32 variable (and a small one beside it), with the
    kernels of this thread given ``width`` threads; the large variable after each."""
    from psflow.ops import kernel_pool

    rng = np.random.default_rng(7)
    big = pf.Variable(rng.standard_normal(BIG, dtype=np.float32))
    small = pf.Variable(rng.standard_normal(5, dtype=np.float32))
    opt = make()
    out = []
    kernel_pool.set_thread_width(width)
    try:
        for _ in range(3):
            g_big = rng.standard_normal(BIG, dtype=np.float32)
            g_small = rng.standard_normal(5, dtype=np.float32)
            opt.apply_gradients([(pf.constant(g_big), big), (pf.constant(g_small), small)])
            out.append(big.numpy().copy())
    finally:
        kernel_pool.set_thread_width(None)
    return out


@pytest.mark.parametrize(
    "make",
    [
        lambda: keras.optimizers.SGD(0.1),
        lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
        lambda: keras.optimizers.Adam(0.01, amsgrad=True),
        lambda: keras.optimizers.Adagrad(0.1),
        lambda: keras.optimizers.RMSprop(0.01, momentum=0.5, centered=True),
    ],
    ids=["sgd", "nesterov", "amsgrad", "adagrad", "rmsprop"],
)
def test_large_variables_update_in_chunks_with_the_bits_of_one_pass(
    make: Callable[[], keras.optimizers.Optimizer],
) -> None:
    from psflow.keras.optimizers import optimizer as optimizer_lib

    assert np.prod(BIG) * 4 >= optimizer_lib.CHUNKED_UPDATE_MIN_BYTES
    chunked, whole = _big_steps(make, width=2), _big_steps(make, width=1)
    for a, b in zip(chunked, whole):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


def test_chunked_update_runs_on_several_threads_and_then_the_constraint() -> None:
    import threading
    import time

    from psflow import update_rules

    seen: set[str] = set()
    real = update_rules.SGD._update

    def spy(self, var, grad, slots, step):  # type: ignore[no-untyped-def]
        seen.add(threading.current_thread().name)
        if threading.current_thread() is threading.main_thread():
            time.sleep(0.002)  # leaves the helper time to wake and claim a chunk
        return real(self, var, grad, slots, step)

    big = pf.Variable(np.ones(BIG, np.float32), constraint=lambda w: pf.clip_by_value(w, 0.0, 0.5))
    opt = keras.optimizers.SGD(1.0)
    from psflow.ops import kernel_pool

    kernel_pool.set_thread_width(2)
    update_rules.SGD._update = spy  # type: ignore[method-assign]
    try:
        for _ in range(20):  # a helper thread claims a chunk in some call (not in every one)
            opt.apply_gradients([(pf.constant(np.full(BIG, 0.25, np.float32)), big)])
            if len(seen) > 1:
                break
    finally:
        update_rules.SGD._update = real  # type: ignore[method-assign]
        kernel_pool.set_thread_width(None)
    assert len(seen) > 1
    # 1 - 0.25 = 0.75, clipped to 0.5 by the constraint after the chunks; then 0.25 each step
    assert float(big.numpy().max()) <= 0.5


def test_the_same_large_variable_twice_gets_both_updates_in_order() -> None:
    from psflow.ops import kernel_pool

    v = pf.Variable(np.ones(BIG, np.float32))
    opt = keras.optimizers.SGD(1.0)
    kernel_pool.set_thread_width(2)
    try:
        opt.apply_gradients(
            [
                (pf.constant(np.full(BIG, 0.25, np.float32)), v),
                (pf.constant(np.full(BIG, 0.5, np.float32)), v),
            ]
        )
    finally:
        kernel_pool.set_thread_width(None)
    np.testing.assert_array_equal(v.numpy(), np.full(BIG, 0.25, np.float32))
    assert int(opt.iterations) == 1


def test_an_invalid_update_of_a_large_variable_names_the_problem() -> None:
    from psflow.ops import kernel_pool

    v = pf.Variable(np.ones(BIG, np.float32))
    opt = keras.optimizers.SGD(1.0)
    kernel_pool.set_thread_width(2)
    try:
        with pytest.raises(pf.errors.InvalidArgumentError, match="does not match"):
            opt.apply_gradients([(pf.constant(np.ones((BIG[0], 3), np.float32)), v)])
    finally:
        kernel_pool.set_thread_width(None)
    np.testing.assert_array_equal(v.numpy(), np.ones(BIG, np.float32))


def test_a_gradient_of_another_dtype_is_cast_first_at_every_step() -> None:
    # float64 gradients, new every step, on a float32 variable: each step is the update with
    # the gradient cast to float32 first, the later steps too (not float64 arithmetic)
    rng = np.random.default_rng(7)
    grads = [rng.standard_normal((3, 4)) for _ in range(4)]
    weights = []
    for cast in (False, True):
        var = pf.Variable(np.ones((3, 4), np.float32))
        opt = keras.optimizers.SGD(0.1, momentum=0.9)
        for g in grads:
            opt.apply_gradients([(g.astype(np.float32) if cast else g, var)])
        weights.append(var.numpy())
    assert weights[0].dtype == np.float32
    assert np.array_equal(weights[0], weights[1])

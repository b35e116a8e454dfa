"""``fit``'s step hands a dense weight's gradient to the optimizer as its two factors.

The optimizer multiplies them out block by block of the weight's rows, updating
each block while it is in cache (psflow/framework/product_gradient.py). These
tests check that nothing else ever sees one, and that the weights come out as
they do with the product written out first: bitwise where both paths make the
same BLAS calls (the first layer, whose product is cut in the same rows), to a
float32 rounding elsewhere.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import psflow as pf
from psflow import errors
from psflow.framework.product_gradient import ProductGradient
from psflow.keras.optimizers import optimizer as optimizer_lib
from psflow.ops import kernel_pool

IN, HIDDEN, OUT, BATCH = 784, 512, 10, 64  # the first weight is over the chunked size


def _data(n: int = BATCH * 4, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.random((n, IN), dtype=np.float32), rng.integers(0, OUT, n)


def _model(optimizer: Any, layers: int = 1, **dense: Any) -> Any:
    pf.random.set_seed(5)
    L = pf.keras.layers
    hidden = [L.Dense(HIDDEN, activation="relu", **dense) for _ in range(layers)]
    model = pf.keras.Sequential([pf.keras.Input((IN,)), *hidden, L.Dense(OUT)])
    model.compile(
        optimizer=optimizer,
        loss=pf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def _fit(optimizer: Any, deferred: bool, monkeypatch: Any, layers: int = 1, **dense: Any) -> Any:
    """Weights after two epochs, with the factors handed on or (``deferred=False``) not."""
    with monkeypatch.context() as m:
        if not deferred:
            m.setattr(optimizer_lib.Optimizer, "_takes_product_gradients", lambda self, v: False)
        model = _model(optimizer, layers, **dense)
        x, y = _data()
        model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    return model.get_weights()


class _Spy:
    """Counts the updates that took factors, and those that had to multiply them out."""

    def __init__(self, monkeypatch: Any) -> None:
        self.taken: list[tuple[int, ...]] = []
        self.made: list[tuple[int, ...]] = []
        add, dense = optimizer_lib._ChunkedUpdates.add_product, ProductGradient.dense_array

        def add_product(batch: Any, rule: Any, arr: Any, grad: Any, *rest: Any) -> bool:
            took = add(batch, rule, arr, grad, *rest)
            if took:
                self.taken.append(arr.shape)
            return took

        def dense_array(grad: ProductGradient) -> Any:
            self.made.append(grad.shape)
            return dense(grad)

        monkeypatch.setattr(optimizer_lib._ChunkedUpdates, "add_product", add_product)
        monkeypatch.setattr(ProductGradient, "dense_array", dense_array)


@pytest.mark.parametrize(
    "make",
    [
        lambda: pf.keras.optimizers.SGD(0.05),
        lambda: pf.keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
        lambda: pf.keras.optimizers.Adam(0.001),
        lambda: pf.keras.optimizers.RMSprop(0.001),
    ],
    ids=["sgd", "nesterov", "adam", "rmsprop"],
)
def test_fit_takes_the_factors_and_gives_the_bits_of_the_written_out_gradient(
    make, monkeypatch
) -> None:
    # the same row cut both ways: the first layer's product alone is cut as row_chunks cuts
    assert kernel_pool.gemm_cut(IN, BATCH, HIDDEN) == (
        "rows",
        list(kernel_pool.row_chunks(IN, BATCH, HIDDEN)),
    )
    spy = _Spy(monkeypatch)
    got = _fit(make(), True, monkeypatch)
    # the large weight takes its factors; the last layer's small one is multiplied out
    assert spy.taken and set(spy.taken) == {(IN, HIDDEN)} and set(spy.made) == {(HIDDEN, OUT)}
    want = _fit(make(), False, monkeypatch)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_two_hidden_layers_and_one_kernel_thread_agree_with_the_written_out_gradient(
    monkeypatch,
) -> None:
    # the second weight's product is cut otherwise when written out (beside its input's
    # gradient): a BLAS may round another cut otherwise, so a float32 tolerance here
    kernel_pool.set_thread_width(1)  # a PS worker's budget: the chunks run one by one
    try:
        spy = _Spy(monkeypatch)
        got = _fit(pf.keras.optimizers.SGD(0.05), True, monkeypatch, layers=2)
        want = _fit(pf.keras.optimizers.SGD(0.05), False, monkeypatch, layers=2)
    finally:
        kernel_pool.set_thread_width(None)
    assert {(IN, HIDDEN), (HIDDEN, HIDDEN)} <= set(spy.taken)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_a_seeded_fit_with_the_factors_is_reproducible_bit_for_bit(monkeypatch) -> None:
    a = _fit(pf.keras.optimizers.SGD(0.05), True, monkeypatch, layers=2)
    b = _fit(pf.keras.optimizers.SGD(0.05), True, monkeypatch, layers=2)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)


def test_a_weight_used_twice_gets_its_products_summed_before_the_update(monkeypatch) -> None:
    """A layer called twice (tied weights): the tape adds two gradients, so it multiplies
    both out, and the optimizer gets an array."""
    spy = _Spy(monkeypatch)

    def run(deferred: bool) -> list[np.ndarray]:
        with monkeypatch.context() as m:
            if not deferred:
                m.setattr(optimizer_lib.Optimizer, "_takes_product_gradients", lambda s, v: False)
            pf.random.set_seed(3)
            inputs = pf.keras.Input((HIDDEN,))
            shared = pf.keras.layers.Dense(HIDDEN, activation="relu")
            outputs = pf.keras.layers.Dense(OUT)(shared(shared(inputs)))
            model = pf.keras.Model(inputs, outputs)
            model.compile(
                optimizer=pf.keras.optimizers.SGD(0.05),
                loss=pf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
            rng = np.random.default_rng(1)
            x = rng.random((BATCH * 2, HIDDEN), dtype=np.float32)
            model.fit(x, rng.integers(0, OUT, BATCH * 2), batch_size=BATCH, verbose=0)
            return model.get_weights()

    got = run(True)
    assert (HIDDEN, HIDDEN) in spy.made and not spy.taken  # both uses multiplied out, summed
    for g, w in zip(got, run(False)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_a_kernel_regularizer_and_a_constraint_still_apply(monkeypatch) -> None:
    spy = _Spy(monkeypatch)
    opts = {
        "kernel_regularizer": pf.keras.regularizers.L2(0.01),
        "kernel_constraint": lambda w: pf.clip_by_value(w, -0.02, 0.02),
    }
    got = _fit(pf.keras.optimizers.SGD(0.05), True, monkeypatch, **opts)
    assert (IN, HIDDEN) in spy.made  # the regularizer's gradient is added to the product's
    assert np.abs(got[0]).max() <= 0.02
    want = _fit(pf.keras.optimizers.SGD(0.05), False, monkeypatch, **opts)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)

    spy.made.clear()  # a constraint alone: the factors are taken, the constraint follows
    got = _fit(
        pf.keras.optimizers.SGD(0.05),
        True,
        monkeypatch,
        **{"kernel_constraint": opts["kernel_constraint"]},
    )
    assert (IN, HIDDEN) in spy.taken and (IN, HIDDEN) not in spy.made
    assert np.abs(got[0]).max() <= 0.02
    want = _fit(
        pf.keras.optimizers.SGD(0.05),
        False,
        monkeypatch,
        kernel_constraint=opts["kernel_constraint"],
    )
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_clipping_a_strategy_or_an_own_apply_never_sees_the_factors(monkeypatch) -> None:
    spy = _Spy(monkeypatch)
    w = [pf.Variable(np.ones((2, 2), np.float32))]
    clipped = pf.keras.optimizers.SGD(0.05, clipnorm=1.0)
    assert not clipped._takes_product_gradients(w)

    class OwnApply(pf.keras.optimizers.SGD):
        def apply_gradients(self, grads_and_vars: Any, **kwargs: Any) -> Any:
            pairs = list(grads_and_vars)
            assert all(type(g) is not ProductGradient for g, _ in pairs)
            return super().apply_gradients(pairs, **kwargs)

    own = OwnApply(0.05)
    assert not own._takes_product_gradients(w)
    strategy = pf.distribute.MirroredStrategy(["/cpu:0"])  # one replica: the plain update
    with strategy.scope():
        mirrored = [pf.Variable(np.ones((2, 2), np.float32))]
        assert not pf.keras.optimizers.SGD(0.05)._takes_product_gradients(mirrored)
    assert not pf.keras.optimizers.SGD(0.05)._takes_product_gradients(mirrored)
    assert pf.keras.optimizers.SGD(0.05)._takes_product_gradients(w)
    for opt in (clipped, own):
        _fit(opt, True, monkeypatch)
    with strategy.scope():  # fit under one mirrored replica: arrays
        model = _model(pf.keras.optimizers.SGD(0.05))
    x, y = _data(BATCH * 2)
    model.fit(x, y, batch_size=BATCH, verbose=0)
    assert spy.taken == [] and spy.made == []


def test_a_users_tape_gets_arrays_only() -> None:
    w = pf.Variable(np.ones((IN, HIDDEN), np.float32))
    x = pf.constant(np.ones((BATCH, IN), np.float32))
    with pf.GradientTape() as tape:
        y = pf.reduce_sum(pf.nn.relu(pf.matmul(x, w)))
    g = tape.gradient(y, w)
    assert type(g) is pf.Tensor and g.shape == (IN, HIDDEN)
    with pf.GradientTape() as tape:
        y = pf.reduce_sum(pf.nn.relu(pf.matmul(x, w)))
    deferred = tape._gradient_for_update(y, [w])[0]
    assert type(deferred) is ProductGradient
    np.testing.assert_array_equal(deferred.dense_array(), g.numpy())


def test_a_product_of_the_wrong_shape_is_refused_and_changes_nothing() -> None:
    opt = pf.keras.optimizers.SGD(0.1)
    w = pf.Variable(np.ones((IN, HIDDEN), np.float32))
    rng = np.random.default_rng(2)
    bad = ProductGradient(
        rng.random((BATCH, IN + 1), dtype=np.float32), rng.random((BATCH, HIDDEN), np.float32)
    )
    with pytest.raises(errors.InvalidArgumentError, match=r"\[785, 512\]"):
        opt.apply_gradients([(bad, w)])
    assert opt.iterations.numpy() == 0
    np.testing.assert_array_equal(w.numpy(), np.ones((IN, HIDDEN), np.float32))


def test_factors_of_another_dtype_are_multiplied_out_first() -> None:
    opt = pf.keras.optimizers.SGD(0.1)
    w = pf.Variable(np.zeros((IN, HIDDEN), np.float32))
    rng = np.random.default_rng(3)
    left, right = rng.random((BATCH, IN)), rng.random((BATCH, HIDDEN))  # float64
    opt.apply_gradients([(ProductGradient(left, right), w)])
    np.testing.assert_allclose(w.numpy(), -0.1 * (left.T @ right), rtol=1e-6)


def test_a_gpu_worker_never_makes_the_factors(monkeypatch) -> None:
    """On a GPU (the strict CuPy double) products are CuPy's: the gradient is written out,
    and training gives the CPU's weights."""
    from psflow.ops import math_ops
    from tests import strict_cupy

    made: list[Any] = []
    monkeypatch.setattr(math_ops, "ProductGradient", lambda *a: made.append(a) or 1 / 0)
    x, y = _data(BATCH * 2)

    def run() -> list[np.ndarray]:
        model = _model(pf.keras.optimizers.SGD(0.05))
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        return [np.asarray(w) for w in model.get_weights()]

    with strict_cupy.installed(devices=1):
        on_gpu = run()
    monkeypatch.undo()
    on_cpu = run()
    assert made == []
    for g, w in zip(on_gpu, on_cpu):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_a_tape_asked_inside_a_deferring_backward_pass_gets_arrays() -> None:
    """A backward function that asks a tape of its own (an op's gradient computed by
    differentiation) runs while the outer tape defers: its answer is an array all the same."""
    from psflow.ops._core import node, out

    w = pf.Variable(np.ones((IN, HIDDEN), np.float32))
    x = np.ones((BATCH, IN), np.float32)
    inner: list[Any] = []

    def backward(g: Any, needs: tuple[bool, ...]) -> tuple[Any]:
        with pf.GradientTape() as tape:
            y = pf.reduce_sum(pf.matmul(pf.constant(x), w))
        inner.append(tape.gradient(y, w))
        return (g,)

    with pf.GradientTape() as tape:
        source = node(w)
        y = pf.reduce_sum(out(source._array() * 2, (source,), backward))
    tape._gradient_for_update(y, [w])
    assert len(inner) == 1 and type(inner[0]) is pf.Tensor
    np.testing.assert_array_equal(inner[0].numpy(), np.full((IN, HIDDEN), BATCH, np.float32))


@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize(
    "make",
    [lambda: pf.keras.optimizers.SGD(0.05), lambda: pf.keras.optimizers.Adam(0.001)],
    ids=["sgd", "adam"],
)
def test_mirrored_fit_sums_the_replicas_factors_in_its_fused_update(
    replicas, make, monkeypatch
) -> None:
    """MirroredStrategy's fused reduce-and-update takes each replica's factors and multiplies
    out its rows of them as it sums: the weights of the written-out path (each row of a
    product made by another BLAS call: a float32 tolerance), on every copy alike."""
    from psflow.collective import reduce_update
    from tests.test_mirrored_training import logical_cpus

    taken: list[tuple[int, ...]] = []
    real = reduce_update._sum_product_rows
    monkeypatch.setattr(
        reduce_update,
        "_sum_product_rows",
        lambda products, *a: taken.append(products[0].shape) or real(products, *a),
    )

    def run(deferred: bool) -> tuple[list[np.ndarray], Any]:
        with monkeypatch.context() as m:
            if not deferred:
                m.setattr(optimizer_lib.Optimizer, "_takes_product_gradients", lambda s, v: False)
            with logical_cpus(replicas):
                strategy = pf.distribute.MirroredStrategy()
                with strategy.scope():
                    model = _model(make(), layers=2)
                x, y = _data(BATCH * replicas * 2)
                model.fit(x, y, batch_size=BATCH * replicas, epochs=2, shuffle=False, verbose=0)
                return model.get_weights(), model

    got, model = run(True)
    assert {(IN, HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, OUT)} <= set(taken)
    for v in model.trainable_variables:  # every replica's copy the same, bitwise
        for copy in v.values[1:]:
            np.testing.assert_array_equal(copy.numpy(), v.values[0].numpy())
    taken.clear()
    want, _ = run(False)
    assert taken == []
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_minimize_takes_the_factors_and_gives_the_written_out_bits(monkeypatch) -> None:
    """``optimizer.minimize`` hands its gradients to nobody else: it takes the factors too."""
    spy = _Spy(monkeypatch)
    rng = np.random.default_rng(6)
    x = pf.constant(rng.random((BATCH, IN), dtype=np.float32))
    start = rng.standard_normal((IN, HIDDEN)).astype(np.float32)

    def run(deferred: bool) -> np.ndarray:
        with monkeypatch.context() as m:
            if not deferred:
                m.setattr(optimizer_lib.Optimizer, "_takes_product_gradients", lambda s, v: False)
            w = pf.Variable(start.copy())
            opt = pf.keras.optimizers.SGD(0.01, momentum=0.9)
            for _ in range(3):
                opt.minimize(lambda: pf.reduce_sum(pf.nn.relu(pf.matmul(x, w))), [w])
            return w.numpy()

    got = run(True)
    assert spy.taken == [(IN, HIDDEN)] * 3
    np.testing.assert_array_equal(got, run(False))  # the same row cut both ways


def test_a_learning_rate_that_changes_every_step_gives_the_written_out_bits(monkeypatch) -> None:
    """A schedule makes a new rule every step: each step's chunks use that step's rate."""
    spy = _Spy(monkeypatch)

    def make() -> Any:
        schedule = pf.keras.optimizers.schedules.ExponentialDecay(
            0.1, decay_steps=1, decay_rate=0.5
        )
        return pf.keras.optimizers.SGD(schedule, momentum=0.5)

    got = _fit(make(), True, monkeypatch)
    assert len(spy.taken) == 8  # 4 steps a epoch, 2 epochs
    want = _fit(make(), False, monkeypatch)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    still = _fit(pf.keras.optimizers.SGD(0.1, momentum=0.5), True, monkeypatch)
    assert not np.array_equal(got[0], still[0])  # the schedule did change the steps

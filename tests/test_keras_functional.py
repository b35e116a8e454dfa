"""The functional API: Model(inputs, outputs) against Sequential, plain NumPy and hand-made steps."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import psflow as pf
from psflow import errors
from tests.test_mirrored_training import logical_cpus

keras = pf.keras
RNG = np.random.default_rng(7)
XA = RNG.normal(size=(8, 3)).astype(np.float32)
XB = RNG.normal(size=(8, 2)).astype(np.float32)
Y1 = RNG.normal(size=(8, 1)).astype(np.float32)
Y2 = RNG.integers(0, 3, size=(8,)).astype(np.int64)


def two_headed(names: tuple[str, str] = ("out1", "out2")) -> Any:
    """Two inputs, a concatenation, a hidden layer and two heads (regression, 3 classes)."""
    a = keras.Input(shape=(3,), name="a")
    b = keras.Input(shape=(2,), name="b")
    h = keras.layers.Concatenate()([a, b])
    h = keras.layers.Dense(4, activation="relu", name="hidden")(h)
    o1 = keras.layers.Dense(1, name=names[0])(h)
    o2 = keras.layers.Dense(3, activation="softmax", name=names[1])(h)
    return keras.Model([a, b], [o1, o2])


def numpy_forward(model: Any, xa: np.ndarray, xb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    w = {v.name.split(":")[0]: v.numpy() for v in model.weights}
    h = np.maximum(np.concatenate([xa, xb], 1) @ w["hidden/kernel"] + w["hidden/bias"], 0)
    o1 = h @ w["out1/kernel"] + w["out1/bias"]
    z = h @ w["out2/kernel"] + w["out2/bias"]
    e = np.exp(z - z.max(1, keepdims=True))
    return o1, e / e.sum(1, keepdims=True)


def numpy_losses(o1: np.ndarray, o2: np.ndarray) -> tuple[float, float]:
    return float(np.mean((o1 - Y1) ** 2)), float(np.mean(-np.log(o2[np.arange(8), Y2])))


# -- building -------------------------------------------------------------------------------
def test_input_and_layer_calls_are_symbolic() -> None:
    x = keras.Input(shape=(4,), name="features")
    y = keras.layers.Dense(2)(x)
    assert tuple(x.shape) == (None, 4) and x.name == "features"
    assert tuple(y.shape) == (None, 2) and y.dtype == "float32"
    assert tuple(keras.layers.Reshape((2, 2))(x).shape) == (None, 2, 2)
    assert tuple(keras.layers.Reshape((-1, 1))(x).shape) == (None, 4, 1)
    assert tuple(keras.layers.Lambda(lambda t: t[:, :1] * 2.0)(x).shape) == (None, 1)
    assert tuple(keras.layers.Concatenate(axis=1)([x, y]).shape) == (None, 6)
    assert tuple(keras.layers.Add()([y, y]).shape) == (None, 2)


def test_model_of_inputs_and_outputs_is_functional_and_lists_its_layers() -> None:
    model = two_headed()
    assert isinstance(model, keras.Model) and type(model).__name__ == "Functional"
    names = [layer.name for layer in model.layers]
    assert names[:2] == ["a", "b"] and names[3:] == ["hidden", "out1", "out2"]
    assert type(model.layers[2]).__name__ == "Concatenate"
    assert model.output_names == ["out1", "out2"]
    assert model.count_params() == (5 * 4 + 4) + (4 + 1) + (4 * 3 + 3)


def test_functional_equals_numpy_and_sequential_outputs_and_gradients() -> None:
    seq = keras.Sequential(
        [keras.layers.Dense(4, activation="relu", input_shape=(3,)), keras.layers.Dense(2)]
    )
    x = keras.Input(shape=(3,))
    func = keras.Model(x, seq.layers[1](seq.layers[0](x)))  # the same layers, so the same weights
    inputs = pf.constant(XA)
    with pf.GradientTape(persistent=True) as tape:
        out_f = func(inputs)
        out_s = seq(inputs)
        loss_f = pf.reduce_sum(pf.square(out_f))
        loss_s = pf.reduce_sum(pf.square(out_s))
    w1, b1, w2, b2 = (v.numpy() for v in seq.weights)
    expected = np.maximum(XA @ w1 + b1, 0) @ w2 + b2
    np.testing.assert_allclose(out_f.numpy(), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out_f.numpy(), out_s.numpy())
    grads_f = tape.gradient(loss_f, func.trainable_variables)
    grads_s = tape.gradient(loss_s, seq.trainable_variables)
    assert len(grads_f) == 4
    for gf, gs in zip(grads_f, grads_s):
        np.testing.assert_array_equal(gf.numpy(), gs.numpy())


def test_shared_layer_has_one_set_of_weights_and_sums_its_gradients() -> None:
    a, b = keras.Input(shape=(3,)), keras.Input(shape=(3,))
    shared = keras.layers.Dense(2, use_bias=False)
    model = keras.Model([a, b], keras.layers.Add()([shared(a), shared(b)]))
    assert len(model.weights) == 1
    xb = XA[::-1].copy()
    with pf.GradientTape() as tape:
        loss = pf.reduce_sum(model([XA, xb]))
    (grad,) = tape.gradient(loss, model.trainable_variables)
    # d/dW sum((a + b) W) = (a + b)^T 1
    np.testing.assert_allclose(grad.numpy(), (XA + xb).T @ np.ones((8, 2)), rtol=1e-5)


def test_nested_models_are_layers() -> None:
    inner_seq = keras.Sequential([keras.Input(shape=(3,)), keras.layers.Dense(4, name="s1")])
    x = keras.Input(shape=(4,))
    inner_func = keras.Model(x, keras.layers.Dense(2, name="f1")(x), name="inner_func")
    outer_in = keras.Input(shape=(3,))
    outer = keras.Model(outer_in, inner_func(inner_seq(outer_in)))
    assert tuple(outer.output.shape) == (None, 2)
    assert len(outer.weights) == 4
    w = [v.numpy() for v in outer.weights]
    expected = (XA @ w[0] + w[1]) @ w[2] + w[3]
    np.testing.assert_allclose(outer(XA).numpy(), expected, rtol=1e-5, atol=1e-6)


def test_dict_inputs_and_outputs() -> None:
    a = keras.Input(shape=(3,), name="a")
    b = keras.Input(shape=(2,), name="b")
    h = keras.layers.Concatenate()([a, b])
    model = keras.Model(
        {"a": a, "b": b}, {"sum": keras.layers.Dense(1)(h), "avg": keras.layers.Average()([a, a])}
    )
    out = model({"b": XB, "a": XA})
    assert sorted(out) == ["avg", "sum"]
    np.testing.assert_allclose(out["avg"].numpy(), XA, rtol=1e-6)
    assert model.output_names == ["avg", "sum"]


def test_merge_layers_match_numpy() -> None:
    a, b = keras.Input(shape=(3,)), keras.Input(shape=(3,))
    layers = keras.layers
    outs = [
        layers.Add()([a, b]),
        layers.Multiply()([a, b]),
        layers.Average()([a, b]),
        layers.Subtract()([a, b]),
        layers.Maximum()([a, b]),
        layers.Minimum()([a, b]),
        layers.Concatenate()([a, b]),
    ]
    model = keras.Model([a, b], outs)
    xb = XA[::-1].copy()
    got = [t.numpy() for t in model([XA, xb])]
    want = [
        XA + xb,
        XA * xb,
        (XA + xb) / 2,
        XA - xb,
        np.maximum(XA, xb),
        np.minimum(XA, xb),
        np.concatenate([XA, xb], 1),
    ]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6)


# -- bad input --------------------------------------------------------------------------------
def test_graph_disconnected_names_the_missing_input() -> None:
    a, b = keras.Input(shape=(3,), name="a_in"), keras.Input(shape=(3,), name="b_in")
    out = keras.layers.Add()([a, b])
    with pytest.raises(errors.InvalidArgumentError, match=r"Graph disconnected.*b_in"):
        keras.Model(a, out)


def test_model_inputs_must_be_keras_inputs() -> None:
    a = keras.Input(shape=(3,))
    h = keras.layers.Dense(2)(a)
    with pytest.raises(errors.InvalidArgumentError, match=r"keras\.Input"):
        keras.Model(h, keras.layers.Dense(1)(h))
    with pytest.raises(errors.InvalidArgumentError, match="ndarray"):
        keras.Model(a, np.zeros(3))


def test_merge_of_incompatible_shapes_fails_when_the_graph_is_built() -> None:
    a, b = keras.Input(shape=(3,)), keras.Input(shape=(2,))
    with pytest.raises(errors.InvalidArgumentError, match=r"\[None, 3\].*\[None, 2\]"):
        keras.layers.Add()([a, b])
    with pytest.raises(errors.InvalidArgumentError, match="at least 2"):
        keras.layers.Concatenate()([a])


def test_calling_with_the_wrong_inputs_names_them() -> None:
    model = two_headed()
    with pytest.raises(errors.InvalidArgumentError, match=r"expects 2 input"):
        model(XA)
    a = keras.Input(shape=(3,), name="a")
    dict_model = keras.Model({"a": a}, keras.layers.Dense(1)(a))
    with pytest.raises(errors.InvalidArgumentError, match=r"missing inputs \['a'\]"):
        dict_model({"z": XA})


def test_compile_rejects_per_output_lists_of_the_wrong_length() -> None:
    model = two_headed()
    with pytest.raises(errors.InvalidArgumentError, match=r"loss_weights.*out1"):
        model.compile("sgd", loss="mse", loss_weights=[1.0])
    with pytest.raises(errors.InvalidArgumentError, match=r"metrics.*2"):
        model.compile("sgd", loss="mse", metrics=["mae"])
    with pytest.raises(errors.InvalidArgumentError, match=r"nope"):
        model.compile("sgd", loss={"nope": "mse"})


# -- training ---------------------------------------------------------------------------------
def test_multi_output_loss_weights_and_keras_log_names() -> None:
    model = two_headed()
    model.compile(
        "sgd",
        loss=["mse", "sparse_categorical_crossentropy"],
        loss_weights=[0.5, 2.0],
        metrics=[["mae"], ["accuracy"]],
    )
    logs = model.evaluate([XA, XB], [Y1, Y2], verbose=0, return_dict=True)
    assert sorted(logs) == ["loss", "out1_loss", "out1_mae", "out2_accuracy", "out2_loss"]
    l1, l2 = numpy_losses(*numpy_forward(model, XA, XB))
    assert logs["out1_loss"] == pytest.approx(l1, rel=1e-5)
    assert logs["out2_loss"] == pytest.approx(l2, rel=1e-5)
    assert logs["loss"] == pytest.approx(0.5 * l1 + 2.0 * l2, rel=1e-5)
    history = model.fit([XA, XB], [Y1, Y2], batch_size=8, epochs=2, verbose=0, shuffle=False)
    assert sorted(history.history) == sorted(logs)


def test_one_fit_step_equals_a_hand_written_tape_step() -> None:
    model = two_headed()
    twin = two_headed(("out1", "out2"))
    twin.set_weights(model.get_weights())
    model.compile(
        keras.optimizers.SGD(0.1),
        loss={"out1": "mse", "out2": "sparse_categorical_crossentropy"},
        loss_weights={"out1": 0.25},
    )
    model.fit([XA, XB], {"out1": Y1, "out2": Y2}, batch_size=8, epochs=1, verbose=0)
    mse = keras.losses.MeanSquaredError()
    sce = keras.losses.SparseCategoricalCrossentropy()
    with pf.GradientTape() as tape:
        o1, o2 = twin([XA, XB])
        loss = 0.25 * mse(Y1, o1) + sce(Y2, o2)
    grads = tape.gradient(loss, twin.trainable_variables)
    for v, g in zip(twin.trainable_variables, grads):
        v.assign_sub(0.1 * g.numpy())
    for got, want in zip(model.get_weights(), twin.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_single_output_model_keeps_plain_log_names() -> None:
    x = keras.Input(shape=(3,))
    model = keras.Model(x, keras.layers.Dense(1, name="head")(x))
    model.compile("sgd", loss="mse", metrics=["mae"])
    logs = model.fit(XA, Y1, epochs=1, verbose=0).history
    assert sorted(logs) == ["loss", "mae"]


@pytest.mark.parametrize(
    ("outputs", "y", "loss", "metrics"),
    [
        ("list", "list", "mse", ["mae"]),
        ("list", "array", ["mse"], [["mae"]]),
        ("dict", "dict", {"k": "mse"}, {"k": "mae"}),
    ],
)
def test_one_output_in_a_list_or_dict_keeps_plain_log_names(
    outputs: str, y: str, loss: Any, metrics: Any
) -> None:
    x = keras.Input(shape=(3,))
    head = keras.layers.Dense(1, name="head")
    out = head(x)
    model = keras.Model(x, [out] if outputs == "list" else {"k": out})
    model.compile("sgd", loss=loss, metrics=metrics)
    target = {"list": [Y1], "array": Y1, "dict": {"k": Y1}}[y]
    logs = model.evaluate(XA, target, verbose=0, return_dict=True)
    assert sorted(logs) == ["loss", "mae"]
    w, b = head.kernel.numpy(), head.bias.numpy()
    assert logs["loss"] == pytest.approx(float(np.mean((XA @ w + b - Y1) ** 2)), rel=1e-5)


def test_summary_has_a_connected_to_column() -> None:
    lines: list[str] = []
    keras.clear_session()
    two_headed().summary(print_fn=lines.append)
    assert "Connected to" in lines[2]
    (row,) = [line for line in lines if line.startswith(" hidden (Dense)")]
    assert "(None, 4)" in row and " 24 " in row and row.rstrip().endswith("concatenate")
    assert any(line.startswith("Total params: 44") for line in lines)


def _fit_two_headed(strategy: Any) -> tuple[list[np.ndarray], dict[str, list[float]]]:
    keras.clear_session()
    scope = strategy.scope() if strategy is not None else pf.distribute.get_strategy().scope()
    with scope:
        model = two_headed()
        model.set_weights([np.full(w.shape, 0.1, np.float32) for w in model.get_weights()])
        model.compile(
            keras.optimizers.SGD(0.05),
            loss=["mse", "sparse_categorical_crossentropy"],
            loss_weights=[0.5, 2.0],
            metrics=[[], ["accuracy"]],
        )
    history = model.fit([XA, XB], [Y1, Y2], batch_size=4, epochs=2, verbose=0, shuffle=False)
    return model.get_weights(), history.history


def test_mirrored_training_of_a_multi_output_model_equals_one_device() -> None:
    want_w, want_logs = _fit_two_headed(None)
    with logical_cpus(2):
        got_w, got_logs = _fit_two_headed(pf.distribute.MirroredStrategy())
    for g, w in zip(got_w, want_w):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    assert sorted(got_logs) == sorted(want_logs)
    for key in want_logs:
        np.testing.assert_allclose(got_logs[key], want_logs[key], rtol=1e-5)


def test_parameter_server_training_of_a_multi_output_model() -> None:
    strategy = pf.distribute.ParameterServerStrategy()
    try:
        got_w, got_logs = _fit_two_headed(strategy)
    finally:
        pf.distribute.coordinator.ClusterCoordinator(strategy).shutdown()
    want_w, want_logs = _fit_two_headed(None)
    assert (
        sorted(got_logs) == sorted(want_logs) == ["loss", "out1_loss", "out2_accuracy", "out2_loss"]
    )
    # one embedded worker, batches in order: the same updates as local training
    for g, w in zip(got_w, want_w):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


# -- Python operators on Keras tensors ------------------------------------------------------
def test_python_operators_build_layers_that_match_numpy_and_differentiate() -> None:
    x, y = keras.Input(shape=(3,)), keras.Input(shape=(3,))
    z = (x / 2.0 + 1 - y * y) ** 2
    model = keras.Model([x, y], [-z[:, 1:], 2.0 / (x + 3), x[:, 0], x[..., None]])
    assert [tuple(t.shape) for t in model.outputs] == [(None, 2), (None, 3), (None,), (None, 3, 1)]
    xa, xb = pf.constant(XA), pf.constant(XA[::-1].copy())
    with pf.GradientTape() as tape:
        tape.watch(xa)
        out = model([xa, xb])
        total = pf.reduce_sum(out[0])
    want_z = (XA / 2 + 1 - XA[::-1] ** 2) ** 2
    np.testing.assert_allclose(out[0].numpy(), -want_z[:, 1:], rtol=1e-5)
    np.testing.assert_allclose(out[1].numpy(), 2 / (XA + 3), rtol=1e-6)
    np.testing.assert_array_equal(out[2].numpy(), XA[:, 0])
    np.testing.assert_array_equal(out[3].numpy(), XA[..., None])
    # d/dx of -sum(z[:, 1:]) = -2 (x/2 + 1 - y^2) / 2 on columns 1 and 2, 0 on column 0
    want_grad = -(XA / 2 + 1 - XA[::-1] ** 2)
    want_grad[:, 0] = 0
    np.testing.assert_allclose(tape.gradient(total, xa).numpy(), want_grad, rtol=1e-5)


def test_operators_reject_what_they_cannot_save_and_ops_point_to_lambda() -> None:
    x = keras.Input(shape=(3,))
    with pytest.raises(errors.InvalidArgumentError, match=r"ndarray.*Lambda"):
        _ = x * np.ones(3)
    with pytest.raises(errors.InvalidArgumentError, match=r"index.*\[None, 3\]"):
        _ = x[:, 5]
    with pytest.raises(errors.InvalidArgumentError, match=r"symbolic.*Lambda"):
        pf.reduce_mean(x, axis=1)

"""Bad input to the Keras API raises ValueError/TypeError naming the offending value,
and leaves the model as it was."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import psflow as pf
from psflow import errors, keras


def _model() -> keras.Sequential:
    pf.random.set_seed(0)
    model = keras.Sequential(
        [keras.layers.Dense(4, activation="relu", input_shape=(3,)), keras.layers.Dense(1)]
    )
    model.compile(optimizer="sgd", loss="mse")
    return model


X = np.ones((10, 3), np.float32)
Y = np.ones((10, 1), np.float32)


def _unchanged(model: keras.Model, before: list[np.ndarray]) -> None:
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"x": X, "y": Y[:7]}, r"x: \[10\].*y: \[7\]"),
        ({"x": X, "y": Y, "sample_weight": np.ones(4)}, r"sample_weight: \[4\]"),
        ({"x": X, "y": Y, "batch_size": -2}, "-2"),
        ({"x": X, "y": Y, "batch_size": 0}, "got 0"),
        ({"x": X, "y": Y, "validation_split": 1.5}, "1.5"),
        ({"x": X, "y": Y, "epochs": -1}, "-1"),
        ({"x": X, "y": Y, "steps_per_epoch": 0}, "0"),
        ({"x": None, "y": Y}, "x is required"),
    ],
    ids=[
        "xy_lengths",
        "sample_weight_length",
        "negative_batch",
        "zero_batch",
        "bad_split",
        "negative_epochs",
        "zero_steps",
        "no_x",
    ],
)
def test_fit_rejects_bad_arguments_without_training(kwargs: dict[str, Any], pattern: str) -> None:
    model = _model()
    before = model.get_weights()
    with pytest.raises(ValueError, match=pattern):
        model.fit(epochs=kwargs.pop("epochs", 1), verbose=0, **kwargs)
    _unchanged(model, before)


def test_evaluate_and_predict_reject_mismatched_lengths_and_bad_batch_sizes() -> None:
    model = _model()
    with pytest.raises(ValueError, match=r"x: \[10\].*y: \[3\]"):
        model.evaluate(X, Y[:3], verbose=0)
    with pytest.raises(ValueError, match="-1"):
        model.predict(X, batch_size=-1, verbose=0)
    with pytest.raises(ValueError, match="-5"):
        model.evaluate(X, Y, batch_size=-5, verbose=0)


def test_wrong_input_shape_for_a_built_model_names_both_shapes() -> None:
    model = _model()
    before = model.get_weights()
    with pytest.raises(ValueError, match=r"last dimension 3.*\[10, 5\]"):
        model.fit(np.ones((10, 5), np.float32), Y, verbose=0)
    with pytest.raises(ValueError, match=r"\[2, 4\]"):
        model.predict(np.ones((2, 4), np.float32), verbose=0)
    with pytest.raises(ValueError, match=r"\[2, 7\]"):
        model(pf.constant(np.ones((2, 7), np.float32)))
    _unchanged(model, before)


def test_incompatible_target_shape_names_both_shapes() -> None:
    model = keras.Sequential([keras.layers.Dense(2, input_shape=(3,))])
    model.compile(optimizer="sgd", loss="mse")
    before = model.get_weights()
    with pytest.raises(ValueError, match=r"\[10, 3\].*\[10, 2\]"):
        model.fit(X, np.ones((10, 3), np.float32), verbose=0)
    _unchanged(model, before)


@pytest.mark.parametrize(
    ("what", "make"),
    [
        ("string x", lambda m: m.fit(np.array([["a", "b", "c"]] * 10), Y, verbose=0)),
        ("string y", lambda m: m.fit(X, np.array([["no"]] * 10), verbose=0)),
        ("object x", lambda m: m.fit(np.array([[object()] * 3] * 10), Y, verbose=0)),
        ("string predict", lambda m: m.predict(np.array([["a", "b", "c"]]), verbose=0)),
        ("string call", lambda m: m(np.array([["a", "b", "c"]]))),
    ],
)
def test_non_numeric_data_raises_type_error_naming_the_element_type(what: str, make: Any) -> None:
    model = _model()
    before = model.get_weights()
    with pytest.raises(TypeError, match=r"<U|object|str|'a'|'no'"):
        make(model)
    _unchanged(model, before)


def test_ragged_data_raises_value_error() -> None:
    model = _model()
    with pytest.raises(ValueError, match="x"):
        model.fit([[1.0, 2.0, 3.0], [1.0]], [[1.0], [2.0]], verbose=0)


@pytest.mark.parametrize("method", ["fit", "evaluate", "train_on_batch", "test_on_batch"])
def test_training_before_compile_raises_value_error(method: str) -> None:
    model = keras.Sequential([keras.layers.Dense(1, input_shape=(3,))])
    with pytest.raises(ValueError, match=rf"compile\(\) before {method}\(\)"):
        getattr(model, method)(X, Y)
    # The typed error is TensorFlow's precondition failure as well.
    with pytest.raises(errors.FailedPreconditionError):
        getattr(model, method)(X, Y)


def test_unknown_names_are_quoted_with_the_known_ones() -> None:
    model = keras.Sequential([keras.layers.Dense(1, input_shape=(3,))])
    with pytest.raises(ValueError, match=r"'sgdd'.*'adam'"):
        model.compile(optimizer="sgdd", loss="mse")
    with pytest.raises(ValueError, match=r"'mean_squared_eror'.*'mse'"):
        model.compile(optimizer="sgd", loss="mean_squared_eror")
    with pytest.raises(ValueError, match=r"'acuracy'.*'accuracy'"):
        model.compile(optimizer="sgd", loss="mse", metrics=["acuracy"])
    assert not model.compiled
    with pytest.raises(ValueError, match=r"'relux'.*'relu'"):
        keras.layers.Dense(3, activation="relux")
    with pytest.raises(ValueError, match=r"'glorot_unifrom'"):
        keras.layers.Dense(3, kernel_initializer="glorot_unifrom")
    with pytest.raises(ValueError, match=r"'l3'"):
        keras.layers.Dense(3, kernel_regularizer="l3")


def test_uninterpretable_objects_raise_type_error() -> None:
    with pytest.raises(TypeError, match="42"):
        keras.optimizers.get(42)
    with pytest.raises(TypeError, match="42"):
        keras.losses.get(42)
    with pytest.raises(TypeError, match="42"):
        keras.metrics.get(42)
    with pytest.raises(TypeError, match="42"):
        keras.activations.get(42)
    with pytest.raises(TypeError, match="str: 'dense'"):
        keras.Sequential(["dense"])


def test_bad_layer_and_optimizer_arguments_name_the_value() -> None:
    with pytest.raises(ValueError, match="-3"):
        keras.layers.Dense(-3)
    with pytest.raises(ValueError, match=r"1\.5"):
        keras.layers.Dropout(1.5)
    with pytest.raises(ValueError, match=r"-0\.1"):
        keras.optimizers.SGD(learning_rate=-0.1)
    with pytest.raises(ValueError, match="'fast'"):
        keras.optimizers.SGD(learning_rate="fast")
    with pytest.raises(TypeError, match="unitz"):
        keras.layers.Dense(3, unitz=4)
    with pytest.raises(ValueError, match="'bogus'"):
        keras.optimizers.SGD(bogus=1.0)


def test_sparse_labels_out_of_range_name_the_label() -> None:
    model = keras.Sequential([keras.layers.Dense(3, input_shape=(2,))])
    model.compile(
        optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    before = model.get_weights()
    with pytest.raises(ValueError, match="label 7"):
        model.fit(np.ones((4, 2), np.float32), np.array([0, 1, 7, 2]), verbose=0)
    _unchanged(model, before)


def test_fit_with_a_generator_and_y_is_rejected() -> None:
    model = _model()

    def gen() -> Any:
        yield X, Y

    with pytest.raises(ValueError, match="y and sample_weight must not be given"):
        model.fit(gen(), Y, verbose=0)


def test_callbacks_must_be_callbacks() -> None:
    model = _model()
    with pytest.raises(TypeError, match="print"):
        model.fit(X, Y, callbacks=[print], verbose=0)

"""model.save / keras.models.load_model: architecture and weights round-trip, bit for bit."""

from __future__ import annotations

import json
import os
import zipfile
from typing import Any

import numpy as np
import pytest

import psflow as pf
from psflow import errors
from psflow.distribute.ps.values import PSVariable
from psflow.distribute.values import MirroredVariable
from tests.numerics import assert_close_across_splits
from tests.test_mirrored_training import logical_cpus

keras = pf.keras
RNG = np.random.default_rng(3)
XA = RNG.normal(size=(6, 3)).astype(np.float32)
XB = RNG.normal(size=(6, 2)).astype(np.float32)


@keras.utils.register_keras_serializable(package="tests")
def halve(t: Any) -> Any:
    """A registered Lambda function."""
    return t * 0.5


@keras.utils.register_keras_serializable(package="tests")
class Scale(keras.layers.Layer):
    """A registered custom layer with a weight and a constructor argument."""

    def __init__(self, factor: float = 1.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.factor = factor

    def build(self, input_shape: Any) -> None:
        self.w = self.add_weight("w", (int(input_shape[-1]),), initializer="random_normal")

    def call(self, x: Any) -> Any:
        return x * self.w * self.factor

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "factor": self.factor}


@keras.utils.register_keras_serializable(package="tests")
class TwoLayerNet(keras.Model):
    """A registered subclassed model."""

    def __init__(self, units: int = 4, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.units = units
        self.d1 = keras.layers.Dense(units, activation="relu")
        self.d2 = keras.layers.Dense(1)

    def call(self, x: Any) -> Any:
        return self.d2(self.d1(x))

    def get_config(self) -> dict[str, Any]:
        return {"units": self.units, "name": self.name}


class Unregistered(keras.layers.Layer):
    """A custom layer nobody registered."""

    def call(self, x: Any) -> Any:
        return x + 1.0


def functional_model() -> Any:
    """Two inputs and two outputs, a shared layer, a nested Sequential and a nested model."""
    a = keras.Input(shape=(3,), name="a")
    b = keras.Input(shape=(2,), name="b")
    shared = keras.layers.Dense(3, name="shared")
    inner_in = keras.Input(shape=(3,))
    inner = keras.Model(inner_in, keras.layers.Dense(3, name="inner_dense")(inner_in), name="inner")
    stack = keras.Sequential(
        [keras.Input(shape=(3,)), keras.layers.Dense(2, activation="tanh")], name="stack"
    )
    h = keras.layers.Concatenate()([shared(a), keras.layers.Dense(3, name="from_b")(b)])
    h = keras.layers.Lambda(halve, name="halve")(keras.layers.Dense(3, name="mix")(h))
    h = keras.layers.Add()([shared(h), inner(a)])
    out1 = keras.layers.Dense(1, name="out1")(Scale(2.0, name="scale")(h))
    out2 = keras.layers.Dense(2, activation="softmax", name="out2")(stack(h))
    return keras.Model([a, b], {"out1": out1, "out2": out2}, name="tutorial")


def sequential_model() -> Any:
    return keras.Sequential(
        [
            keras.Input(shape=(3,)),
            keras.layers.Dense(4, activation="relu"),
            keras.layers.Dropout(0.2),
            keras.layers.Dense(2),
        ]
    )


def assert_same_predictions(a: Any, b: Any, x: Any) -> None:
    """Bit for bit: both models predict ``x`` with the same operations on the same shapes."""
    pa, pb = a.predict(x, verbose=0), b.predict(x, verbose=0)
    for leaf_a, leaf_b in zip(pf.nest.flatten(pa), pf.nest.flatten(pb)):
        np.testing.assert_array_equal(leaf_a, leaf_b)


def assert_same_weights(a: Any, b: Any) -> None:
    """The round trip itself: every weight comes back bit for bit."""
    wa, wb = a.get_weights(), b.get_weights()
    assert len(wa) == len(wb)
    for x, y in zip(wa, wb):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("suffix", [".keras", "_dir"])
def test_functional_round_trip_is_bit_equal(tmp_path: Any, suffix: str) -> None:
    model = functional_model()
    path = str(tmp_path / f"model{suffix}")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded).__name__ == "Functional" and loaded.name == "tutorial"
    assert [layer.name for layer in loaded.layers] == [layer.name for layer in model.layers]
    assert len(loaded.weights) == len(model.weights)
    assert_same_predictions(model, loaded, [XA, XB])
    # the shared layer is shared again: one kernel, used twice
    assert sum(1 for v in loaded.weights if v.name.startswith("shared/kernel")) == 1


def test_sequential_round_trip_keeps_compile_settings(tmp_path: Any) -> None:
    model = sequential_model()
    model.compile(keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    model.fit(XA, XA[:, :2], epochs=1, verbose=0)
    path = tmp_path / "seq.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert_same_predictions(model, loaded, XA)
    assert loaded.compiled and type(loaded.optimizer).__name__ == "Adam"
    assert loaded.optimizer.learning_rate == pytest.approx(0.01)
    logs = loaded.evaluate(XA, XA[:, :2], verbose=0, return_dict=True)
    assert logs == pytest.approx(model.evaluate(XA, XA[:, :2], verbose=0, return_dict=True))
    assert not keras.models.load_model(path, compile=False).compiled


def test_sequential_built_from_data_round_trips(tmp_path: Any) -> None:
    model = keras.Sequential([keras.layers.Dense(3), keras.layers.Dense(1)])
    model(XA)  # built from a batch: no Input in the config
    model.save(tmp_path / "m.keras")
    assert_same_predictions(model, keras.models.load_model(tmp_path / "m.keras"), XA)


def test_registered_subclassed_model_round_trips(tmp_path: Any) -> None:
    model = TwoLayerNet(units=5)
    model(XA)
    model.save(tmp_path / "sub.keras")
    loaded = keras.models.load_model(tmp_path / "sub.keras")
    assert isinstance(loaded, TwoLayerNet) and loaded.units == 5
    assert_same_predictions(model, loaded, XA)


def test_unknown_class_needs_custom_objects(tmp_path: Any) -> None:
    x = keras.Input(shape=(3,))
    model = keras.Model(x, Unregistered(name="plus_one")(keras.layers.Dense(2)(x)))
    model.save(tmp_path / "u.keras")
    with pytest.raises(errors.InvalidArgumentError, match=r"Unknown layer class 'Unregistered'"):
        keras.models.load_model(tmp_path / "u.keras")
    loaded = keras.models.load_model(
        tmp_path / "u.keras", custom_objects={"Unregistered": Unregistered}
    )
    assert_same_predictions(model, loaded, XA)


def test_anonymous_lambda_loads_only_with_custom_objects(tmp_path: Any) -> None:
    x = keras.Input(shape=(3,))
    model = keras.Model(x, keras.layers.Lambda(lambda t: t * 3.0)(x))
    model.save(tmp_path / "l.keras")
    with pytest.raises(errors.InvalidArgumentError, match=r"Unknown function '<lambda>'"):
        keras.models.load_model(tmp_path / "l.keras")
    loaded = keras.models.load_model(
        tmp_path / "l.keras", custom_objects={"<lambda>": lambda t: t * 3.0}
    )
    assert_same_predictions(model, loaded, XA)


def test_bad_files_raise_typed_errors_naming_the_path(tmp_path: Any) -> None:
    missing = str(tmp_path / "nope.keras")
    with pytest.raises(errors.NotFoundError, match=r"nope\.keras"):
        keras.models.load_model(missing)
    not_zip = tmp_path / "garbage.keras"
    not_zip.write_bytes(b"not a zip")
    with pytest.raises(errors.DataLossError, match=r"garbage\.keras"):
        keras.models.load_model(not_zip)
    model = sequential_model()
    path = tmp_path / "m.keras"
    model.save(path)
    corrupt = tmp_path / "corrupt.keras"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(corrupt, "w") as dst:
        for name in src.namelist():
            data = src.read(name)
            dst.writestr(name, b'{"model": ' if name == "config.json" else data)
    with pytest.raises(errors.DataLossError, match=r"corrupt.keras.*invalid JSON"):
        keras.models.load_model(corrupt)
    directory = tmp_path / "d"
    model.save(directory)
    os.remove(directory / "model.weights.safetensors")
    with pytest.raises(errors.NotFoundError, match=r"model\.weights\.safetensors"):
        keras.models.load_model(directory)


def test_a_config_with_an_unknown_class_name_is_named(tmp_path: Any) -> None:
    path = tmp_path / "d"
    sequential_model().save(path)
    config = json.loads((path / "config.json").read_text())
    config["model"]["config"]["layers"][1]["class_name"] = "Dense3000"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(errors.InvalidArgumentError, match="'Dense3000'"):
        keras.models.load_model(path)


def test_save_respects_overwrite_and_leaves_no_temporary_files(tmp_path: Any) -> None:
    model = sequential_model()
    model.save(tmp_path / "m.keras")
    with pytest.raises(errors.AlreadyExistsError, match=r"m\.keras"):
        model.save(tmp_path / "m.keras", overwrite=False)
    model.save(tmp_path / "m.keras")
    with pytest.raises(errors.UnimplementedError, match=r"m\.h5"):
        model.save(tmp_path / "m.h5")
    assert sorted(os.listdir(tmp_path)) == ["m.keras"]


def test_mirrored_save_and_load_in_scope(tmp_path: Any) -> None:
    with logical_cpus(2):
        strategy = pf.distribute.MirroredStrategy()
        with strategy.scope():
            model = functional_model()
        model.save(tmp_path / "m.keras")
        with strategy.scope():
            loaded = keras.models.load_model(tmp_path / "m.keras")
        assert all(isinstance(v, MirroredVariable) for v in loaded.weights)
        assert_same_predictions(model, loaded, [XA, XB])
    plain = keras.models.load_model(tmp_path / "m.keras")  # and outside any strategy
    assert_same_weights(model, plain)
    # two replicas split the batch, one device does not: each GEMM sees other rows, and
    # the BLAS may block (so round) its sums otherwise - equal within float32 ulps only
    for got, want in zip(
        pf.nest.flatten(plain.predict([XA, XB], verbose=0)),
        pf.nest.flatten(model.predict([XA, XB], verbose=0)),
    ):
        assert_close_across_splits(got, want)


def test_parameter_server_save_and_load_in_scope(tmp_path: Any) -> None:
    strategy = pf.distribute.ParameterServerStrategy()
    try:
        with strategy.scope():
            model = sequential_model()
            model.compile("sgd", loss="mse")
        model.fit(XA, XA[:, :2], epochs=1, verbose=0)
        model.save(tmp_path / "ps.keras")
        with strategy.scope():
            loaded = keras.models.load_model(tmp_path / "ps.keras")
        assert all(isinstance(v, PSVariable) for v in loaded.weights)
        assert_same_predictions(model, loaded, XA)
        want = model.predict(XA, verbose=0)
        loaded.fit(XA, XA[:, :2], epochs=1, verbose=0)  # and it trains on
    finally:
        pf.distribute.coordinator.ClusterCoordinator(strategy).shutdown()
    local = keras.models.load_model(tmp_path / "ps.keras")
    np.testing.assert_array_equal(local.predict(XA, verbose=0), want)


def test_regularizers_and_initializers_survive_the_round_trip(tmp_path: Any) -> None:
    model = keras.Sequential(
        [
            keras.Input(shape=(3,)),
            keras.layers.Dense(
                2,
                kernel_regularizer="l2",
                bias_regularizer=keras.regularizers.L1(0.3),
                kernel_initializer="he_normal",
                bias_initializer="ones",
            ),
        ]
    )
    model.save(tmp_path / "r.keras")
    loaded = keras.models.load_model(tmp_path / "r.keras")
    assert [float(x) for x in loaded.losses] == [float(x) for x in model.losses]
    assert float(model.losses[1]) == pytest.approx(0.3 * 2)  # L1 of the ones bias
    layer = loaded.layers[0]
    assert type(layer.kernel_initializer).__name__ == "HeNormal"
    assert type(layer.bias_initializer).__name__ == "Ones"


@pytest.mark.parametrize(
    "layer",
    [
        keras.layers.Dense(3, activation="relu", use_bias=False, name="d"),
        keras.layers.Activation("tanh"),
        keras.layers.Flatten(),
        keras.layers.Reshape((2, -1)),
        keras.layers.Dropout(0.3, seed=4),
        keras.layers.Lambda(halve, output_shape=(3,)),
        keras.layers.InputLayer(shape=(5,), batch_size=2),
        keras.layers.Concatenate(axis=1),
        keras.layers.Add(),
        keras.layers.Average(),
        Scale(3.0),
    ],
    ids=lambda layer: type(layer).__name__,
)
def test_layer_config_protocol_round_trips(layer: Any) -> None:
    """``from_config(get_config())`` rebuilds an equal config, through the JSON text."""
    config = json.loads(json.dumps(keras.saving.serialize_keras_object(layer)))
    rebuilt = keras.saving.deserialize_keras_object(config)
    assert type(rebuilt) is type(layer)
    assert json.loads(json.dumps(rebuilt.get_config())) == config["config"]


def test_loss_objects_and_multi_output_compile_settings_are_restored(tmp_path: Any) -> None:
    model = functional_model()
    model.compile(
        keras.optimizers.SGD(0.2),
        loss={"out1": keras.losses.Huber(delta=0.5), "out2": "sparse_categorical_crossentropy"},
        loss_weights={"out1": 0.3, "out2": 1.5},
        metrics={"out2": ["accuracy"]},
    )
    y = {"out1": XA[:, :1], "out2": np.arange(6) % 2}
    model.save(tmp_path / "c.keras")
    loaded = keras.models.load_model(tmp_path / "c.keras")
    want = model.evaluate([XA, XB], y, verbose=0, return_dict=True)
    got = loaded.evaluate([XA, XB], y, verbose=0, return_dict=True)
    assert sorted(got) == ["loss", "out1_loss", "out2_accuracy", "out2_loss"]
    assert got == pytest.approx(want, rel=1e-6)
    huber = loaded._output_losses.losses[0]
    assert type(huber).__name__ == "Huber" and huber.get_config()["delta"] == 0.5


def test_a_custom_loss_function_loads_uncompiled(tmp_path: Any) -> None:
    model = sequential_model()
    model.compile("sgd", loss=lambda yt, yp: (yt - yp) ** 2)
    model.save(tmp_path / "f.keras")
    loaded = keras.models.load_model(tmp_path / "f.keras")
    assert not loaded.compiled
    assert_same_predictions(model, loaded, XA)


def test_python_operators_on_inputs_round_trip(tmp_path: Any) -> None:
    x = keras.Input(shape=(3,))
    h = keras.layers.Dense(4)(x / 255.0 - 0.5)
    model = keras.Model(x, [-(h[:, :2] ** 2), 1.0 / (h * h + 1)])
    model.save(tmp_path / "ops.keras")
    assert_same_predictions(model, keras.models.load_model(tmp_path / "ops.keras"), XA)

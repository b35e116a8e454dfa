"""Columns as Keras takes them: text arrays (``<U``, or ``object`` as pandas gives) and
rank-1 columns for ``Input(shape=(1,))``, in ``fit``/``evaluate``/``predict``, locally
and under ParameterServerStrategy on real worker processes.

The reference is the model called on explicit ``(batch, 1)`` string tensors (which
always worked), trained by a plain ``GradientTape`` loop over the same batches.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import psflow as pf

keras = pf.keras
N, BATCH = 64, 16
COLORS = ["red", "green", "blue"]


def _columns(kind: str = "object") -> tuple[dict[str, np.ndarray], np.ndarray]:
    """A DataFrame's columns: rank 1, text as ``kind`` (``object`` or ``<U``)."""
    rng = np.random.default_rng(0)
    color = np.array(COLORS, dtype=object)[rng.integers(0, 3, size=N)]
    if kind != "object":
        color = color.astype(str)
    num = rng.normal(size=N)  # float64, as pandas gives
    y = ((color == "red") | (num > 1.0)).astype(np.float32)
    return {"color": color, "num": num}, y


def _model() -> Any:
    color = keras.Input(shape=(1,), name="color", dtype="string")
    num = keras.Input(shape=(1,), name="num")
    lookup = keras.layers.StringLookup(vocabulary=COLORS, output_mode="one_hot")
    features = keras.layers.Concatenate()([lookup(color), num])
    out = keras.layers.Dense(1, activation="sigmoid")(features)
    model = keras.Model({"color": color, "num": num}, out)
    rng = np.random.default_rng(3)  # every model starts from the same weights
    model.set_weights([rng.normal(size=w.shape).astype(np.float32) for w in model.get_weights()])
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="binary_crossentropy")
    return model


def _as_2d(x: dict[str, np.ndarray]) -> dict[str, Any]:
    return {
        "color": pf.constant(np.asarray(x["color"], dtype=object).reshape(-1, 1)),
        "num": pf.constant(x["num"].astype(np.float32).reshape(-1, 1)),
    }


def _reference_weights(x: dict[str, np.ndarray], y: np.ndarray) -> list[np.ndarray]:
    model = _model()
    opt = keras.optimizers.SGD(0.5)
    for start in range(0, N, BATCH):
        part = {k: v[start : start + BATCH] for k, v in x.items()}
        with pf.GradientTape() as tape:
            pred = model(_as_2d(part), training=True)
            loss = pf.reduce_mean(
                keras.losses.binary_crossentropy(pf.constant(y[start : start + BATCH, None]), pred)
            )
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
    return model.get_weights()


@pytest.mark.parametrize("kind", ["object", "unicode"])
def test_fit_takes_rank1_text_columns_and_trains_as_the_explicit_loop(kind: str) -> None:
    x, y = _columns(kind)
    model = _model()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), _reference_weights(x, y)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_an_object_column_of_python_numbers_is_a_number_column() -> None:
    x, y = _columns()
    model = _model()
    as_objects = dict(x, num=np.array(x["num"].tolist(), dtype=object))
    model.fit(as_objects, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), _reference_weights(x, y)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_evaluate_and_predict_take_text_columns() -> None:
    x, y = _columns()
    model = _model()
    want = model(_as_2d(x)).numpy()
    np.testing.assert_allclose(model.predict(x, batch_size=BATCH, verbose=0), want, rtol=1e-6)
    loss = model.evaluate(x, y, batch_size=N, verbose=0)
    bce = -np.mean(y * np.log(want[:, 0]) + (1 - y) * np.log(1 - want[:, 0]))
    assert loss == pytest.approx(bce, rel=1e-4)


def test_dataset_elements_of_rank1_columns_are_expanded() -> None:
    x, y = _columns()
    model = _model()
    ds = pf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    model.fit(ds, epochs=1, verbose=0)
    for got, want in zip(model.get_weights(), _reference_weights(x, y)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_rank1_column_for_a_sequential_input_is_expanded() -> None:
    model = keras.Sequential([keras.Input(shape=(1,)), keras.layers.Dense(2)])
    x = np.arange(5.0)
    np.testing.assert_allclose(model.predict(x, verbose=0), model(x[:, None]).numpy())


@pytest.mark.parametrize(
    ("column", "value", "error", "pattern"),
    [
        ("color", np.array(["red", None] * (N // 2), dtype=object), TypeError, r"None.*text"),
        ("num", np.ones((N, 2)), pf.errors.InvalidArgumentError, r"'num'.*\(None, 1\).*\[16, 2\]"),
        ("color", np.array(["red", 1] * (N // 2), dtype=object), TypeError, r"1 .*is not text"),
        ("color", np.arange(N), TypeError, r"'color'.*string input.*int"),
        ("num", np.array(["1.5"] * N), TypeError, r"'num'.*text.*StringLookup"),
    ],
)
def test_an_unusable_column_is_named_and_trains_nothing(
    column: str, value: np.ndarray, error: type, pattern: str
) -> None:
    x, y = _columns()
    x[column] = value
    model = _model()
    before = model.get_weights()
    with pytest.raises(error, match=pattern) as info:
        model.fit(x, y, batch_size=BATCH, verbose=0)
    assert column in str(info.value)
    for got, want in zip(model.get_weights(), before):
        np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_text_and_rank1_columns_train_on_a_ps_worker(start_cluster: Any, monkeypatch) -> None:
    # one closure in flight: with two, a loaded host can deliver the second after the one
    # sent when the first ended, and the worker runs them in either order (async mode
    # promises no order); this test compares with the batches' order
    monkeypatch.setenv("PSFLOW_CLOSURES_IN_FLIGHT", "1")
    x, y = _columns()
    cluster = start_cluster(num_ps=1, num_workers=1)
    strategy = pf.distribute.ParameterServerStrategy(cluster.resolver())
    with strategy.scope():
        model = _model()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    # one worker trains the batches in order: the weights of the explicit loop
    for got, want in zip(model.get_weights(), _reference_weights(x, y)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    local = _model()
    local.set_weights(model.get_weights())
    np.testing.assert_allclose(
        model.predict(x, batch_size=BATCH, verbose=0), local(_as_2d(x)).numpy(), rtol=1e-6
    )
    bad = dict(x, num=np.ones((N, 2)))
    with pytest.raises(pf.errors.InvalidArgumentError, match=r"'num'.*\(None, 1\)"):
        model.fit(bad, y, batch_size=BATCH, verbose=0)


def test_a_pandas_dataframe_trains_as_its_columns() -> None:
    pd = pytest.importorskip("pandas")  # not a dependency: only where it is installed
    x, y = _columns()
    frame = pd.DataFrame(x)
    model = _model()
    model.fit(dict(frame), y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), _reference_weights(x, y)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_an_unbatched_example_passes_and_a_wrong_one_is_named() -> None:
    # TensorFlow's PS tutorial calls a preprocessing model on single examples in Dataset.map
    words = keras.Input(shape=(3,), dtype="string", name="words")
    model = keras.Model({"words": words}, keras.layers.StringLookup(vocabulary=["a", "b"])(words))
    assert model({"words": pf.constant(["a", "b", "z"])}).numpy().tolist() == [1, 2, 0]
    with pytest.raises(pf.errors.InvalidArgumentError, match=r"'words'.*\(None, 3\).*\[2\]"):
        model({"words": pf.constant(["a", "b"])})
    with pytest.raises(pf.errors.InvalidArgumentError, match=r"'words'.*\[1, 1, 3\]"):
        model({"words": pf.constant([[["a", "b", "z"]]])})

"""The same functional-API program under tf.keras and under psflow gives the same results.

Optional: runs only where TensorFlow is installed. Each framework runs the
program in its own process; the program prints JSON: log names and values of
a multi-input/multi-output model trained with loss_weights and per-output
metrics, its weights after training, a save/load round trip, the learning
rates ReduceLROnPlateau sets for a fixed sequence of values, CSVLogger's
columns, where TerminateOnNaN stops, and the TensorBoard tags written.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from tests.tf_reference import run_reference_program

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("tensorflow") is None, reason="TensorFlow is not installed"
    ),
]

PROGRAM = r"""
import json, os, sys, tempfile
if sys.argv[1] == "tf":
    import tensorflow as tf
else:
    import psflow as tf
import numpy as np

keras = tf.keras
rng = np.random.default_rng(0)
xa = rng.normal(size=(16, 3)).astype("float32")
xb = rng.normal(size=(16, 2)).astype("float32")
y1 = rng.normal(size=(16, 1)).astype("float32")
y2 = rng.integers(0, 3, size=(16,))

a = keras.Input(shape=(3,), name="a")
b = keras.Input(shape=(2,), name="b")
shared = keras.layers.Dense(3, name="shared")
h = keras.layers.Concatenate(name="concat")([shared(a), keras.layers.Dense(3, name="from_b")(b)])
m = keras.layers.Dense(3, name="mix")(h)
h = keras.layers.Add(name="add")([shared(m), m])
h = keras.layers.Dense(4, activation="relu", name="hidden")(h)
o1 = keras.layers.Dense(1, name="out1")(h)
o2 = keras.layers.Dense(3, activation="softmax", name="out2")(h)
model = keras.Model([a, b], [o1, o2])
weights = [np.asarray(rng.normal(size=w.shape) * 0.3, "float32") for w in model.get_weights()]
model.set_weights(weights)
model.compile(keras.optimizers.SGD(0.05), loss=["mse", "sparse_categorical_crossentropy"],
              loss_weights=[0.5, 2.0], metrics=[["mae"], ["accuracy"]])
out = {}
out["layers"] = [l.name for l in model.layers]
out["evaluate"] = model.evaluate([xa, xb], [y1, y2], verbose=0, return_dict=True)
history = model.fit([xa, xb], [y1, y2], batch_size=8, epochs=2, shuffle=False, verbose=0)
out["history"] = {k: [float(v) for v in vs] for k, vs in history.history.items()}
out["weights"] = [np.asarray(w).tolist() for w in model.get_weights()]
path = os.path.join(tempfile.mkdtemp(), "m.keras")
model.save(path)
loaded = keras.models.load_model(path)
out["loaded_equal"] = all(
    np.array_equal(p, q) for p, q in zip(model.predict([xa, xb], verbose=0),
                                         loaded.predict([xa, xb], verbose=0)))

cb = keras.callbacks.ReduceLROnPlateau(factor=0.1, patience=1, cooldown=2, min_lr=0.0005)
cb.set_model(model)
cb.on_train_begin()
rates = []
for epoch, value in enumerate([1.0, 1.0, 0.99995, 1.0, 0.5, 0.6, 0.6, 0.6, 0.6, 0.6]):
    cb.on_epoch_end(epoch, {"val_loss": value})
    rates.append(float(np.asarray(model.optimizer.learning_rate)))
out["plateau"] = rates

csv_path = os.path.join(tempfile.mkdtemp(), "log.csv")
one_in = keras.Input(shape=(3,))
tiny = keras.Model(one_in, keras.layers.Dense(1)(one_in))
tiny.compile("sgd", loss="mse", metrics=["mae"])
tiny.fit(xa, y1, batch_size=8, epochs=2, validation_data=(xa, y1), verbose=0,
         callbacks=[keras.callbacks.CSVLogger(csv_path)])
with open(csv_path) as f:
    rows = [line.strip().split(",") for line in f if line.strip()]
out["csv"] = [rows[0], [r[0] for r in rows[1:]]]
batches = []
bad = y1.copy()
bad[8:] = np.nan
nan_history = tiny.fit(xa, bad, batch_size=4, epochs=3, shuffle=False, verbose=0, callbacks=[
    keras.callbacks.TerminateOnNaN(),
    keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: batches.append(batch))])
out["nan"] = [batches, len(nan_history.history["loss"])]

import importlib.util
out["tensorboard_dirs"] = out["tensorboard_log_dir"] = None
if importlib.util.find_spec("tensorboard") is not None:  # optional on both sides
    log_dir = tempfile.mkdtemp()
    single_in = keras.Input(shape=(3,))
    small = keras.Model(single_in, keras.layers.Dense(1)(single_in))
    small.compile("sgd", loss="mse", metrics=["mae"])
    small.fit(xa, y1, batch_size=8, epochs=2, validation_data=(xa, y1), verbose=0,
              callbacks=[keras.callbacks.TensorBoard(log_dir, update_freq=1)])
    out["tensorboard_dirs"] = sorted(os.listdir(log_dir))
    out["tensorboard_log_dir"] = log_dir
print("RESULT " + json.dumps(out))
"""


def run_program(framework: str) -> dict:
    return run_reference_program(PROGRAM, framework)


def tags(directory: str) -> set[str]:
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(directory, size_guidance={"tensors": 0})
    acc.Reload()
    return set(acc.Tags()["tensors"]) | set(acc.Tags()["scalars"])


def test_psflow_gives_tf_keras_results() -> None:
    theirs = run_program("tf")
    ours = run_program("psflow")
    assert ours["layers"] == theirs["layers"]
    assert sorted(ours["evaluate"]) == sorted(theirs["evaluate"])
    for key, value in theirs["evaluate"].items():
        assert ours["evaluate"][key] == pytest.approx(value, rel=1e-5), key
    assert sorted(ours["history"]) == sorted(theirs["history"])
    for key, values in theirs["history"].items():
        np.testing.assert_allclose(ours["history"][key], values, rtol=1e-4, err_msg=key)
    for mine, reference in zip(ours["weights"], theirs["weights"]):
        np.testing.assert_allclose(mine, reference, rtol=1e-4, atol=1e-6)
    assert ours["loaded_equal"] and theirs["loaded_equal"]
    np.testing.assert_allclose(ours["plateau"], theirs["plateau"], rtol=1e-6)
    assert ours["csv"] == theirs["csv"]
    assert ours["nan"] == theirs["nan"]
    if theirs["tensorboard_dirs"] is None:
        return  # TensorFlow's side has no tensorboard package: no tags to compare with
    assert ours["tensorboard_dirs"] == theirs["tensorboard_dirs"]
    for kind in ours["tensorboard_dirs"]:
        mine = tags(f"{ours['tensorboard_log_dir']}/{kind}")
        reference = tags(f"{theirs['tensorboard_log_dir']}/{kind}")
        # Keras 3 also writes the learning rate and evaluation curves; every tag we write it writes
        assert mine and mine <= reference, (kind, mine, reference)

"""Keras's "Structured data classification from scratch", with psflow and ParameterServerStrategy.

The tutorial's shape: a CSV table of patients (numeric columns, integer-coded
categories and one text category), read into a dict of columns, a
``Dataset`` of ``(features, target)``, one ``keras.Input`` per column,
``Normalization`` for the numeric ones, ``IntegerLookup``/``StringLookup``
(``output_mode="binary"``, the tutorial's, and ``"one_hot"``) for the
categorical ones, all adapted on the training data, concatenated and fed to
``Dense(32) -> Dropout -> Dense(1, sigmoid)``.

Differences: no download. The table is generated here (``--rows``, seeded),
with the tutorial's columns and a target that depends on them, and written
to and read back from a CSV file with the ``csv`` module (no pandas); pass
``--csv heart.csv`` to use the tutorial's file instead. The model trains
under ``ParameterServerStrategy`` (``psflow local`` sets ``TF_CONFIG``;
alone it runs with an embedded PS). The preprocessing layers are adapted
outside the strategy's scope, as TensorFlow's PS tutorial advises; the
model's weights are made in it, on the parameter servers.

Run it on a local cluster::

    psflow local --ps 1 --workers 2 examples/structured_data_classification.py

It prints ``Validation accuracy: A (majority class: B)``; ``--min-accuracy``
makes the exit status say whether it learned.
"""

import argparse
import csv
import os
import sys
import tempfile

import numpy as np

import psflow as tf
from psflow import keras
from psflow.keras import layers

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--csv", help="the tutorial's heart.csv (default: a generated table)")
parser.add_argument("--rows", type=int, default=800)
parser.add_argument("--epochs", type=int, default=15)
parser.add_argument("--workdir", default=tempfile.gettempdir())
parser.add_argument("--min-accuracy", type=float, default=0.0, help="exit 1 below this")
args = parser.parse_args()
tf.random.set_seed(1337)

INTEGER_CATEGORIES = ["sex", "cp", "fbs", "restecg", "exang", "ca"]
STRING_CATEGORIES = ["thal"]
NUMERIC = ["age", "trestbps", "chol", "thalach", "oldpeak", "slope"]


def generate_table(path: str, rows: int) -> None:
    """A table with the tutorial's columns; the target follows a noisy risk score."""
    rng = np.random.default_rng(42)
    table = {
        "age": rng.integers(29, 78, rows),
        "sex": rng.integers(0, 2, rows),
        "cp": rng.integers(0, 5, rows),
        "trestbps": rng.integers(94, 201, rows),
        "chol": rng.integers(126, 565, rows),
        "fbs": rng.integers(0, 2, rows),
        "restecg": rng.integers(0, 3, rows),
        "thalach": rng.integers(71, 203, rows),
        "exang": rng.integers(0, 2, rows),
        "oldpeak": np.round(rng.gamma(1.2, 0.9, rows), 1),
        "slope": rng.integers(1, 4, rows),
        "ca": rng.integers(0, 4, rows),
        "thal": rng.choice(["fixed", "normal", "reversible"], rows, p=[0.1, 0.55, 0.35]),
    }
    cp_risk = np.array([-1.2, -0.6, 0.4, 1.3, 0.2])[table["cp"]]
    thal_risk = np.select(
        [table["thal"] == "normal", table["thal"] == "fixed"], [-1.1, 0.4], default=1.2
    )
    score = (
        0.04 * (table["age"] - 54)
        + 0.8 * table["sex"]
        + cp_risk
        + 1.0 * table["exang"]
        + 0.7 * table["oldpeak"]
        - 0.03 * (table["thalach"] - 150)
        + 0.8 * table["ca"]
        + thal_risk
        - 3.0
    )
    table["target"] = (rng.random(rows) < 1 / (1 + np.exp(-2 * score))).astype(int)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(list(table))
        writer.writerows(zip(*(column.tolist() for column in table.values())))


def read_table(path: str) -> dict:
    """The CSV's columns as NumPy arrays: text stays text, numbers become int64 or float."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    columns = {}
    for name in rows[0]:
        values = [row[name] for row in rows]
        if name in STRING_CATEGORIES:
            columns[name] = np.array(values, dtype=object)  # as pandas reads text columns
        elif all(v.lstrip("-").isdigit() for v in values):
            columns[name] = np.array(values, dtype=np.int64)
        else:
            columns[name] = np.array(values, dtype=np.float64)
    return columns


path = args.csv or os.path.join(args.workdir, "structured_data.csv")
os.makedirs(args.workdir, exist_ok=True)
if not args.csv:
    generate_table(path, args.rows)
columns = read_table(path)
target = columns.pop("target")
n = len(target)
order = np.random.default_rng(1337).permutation(n)
cut = int(0.8 * n)
train_idx, val_idx = order[:cut], order[cut:]
print(f"Using {len(train_idx)} samples for training and {len(val_idx)} for validation")


def dataframe_to_dataset(idx: np.ndarray, shuffle: bool) -> tf.data.Dataset:
    # one rank-1 column per feature, as dict(dataframe) gives: fit expands each to (batch, 1)
    ds = tf.data.Dataset.from_tensor_slices(({k: v[idx] for k, v in columns.items()}, target[idx]))
    if shuffle:
        ds = ds.shuffle(buffer_size=len(idx), seed=1337)
    return ds


train_ds = dataframe_to_dataset(train_idx, shuffle=True).batch(32)
val_ds = dataframe_to_dataset(val_idx, shuffle=False).batch(32)


# -- preprocessing, adapted on the training data (outside the strategy's scope) ---------------
def feature_column(name: str):
    return train_ds.map(lambda x, y: tf.expand_dims(x[name], -1))


def numeric_encoder(name: str):
    normalizer = layers.Normalization()
    normalizer.adapt(feature_column(name))
    return normalizer


def categorical_encoder(name: str, is_string: bool):
    lookup_class = layers.StringLookup if is_string else layers.IntegerLookup
    # the tutorial's "binary" (Keras's older name of multi_hot); one_hot for the text column
    lookup = lookup_class(output_mode="one_hot" if is_string else "binary")
    lookup.adapt(feature_column(name))
    return lookup


encoders = {name: numeric_encoder(name) for name in NUMERIC}
encoders.update({name: categorical_encoder(name, False) for name in INTEGER_CATEGORIES})
encoders.update({name: categorical_encoder(name, True) for name in STRING_CATEGORIES})

# -- the model, its weights on the parameter servers -----------------------------------------
strategy = tf.distribute.ParameterServerStrategy(
    tf.distribute.cluster_resolver.TFConfigClusterResolver()
)
with strategy.scope():
    inputs = {}
    for name in NUMERIC:
        inputs[name] = keras.Input(shape=(1,), name=name)
    for name in INTEGER_CATEGORIES:
        inputs[name] = keras.Input(shape=(1,), name=name, dtype="int64")
    for name in STRING_CATEGORIES:
        inputs[name] = keras.Input(shape=(1,), name=name, dtype="string")
    all_features = layers.concatenate([encoders[name](inputs[name]) for name in inputs])
    x = layers.Dense(32, activation="relu")(all_features)
    x = layers.Dropout(0.5)(x)
    output = layers.Dense(1, activation="sigmoid")(x)
    model = keras.Model(inputs, output)
    model.compile(
        optimizer=keras.optimizers.Adam(0.01), loss="binary_crossentropy", metrics=["accuracy"]
    )

model.fit(train_ds, epochs=args.epochs, validation_data=val_ds, verbose=2)
loss, accuracy = model.evaluate(val_ds, verbose=0)
majority = max(target[val_idx].mean(), 1 - target[val_idx].mean())
print(f"Validation accuracy: {accuracy:.4f} (majority class: {majority:.4f})")

sample = {
    "age": 60, "sex": 1, "cp": 1, "trestbps": 145, "chol": 233, "fbs": 1, "restecg": 2,
    "thalach": 150, "exang": 0, "oldpeak": 2.3, "slope": 3, "ca": 0, "thal": "fixed",
}  # fmt: skip
prediction = model.predict({k: np.array([v]) for k, v in sample.items()}, verbose=0)
print(
    f"This particular patient had a {100 * prediction[0][0]:.1f} percent probability of heart disease"
)
sys.exit(0 if accuracy >= args.min_accuracy else 1)

"""TensorFlow's "Multi-worker training with Keras" tutorial, with the import swapped.

The tutorial's program: ``mnist_setup`` (a shuffled, repeated dataset batched
by the *global* batch), ``build_and_compile_cnn_model``, a
``MultiWorkerMirroredStrategy`` from ``TF_CONFIG``, the model built in its
scope, ``fit`` with ``steps_per_epoch`` and ``BackupAndRestore``, then
``model.save`` by the tutorial's rule: the chief writes the real path, every
other worker a temporary directory it removes.

Differences from the tutorial, all about the data: the UCI digits shipped with
psflow (8x8 images, pixel values up to 16) stand in for MNIST, so the scaling
divides by 16, the input is ``(8, 8)`` and the batch per worker is 16; and
``os.makedirs`` for ``tf.io.gfile.makedirs``, which psflow does not have.

Run it alone with ``python examples/multi_worker_keras_tutorial.py``, or as the
tutorial's two workers with
``psflow local --mode multi-worker --workers 2 examples/multi_worker_keras_tutorial.py``.
``--workdir`` keeps its files apart; ``--min-accuracy`` makes it exit 1 below that.
"""

import argparse
import json
import os
import shutil
import sys

import numpy as np

import psflow as tf
from psflow.keras.datasets import digits

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--workdir", default="/tmp/psflow-multi-worker-keras")
parser.add_argument("--min-accuracy", type=float, default=0.0)
args = parser.parse_args()


def mnist_setup():
    """The tutorial's ``mnist.mnist_dataset`` and ``build_and_compile_cnn_model``."""

    def mnist_dataset(batch_size):
        (x_train, y_train), _ = digits.load_data()
        x_train = x_train.reshape(-1, 8, 8) / np.float32(16)
        y_train = y_train.astype(np.int64)
        train_dataset = (
            tf.data.Dataset.from_tensor_slices((x_train, y_train))
            .shuffle(2000, seed=0)
            .repeat()
            .batch(batch_size)
        )
        return train_dataset

    def build_and_compile_cnn_model():
        model = tf.keras.Sequential(
            [
                tf.keras.layers.InputLayer(input_shape=(8, 8)),
                tf.keras.layers.Reshape(target_shape=(8, 8, 1)),
                tf.keras.layers.Conv2D(32, 3, activation="relu"),
                tf.keras.layers.Flatten(),
                tf.keras.layers.Dense(128, activation="relu"),
                tf.keras.layers.Dense(10),
            ]
        )
        model.compile(
            loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            optimizer=tf.keras.optimizers.SGD(learning_rate=0.1),
            metrics=["accuracy"],
        )
        return model

    return mnist_dataset, build_and_compile_cnn_model


mnist_dataset, build_and_compile_cnn_model = mnist_setup()

tf_config = json.loads(os.environ.get("TF_CONFIG") or "{}")
num_workers = len(tf_config.get("cluster", {}).get("worker", [])) or 1

per_worker_batch_size = 16
global_batch_size = per_worker_batch_size * num_workers

strategy = tf.distribute.MultiWorkerMirroredStrategy()
multi_worker_dataset = mnist_dataset(global_batch_size)

with strategy.scope():
    # Model building/compiling need to be within `strategy.scope()`.
    multi_worker_model = build_and_compile_cnn_model()

callbacks = [tf.keras.callbacks.BackupAndRestore(backup_dir=os.path.join(args.workdir, "backup"))]
history = multi_worker_model.fit(
    multi_worker_dataset, epochs=args.epochs, steps_per_epoch=70, callbacks=callbacks, verbose=2
)


# The tutorial's saving rule.
def _is_chief(task_type, task_id):
    return task_type is None or task_type == "chief" or (task_type == "worker" and task_id == 0)


def _get_temp_dir(dirpath, task_id):
    base_dirpath = "workertemp_" + str(task_id)
    temp_dir = os.path.join(dirpath, base_dirpath)
    os.makedirs(temp_dir, exist_ok=True)  # the tutorial's tf.io.gfile.makedirs
    return temp_dir


def write_filepath(filepath, task_type, task_id):
    dirpath = os.path.dirname(filepath)
    base = os.path.basename(filepath)
    if not _is_chief(task_type, task_id):
        dirpath = _get_temp_dir(dirpath, task_id)
    return os.path.join(dirpath, base)


task_type, task_id = strategy.cluster_resolver.task_type, strategy.cluster_resolver.task_id
model_path = os.path.join(args.workdir, "keras-model.keras")
write_model_path = write_filepath(model_path, task_type, task_id)
multi_worker_model.save(write_model_path)
if not _is_chief(task_type, task_id):
    shutil.rmtree(os.path.dirname(write_model_path), ignore_errors=True)

accuracy = history.history["accuracy"][-1]
print(f"final training accuracy {accuracy:.3f}")
if accuracy < args.min_accuracy:
    sys.exit(1)

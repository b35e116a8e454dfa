"""TensorFlow's "Parameter server training" tutorial, Keras part, with the import swapped.

What the tutorial does with ``Model.fit``: a ``ParameterServerStrategy`` with a
``MinSizePartitioner``, input as a ``dataset_fn(input_context)`` wrapped in a
``keras.utils.experimental.DatasetCreator``, ``fit(..., steps_per_epoch=...)``
with ``TensorBoard``, ``ModelCheckpoint`` and ``BackupAndRestore``; then its
data-preprocessing model: string features and labels turned into ids by
``StringLookup`` layers inside the ``dataset_fn`` (so on each worker), feeding
an embedding model whose variables are sharded over the parameter servers.

Differences from the tutorial: the cluster comes from ``TF_CONFIG`` (``psflow
local`` sets it) instead of an in-process cluster the tutorial builds with
``tf.distribute.Server``s; the embedding model is trained with ``fit`` on a
``DatasetCreator`` (the tutorial trains it with a custom loop, see
``examples/ps_custom_loop.py``), validated with ``validation_data`` /
``validation_steps`` and evaluated with ``evaluate(..., steps=...)``; its
``tf.reduce_mean`` over the embeddings is wrapped in a ``Lambda`` layer (psflow's
functional API takes layers and Python operators on symbolic tensors, not ops;
under Keras 3 TensorFlow itself refuses ``tf.reduce_mean`` of a KerasTensor).

Run it on a local cluster::

    psflow local --ps 2 --workers 2 examples/ps_keras_tutorial.py

or anywhere (embedded PS, this process as the only worker):
``python examples/ps_keras_tutorial.py``. ``--workdir`` puts its files elsewhere
than ``/tmp/my_working_dir``; ``--min-accuracy`` makes the exit status say
whether the embedding model learned its labels.
"""

import argparse
import os
import random
import sys

import psflow as tf

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--workdir", default="/tmp/my_working_dir")
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--min-accuracy", type=float, default=0.0, help="exit 1 below this")
args = parser.parse_args()
tf.random.set_seed(0)
random.seed(0)

cluster_resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
NUM_PS = max(1, len(cluster_resolver.cluster_spec().as_dict().get("ps", [])))

variable_partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
    min_shard_bytes=(256 << 10), max_shards=NUM_PS
)

strategy = tf.distribute.ParameterServerStrategy(
    cluster_resolver, variable_partitioner=variable_partitioner
)


# -- Training with Keras Model.fit ----------------------------------------------------------
def dataset_fn(input_context):
    global_batch_size = 64
    batch_size = input_context.get_per_replica_batch_size(global_batch_size)

    x = tf.random.uniform((10, 10))
    y = tf.random.uniform((10,))

    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(10).repeat()
    dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    dataset = dataset.batch(batch_size)
    dataset = dataset.prefetch(2)

    return dataset


dc = tf.keras.utils.experimental.DatasetCreator(dataset_fn)

with strategy.scope():
    model = tf.keras.models.Sequential([tf.keras.layers.Dense(10)])

    model.compile(tf.keras.optimizers.SGD(), loss="mse", steps_per_execution=10)

working_dir = args.workdir
log_dir = os.path.join(working_dir, "log")
ckpt_filepath = os.path.join(working_dir, "ckpt")
backup_dir = os.path.join(working_dir, "backup")

callbacks = [
    tf.keras.callbacks.TensorBoard(log_dir=log_dir),
    tf.keras.callbacks.ModelCheckpoint(filepath=ckpt_filepath),
    tf.keras.callbacks.BackupAndRestore(backup_dir=backup_dir),
]

model.fit(dc, epochs=5, steps_per_epoch=20, callbacks=callbacks)

# -- Data preprocessing: string features through StringLookup in the dataset_fn --------------
feature_vocab = ["avenger", "ironman", "batman", "hulk", "spiderman", "kingkong", "wonder_woman"]
label_vocab = ["yes", "no"]

with strategy.scope():
    feature_lookup_layer = tf.keras.layers.StringLookup(vocabulary=feature_vocab, mask_token=None)
    label_lookup_layer = tf.keras.layers.StringLookup(
        vocabulary=label_vocab, num_oov_indices=0, mask_token=None
    )

    raw_feature_input = tf.keras.layers.Input(shape=(3,), dtype=tf.string, name="feature")
    feature_id_input = feature_lookup_layer(raw_feature_input)
    feature_preprocess_stage = tf.keras.Model({"features": raw_feature_input}, feature_id_input)

    raw_label_input = tf.keras.layers.Input(shape=(1,), dtype=tf.string, name="label")
    label_id_input = label_lookup_layer(raw_label_input)

    label_preprocess_stage = tf.keras.Model({"label": raw_label_input}, label_id_input)


def feature_and_label_gen(num_examples=200):
    examples = {"features": [], "label": []}
    for _ in range(num_examples):
        features = random.sample(feature_vocab, 3)
        label = ["yes"] if "avenger" in features else ["no"]
        examples["features"].append(features)
        examples["label"].append(label)
    return examples


examples = feature_and_label_gen()


def dataset_fn(_):
    raw_dataset = tf.data.Dataset.from_tensor_slices(examples)

    train_dataset = (
        raw_dataset.map(
            lambda x: (
                {"features": feature_preprocess_stage(x["features"])},
                label_preprocess_stage(x["label"]),
            )
        )
        .shuffle(200)
        .batch(32)
        .repeat()
    )
    return train_dataset


# These variables created under the `Strategy.scope` will be placed on parameter
# servers in a round-robin fashion.
with strategy.scope():
    # Create the model. The input needs to be compatible with Keras processing layers.
    model_input = tf.keras.layers.Input(shape=(3,), dtype=tf.int64, name="model_input")

    emb_layer = tf.keras.layers.Embedding(
        input_dim=len(feature_lookup_layer.get_vocabulary()), output_dim=16384
    )
    # the tutorial's tf.reduce_mean(..., axis=1) on the symbolic tensor, as a layer
    emb_output = tf.keras.layers.Lambda(lambda t: tf.reduce_mean(t, axis=1))(emb_layer(model_input))
    dense_output = tf.keras.layers.Dense(
        units=1,
        activation="sigmoid",
        kernel_regularizer=tf.keras.regularizers.L2(1e-4),
    )(emb_output)
    model = tf.keras.Model({"features": model_input}, dense_output)

    model.compile(
        optimizer=tf.keras.optimizers.RMSprop(learning_rate=0.1),
        loss="binary_crossentropy",
        metrics=["accuracy"],
    )

dc = tf.keras.utils.experimental.DatasetCreator(dataset_fn)
model.fit(dc, epochs=args.epochs, steps_per_epoch=10, validation_data=dc, validation_steps=4)
eval_loss, eval_accuracy = model.evaluate(dc, steps=8)
print("Eval loss: {}, Eval accuracy: {}".format(eval_loss, eval_accuracy))  # noqa: UP032
sys.exit(0 if eval_accuracy >= args.min_accuracy else 1)

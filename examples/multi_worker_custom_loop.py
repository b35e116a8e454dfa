"""TensorFlow's multi-worker custom training loop, with the import swapped.

The pattern: ``MultiWorkerMirroredStrategy`` from ``TF_CONFIG``, a model and
optimizer built in ``strategy.scope()``, a dataset of global batches
distributed with ``experimental_distribute_dataset`` (auto-sharded by worker),
``strategy.run(train_step)`` with ``GradientTape`` and ``apply_gradients``, the
losses reduced across workers, and the chief alone writing the checkpoint.

Run it alone (one worker) with ``python examples/multi_worker_custom_loop.py``,
or as two peer processes with
``psflow local --mode multi-worker --workers 2 examples/multi_worker_custom_loop.py``.
Every worker prints the same losses and the same final weights checksum.
"""

import os
import tempfile

import psflow as tf

strategy = tf.distribute.MultiWorkerMirroredStrategy()
task = strategy.cluster_resolver.task_type, strategy.cluster_resolver.task_id
print(f"task {task}: {strategy.num_replicas_in_sync} replicas in sync")

GLOBAL_BATCH_SIZE = 64
tf.random.set_seed(0)
x = tf.random.uniform((1024, 10), seed=1)
y = tf.cast(tf.reduce_sum(x, axis=1, keepdims=True) > 5.0, tf.float32)
dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH_SIZE)
dist_dataset = strategy.experimental_distribute_dataset(dataset)

with strategy.scope():
    model = tf.keras.Sequential(
        [tf.keras.layers.Dense(16, activation="relu"), tf.keras.layers.Dense(1)]
    )
    model.build((None, 10))
    optimizer = tf.keras.optimizers.SGD(learning_rate=0.1)
    loss_object = tf.keras.losses.BinaryCrossentropy(
        from_logits=True, reduction=tf.keras.losses.Reduction.NONE
    )


def train_step(inputs):
    features, labels = inputs
    with tf.GradientTape() as tape:
        logits = model(features, training=True)
        loss = tf.nn.compute_average_loss(
            loss_object(labels, logits), global_batch_size=GLOBAL_BATCH_SIZE
        )
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss


@tf.function
def distributed_train_step(dist_inputs):
    per_replica_losses = strategy.run(train_step, args=(dist_inputs,))
    return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)


for epoch in range(3):
    total, steps = 0.0, 0
    for batch in dist_dataset:
        total += float(distributed_train_step(batch))
        steps += 1
    print(f"epoch {epoch}: loss {total / steps:.6f}")

checksum = sum(float(tf.reduce_sum(w)) for w in model.trainable_variables)
print(f"weights checksum {checksum:.8f}")

# TensorFlow's rule: the chief writes the real checkpoint (every worker holds the same weights)
if strategy.extended.should_checkpoint:
    directory = os.environ.get("CHECKPOINT_DIR") or tempfile.mkdtemp(prefix="mwms-")
    path = tf.train.Checkpoint(model=model).save(os.path.join(directory, "ckpt"))
    print(f"chief saved {path}")

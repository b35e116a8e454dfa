"""TensorFlow's parameter-server tutorial (custom training loop), with the import swapped.

The pattern: a ``dataset_fn`` sharded by its ``InputContext``, per-worker
datasets and iterators from the ClusterCoordinator, a ``step_fn`` running
``strategy.run(replica_fn)`` with ``GradientTape`` and ``apply_gradients``,
closures scheduled and joined, and a metric read on the chief.

Run it anywhere (embedded mode) with ``python examples/ps_custom_loop.py``, or
on a local cluster with ``psflow local --ps 2 --workers 2 examples/ps_custom_loop.py``.
"""

import psflow as tf

tf.random.set_seed(0)
strategy = tf.distribute.ParameterServerStrategy()


def dataset_fn(input_context):
    global_batch_size = 64
    batch_size = input_context.get_per_replica_batch_size(global_batch_size)
    x = tf.random.uniform((1024, 10), seed=1)
    y = tf.cast(tf.reduce_sum(x, axis=1, keepdims=True) > 5.0, tf.float32)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(1024, seed=2).repeat()
    dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    dataset = dataset.batch(batch_size)
    dataset = dataset.prefetch(2)
    return dataset


with strategy.scope():
    model = tf.keras.layers.Dense(1, activation="sigmoid", kernel_initializer="zeros")
    optimizer = tf.keras.optimizers.RMSprop(learning_rate=0.1)
    accuracy = tf.keras.metrics.Accuracy()


@tf.function
def step_fn(iterator):
    def replica_fn(batch_data, labels):
        with tf.GradientTape() as tape:
            pred = model(batch_data, training=True)
            per_example_loss = tf.keras.losses.BinaryCrossentropy(
                reduction=tf.keras.losses.Reduction.NONE
            )(labels, pred)
            loss = tf.nn.compute_average_loss(per_example_loss)
            model_losses = model.losses
            if model_losses:
                loss += tf.nn.scale_regularization_loss(tf.add_n(model_losses))
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        actual_pred = tf.cast(tf.greater(pred, 0.5), tf.int64)
        accuracy.update_state(labels, actual_pred)
        return loss

    batch_data, labels = next(iterator)
    losses = strategy.run(replica_fn, args=(batch_data, labels))
    return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)


coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)


@tf.function
def per_worker_dataset_fn():
    return strategy.distribute_datasets_from_function(dataset_fn)


per_worker_dataset = coordinator.create_per_worker_dataset(per_worker_dataset_fn)
per_worker_iterator = iter(per_worker_dataset)

num_epochs = 4
steps_per_epoch = 5
for i in range(num_epochs):
    accuracy.reset_states()
    for _ in range(steps_per_epoch):
        coordinator.schedule(step_fn, args=(per_worker_iterator,))
    # Wait at epoch boundaries.
    coordinator.join()
    print("Finished epoch %d, accuracy is %f." % (i, accuracy.result().numpy()))

loss = coordinator.schedule(step_fn, args=(per_worker_iterator,))
print("Final loss is %f" % loss.fetch())

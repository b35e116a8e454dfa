# The spec's second MirroredStrategy example; only the import line differs from TensorFlow's.
import psflow as tf

tf.random.set_seed(0)

strategy = tf.distribute.MirroredStrategy()

with strategy.scope():
    model = tf.keras.Sequential([
        tf.keras.layers.Dense(4, activation='relu'),
        tf.keras.layers.Dense(1)
    ])
    model.compile(optimizer='sgd', loss='mse')

dataset = tf.data.Dataset.from_tensor_slices(
    (tf.constant([[1.0], [2.0], [3.0], [4.0]]),
     tf.constant([[2.0], [4.0], [6.0], [8.0]]))
).batch(2)

dist_dataset = strategy.experimental_distribute_dataset(dataset)

model.fit(dist_dataset, epochs=1)

# The spec's third ParameterServerStrategy example; only the import line differs from TensorFlow's.
import psflow as tf

tf.random.set_seed(0)

strategy = tf.distribute.ParameterServerStrategy()

with strategy.scope():
    model = tf.keras.Sequential([
        tf.keras.layers.Dense(1, input_shape=(1,))
    ])
    model.compile(optimizer='sgd', loss='mse')

x = tf.constant([[1.0], [2.0], [3.0], [4.0]])
y = tf.constant([[2.0], [4.0], [6.0], [8.0]])

history = model.fit(x, y, epochs=5, verbose=0)
print(history.history['loss'][-1])

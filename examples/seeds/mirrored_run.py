# The spec's third MirroredStrategy example; only the import line differs from TensorFlow's.
import psflow as tf

strategy = tf.distribute.MirroredStrategy()

with strategy.scope():
    t = tf.constant([1, 2, 3, 4, 5])
    res = strategy.run(lambda x: x + 1, args=(t,))

print(res)

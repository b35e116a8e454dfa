# The spec's first MirroredStrategy example; only the import line differs from TensorFlow's.
import psflow as tf

strategy = tf.distribute.MirroredStrategy()
print(strategy.num_replicas_in_sync)

# The spec's second ParameterServerStrategy example; only the import line differs from TensorFlow's.
import psflow as tf

strategy = tf.distribute.ParameterServerStrategy()

with strategy.scope():
    v = tf.Variable([1, 2, 3, 4, 5], name='weights')

print(v)

# The spec's first ParameterServerStrategy example; only the import line differs from TensorFlow's.
import psflow as tf

resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
strategy = tf.distribute.ParameterServerStrategy(resolver)

print(strategy.num_replicas_in_sync)

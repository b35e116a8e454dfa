"""``psflow.nn``: TensorFlow's ``tf.nn`` names."""

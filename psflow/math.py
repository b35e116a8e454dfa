"""``psflow.math``: TensorFlow's ``tf.math`` names."""

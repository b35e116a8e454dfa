"""psflow: parameter-server and mirrored data-parallel training, TensorFlow's way.

``import psflow as tf`` gives the names a ``tf.distribute`` training script uses:
tensors and variables, math ops, ``GradientTape``, ``data``, ``keras`` and
``distribute``, on NumPy (CPU) or CuPy (GPU).
"""

__version__ = "0.1.0"

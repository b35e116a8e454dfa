"""A job of your own: the sample script docker/README.md deploys ("Your own script").

A linear model y = 3x - 2 (plus noise) fitted with Keras ``fit`` under
ParameterServerStrategy. It stands for your program: put yours in this
directory (compose mounts it at /opt/psflow/job), in a ConfigMap (Kubernetes),
or COPY it into an image derived from ``psflow`` (docker/job/Dockerfile). It
runs anywhere: ``python docker/job/train.py`` (embedded PS) or
``psflow local --ps 1 --workers 1 docker/job/train.py``. Exit 1 when the fit
misses the true weights, so a broken deployment fails its job.
"""

import sys

import numpy as np

import psflow as tf

rng = np.random.default_rng(0)
x = rng.uniform(-1.0, 1.0, size=(512, 1)).astype("float32")
y = (3.0 * x - 2.0 + rng.normal(0.0, 0.05, size=x.shape)).astype("float32")

strategy = tf.distribute.ParameterServerStrategy()
with strategy.scope():
    model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(1,))])
    model.compile(optimizer=tf.keras.optimizers.SGD(0.2), loss="mse")
model.fit(x, y, batch_size=32, epochs=8, verbose=2)
kernel, bias = (float(np.asarray(w).ravel()[0]) for w in model.get_weights())
print(f"job done: y = {kernel:.3f} x + {bias:.3f} (true: 3x - 2)", flush=True)
sys.exit(0 if abs(kernel - 3.0) < 0.1 and abs(bias + 2.0) < 0.1 else 1)

"""``psflow.keras``: Keras's names for models, layers, losses, optimizers and callbacks.

Example:
    >>> import psflow as tf
    >>> model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(1,))])
    >>> model.compile(optimizer="sgd", loss="mse")
"""

from psflow.keras import (
    activations,
    callbacks,
    initializers,
    layers,
    losses,
    metrics,
    models,
    optimizers,
    regularizers,
    saving,
    utils,
)
from psflow.keras.engine.sequential import Sequential
from psflow.keras.engine.training import Model
from psflow.keras.layers import Input
from psflow.keras.layers.base import clear_session
from psflow.keras.saving import load_model


def __getattr__(name: str):
    if name == "datasets":
        import importlib

        return importlib.import_module("psflow.keras.datasets")
    if name == "backend":
        import importlib

        return importlib.import_module("psflow.keras.backend")
    raise AttributeError(f"module 'psflow.keras' has no attribute {name!r}")

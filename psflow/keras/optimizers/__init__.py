"""Optimizers (Keras's ``keras.optimizers``), by object or by name.

The update math lives once in :mod:`psflow.update_rules`; these classes hold
hyperparameters, the step counter and (for in-process variables) the slots,
and apply the same rules a parameter server applies next to its variables.
"""

from psflow.keras.optimizers import schedules
from psflow.keras.optimizers.optimizer import (
    SGD,
    Adagrad,
    Adam,
    Optimizer,
    RMSprop,
    deserialize,
    get,
    serialize,
)

legacy = None  # Keras 2's legacy optimizers are not provided

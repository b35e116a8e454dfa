"""Keras utilities."""

from psflow.keras.saving.serialization import (
    custom_object_scope,
    get_registered_name,
    get_registered_object,
    register_keras_serializable,
)
from psflow.keras.utils import experimental
from psflow.keras.utils.plotting import model_to_dot, plot_model
from psflow.keras.utils.progbar import Progbar


def to_categorical(y, num_classes=None, dtype="float32"):
    """One-hot encodes integer class ids as a NumPy array (Keras's ``to_categorical``)."""
    import numpy as np

    from psflow import errors

    y = np.asarray(y, dtype=np.int64)
    if y.ndim > 1 and y.shape[-1] == 1:
        y = y[..., 0]
    n = int(num_classes) if num_classes is not None else int(y.max()) + 1 if y.size else 0
    if y.size and (y.min() < 0 or y.max() >= n):
        raise errors.InvalidArgumentError(
            f"to_categorical: class ids must be in [0, {n}), got {y.min()}..{y.max()}"
        )
    out = np.zeros((*y.shape, n), dtype=dtype)
    np.put_along_axis(out, y[..., None], 1, axis=-1)
    return out

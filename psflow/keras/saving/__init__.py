"""Saving and loading whole models (Keras's ``keras.saving``)."""

from psflow.keras.saving.saving_lib import load_model, save_model
from psflow.keras.saving.serialization import (
    custom_object_scope,
    deserialize_keras_object,
    get_registered_name,
    get_registered_object,
    register_keras_serializable,
    serialize_keras_object,
)

__all__ = [
    "custom_object_scope",
    "deserialize_keras_object",
    "get_registered_name",
    "get_registered_object",
    "load_model",
    "register_keras_serializable",
    "save_model",
    "serialize_keras_object",
]

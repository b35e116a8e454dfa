"""``keras.models``: model classes and ``load_model``."""

from psflow.keras.engine.functional import Functional
from psflow.keras.engine.sequential import Sequential
from psflow.keras.engine.training import Model
from psflow.keras.saving import load_model, save_model

__all__ = ["Functional", "Model", "Sequential", "load_model", "save_model"]

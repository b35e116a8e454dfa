"""``keras.utils.experimental``: TensorFlow's experimental Keras utilities."""

from psflow.keras.utils.dataset_creator import DatasetCreator

__all__ = ["DatasetCreator"]

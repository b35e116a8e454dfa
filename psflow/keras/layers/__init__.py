"""Keras layers."""

from psflow.keras.layers.base import Layer
from psflow.keras.layers.core import (
    Activation,
    Dense,
    Dropout,
    Flatten,
    Input,
    InputLayer,
    Reshape,
)
from psflow.keras.layers.dynamic_embedding import DynamicEmbedding
from psflow.keras.layers.embedding import Embedding

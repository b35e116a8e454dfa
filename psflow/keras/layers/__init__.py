"""Keras layers."""

from psflow.keras.layers.base import Layer
from psflow.keras.layers.core import (
    Activation,
    Dense,
    Dropout,
    Flatten,
    Input,
    InputLayer,
    Lambda,
    Reshape,
)
from psflow.keras.layers.embedding import Embedding

# -- functional API: merge layers (helper funcapi) --
from psflow.keras.layers.merge import (
    Add,
    Average,
    Concatenate,
    Maximum,
    Minimum,
    Multiply,
    Subtract,
    add,
    average,
    concatenate,
    maximum,
    minimum,
    multiply,
    subtract,
)
from psflow.keras.layers.operators import TensorOperator, TensorSlice

"""Keras layers."""

from psflow.keras.layers.base import Layer
from psflow.keras.layers.convolutional import Conv1D, Conv2D, Convolution1D, Convolution2D
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
from psflow.keras.layers.dynamic_embedding import DynamicEmbedding
from psflow.keras.layers.embedding import Embedding
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
from psflow.keras.layers.normalization import BatchNormalization, LayerNormalization
from psflow.keras.layers.operators import TensorOperator, TensorSlice
from psflow.keras.layers.pooling import (
    AveragePooling1D,
    AveragePooling2D,
    AvgPool1D,
    AvgPool2D,
    GlobalAveragePooling1D,
    GlobalAveragePooling2D,
    GlobalAvgPool1D,
    GlobalAvgPool2D,
    GlobalMaxPool1D,
    GlobalMaxPool2D,
    GlobalMaxPooling1D,
    GlobalMaxPooling2D,
    MaxPool1D,
    MaxPool2D,
    MaxPooling1D,
    MaxPooling2D,
)
from psflow.keras.layers.preprocessing import (
    CategoryEncoding,
    Discretization,
    Hashing,
    IntegerLookup,
    Normalization,
    StringLookup,
)

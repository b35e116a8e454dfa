"""Preprocessing layers: lookups, hashing, encodings, normalization and discretization.

They run on the host and work on string tensors as well as numbers, so they fit
in a ``dataset_fn``'s ``map`` on parameter-server workers, as in TensorFlow's
parameter-server tutorial.
"""

from psflow.keras.layers.preprocessing.category_encoding import CategoryEncoding
from psflow.keras.layers.preprocessing.discretization import Discretization
from psflow.keras.layers.preprocessing.hashing import Hashing
from psflow.keras.layers.preprocessing.index_lookup import IntegerLookup, StringLookup
from psflow.keras.layers.preprocessing.normalization import Normalization

"""The UCI optical handwritten digits: 1797 grey 8x8 images of the digits 0-9.

The data (CC BY 4.0, Alpaydin & Kaynak 1998; see ``data/NOTICE.txt``) ships
inside the package, so loading needs no network.

Example:
    >>> from psflow.keras.datasets import digits
    >>> (x_train, y_train), (x_test, y_test) = digits.load_data(test_split=0.25, seed=1)
    >>> x_train.dtype, y_train.dtype, float(x_train.max())
    (dtype('float32'), dtype('uint8'), 16.0)
"""

from __future__ import annotations

import gzip
import importlib.resources
import io

import numpy as np

from psflow import errors

NUM_EXAMPLES = 1797
NUM_CLASSES = 10
_FILE = "digits.csv.gz"


def _read() -> tuple[np.ndarray, np.ndarray]:
    """All images (float32, (1797, 8, 8)) and labels (uint8), in the file's order."""
    blob = importlib.resources.files(__package__).joinpath("data", _FILE).read_bytes()
    with gzip.open(io.BytesIO(blob), "rt") as text:
        table = np.loadtxt(text, delimiter=",", dtype=np.float32)
    if table.shape != (NUM_EXAMPLES, 65):
        raise errors.DataLossError(
            f"{_FILE} should hold {NUM_EXAMPLES} rows of 65 values, got shape {table.shape}"
        )
    return table[:, :64].reshape(-1, 8, 8), table[:, 64].astype(np.uint8)


def load_data(
    test_split: float = 0.2, seed: int = 113
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Loads the digits, shuffled by ``seed`` and split into training and test sets.

    Like Keras's ``load_data`` functions: the examples are shuffled with
    ``numpy.random.RandomState(seed)`` (a stream NumPy keeps fixed across
    versions), then the last ``test_split`` fraction becomes the test set.
    The same arguments give the same arrays on every machine.

    Args:
        test_split: fraction of the examples held out for testing, in ``[0, 1)``.
        seed: the shuffling seed.

    Returns:
        ``(x_train, y_train), (x_test, y_test)``: ``x`` float32 of shape
        ``(n, 8, 8)`` with integral pixel values in ``[0, 16]``; ``y`` uint8
        class ids in ``[0, 9]``.

    Raises:
        InvalidArgumentError: ``test_split`` outside ``[0, 1)`` or a non-integer
            ``seed``, naming the value.
    """
    try:
        split = float(test_split)
    except (TypeError, ValueError):
        raise errors.InvalidArgumentError(
            f"test_split must be a number in [0, 1), got {test_split!r}"
        ) from None
    if not 0.0 <= split < 1.0:
        raise errors.InvalidArgumentError(f"test_split must be in [0, 1), got {test_split!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise errors.InvalidArgumentError(f"seed must be an integer >= 0, got {seed!r}")
    x, y = _read()
    order = np.random.RandomState(int(seed)).permutation(len(x))
    x, y = x[order], y[order]
    cut = int(len(x) * (1.0 - split))
    return (x[:cut], y[:cut]), (x[cut:], y[cut:])

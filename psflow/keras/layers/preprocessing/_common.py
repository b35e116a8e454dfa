"""What the preprocessing layers share: host arrays in and out, ``adapt`` data, encodings.

Preprocessing runs on the host (NumPy), as TensorFlow runs it on the CPU:
lookups and hashes have no gradient and work on text, which never goes to a
GPU. Numeric results become tensors on the current device.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from psflow import backend, errors
from psflow.framework.tensor import Tensor, constant, to_array

OUTPUT_MODES = ("int", "one_hot", "multi_hot", "count")

# Keras's older names, still accepted (tutorials written for TF 2.4-2.5 use them)
LEGACY_OUTPUT_MODES = {"binary": "multi_hot", "tf-idf": "tf_idf"}


def host_array(value: Any, layer: str) -> np.ndarray:
    """``value`` (a tensor, array, list or scalar) as a host array; text as an object array.

    Raises:
        InvalidArgumentError: data that is neither numbers nor text, naming the layer.
    """
    try:
        arr = value._array() if isinstance(value, Tensor) else to_array(value)
    except TypeError as e:
        raise errors.InvalidArgumentError(f"{layer}: cannot read the inputs: {e}") from None
    return backend.to_numpy(arr)


def batches(data: Any, steps: int | None, layer: str) -> Iterator[np.ndarray]:
    """The host arrays of ``adapt`` data: one array, or the batches of a dataset or iterable.

    Raises:
        InvalidArgumentError: ``steps`` with in-memory data, or a dataset of tuples.
    """
    from psflow.data import Dataset

    if isinstance(data, Dataset) or (
        not isinstance(data, (np.ndarray, list, tuple, Tensor, str, bytes))
        and hasattr(data, "__iter__")
    ):
        for i, batch in enumerate(data):
            if steps is not None and i >= steps:
                return
            if isinstance(batch, (tuple, dict)):
                raise errors.InvalidArgumentError(
                    f"{layer}.adapt needs a dataset of features only, got an element "
                    f"{type(batch).__name__}; map it to the feature first"
                )
            yield host_array(batch, layer)
        return
    if steps is not None:
        raise errors.InvalidArgumentError(
            f"{layer}.adapt: steps={steps!r} applies to datasets, not to in-memory data"
        )
    yield host_array(data, layer)


def encode(
    indices: np.ndarray,
    mode: str,
    depth: int,
    dtype: str,
    layer: str,
    count_weights: np.ndarray | None = None,
    drop_negative: bool = False,
) -> Tensor:
    """Integer ``indices`` in ``[0, depth)`` as Keras encodes them (``output_mode``).

    ``int`` keeps them; ``one_hot`` adds a last axis of ``depth`` (replacing a last
    axis of 1); ``multi_hot`` and ``count`` reduce the last axis of a rank-2 input
    (a rank-1 input is one value per example) into ``depth`` presence flags or counts.

    With ``drop_negative``, index -1 (a masked value) counts for nothing.

    Raises:
        InvalidArgumentError: an index outside ``[0, depth)``, named.
    """
    if mode == "int":
        return constant(indices.astype(dtype, copy=False))
    keep = None
    if drop_negative and indices.size and int(indices.min()) < 0:
        keep = indices >= 0
        indices = np.where(keep, indices, 0)
    if indices.size:
        lo, hi = int(indices.min()), int(indices.max())
        if lo < 0 or hi >= depth:
            raise errors.InvalidArgumentError(
                f"{layer}: input value {lo if lo < 0 else hi} is outside [0, {depth})"
            )
    if mode == "one_hot":
        if indices.ndim and indices.shape[-1] == 1:
            indices = indices[..., 0]
        if keep is not None and keep.ndim and keep.shape[-1] == 1 and keep.ndim > indices.ndim:
            keep = keep[..., 0]
        encoded = np.eye(depth, dtype=dtype)[indices]
        if keep is not None:
            encoded *= keep[..., None]
        return constant(encoded)
    if keep is not None:
        count_weights = keep * (1 if count_weights is None else np.asarray(count_weights))
    if indices.ndim == 0:
        indices = indices.reshape(1)
    if indices.ndim == 1:
        indices = indices[:, None]
        if count_weights is not None:
            count_weights = np.asarray(count_weights).reshape(indices.shape)
    rows = indices.reshape(-1, indices.shape[-1])
    out = np.zeros((rows.shape[0], depth), dtype=dtype)
    row_ids = np.repeat(np.arange(rows.shape[0]), rows.shape[1])
    if mode == "multi_hot":
        flags = 1 if keep is None else np.asarray(count_weights).reshape(-1)
        np.maximum.at(out, (row_ids, rows.reshape(-1)), flags)
    else:
        weights = 1 if count_weights is None else np.asarray(count_weights).reshape(-1)
        np.add.at(out, (row_ids, rows.reshape(-1)), weights)
    return constant(out.reshape(*indices.shape[:-1], depth))


def check_output_mode(mode: Any, allowed: tuple[str, ...], layer: str) -> str:
    """``mode`` if allowed.

    Raises:
        InvalidArgumentError: any other mode, quoting the allowed ones.
    """
    if mode not in allowed:
        raise errors.InvalidArgumentError(
            f"{layer}: output_mode must be one of {list(allowed)}, got {mode!r}"
        )
    return str(mode)

"""How a model takes a value for one of its inputs: Keras's rank, dtype and shape rules.

A functional model (and a Sequential that starts with an ``Input`` or a layer
given ``input_shape``) conforms each value to the input it feeds, as Keras
does before running the graph:

* rank: a value of rank ``r - 1`` for an input of rank ``r`` whose last
  dimension is 1 gains that axis (a DataFrame column, ``(batch,)``, feeding
  ``Input(shape=(1,))``); one of rank ``r + 1`` ending in 1 loses it;
* dtype: numbers are cast to the input's numeric dtype; text feeds only
  ``string`` inputs, and a ``string`` input only takes text;
* shape: every known dimension must match (a single example, without the
  batch axis, is matched against the dimensions after it).

Each failure names the input, so a model with a dict of twenty columns says
which one is wrong (not an op deep in the graph, on a worker).
"""

from __future__ import annotations

from typing import Any

from psflow import errors
from psflow.framework.tensor import Tensor, convert_to_tensor, is_tensor


def conform(
    value: Any, shape: Any, dtype: str | None, name: str, model: str, check_shape: bool = True
) -> Tensor:
    """``value`` as the tensor input ``name`` of ``model`` takes (shape ``shape``, batch first).

    ``dtype`` None leaves the value's dtype as it is; ``check_shape`` False leaves
    the dimensions to the layer the value feeds (it only adjusts the rank).

    Example:
        >>> import numpy as np
        >>> conform(np.array([1.0, 2.0]), (None, 1), "float32", "age", "m").shape
        TensorShape([2, 1])

    Raises:
        TypeError: text for a numeric input, numbers for a ``string`` input, or data
            that is neither, naming the input.
        InvalidArgumentError: a rank or a dimension that does not match, naming the
            input and both shapes.
    """
    want = tuple(shape)
    if type(value) is Tensor and dtype is not None:
        # a step's batch as the input takes it already (each fit step): returned as it is,
        # without the shape and dtype objects of the general path
        a = value._array()
        if (
            a.ndim == len(want)
            and a.dtype.name == dtype
            and all(w is None or w == g for w, g in zip(want, a.shape))
        ):
            return value
    from psflow.ops import array_ops, math_ops

    try:
        t = value if is_tensor(value) else convert_to_tensor(value)
    except TypeError as e:
        raise TypeError(f"{model}: input {name!r} cannot take {_brief(value)}: {e}") from None
    got = tuple(t.shape)
    if len(got) == len(want) - 1 and want and want[-1] == 1:
        t = array_ops.expand_dims(t, -1)
    elif len(got) == len(want) + 1 and got and got[-1] == 1:
        t = array_ops.squeeze(t, -1)
    text = t.dtype.name == "string"
    if dtype is not None:
        want_text = dtype == "string"
        if text and not want_text:
            raise TypeError(
                f"{model}: input {name!r} is {dtype} but got text (e.g. {_first(t)!r}); declare "
                f"it keras.Input(..., dtype='string') and map the text to numbers in the model "
                f"(StringLookup, Hashing), or give numbers"
            )
        if want_text and not text:
            raise TypeError(
                f"{model}: input {name!r} is a string input but got {t.dtype.name} values; give "
                "text (str or bytes)"
            )
        if not text and t.dtype.name != dtype:
            t = math_ops.cast(t, dtype)
    got = tuple(t.shape)
    if check_shape and not _compatible(got, want):
        raise errors.InvalidArgumentError(
            f"{model}: input {name!r} expects shape {_shown(want)} (None: any size), got "
            f"{list(tuple(value.shape) if hasattr(value, 'shape') else got)}"
        )
    return t


def _compatible(got: tuple, want: tuple) -> bool:
    """Every known dimension matches; one example without its batch axis (a model called
    in ``Dataset.map`` before ``batch``, as TensorFlow's tutorials do) is matched against
    the dimensions after the batch one, as Keras 2 lets it through."""
    if len(got) == len(want) - 1:
        want = want[1:]
    if len(got) != len(want):
        return False
    return all(w is None or g is None or w == g for w, g in zip(want, got))


def _shown(shape: tuple) -> str:
    return (
        "("
        + ", ".join("None" if d is None else str(d) for d in shape)
        + ("," if len(shape) == 1 else "")
        + ")"
    )


def _first(t: Tensor) -> Any:
    flat = t.numpy().reshape(-1) if t.shape.rank else [t.numpy()]
    return flat[0] if len(flat) else None


def _brief(value: Any) -> str:
    kind = type(value).__name__
    dtype = getattr(value, "dtype", None)
    return f"a {kind}" + (f" of {dtype}" if dtype is not None else "")

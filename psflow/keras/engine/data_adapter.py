"""Turns what ``fit`` is given (arrays, tensors, datasets) into per-epoch batch streams.

Arrays are sliced into batches directly (no per-example pipeline), reshuffled
each epoch from ``psflow.random`` so a seeded run is reproducible. Datasets are
iterated as they are. Dataset functions (a ``DatasetCreator``, a callable
``dataset_fn(input_context)``, or what ``distribute_datasets_from_function``
returns under ParameterServerStrategy) become :class:`FunctionBatches`: each
input pipeline builds its own dataset; they need the step count, as in TensorFlow.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from psflow import backend, errors
from psflow import random as random_lib
from psflow.distribute import distribute_lib, input_lib
from psflow.framework.tensor import Tensor, convert_to_tensor, is_tensor
from psflow.util import nest


def unpack_x_y_sample_weight(data: Any) -> tuple[Any, Any, Any]:
    """Splits a batch into ``(x, y, sample_weight)`` (Keras's rule for tuples)."""
    if isinstance(data, list):
        data = tuple(data)
    if not isinstance(data, tuple):
        return data, None, None
    if len(data) == 1:
        return data[0], None, None
    if len(data) == 2:
        return data[0], data[1], None
    if len(data) == 3:
        return data
    raise errors.InvalidArgumentError(
        f"Data is expected to be (x,), (x, y) or (x, y, sample_weight), got a tuple of {len(data)}"
    )


def _is_dataset(x: Any) -> bool:
    import sys

    data = sys.modules.get("psflow.data")  # no dataset exists unless psflow.data was imported
    return data is not None and isinstance(x, data.Dataset)


def is_distributed(x: Any) -> bool:
    """Whether ``x`` came from ``strategy.experimental_distribute_dataset`` or the like."""
    return isinstance(x, (input_lib.DistributedDataset, input_lib.DistributedDatasetsFromFunction))


def _to_numpy(value: Any, what: str) -> Any:
    if value is None:
        return None
    if isinstance(value, dict):
        return {k: _to_numpy(v, f"{what}[{k!r}]") for k, v in value.items()}
    if (
        isinstance(value, (list, tuple))
        and value
        and (is_tensor(value[0]) or isinstance(value[0], np.ndarray))
    ):
        return type(value)(_to_numpy(v, f"{what}[{i}]") for i, v in enumerate(value))
    try:
        arr = backend.to_numpy(value._array()) if is_tensor(value) else np.asarray(value)
    except (TypeError, ValueError) as e:
        raise errors.InvalidArgumentError(
            f"{what} could not be converted to an array: {e}"
        ) from None
    if arr.dtype.kind == "O" and not any(isinstance(e, (str, bytes)) for e in arr.flat):
        arr = _numbers(arr)  # an object column of Python numbers (pandas gives some)
    if arr.dtype.kind in "USO":
        # text (NumPy str arrays, or object arrays of str as pandas gives) feeds string
        # inputs (StringLookup, Hashing), as Keras takes it
        return _text_array(arr, what)
    if arr.dtype.kind not in "fiub":
        raise TypeError(_unusable(what, arr))
    if arr.dtype == np.float64:  # Keras casts float inputs to floatx (float32)
        arr = arr.astype(np.float32)
    return arr


_WHAT_WORKS = (
    "arrays of numbers (int, float, bool) or of text (str or bytes, for string inputs "
    "such as keras.Input(dtype='string') feeding a StringLookup)"
)


def _unusable(what: str, arr: np.ndarray) -> str:
    first = arr.ravel()[:1].tolist()
    sample = f" (e.g. {first[0]!r})" if first else ""
    return f"{what} holds elements of type {arr.dtype}{sample}: fit, evaluate and predict take {_WHAT_WORKS}"


def _numbers(arr: np.ndarray) -> np.ndarray:
    """An object array of numbers as a numeric array; unchanged when it holds anything else."""
    if arr.size == 0 or not all(isinstance(e, (int, float, np.number, np.bool_)) for e in arr.flat):
        return arr
    return np.array(arr.tolist())


def _text_array(arr: np.ndarray, what: str) -> np.ndarray:
    """A string tensor's array (object array of ``str``) for text ``arr``.

    Raises:
        TypeError: an element that is neither ``str`` nor ``bytes`` (a ``None``, a
            ``float`` NaN from a pandas column with gaps...), naming ``what``.
    """
    from psflow.framework.tensor import string_array

    try:
        return string_array(arr, arr)
    except TypeError:
        flat = arr.reshape(-1).tolist()
        others = [e for e in flat if not isinstance(e, (str, bytes))]
        if others:
            kind = "not text" if len(others) < len(flat) else "neither a number nor text"
            detail = f"{others[0]!r} (a {type(others[0]).__name__}) is {kind}"
        else:  # bytes that are not UTF-8
            bad = next(e for e in flat if isinstance(e, bytes) and not _utf8(e))
            detail = f"{bad!r} is not UTF-8"
        raise TypeError(
            f"{what} holds elements of type {arr.dtype}: {detail}; fit, evaluate and predict "
            f"take {_WHAT_WORKS}"
        ) from None


def _utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _num_examples(arrays: Any, names: list[str]) -> int:
    lengths = {}
    for name, structure in zip(names, arrays):
        for leaf in nest.flatten(structure):
            if leaf is None:
                continue
            if np.ndim(leaf) == 0:
                raise errors.InvalidArgumentError(
                    f"{name} must have a batch dimension, got a scalar"
                )
            lengths.setdefault(name, set()).add(len(leaf))
    sizes = {n for s in lengths.values() for n in s}
    if len(sizes) > 1:
        detail = ", ".join(f"{k}: {sorted(v)}" for k, v in lengths.items())
        raise errors.InvalidArgumentError(
            f"Data cardinality is ambiguous: make sure all arrays contain the same number of samples ({detail})"
        )
    return sizes.pop() if sizes else 0


def _take(structure: Any, idx: Any) -> Any:
    if type(structure) is np.ndarray:  # one array (the common x and y): no structure to map
        # a shuffled batch's rows by ``take``: the same C-ordered copy as ``structure[idx]``
        # (of a C-ordered array), quicker
        shuffled = type(idx) is np.ndarray and structure.flags.c_contiguous
        rows = structure.take(idx, axis=0) if shuffled else structure[idx]
        return Tensor._wrap(rows)
    return nest.map_structure(lambda a: None if a is None else Tensor._wrap(a[idx]), structure)


class ArrayBatches:
    """Batches of in-memory arrays, reshuffled each epoch when ``shuffle``.

    Example:
        >>> import numpy as np
        >>> src = ArrayBatches(np.arange(5.0), np.arange(5.0), None, batch_size=2, shuffle=False)
        >>> [len(x) for x, y in src]
        [2, 2, 1]
    """

    def __init__(
        self, x: Any, y: Any, sample_weight: Any, batch_size: int | None, shuffle: bool = False
    ) -> None:
        self.x, self.y, self.sample_weight = x, y, sample_weight
        self.num_examples = _num_examples([x, y, sample_weight], ["x", "y", "sample_weight"])
        batch_size = 32 if batch_size is None else batch_size
        if int(batch_size) <= 0:
            raise errors.InvalidArgumentError(
                f"batch_size must be a positive integer, got {batch_size!r}"
            )
        self.batch_size = int(batch_size)
        self.shuffle = shuffle

    @property
    def steps(self) -> int:
        """Batches per epoch."""
        return math.ceil(self.num_examples / self.batch_size)

    def _pack(self, idx: Any) -> tuple[Any, ...]:
        parts = [_take(self.x, idx)]
        if self.y is not None:
            parts.append(_take(self.y, idx))
        if self.sample_weight is not None:
            parts.append(_take(self.sample_weight, idx))
        return tuple(parts) if len(parts) > 1 else (parts[0],)

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        n, bs = self.num_examples, self.batch_size
        order = random_lib.new_generator().permutation(n) if self.shuffle else None
        for start in range(0, n, bs):
            stop = min(start + bs, n)
            idx = order[start:stop] if order is not None else slice(start, stop)
            yield self._pack(idx)

    def peek(self) -> tuple[Any, ...]:
        """The first batch, without disturbing iteration."""
        return self._pack(slice(0, min(self.batch_size, self.num_examples)))

    def split(self, fraction: float) -> tuple[ArrayBatches, ArrayBatches]:
        """Keras's ``validation_split``: the last ``fraction`` of examples, before shuffling."""
        if not 0 < fraction < 1:
            raise errors.InvalidArgumentError(
                f"validation_split must be in (0, 1), got {fraction!r}"
            )
        cut = int(self.num_examples * (1 - fraction))
        if cut == 0 or cut == self.num_examples:
            raise errors.InvalidArgumentError(
                f"validation_split={fraction} leaves no examples for training or validation "
                f"({self.num_examples} examples)"
            )

        def part(s: slice) -> Any:
            return lambda st: nest.map_structure(lambda a: None if a is None else a[s], st)

        head, tail = part(slice(0, cut)), part(slice(cut, None))
        train = ArrayBatches(
            head(self.x), head(self.y), head(self.sample_weight), self.batch_size, self.shuffle
        )
        val = ArrayBatches(
            tail(self.x), tail(self.y), tail(self.sample_weight), self.batch_size, False
        )
        return train, val


class DatasetBatches:
    """A dataset's elements as batches; a new pass each epoch unless ``steps`` is given."""

    def __init__(self, dataset: Any, steps: int | None = None) -> None:
        self.dataset = dataset
        self._steps = steps
        self._persistent: Iterator | None = None

    @property
    def steps(self) -> int | None:
        """Batches per epoch, when known."""
        if self._steps is not None:
            return self._steps
        card = getattr(self.dataset, "cardinality", None)
        if card is None:
            return None
        n = int(card())
        return n if n >= 0 else None

    def __iter__(self) -> Iterator[Any]:
        if self._steps is None:
            return iter(self.dataset)
        if self._persistent is None:
            self._persistent = iter(self.dataset)
        return self._persistent

    def with_dataset(self, dataset: Any) -> DatasetBatches:
        """The same batches of another dataset (a worker's shard of this one)."""
        return DatasetBatches(dataset, self._steps)

    def peek(self) -> Any:
        """The first element of a fresh pass."""
        if isinstance(self.dataset, _Reiterable):
            return self.dataset.peek()
        for element in self.dataset:
            return element
        raise errors.InvalidArgumentError("The dataset is empty")


# the argument that bounds each input kind's steps, named in the error when it is missing
_STEPS_ARGUMENT = {"fit": "steps_per_epoch", "validation_data": "validation_steps"}


def _is_dataset_function(x: Any) -> bool:
    """A ``DatasetCreator`` (or the like), or a bare ``dataset_fn(input_context)``."""
    if isinstance(x, input_lib.DatasetFunction):
        return True
    return (
        callable(x)
        and not _is_dataset(x)
        and not is_distributed(x)
        and not is_tensor(x)
        and not hasattr(x, "__next__")
    )


class FunctionBatches(DatasetBatches):
    """Batches from a dataset function: each input pipeline calls it for its own dataset.

    Under ParameterServerStrategy the runner sends :attr:`dataset_fn` to the
    workers, each building the pipeline of its worker index (see
    :class:`psflow.keras.engine.ps_batches.FunctionReader`). Elsewhere one
    pipeline (``InputContext(1, 0, 1)``) runs here and yields global batches,
    split across replicas as any dataset's are. The step count is required
    (the dataset may repeat forever); one iterator runs on across epochs, as
    TensorFlow's does when ``steps_per_epoch`` is given.
    """

    def __init__(self, dataset_fn: input_lib.DatasetFunction, steps: int) -> None:
        self.dataset_fn = dataset_fn
        self._built: Any = None
        super().__init__(None, steps)

    @property  # type: ignore[override]
    def dataset(self) -> Any:
        """The single pipeline's dataset (built on first use, on this process)."""
        if self._built is None:
            self._built = self.dataset_fn(distribute_lib.InputContext(1, 0, 1))
        return self._built

    @dataset.setter
    def dataset(self, value: Any) -> None:
        self._built = value


def _function_batches(x: Any, batch_size: Any, steps: int | None, what: str) -> FunctionBatches:
    kind = type(x).__name__
    if steps is None:
        argument = _STEPS_ARGUMENT.get(what, "steps")
        raise errors.InvalidArgumentError(
            f"{what}: when x is a dataset function ({kind}), `{argument}` must be given "
            "(the dataset it builds may be infinite)"
        )
    if batch_size is not None and what != "validation_data":
        raise errors.InvalidArgumentError(
            f"{what}: batch_size must not be given with a dataset function ({kind}); "
            f"batch in the dataset_fn, got batch_size={batch_size!r}"
        )
    fn = x if isinstance(x, input_lib.DatasetFunction) else input_lib.DatasetFunction(x)
    return FunctionBatches(fn, int(steps))


def make_batches(
    x: Any,
    y: Any = None,
    sample_weight: Any = None,
    batch_size: int | None = None,
    shuffle: bool = False,
    steps: int | None = None,
    what: str = "fit",
) -> Any:
    """The batch source for ``x`` (and ``y``, ``sample_weight``).

    Raises:
        InvalidArgumentError: ``y`` given with a dataset or generator, missing ``x``,
            arrays of different lengths, or a dataset function without the step count
            (names ``steps_per_epoch``, ``validation_steps`` or ``steps``).
        TypeError: data that is neither numbers nor text, naming the input.
    """
    if x is None:
        raise errors.InvalidArgumentError(f"{what}: x is required")
    if _is_dataset(x) or is_distributed(x):
        if y is not None:
            raise errors.InvalidArgumentError(
                f"{what}: y must not be given when x is a dataset (it yields (x, y))"
            )
        if batch_size is not None and _is_dataset(x):
            raise errors.InvalidArgumentError(
                f"{what}: batch_size must not be given when x is a dataset (batch it)"
            )
        return DatasetBatches(x, steps)
    if _is_dataset_function(x):
        if y is not None or sample_weight is not None:
            raise errors.InvalidArgumentError(
                f"{what}: y and sample_weight must not be given when x is a dataset function "
                "(its dataset yields (x, y) or (x, y, sample_weight))"
            )
        return _function_batches(x, batch_size, steps, what)
    if hasattr(x, "__next__"):
        if y is not None or sample_weight is not None:
            raise errors.InvalidArgumentError(
                f"{what}: y and sample_weight must not be given when x is a generator "
                "(it yields (x, y) or (x, y, sample_weight))"
            )
        return DatasetBatches(_Reiterable(x), steps)
    xs = _to_numpy(x, "x")
    ys = _to_numpy(y, "y")
    sw = _to_numpy(sample_weight, "sample_weight")
    return ArrayBatches(xs, ys, sw, batch_size, shuffle)


class _Reiterable:
    """A Python iterator/generator used as a (single-pass) dataset.

    ``peek`` keeps the element it reads, so building the model from the first
    batch does not take that batch away from training.
    """

    def __init__(self, it: Iterator) -> None:
        self._it = it
        self._peeked: list[Any] = []

    def peek(self) -> Any:
        """The next element, left in place for iteration."""
        if not self._peeked:
            for element in self._it:
                self._peeked.append(element)
                break
            else:
                raise errors.InvalidArgumentError("The input generator yielded no batches")
        return self._peeked[0]

    def __iter__(self) -> Iterator:
        # Steps see tensors, whatever the generator yields (as from arrays or datasets).
        while self._peeked:
            yield as_tensors(self._peeked.pop(0))
        for element in self._it:
            yield as_tensors(element)


def batch_size_of(x: Any) -> int:
    """Examples in a batch: the first dimension of its first array."""
    if type(x) is Tensor:  # a step's single input (every fit step asks): no flattening
        shape = x._value.shape
        return int(shape[0]) if shape else 1
    leaf = nest.flatten(x)[0]
    return int(leaf.shape[0]) if len(leaf.shape) else 1


def on_device(batch: Any) -> Any:
    """The batch with every host array placed on the current device.

    Data pipelines produce host (NumPy) arrays; a step on a GPU computes on
    CuPy arrays, which never mix with host ones implicitly. Tensors already on
    the device, and every batch on a CPU device, come back unchanged.
    """
    dev = backend.current_device()
    if not dev.is_gpu:
        return batch
    return nest.map_structure(lambda v: _placed(v, dev), batch)


def _placed(value: Any, dev: backend.Device) -> Any:
    if isinstance(value, Tensor):  # variables stay where they live
        arr = value._array()
        if isinstance(arr, np.ndarray) and arr.dtype.kind == "O":  # text stays on the host
            return value
        placed = backend.place(arr, dev)
        return value if placed is arr else Tensor._wrap(placed)
    if isinstance(value, np.ndarray) and value.dtype.kind != "O":  # text stays on the host
        return Tensor._wrap(backend.place(value, dev))
    if isinstance(value, np.ndarray):
        return Tensor._wrap(value)
    return value


def as_tensors(batch: Any) -> Any:
    """Converts every leaf of a batch into a tensor."""
    return nest.map_structure(
        lambda v: v if v is None or is_tensor(v) else convert_to_tensor(v), batch
    )

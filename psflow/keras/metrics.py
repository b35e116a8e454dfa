"""Metrics (Keras's ``keras.metrics``): stateful, mergeable accumulators.

A metric's state is a few host-side NumPy numbers (totals and counts, or
confusion counts). Replicas of a MirroredStrategy update one metric under its
lock; parameter-server workers send their state back and the chief merges it
with ``merge_state`` — so a reported value covers every replica's batches.

Example:
    >>> import psflow as pf
    >>> m = pf.keras.metrics.SparseCategoricalAccuracy()
    >>> m.update_state([1, 0], [[0.1, 0.9], [0.2, 0.8]])
    >>> float(m.result())
    0.5
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from psflow import backend, errors
from psflow.framework.tensor import Tensor, to_array
from psflow.keras import losses as losses_lib


def _host(x: Any) -> np.ndarray:
    if x is None:
        return None  # type: ignore[return-value]
    return backend.to_numpy(to_array(x))


def on_host(structure: Any) -> Any:
    """Every tensor or array of ``structure`` as a tensor on the host (``None`` stays).

    Metrics compute on the host; copying a step's labels and predictions once,
    before every metric reads them, keeps a GPU step to one device sync per
    array instead of one per metric.
    """
    if type(structure) is tuple and all(
        v is None or (type(v) is Tensor and type(v._array()) is np.ndarray) for v in structure
    ):
        return structure  # a step's outputs on the host already (a CPU step): nothing to copy
    from psflow.util import nest

    return nest.map_structure(lambda v: None if v is None else Tensor._wrap(_host(v)), structure)


_local = threading.local()


@contextlib.contextmanager
def local_metrics() -> Iterator[None]:
    """Metrics created inside stay in this process even under a ParameterServerStrategy."""
    prev = getattr(_local, "force_local", False)
    _local.force_local = True
    try:
        yield
    finally:
        _local.force_local = prev


class Metric:
    """Base class: ``update_state``, ``result``, ``reset_state``, ``merge_state``.

    The built-in metrics keep their state as a few float64 arrays. Created in a
    ParameterServerStrategy's scope, that state lives on the parameter servers:
    workers add their updates to it when a closure ends, and ``result()`` on
    the chief reads the sum of every worker's contributions (TensorFlow's
    behaviour for metrics created in scope).
    """

    def __init__(self, name: str | None = None, dtype: Any = None) -> None:
        self.name = name or losses_lib._snake(type(self).__name__)
        self._lock = threading.Lock()
        self._ps: Any = None
        self.reset_state()
        if self._initial_state() is not None and not getattr(_local, "force_local", False):
            from psflow.distribute import distribute_lib

            self._ps = distribute_lib.get_strategy().extended.metric_backing(self)

    @property
    def ps_backing(self) -> Any:
        """The parameter-server state of a metric created in such a scope, else None."""
        return self._ps

    # -- state ---------------------------------------------------------------------------
    def _initial_state(self) -> list[np.ndarray] | None:
        """Fresh state arrays (float64), or None for a metric that manages its own state."""
        return None

    def _result_from(self, state: tuple[np.ndarray, ...]) -> Tensor:
        """The metric's value for a state."""
        raise NotImplementedError

    def _accumulate(self, deltas: Sequence[Any]) -> None:
        with self._lock:
            for arr, d in zip(self._state, deltas):
                arr += d
        if self._ps is not None:
            self._ps.after_update(self)

    def _local_state(self) -> tuple[np.ndarray, ...]:
        with self._lock:
            return tuple(a.copy() for a in self._state)

    def _clear_local(self) -> None:
        with self._lock:
            self._state = self._initial_state()

    def update_state(self, *args: Any, **kwargs: Any) -> None:
        """Accumulates a batch."""
        raise NotImplementedError

    def result(self) -> Tensor:
        """The current value, a float32 scalar tensor."""
        return self._result_from(self.get_state())

    def result_of_state(self, state: Any) -> Tensor:
        """The value this metric has with ``state`` (e.g. several processes' states summed)."""
        return self._result_from(tuple(np.asarray(x, dtype=np.float64) for x in state))

    def reset_state(self) -> None:
        """Clears the accumulated state (on the parameter servers too, when it lives there)."""
        initial = self._initial_state()
        if initial is None:
            raise NotImplementedError
        with self._lock:
            self._state = initial
        if self._ps is not None:
            self._ps.reset(self)

    def reset_states(self) -> None:
        """Clears the accumulated state (Keras 2's name)."""
        self.reset_state()

    def get_state(self) -> tuple[np.ndarray, ...]:
        """A copy of the state (host arrays), for merging elsewhere."""
        if self._ps is not None:
            return self._ps.state(self)
        return self._local_state()

    def merge_state(self, states: Any) -> None:
        """Adds states (from :meth:`get_state` of same-kind metrics) into this one."""
        for state in states if isinstance(states, list) else [states]:
            deltas = [np.asarray(x, dtype=np.float64) for x in state]
            if self._ps is not None:
                self._ps.add(self, deltas)
            else:
                with self._lock:
                    for arr, d in zip(self._state, deltas):
                        arr += d

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        self.update_state(*args, **kwargs)
        return self.result()

    def get_config(self) -> dict[str, Any]:
        """Constructor arguments."""
        return {"name": self.name}

    def __getstate__(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d.pop("_lock", None)
        return d

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__dict__.update(d)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} name={self.name}>"


class _TotalCount(Metric):
    """A weighted mean: total of values and total of weights."""

    def _initial_state(self) -> list[np.ndarray]:
        return [np.zeros((), np.float64), np.zeros((), np.float64)]

    def _add(self, values: np.ndarray, weights: np.ndarray | None) -> None:
        values = np.asarray(values, dtype=np.float64)
        if weights is None:
            total, count = float(values.sum()), float(values.size)
        else:
            w = np.asarray(weights, dtype=np.float64)
            if values.ndim == 0 and w.ndim == 0:  # a step's mean loss and its batch size
                self._accumulate([np.float64(float(values * w)), np.float64(float(w))])
                return
            while w.ndim > values.ndim and w.shape[-1] == 1:
                w = w[..., 0]
            w = np.broadcast_to(w, values.shape)
            total, count = float((values * w).sum()), float(w.sum())
        self._accumulate([np.float64(total), np.float64(count)])


class Mean(_TotalCount):
    """The (weighted) mean of the values given."""

    def update_state(self, values: Any, sample_weight: Any = None) -> None:
        """Adds values (with optional weights)."""
        if type(values) is Tensor and type(sample_weight) is np.float64:
            v = values._value
            if type(v) is np.ndarray and v.ndim == 0 and v.dtype.kind == "f":
                # a step's mean loss weighted by its batch size (every fit step): the sums
                # _add makes, in Python floats (the same float64 roundings) without its arrays
                w = float(sample_weight)
                self._accumulate((float(v) * w, w))
                return
        self._add(_host(values), _host(sample_weight))

    def _result_from(self, state: tuple[np.ndarray, ...]) -> Tensor:
        total, count = float(state[0]), float(state[1])
        return Tensor._wrap(np.asarray(total / count if count else 0.0, dtype=np.float32))


class Sum(_TotalCount):
    """The (weighted) sum of the values given."""

    def update_state(self, values: Any, sample_weight: Any = None) -> None:
        """Adds values (with optional weights)."""
        self._add(_host(values), _host(sample_weight))

    def _result_from(self, state: tuple[np.ndarray, ...]) -> Tensor:
        return Tensor._wrap(np.asarray(float(state[0]), dtype=np.float32))


def _squeeze_like(y_true: np.ndarray, y_pred: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if y_true.ndim == y_pred.ndim + 1 and y_true.shape[-1] == 1:
        y_true = y_true[..., 0]
    elif y_pred.ndim == y_true.ndim + 1 and y_pred.shape[-1] == 1:
        y_pred = y_pred[..., 0]
    return y_true, y_pred


def accuracy(y_true: np.ndarray, y_pred: np.ndarray) -> np.ndarray:
    """1 where ``y_true == y_pred`` exactly."""
    y_true, y_pred = _squeeze_like(y_true, y_pred)
    return (y_true == y_pred).astype(np.float32)


def binary_accuracy(y_true: np.ndarray, y_pred: np.ndarray, threshold: float = 0.5) -> np.ndarray:
    """Mean over the last axis of ``(y_pred > threshold) == y_true``."""
    y_true, y_pred = _squeeze_like(y_true, y_pred)
    hit = (y_pred > threshold).astype(np.float32) == y_true.astype(np.float32)
    return hit.astype(np.float32).mean(axis=-1) if hit.ndim > 1 else hit.astype(np.float32)


def categorical_accuracy(y_true: np.ndarray, y_pred: np.ndarray) -> np.ndarray:
    """1 where the argmax of the one-hot label equals the argmax of the prediction."""
    return (np.argmax(y_true, axis=-1) == np.argmax(y_pred, axis=-1)).astype(np.float32)


def sparse_categorical_accuracy(y_true: np.ndarray, y_pred: np.ndarray) -> np.ndarray:
    """1 where the integer label equals the argmax of the prediction."""
    if y_true.ndim == y_pred.ndim and y_true.shape[-1] == 1:
        y_true = y_true[..., 0]
    return (y_true.astype(np.int64) == np.argmax(y_pred, axis=-1)).astype(np.float32)


def top_k_categorical_accuracy(y_true: np.ndarray, y_pred: np.ndarray, k: int = 5) -> np.ndarray:
    """1 where the true class is among the top ``k`` predictions (one-hot labels)."""
    top = np.argsort(-y_pred, axis=-1)[..., :k]
    return (top == np.argmax(y_true, axis=-1)[..., None]).any(axis=-1).astype(np.float32)


def sparse_top_k_categorical_accuracy(
    y_true: np.ndarray, y_pred: np.ndarray, k: int = 5
) -> np.ndarray:
    """1 where the integer label is among the top ``k`` predictions."""
    if y_true.ndim == y_pred.ndim:
        y_true = y_true[..., 0]
    top = np.argsort(-y_pred, axis=-1)[..., :k]
    return (top == y_true.astype(np.int64)[..., None]).any(axis=-1).astype(np.float32)


def _mse(y_true: np.ndarray, y_pred: np.ndarray) -> np.ndarray:
    y_true, y_pred = _squeeze_like(y_true, y_pred)
    d = y_pred.astype(np.float64) - y_true
    return (d * d).mean(axis=-1) if d.ndim > 1 else d * d


def _mae(y_true: np.ndarray, y_pred: np.ndarray) -> np.ndarray:
    y_true, y_pred = _squeeze_like(y_true, y_pred)
    d = np.abs(y_pred.astype(np.float64) - y_true)
    return d.mean(axis=-1) if d.ndim > 1 else d


class MeanMetricWrapper(Mean):
    """The mean of ``fn(y_true, y_pred)`` per example, over every batch seen."""

    def __init__(
        self, fn: Callable[..., Any], name: str | None = None, dtype: Any = None, **kwargs: Any
    ) -> None:
        self._fn = fn
        self._fn_kwargs = kwargs
        super().__init__(name=name or getattr(fn, "__name__", None), dtype=dtype)

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        """Adds one batch of labels and predictions."""
        yt, yp = _host(y_true), _host(y_pred)
        if yt.shape[:1] != yp.shape[:1]:
            raise errors.InvalidArgumentError(
                f"{self.name}: y_true has {yt.shape[:1]} examples but y_pred has {yp.shape[:1]}"
            )
        values = self._fn(yt, yp, **self._fn_kwargs)
        if not isinstance(values, np.ndarray):
            values = _host(values)
        self._add(values, _host(sample_weight))


class Accuracy(MeanMetricWrapper):
    """How often predictions equal labels exactly."""

    def __init__(self, name: str = "accuracy", dtype: Any = None) -> None:
        super().__init__(accuracy, name, dtype)


class BinaryAccuracy(MeanMetricWrapper):
    """How often ``y_pred > threshold`` matches binary labels."""

    def __init__(
        self, name: str = "binary_accuracy", dtype: Any = None, threshold: float = 0.5
    ) -> None:
        super().__init__(binary_accuracy, name, dtype, threshold=threshold)


class CategoricalAccuracy(MeanMetricWrapper):
    """How often the argmax matches one-hot labels."""

    def __init__(self, name: str = "categorical_accuracy", dtype: Any = None) -> None:
        super().__init__(categorical_accuracy, name, dtype)


class SparseCategoricalAccuracy(MeanMetricWrapper):
    """How often the argmax matches integer labels."""

    def __init__(self, name: str = "sparse_categorical_accuracy", dtype: Any = None) -> None:
        super().__init__(sparse_categorical_accuracy, name, dtype)


class TopKCategoricalAccuracy(MeanMetricWrapper):
    """How often the one-hot label is in the top ``k``."""

    def __init__(
        self, k: int = 5, name: str = "top_k_categorical_accuracy", dtype: Any = None
    ) -> None:
        super().__init__(top_k_categorical_accuracy, name, dtype, k=k)


class SparseTopKCategoricalAccuracy(MeanMetricWrapper):
    """How often the integer label is in the top ``k``."""

    def __init__(
        self, k: int = 5, name: str = "sparse_top_k_categorical_accuracy", dtype: Any = None
    ) -> None:
        super().__init__(sparse_top_k_categorical_accuracy, name, dtype, k=k)


class MeanSquaredError(MeanMetricWrapper):
    """Mean squared error over every example seen."""

    def __init__(self, name: str = "mean_squared_error", dtype: Any = None) -> None:
        super().__init__(_mse, name, dtype)


class MeanAbsoluteError(MeanMetricWrapper):
    """Mean absolute error over every example seen."""

    def __init__(self, name: str = "mean_absolute_error", dtype: Any = None) -> None:
        super().__init__(_mae, name, dtype)


class RootMeanSquaredError(MeanMetricWrapper):
    """Square root of the mean squared error over every example seen."""

    def __init__(self, name: str = "root_mean_squared_error", dtype: Any = None) -> None:
        super().__init__(_mse, name, dtype)

    def _result_from(self, state: tuple[np.ndarray, ...]) -> Tensor:
        return Tensor._wrap(np.sqrt(super()._result_from(state)._value))


class _Confusion(Metric):
    """True/false positive/negative counts at fixed thresholds."""

    def __init__(self, thresholds: Any, name: str | None, dtype: Any = None) -> None:
        self._thresholds = np.asarray(thresholds, dtype=np.float64)
        super().__init__(name=name, dtype=dtype)

    def _initial_state(self) -> list[np.ndarray]:
        return [np.zeros((4, len(self._thresholds)), dtype=np.float64)]  # tp, fp, tn, fn

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        """Adds one batch of binary labels and scores."""
        yt = _host(y_true).astype(np.float64).reshape(-1)
        yp = _host(y_pred).astype(np.float64).reshape(-1)
        if yt.shape != yp.shape:
            raise errors.InvalidArgumentError(
                f"{self.name}: y_true has {yt.size} values but y_pred has {yp.size}"
            )
        w = (
            np.ones_like(yt)
            if sample_weight is None
            else np.broadcast_to(_host(sample_weight).astype(np.float64).reshape(-1), yt.shape)
        )
        pos = yt > 0.5
        above = yp[None, :] > self._thresholds[:, None]
        counts = np.stack(
            [
                (above & pos) @ w,
                (above & ~pos) @ w,
                (~above & ~pos) @ w,
                (~above & pos) @ w,
            ]
        )
        self._accumulate([counts])


class Precision(_Confusion):
    """``tp / (tp + fp)`` at ``thresholds`` (0.5)."""

    def __init__(self, thresholds: float = 0.5, name: str = "precision", dtype: Any = None) -> None:
        super().__init__([thresholds], name, dtype)

    def _result_from(self, state: tuple[np.ndarray, ...]) -> Tensor:
        tp, fp = state[0][0, 0], state[0][1, 0]
        return Tensor._wrap(np.asarray(tp / (tp + fp) if tp + fp else 0.0, np.float32))


class Recall(_Confusion):
    """``tp / (tp + fn)`` at ``thresholds`` (0.5)."""

    def __init__(self, thresholds: float = 0.5, name: str = "recall", dtype: Any = None) -> None:
        super().__init__([thresholds], name, dtype)

    def _result_from(self, state: tuple[np.ndarray, ...]) -> Tensor:
        tp, fn = state[0][0, 0], state[0][3, 0]
        return Tensor._wrap(np.asarray(tp / (tp + fn) if tp + fn else 0.0, np.float32))


class AUC(_Confusion):
    """Area under the ROC curve, by the trapezoidal rule over ``num_thresholds`` (Keras's method)."""

    def __init__(
        self, num_thresholds: int = 200, curve: str = "ROC", name: str = "auc", dtype: Any = None
    ) -> None:
        if num_thresholds < 2:
            raise errors.InvalidArgumentError(
                f"AUC: num_thresholds must be > 1, got {num_thresholds}"
            )
        if str(curve).upper() != "ROC":
            raise errors.UnimplementedError(f"AUC curve {curve!r} is not supported (only ROC)")
        eps = 1e-7
        inner = [(i + 1) / (num_thresholds - 1) for i in range(num_thresholds - 2)]
        super().__init__([0.0 - eps, *inner, 1.0 + eps], name, dtype)

    def _result_from(self, state: tuple[np.ndarray, ...]) -> Tensor:
        tp, fp, tn, fn = state[0]
        tpr = np.divide(tp, tp + fn, out=np.zeros_like(tp), where=(tp + fn) > 0)
        fpr = np.divide(fp, fp + tn, out=np.zeros_like(fp), where=(fp + tn) > 0)
        area = np.sum((fpr[:-1] - fpr[1:]) * (tpr[:-1] + tpr[1:]) / 2)
        return Tensor._wrap(np.asarray(area, np.float32))


_BY_NAME: dict[str, Callable[[], Metric]] = {
    "accuracy": Accuracy,
    "binary_accuracy": BinaryAccuracy,
    "categorical_accuracy": CategoricalAccuracy,
    "sparse_categorical_accuracy": SparseCategoricalAccuracy,
    "top_k_categorical_accuracy": TopKCategoricalAccuracy,
    "sparse_top_k_categorical_accuracy": SparseTopKCategoricalAccuracy,
    "mse": lambda: MeanSquaredError(name="mse"),
    "mean_squared_error": MeanSquaredError,
    "mae": lambda: MeanAbsoluteError(name="mae"),
    "mean_absolute_error": MeanAbsoluteError,
    "rmse": lambda: RootMeanSquaredError(name="rmse"),
    "root_mean_squared_error": RootMeanSquaredError,
    "auc": AUC,
    "precision": Precision,
    "recall": Recall,
}


def get(identifier: Any) -> Metric:
    """A metric from a name, a class, an instance or a function ``fn(y_true, y_pred)``.

    ``"accuracy"``/``"acc"`` resolve at their first batch to the binary,
    categorical or sparse variant by the shapes of labels and predictions,
    as Keras does (see :class:`_AutoAccuracy`).

    Raises:
        ValueError: an unknown name, quoted with the known ones.
    """
    if isinstance(identifier, Metric):
        return identifier
    if isinstance(identifier, type) and issubclass(identifier, Metric):
        return identifier()
    if isinstance(identifier, str):
        if identifier in ("accuracy", "acc"):
            return _AutoAccuracy(name=identifier)
        make = _BY_NAME.get(identifier)
        if make is None:
            raise errors.InvalidArgumentError(
                f"Unknown metric {identifier!r}; known: {sorted(_BY_NAME)}"
            )
        return make()
    if callable(identifier):
        return MeanMetricWrapper(
            lambda yt, yp, _f=identifier: _host(_f(Tensor._wrap(yt), Tensor._wrap(yp))),
            name=getattr(identifier, "__name__", None),
        )
    raise TypeError(f"Could not interpret metric {identifier!r}")


class _AutoAccuracy(MeanMetricWrapper):
    """``"accuracy"``: binary when predictions have one column, sparse when labels are class ids."""

    def __init__(self, name: str = "accuracy") -> None:
        super().__init__(self._pick, name)

    @staticmethod
    def _pick(y_true: np.ndarray, y_pred: np.ndarray) -> np.ndarray:
        if (y_pred.ndim >= 1 and y_pred.shape[-1] == 1) or y_pred.ndim == y_true.ndim == 1:
            return binary_accuracy(y_true, y_pred)
        if y_true.ndim < y_pred.ndim or (y_true.ndim == y_pred.ndim and y_true.shape[-1] == 1):
            return sparse_categorical_accuracy(y_true, y_pred)
        return categorical_accuracy(y_true, y_pred)

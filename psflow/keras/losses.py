"""Losses (Keras's ``keras.losses``): classes, functions, and lookup by name.

Per-example values are reduced over the last axis; a ``Loss`` object then
reduces over the batch (``"sum_over_batch_size"`` by default, Keras's rule).

Example:
    >>> import psflow as pf
    >>> mse = pf.keras.losses.MeanSquaredError()
    >>> float(mse(pf.constant([[1.0], [2.0]]), pf.constant([[1.0], [4.0]])))
    2.0
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from psflow import errors
from psflow.framework.tensor import Tensor
from psflow.keras import activations
from psflow.ops import array_ops, math_ops, nn_ops
from psflow.ops._core import node

EPSILON = 1e-7


class Reduction:
    """How a loss reduces per-example values (Keras's names)."""

    AUTO = "auto"
    NONE = "none"
    SUM = "sum"
    SUM_OVER_BATCH_SIZE = "sum_over_batch_size"

    @classmethod
    def all(cls) -> tuple[str, ...]:
        """Every valid reduction name."""
        return (cls.AUTO, cls.NONE, cls.SUM, cls.SUM_OVER_BATCH_SIZE)

    @classmethod
    def validate(cls, key: Any) -> str:
        """Returns ``key`` if valid.

        Raises:
            InvalidArgumentError: an unknown reduction, quoted.
        """
        if key is None:
            return cls.NONE
        if key not in cls.all():
            raise errors.InvalidArgumentError(
                f"Invalid reduction {key!r}; expected one of {cls.all()}"
            )
        return key


def _same_rank(y_true: Any, y_pred: Any) -> tuple[Any, Any]:
    """Squeezes or expands ``y_true``'s last axis so both ranks match (Keras's rule)."""
    yt, yp = node(y_true), node(y_pred)
    rt, rp = yt._array().ndim, yp._array().ndim
    if rt == rp + 1 and yt._array().shape[-1] == 1:
        yt = array_ops.squeeze(yt, axis=-1)
    elif rp == rt + 1 and yp._array().shape[-1] == 1:
        yt = array_ops.expand_dims(yt, -1)
    return yt, yp


def _cast_like(y_true: Any, y_pred: Any) -> Any:
    if y_true._array().dtype != y_pred._array().dtype:
        return math_ops.cast(y_true, y_pred.dtype)
    return y_true


def _check_shapes(y_true: Any, y_pred: Any, name: str) -> None:
    a, b = y_true._array().shape, y_pred._array().shape
    if a != b:
        try:
            from psflow.ops._core import check_broadcast

            check_broadcast(y_true._array(), y_pred._array(), name)
        except errors.InvalidArgumentError:
            raise errors.InvalidArgumentError(
                f"{name}: y_true shape {list(a)} and y_pred shape {list(b)} are incompatible"
            ) from None


def mean_squared_error(y_true: Any, y_pred: Any) -> Tensor:
    """Per-example mean of squared errors over the last axis."""
    yt, yp = _same_rank(y_true, y_pred)
    yt = _cast_like(yt, yp)
    _check_shapes(yt, yp, "mean_squared_error")
    return math_ops.reduce_mean(math_ops.squared_difference(yp, yt), axis=-1)


def mean_absolute_error(y_true: Any, y_pred: Any) -> Tensor:
    """Per-example mean of absolute errors over the last axis."""
    yt, yp = _same_rank(y_true, y_pred)
    yt = _cast_like(yt, yp)
    _check_shapes(yt, yp, "mean_absolute_error")
    return math_ops.reduce_mean(math_ops.abs(math_ops.subtract(yp, yt)), axis=-1)


def mean_absolute_percentage_error(y_true: Any, y_pred: Any) -> Tensor:
    """``100 * mean(|y_true - y_pred| / |y_true|)`` per example."""
    yt, yp = _same_rank(y_true, y_pred)
    yt = _cast_like(yt, yp)
    diff = math_ops.abs(
        math_ops.divide(math_ops.subtract(yt, yp), math_ops.maximum(math_ops.abs(yt), EPSILON))
    )
    return math_ops.multiply(100.0, math_ops.reduce_mean(diff, axis=-1))


def huber(y_true: Any, y_pred: Any, delta: float = 1.0) -> Tensor:
    """Quadratic for small errors, linear beyond ``delta``."""
    yt, yp = _same_rank(y_true, y_pred)
    yt = _cast_like(yt, yp)
    err = math_ops.abs(math_ops.subtract(yp, yt))
    quad = math_ops.minimum(err, delta)
    lin = math_ops.subtract(err, quad)
    return math_ops.reduce_mean(
        math_ops.add(math_ops.multiply(0.5, math_ops.square(quad)), math_ops.multiply(delta, lin)),
        axis=-1,
    )


def binary_crossentropy(
    y_true: Any,
    y_pred: Any,
    from_logits: bool = False,
    label_smoothing: float = 0.0,
    axis: int = -1,
) -> Tensor:
    """Per-example binary cross-entropy, averaged over the last axis.

    Probabilities from a sigmoid activation are scored from its logits (Keras's
    rule), which stays exact where the sigmoid saturates.
    """
    if not from_logits:
        logits = activations.sigmoid_logits(y_pred)
        if logits is not None:
            y_pred, from_logits = logits, True
    yt, yp = _same_rank(y_true, y_pred)
    yt = _cast_like(yt, yp)
    _check_shapes(yt, yp, "binary_crossentropy")
    if label_smoothing:
        yt = math_ops.add(math_ops.multiply(yt, 1.0 - label_smoothing), 0.5 * label_smoothing)
    if from_logits:
        ce = nn_ops.sigmoid_cross_entropy_with_logits(labels=yt, logits=yp)
    else:
        p = math_ops.minimum(math_ops.maximum(yp, EPSILON), 1.0 - EPSILON)
        ce = math_ops.negative(
            math_ops.add(
                math_ops.multiply(yt, math_ops.log(p)),
                math_ops.multiply(
                    math_ops.subtract(1.0, yt), math_ops.log(math_ops.subtract(1.0, p))
                ),
            )
        )
    return math_ops.reduce_mean(ce, axis=axis)


def categorical_crossentropy(
    y_true: Any,
    y_pred: Any,
    from_logits: bool = False,
    label_smoothing: float = 0.0,
    axis: int = -1,
) -> Tensor:
    """Per-example cross-entropy of one-hot (or soft) labels."""
    yt, yp = node(y_true), node(y_pred)
    yt = _cast_like(yt, yp)
    if yt._array().shape != yp._array().shape:
        raise errors.InvalidArgumentError(
            f"categorical_crossentropy: y_true shape {list(yt._array().shape)} must equal y_pred "
            f"shape {list(yp._array().shape)} (use sparse_categorical_crossentropy for integer labels)"
        )
    if label_smoothing:
        k = yp._array().shape[axis]
        yt = math_ops.add(math_ops.multiply(yt, 1.0 - label_smoothing), label_smoothing / k)
    if from_logits:
        return nn_ops.softmax_cross_entropy_with_logits(labels=yt, logits=yp, axis=axis)
    p = math_ops.divide(yp, math_ops.reduce_sum(yp, axis=axis, keepdims=True))
    p = math_ops.minimum(math_ops.maximum(p, EPSILON), 1.0 - EPSILON)
    return math_ops.negative(math_ops.reduce_sum(math_ops.multiply(yt, math_ops.log(p)), axis=axis))


def sparse_categorical_crossentropy(
    y_true: Any,
    y_pred: Any,
    from_logits: bool = False,
    axis: int = -1,
    ignore_class: int | None = None,
) -> Tensor:
    """Per-example cross-entropy of integer class labels."""
    yt, yp = node(y_true), node(y_pred)
    a = yt._array()
    if a.ndim == yp._array().ndim and a.shape[-1] == 1:
        yt = array_ops.squeeze(yt, axis=-1)
        a = yt._array()
    if a.dtype.kind == "f":
        if (a != a.round()).any():
            raise errors.InvalidArgumentError(
                "sparse_categorical_crossentropy: y_true must hold integer class ids, got "
                f"non-integral values such as {a.ravel()[(a != a.round()).ravel()][:3].tolist()}"
            )
        yt = math_ops.cast(yt, "int64")
    if from_logits:
        return nn_ops.sparse_softmax_cross_entropy_with_logits(labels=yt, logits=yp)
    p = math_ops.divide(yp, math_ops.reduce_sum(yp, axis=-1, keepdims=True))
    p = math_ops.minimum(math_ops.maximum(p, EPSILON), 1.0 - EPSILON)
    k = yp._array().shape[-1]
    onehot = array_ops.one_hot(yt, k, dtype=yp.dtype)
    return math_ops.negative(
        math_ops.reduce_sum(math_ops.multiply(onehot, math_ops.log(p)), axis=-1)
    )


def hinge(y_true: Any, y_pred: Any) -> Tensor:
    """``mean(max(1 - y_true * y_pred, 0))`` with labels in {-1, 1} (0/1 converted)."""
    yt, yp = _same_rank(y_true, y_pred)
    yt = _cast_like(yt, yp)
    a = yt._array()
    if a.size and ((a == 0) | (a == 1)).all():
        yt = math_ops.subtract(math_ops.multiply(2.0, yt), 1.0)
    return math_ops.reduce_mean(
        math_ops.maximum(math_ops.subtract(1.0, math_ops.multiply(yt, yp)), 0.0), axis=-1
    )


def kl_divergence(y_true: Any, y_pred: Any) -> Tensor:
    """``sum(y_true * log(y_true / y_pred))`` with both clipped to [eps, 1]."""
    yt, yp = _same_rank(y_true, y_pred)
    yt = _cast_like(yt, yp)
    t = math_ops.minimum(math_ops.maximum(yt, EPSILON), 1.0)
    p = math_ops.minimum(math_ops.maximum(yp, EPSILON), 1.0)
    return math_ops.reduce_sum(math_ops.multiply(t, math_ops.log(math_ops.divide(t, p))), axis=-1)


mse = MSE = mean_squared_error
mae = MAE = mean_absolute_error
mape = MAPE = mean_absolute_percentage_error
kld = KLD = kl_divergence


class Loss:
    """Base class: ``loss(y_true, y_pred, sample_weight=None)`` returns the reduced loss.

    Subclasses implement ``call(y_true, y_pred)`` returning per-example values.
    """

    def __init__(
        self, name: str | None = None, reduction: str = "sum_over_batch_size", dtype: Any = None
    ) -> None:
        self.name = name or _snake(type(self).__name__)
        self.reduction = Reduction.validate(reduction)

    def call(self, y_true: Any, y_pred: Any) -> Tensor:
        """Per-example losses."""
        raise NotImplementedError

    def __call__(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> Tensor:
        values = self.call(y_true, y_pred)
        return reduce_values(values, sample_weight, self.reduction)

    def get_config(self) -> dict[str, Any]:
        """Constructor arguments."""
        return {"name": self.name, "reduction": self.reduction}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Loss:
        """Rebuilds from :meth:`get_config`."""
        return cls(**config)


_MEAN_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def reduce_values(values: Any, sample_weight: Any, reduction: str) -> Tensor:
    """Applies sample weights and reduces per-example losses (Keras's rules)."""
    values = node(values)
    if sample_weight is not None:
        sw = math_ops.cast(sample_weight, values.dtype)
        while sw._array().ndim > values._array().ndim and sw._array().shape[-1] == 1:
            sw = array_ops.squeeze(sw, axis=-1)
        values = math_ops.multiply(values, sw)
    if reduction == Reduction.NONE:
        return values
    a = values._array()
    if reduction == Reduction.SUM_OVER_BATCH_SIZE and a.size and a.dtype in _MEAN_DTYPES:
        # the sum divided by the count in one op: the same bits as the two below (both
        # divide the float32 or float64 sum by the count in that dtype)
        return math_ops.reduce_mean(values)
    total = math_ops.reduce_sum(values)
    if reduction == Reduction.SUM:
        return total
    n = max(values._array().size, 1)
    return math_ops.divide(total, float(n))


def _snake(name: str) -> str:
    out = []
    for i, ch in enumerate(name):
        if ch.isupper() and i and not name[i - 1].isupper():
            out.append("_")
        out.append(ch.lower())
    return "".join(out)


class LossFunctionWrapper(Loss):
    """A ``Loss`` around a per-example function and its keyword arguments."""

    def __init__(
        self,
        fn: Callable[..., Any],
        reduction: str = "sum_over_batch_size",
        name: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(name=name, reduction=reduction)
        self.fn = fn
        self._fn_kwargs = kwargs

    def call(self, y_true: Any, y_pred: Any) -> Tensor:
        return self.fn(y_true, y_pred, **self._fn_kwargs)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), **self._fn_kwargs}


class MeanSquaredError(LossFunctionWrapper):
    """Mean of squared errors."""

    def __init__(
        self, reduction: str = "sum_over_batch_size", name: str = "mean_squared_error"
    ) -> None:
        super().__init__(mean_squared_error, reduction=reduction, name=name)


class MeanAbsoluteError(LossFunctionWrapper):
    """Mean of absolute errors."""

    def __init__(
        self, reduction: str = "sum_over_batch_size", name: str = "mean_absolute_error"
    ) -> None:
        super().__init__(mean_absolute_error, reduction=reduction, name=name)


class MeanAbsolutePercentageError(LossFunctionWrapper):
    """Mean absolute percentage error."""

    def __init__(
        self, reduction: str = "sum_over_batch_size", name: str = "mean_absolute_percentage_error"
    ) -> None:
        super().__init__(mean_absolute_percentage_error, reduction=reduction, name=name)


class Huber(LossFunctionWrapper):
    """Huber loss with threshold ``delta``."""

    def __init__(
        self, delta: float = 1.0, reduction: str = "sum_over_batch_size", name: str = "huber_loss"
    ) -> None:
        super().__init__(huber, reduction=reduction, name=name, delta=delta)


class BinaryCrossentropy(LossFunctionWrapper):
    """Binary cross-entropy, from probabilities or (``from_logits``) logits."""

    def __init__(
        self,
        from_logits: bool = False,
        label_smoothing: float = 0.0,
        axis: int = -1,
        reduction: str = "sum_over_batch_size",
        name: str = "binary_crossentropy",
    ) -> None:
        super().__init__(
            binary_crossentropy,
            reduction=reduction,
            name=name,
            from_logits=from_logits,
            label_smoothing=label_smoothing,
            axis=axis,
        )


class CategoricalCrossentropy(LossFunctionWrapper):
    """Cross-entropy of one-hot labels."""

    def __init__(
        self,
        from_logits: bool = False,
        label_smoothing: float = 0.0,
        axis: int = -1,
        reduction: str = "sum_over_batch_size",
        name: str = "categorical_crossentropy",
    ) -> None:
        super().__init__(
            categorical_crossentropy,
            reduction=reduction,
            name=name,
            from_logits=from_logits,
            label_smoothing=label_smoothing,
            axis=axis,
        )


class SparseCategoricalCrossentropy(LossFunctionWrapper):
    """Cross-entropy of integer labels."""

    def __init__(
        self,
        from_logits: bool = False,
        ignore_class: int | None = None,
        reduction: str = "sum_over_batch_size",
        name: str = "sparse_categorical_crossentropy",
    ) -> None:
        super().__init__(
            sparse_categorical_crossentropy, reduction=reduction, name=name, from_logits=from_logits
        )


class Hinge(LossFunctionWrapper):
    """Hinge loss."""

    def __init__(self, reduction: str = "sum_over_batch_size", name: str = "hinge") -> None:
        super().__init__(hinge, reduction=reduction, name=name)


class KLDivergence(LossFunctionWrapper):
    """Kullback-Leibler divergence."""

    def __init__(self, reduction: str = "sum_over_batch_size", name: str = "kl_divergence") -> None:
        super().__init__(kl_divergence, reduction=reduction, name=name)


_BY_NAME: dict[str, type[Loss]] = {
    "mean_squared_error": MeanSquaredError,
    "mse": MeanSquaredError,
    "mean_absolute_error": MeanAbsoluteError,
    "mae": MeanAbsoluteError,
    "mean_absolute_percentage_error": MeanAbsolutePercentageError,
    "mape": MeanAbsolutePercentageError,
    "huber": Huber,
    "huber_loss": Huber,
    "binary_crossentropy": BinaryCrossentropy,
    "categorical_crossentropy": CategoricalCrossentropy,
    "sparse_categorical_crossentropy": SparseCategoricalCrossentropy,
    "hinge": Hinge,
    "kl_divergence": KLDivergence,
    "kld": KLDivergence,
}


def get(identifier: Any) -> Loss:
    """A ``Loss`` from a name, a class, an instance or a per-example function.

    Raises:
        ValueError: an unknown name, quoted with the known ones.
    """
    if isinstance(identifier, Loss):
        return identifier
    if isinstance(identifier, type) and issubclass(identifier, Loss):
        return identifier()
    if isinstance(identifier, str):
        key = identifier if identifier in _BY_NAME else _snake(identifier)
        cls = _BY_NAME.get(key)
        if cls is None:
            raise errors.InvalidArgumentError(
                f"Unknown loss {identifier!r}; known: {sorted(_BY_NAME)}"
            )
        return cls()
    if callable(identifier):
        return LossFunctionWrapper(identifier, name=getattr(identifier, "__name__", None))
    raise TypeError(f"Could not interpret loss {identifier!r}")


def serialize(loss: Loss) -> dict[str, Any]:
    """A loss's class name and config."""
    return {"class_name": type(loss).__name__, "config": loss.get_config()}

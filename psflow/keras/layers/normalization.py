"""Normalization layers: ``BatchNormalization`` and ``LayerNormalization``.

Both are compositions of differentiable ops (mean, variance, rsqrt, multiply,
add), so their gradients come from the ops' VJPs, including the terms through
the batch (or layer) statistics.

BatchNormalization normalizes by the batch's statistics while training and by
its moving statistics otherwise; each training call moves them,
``moving = moving * momentum + batch * (1 - momentum)`` (Keras's rule, with the
biased batch variance). The moving statistics are non-trainable variables
created with ``aggregation=MEAN``: under MirroredStrategy every replica's update
is averaged, which equals TensorFlow's sync-on-read mean of per-replica copies
(the update is linear and all copies start equal).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from psflow import errors
from psflow.distribute import distribute_lib
from psflow.framework.tensor import TensorShape
from psflow.framework.variable import VariableAggregation, VariableSynchronization
from psflow.keras import initializers, regularizers
from psflow.keras.layers.base import Layer
from psflow.ops import array_ops, math_ops, nn_ops
from psflow.ops._core import node


def _axes(axis: Any, rank: int, layer: str) -> tuple[int, ...]:
    """``axis`` (an int or ints) as sorted positive axes of a rank-``rank`` input.

    Raises:
        InvalidArgumentError: an axis out of range, the batch axis, or a repeated axis.
    """
    raw = [axis] if isinstance(axis, (int, np.integer)) else list(axis)
    axes = []
    for a in raw:
        a = int(a)
        if not -rank <= a < rank or a % rank == 0:
            raise errors.InvalidArgumentError(
                f"{layer}: axis {a} is out of range for inputs of rank {rank} (or is the "
                "batch axis)"
            )
        axes.append(a % rank)
    if len(set(axes)) != len(axes) or not axes:
        raise errors.InvalidArgumentError(f"{layer}: invalid axis {axis!r}")
    return tuple(sorted(axes))


def _float_input(inputs: Any, dtype: str) -> Any:
    x = node(inputs)
    if x._array().dtype != dtype:  # Keras casts inputs to the layer's dtype
        x = math_ops.cast(x, dtype)
    return x


class _Normalization(Layer):
    """Shared by both layers: the normalized axes, ``gamma``/``beta`` and their broadcast."""

    def __init__(
        self,
        axis: Any,
        epsilon: float,
        center: bool,
        scale: bool,
        beta_initializer: Any,
        gamma_initializer: Any,
        beta_regularizer: Any,
        gamma_regularizer: Any,
        beta_constraint: Any,
        gamma_constraint: Any,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if not float(epsilon) > 0:
            raise errors.InvalidArgumentError(
                f"{type(self).__name__}: epsilon must be > 0, got {epsilon!r}"
            )
        self.axis = axis if isinstance(axis, (int, np.integer)) else list(axis)
        self.epsilon = float(epsilon)
        self.center, self.scale = bool(center), bool(scale)
        self._ids = {
            "beta_initializer": beta_initializer,
            "gamma_initializer": gamma_initializer,
            "beta_regularizer": beta_regularizer,
            "gamma_regularizer": gamma_regularizer,
            "beta_constraint": beta_constraint,
            "gamma_constraint": gamma_constraint,
        }

    def _build_params(self, input_shape: Any) -> None:
        shape = tuple(input_shape)
        self.axes = _axes(self.axis, len(shape), self.name)
        self.param_shape = tuple(shape[a] for a in self.axes)
        if any(d is None for d in self.param_shape):
            raise errors.InvalidArgumentError(
                f"{self.name}: the normalized axes {list(self.axes)} of the input shape "
                f"{list(shape)} must be known"
            )
        self.input_rank = len(shape)
        # gamma, beta and statistics of param_shape broadcast against the input as this shape
        self.broadcast_shape = [shape[a] if a in self.axes else 1 for a in range(len(shape))]
        ids = self._ids
        self.gamma = (
            self.add_weight(
                "gamma",
                self.param_shape,
                initializer=initializers.get(ids["gamma_initializer"]),
                regularizer=regularizers.get(ids["gamma_regularizer"])
                if ids["gamma_regularizer"]
                else None,
                constraint=ids["gamma_constraint"],
            )
            if self.scale
            else None
        )
        self.beta = (
            self.add_weight(
                "beta",
                self.param_shape,
                initializer=initializers.get(ids["beta_initializer"]),
                regularizer=regularizers.get(ids["beta_regularizer"])
                if ids["beta_regularizer"]
                else None,
                constraint=ids["beta_constraint"],
            )
            if self.center
            else None
        )

    def _broadcast(self, t: Any) -> Any:
        """``t`` of ``param_shape`` reshaped to broadcast against the input."""
        if self.axes == (self.input_rank - 1,):
            return t  # a trailing axis broadcasts as it is
        return array_ops.reshape(t, self.broadcast_shape)

    def _check_input(self, x: Any) -> None:
        a = x._array()
        if a.ndim != self.input_rank or tuple(a.shape[i] for i in self.axes) != self.param_shape:
            raise errors.InvalidArgumentError(
                f"{self.name}: expected inputs of rank {self.input_rank} with "
                f"{list(self.param_shape)} along axes {list(self.axes)}, got shape {list(a.shape)}"
            )

    def _normalize(self, x: Any, mean: Any, variance: Any) -> Any:
        """``(x - mean) * rsqrt(variance + eps) * gamma + beta``; statistics broadcast already."""
        inv = math_ops.rsqrt(math_ops.add(variance, self.epsilon))
        if self.gamma is not None:
            inv = math_ops.multiply(inv, self._broadcast(self.gamma))
        y = math_ops.multiply(math_ops.subtract(x, mean), inv)
        if self.beta is not None:
            y = math_ops.add(y, self._broadcast(self.beta))
        return y

    def compute_output_shape(self, input_shape: Any) -> TensorShape:
        return TensorShape(input_shape)

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "axis": self.axis,
            "epsilon": self.epsilon,
            "center": self.center,
            "scale": self.scale,
            **self._ids,
        }


class BatchNormalization(_Normalization):
    """Normalizes each feature by batch statistics in training, moving statistics otherwise.

    Args:
        axis: the feature axis (or axes) kept; statistics reduce over all others.
        momentum: the moving statistics' decay.
        epsilon: added to the variance before the square root.
        center, scale: whether to add ``beta`` / multiply by ``gamma``.

    Example:
        >>> import psflow as pf
        >>> bn = pf.keras.layers.BatchNormalization()
        >>> y = bn(pf.constant([[1.0, 2.0], [3.0, 6.0]]), training=True)
        >>> [round(float(v), 3) for v in bn.moving_mean.numpy()]
        [0.02, 0.04]
    """

    def __init__(
        self,
        axis: Any = -1,
        momentum: float = 0.99,
        epsilon: float = 1e-3,
        center: bool = True,
        scale: bool = True,
        beta_initializer: Any = "zeros",
        gamma_initializer: Any = "ones",
        moving_mean_initializer: Any = "zeros",
        moving_variance_initializer: Any = "ones",
        beta_regularizer: Any = None,
        gamma_regularizer: Any = None,
        beta_constraint: Any = None,
        gamma_constraint: Any = None,
        synchronized: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            axis,
            epsilon,
            center,
            scale,
            beta_initializer,
            gamma_initializer,
            beta_regularizer,
            gamma_regularizer,
            beta_constraint,
            gamma_constraint,
            **kwargs,
        )
        if not 0 <= float(momentum) <= 1:
            raise errors.InvalidArgumentError(
                f"BatchNormalization: momentum must be in [0, 1], got {momentum!r}"
            )
        if synchronized:
            raise errors.UnimplementedError(
                "BatchNormalization: synchronized=True (cross-replica batch statistics) is not "
                "implemented; each replica normalizes by its own batch"
            )
        self.momentum = float(momentum)
        self.synchronized = False
        self._ids.update(
            moving_mean_initializer=moving_mean_initializer,
            moving_variance_initializer=moving_variance_initializer,
        )
        if self._batch_input_shape is not None:
            self._maybe_build(self._batch_input_shape)

    def build(self, input_shape: Any) -> None:
        self._build_params(input_shape)
        stats = {
            "trainable": False,
            "synchronization": VariableSynchronization.ON_READ,
            "aggregation": VariableAggregation.MEAN,
        }
        self.moving_mean = self.add_weight(
            "moving_mean",
            self.param_shape,
            initializer=initializers.get(self._ids["moving_mean_initializer"]),
            **stats,
        )
        self.moving_variance = self.add_weight(
            "moving_variance",
            self.param_shape,
            initializer=initializers.get(self._ids["moving_variance_initializer"]),
            **stats,
        )
        self.reduction_axes = [a for a in range(self.input_rank) if a not in self.axes]
        self.built = True

    def call(self, inputs: Any, training: Any = None) -> Any:
        x = _float_input(inputs, self.dtype)
        self._check_input(x)
        if not (training and self.trainable):
            # the statistics are sync-on-read: a replica's own copy moved with its own
            # batches only, so inference reads their aggregate, as on one device
            read = distribute_lib.get_strategy().extended.read_var
            return self._normalize(
                x,
                self._broadcast(read(self.moving_mean)),
                self._broadcast(read(self.moving_variance)),
            )
        mean, variance = nn_ops.moments(x, self.reduction_axes, keepdims=True)
        y = self._normalize(x, mean, variance)
        self._update_moving(mean, variance)
        return y

    def _update_moving(self, mean: Any, variance: Any) -> None:
        """Moves the statistics towards the batch's (outside any tape: they are not trained)."""
        shape = list(self.param_shape)
        decay = 1.0 - self.momentum
        for var, batch in ((self.moving_mean, mean), (self.moving_variance, variance)):
            target = array_ops.stop_gradient(array_ops.reshape(batch, shape))
            var.assign(
                math_ops.add(
                    math_ops.multiply(var, self.momentum), math_ops.multiply(target, decay)
                )
            )

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "momentum": self.momentum, "synchronized": False}


class LayerNormalization(_Normalization):
    """Normalizes each example over ``axis`` (the last by default), then scales and shifts.

    Example:
        >>> import psflow as pf
        >>> y = pf.keras.layers.LayerNormalization()(pf.constant([[1.0, 3.0]]))
        >>> [round(float(v), 3) for v in y.numpy()[0]]
        [-1.0, 1.0]
    """

    def __init__(
        self,
        axis: Any = -1,
        epsilon: float = 1e-3,
        center: bool = True,
        scale: bool = True,
        beta_initializer: Any = "zeros",
        gamma_initializer: Any = "ones",
        beta_regularizer: Any = None,
        gamma_regularizer: Any = None,
        beta_constraint: Any = None,
        gamma_constraint: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            axis,
            epsilon,
            center,
            scale,
            beta_initializer,
            gamma_initializer,
            beta_regularizer,
            gamma_regularizer,
            beta_constraint,
            gamma_constraint,
            **kwargs,
        )
        if self._batch_input_shape is not None:
            self._maybe_build(self._batch_input_shape)

    def build(self, input_shape: Any) -> None:
        self._build_params(input_shape)
        self.built = True

    def call(self, inputs: Any) -> Any:
        x = _float_input(inputs, self.dtype)
        self._check_input(x)
        mean, variance = nn_ops.moments(x, list(self.axes), keepdims=True)
        return self._normalize(x, mean, variance)

"""Optimizer update rules, written once for local training and for the parameter servers.

A rule is a frozen dataclass of hyperparameters with no state of its own: the
variable and its slots (momentum, velocity...) are arrays passed in and updated
in place.  The same code runs on NumPy and CuPy arrays (the module is taken from
the variable), in the Keras optimizers and inside ``ps_server``, so parameter-server
training is bit for bit the same arithmetic as local training.

The formulas are Keras 3's (``keras/src/optimizers/*.py``), including where it
rounds: hyperparameters are cast to the variable's dtype before use, and
``1 - beta`` is computed in Python (double) precision and then cast, as Keras does.
All arithmetic stays in the variable's dtype; Python floats and NumPy scalars of
the variable's dtype never upcast a float16/float32 array.

Sparse updates (``apply_sparse``) receive rows: duplicate indices are summed
first (in order of appearance), then only the touched rows of the variable and of
its slots are updated ("lazy" semantics, as TensorFlow's sparse apply kernels and
LazyAdam).  For plain SGD and for Adagrad that equals the dense update of the
gradient with zero rows, bit for bit.  For momentum SGD, Adam and RMSprop it does
not: Keras 3 densifies such gradients (every row's slots decay), which
:func:`densify_rows` reproduces if a caller wants that instead.

The ``step`` argument is the 1-based count of updates this variable has received
(Keras's ``iterations + 1``); only Adam uses it (bias correction).

Example:
    >>> import numpy as np
    >>> rule = rule_from_config({"name": "sgd", "learning_rate": 0.5})
    >>> var = np.array([1.0, 2.0], dtype=np.float32)
    >>> rule.apply_dense(var, np.array([1.0, 1.0], np.float32), rule.init_slots(var), step=1)
    >>> var
    array([0.5, 1.5], dtype=float32)
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import Any, ClassVar

import numpy as np

from psflow.errors import InvalidArgumentError
from psflow.ops import compiled

__all__ = [
    "SGD",
    "Adagrad",
    "Adam",
    "Ftrl",
    "RMSprop",
    "UpdateRule",
    "array_module",
    "densify_rows",
    "dedupe_rows",
    "put_rows",
    "registered_rules",
    "rule_from_config",
    "take_rows",
]


def array_module(array: Any):
    """Returns ``numpy`` or ``cupy``, whichever module ``array`` belongs to.

    CuPy is imported only when a CuPy array is actually seen.
    """
    if type(array).__module__.split(".", 1)[0] == "cupy":
        import cupy  # optional dependency, imported on use

        return cupy
    return np


def _scalar(value: float, dtype: Any) -> Any:
    """``value`` as a NumPy scalar of ``dtype`` (Keras's ``ops.cast(value, var.dtype)``)."""
    return np.dtype(dtype).type(value)


def _scatter_add(xp, target, indices, values) -> None:
    """``target[indices] += values`` with repeated indices accumulated, in order."""
    if xp is np:
        np.add.at(target, indices, values)
    else:
        import cupyx  # optional dependency, imported on use

        cupyx.scatter_add(target, indices, values)


def take_rows(array: Any, rows: Any) -> Any:
    """``array[rows]`` for 1-D integer ``rows`` (a copy).

    NumPy's ``take`` along axis 0 copies whole rows; fancy indexing of a 2-D
    array goes through its general index machinery, several times slower for
    the narrow rows of an embedding table; a C-contiguous 2-D NumPy array is
    taken as 1-D opaque rows, a fifth faster again.
    """
    view = _row_view(array)
    if view is None:
        return array_module(array).take(array, rows, axis=0)
    return view.take(rows).view(array.dtype).reshape(-1, array.shape[1])


def _row_view(array: Any) -> Any:
    """A C-contiguous 2-D NumPy ``array`` as 1-D opaque rows, or None."""
    if (
        not isinstance(array, np.ndarray)
        or array.ndim != 2
        or not array.flags.c_contiguous
        or not array.shape[1]
    ):
        return None
    return array.view(np.dtype((np.void, array.dtype.itemsize * array.shape[1]))).reshape(-1)


def put_rows(array: Any, rows: Any, values: Any) -> None:
    """``array[rows] = values`` for 1-D integer ``rows`` without repeats.

    A C-contiguous 2-D NumPy array is written as 1-D opaque rows (one copy per
    row rather than per element: about twice as fast), by ``put``: fancy
    assignment checks and copies each opaque row through the general index
    machinery, two to three times slower on a table's scattered rows.  Other
    arrays, values that are not one row per index (``put`` would repeat them)
    and rows out of range (``put`` would write those before the bad one) go by
    indexing, which refuses them before it writes anything.
    """
    target = _row_view(array)
    source = None if target is None else _row_view(np.ascontiguousarray(values, array.dtype))
    if source is None or not _fits(np.asarray(rows), source.shape[0], target.shape[0]):
        array[rows] = values
    else:
        target.put(rows, source)


def _fits(rows: np.ndarray, count: int, size: int) -> bool:
    """Whether ``rows`` are ``count`` integers in range of ``size`` rows (negative
    ones counted from the end, as indexing does)."""
    if rows.ndim != 1 or rows.shape[0] != count or rows.dtype.kind not in "iu":
        return False
    return not count or (int(rows.min()) >= -size and int(rows.max()) < size)


def dedupe_rows(indices: Any, values: Any, num_rows: int) -> tuple[Any, Any]:
    """Validates sparse rows and sums the values of repeated indices.

    Args:
        indices: 1-D integer array of row numbers.
        values: array of shape ``(len(indices), *row_shape)``.
        num_rows: the variable's first dimension; indices must lie in ``[0, num_rows)``.

    Returns:
        ``(unique_indices, summed_values)``, indices sorted ascending.

    Raises:
        InvalidArgumentError: non-integer or non-1-D indices, an index out of
            range (quoted), or values whose first dimension does not match.
    """
    xp = array_module(values)
    indices = xp.asarray(indices)
    if indices.ndim != 1 or indices.dtype.kind not in "iu":
        raise InvalidArgumentError(
            f"sparse indices must be a 1-D integer array, got dtype {indices.dtype} "
            f"and shape {tuple(indices.shape)}"
        )
    if values.shape[:1] != indices.shape:
        raise InvalidArgumentError(
            f"sparse values shape {tuple(values.shape)} does not match {indices.shape[0]} indices"
        )
    if indices.size:
        low, high = int(indices.min()), int(indices.max())
        if low < 0 or high >= num_rows:
            bad = low if low < 0 else high
            raise InvalidArgumentError(
                f"sparse index {bad} out of range for a variable of {num_rows} rows"
            )
    unique, inverse = xp.unique(indices, return_inverse=True)
    if unique.shape[0] == indices.shape[0]:
        # No duplicates: unique is sorted; put the values in that order.
        order = xp.argsort(indices)
        return unique, values[order]
    summed = xp.zeros((unique.shape[0], *values.shape[1:]), dtype=values.dtype)
    _scatter_add(xp, summed, inverse.reshape(-1), values)
    return unique, summed


def densify_rows(shape: tuple[int, ...], indices: Any, values: Any) -> Any:
    """The dense gradient equal to sparse rows (repeated indices summed in order)."""
    xp = array_module(values)
    dense = xp.zeros(shape, dtype=values.dtype)
    _scatter_add(xp, dense, xp.asarray(indices), values)
    return dense


_REGISTRY: dict[str, type[UpdateRule]] = {}


def registered_rules() -> tuple[str, ...]:
    """Names accepted by :func:`rule_from_config`."""
    return tuple(sorted(_REGISTRY))


def _register(cls: type[UpdateRule]) -> type[UpdateRule]:
    _REGISTRY[cls.name] = cls
    return cls


@dataclasses.dataclass(frozen=True)
class UpdateRule(abc.ABC):
    """An optimizer's update formula; hyperparameters only, no state.

    Subclasses are frozen dataclasses.  ``slot_names`` lists the per-variable
    arrays the rule keeps (Keras's optimizer variable names).
    """

    name: ClassVar[str]

    def __post_init__(self) -> None:
        self._validate()

    @property
    @abc.abstractmethod
    def slot_names(self) -> tuple[str, ...]:
        """Names of the slots :meth:`init_slots` creates, in a fixed order."""

    def init_slots(self, var: Any) -> dict[str, Any]:
        """New slots for ``var``: zeros of its shape, dtype and array module."""
        xp = array_module(var)
        return {name: xp.zeros_like(var) for name in self.slot_names}

    @abc.abstractmethod
    def _update(self, var: Any, grad: Any, slots: dict[str, Any], step: int) -> None:
        """The dense formula, in place; ``grad`` already has ``var``'s dtype and shape."""

    def apply_dense(self, var: Any, grad: Any, slots: dict[str, Any], step: int) -> None:
        """Applies a dense gradient to ``var`` and its ``slots`` in place.

        Raises:
            InvalidArgumentError: shapes differ, missing slots, or ``step < 1``.
        """
        if tuple(grad.shape) != tuple(var.shape):
            raise InvalidArgumentError(
                f"gradient shape {tuple(grad.shape)} does not match variable shape "
                f"{tuple(var.shape)}"
            )
        self._check_slots(var, slots, step)
        if grad.dtype != var.dtype:
            grad = grad.astype(var.dtype)
        self._update(var, grad, slots, step)

    def apply_dense_to_copies(
        self, copies: list[Any], grad: Any, slots: list[dict[str, Any]], step: int
    ) -> None:
        """Applies one dense gradient to several identical copies of a variable.

        ``copies[i]`` and its ``slots[i]`` are updated in place; all copies get the
        same values, bitwise, as from :meth:`apply_dense` on each.  ``grad`` is
        scratch the caller gives up: a rule may overwrite it.

        Raises:
            InvalidArgumentError: as :meth:`apply_dense`, for any copy.
        """
        for var, var_slots in zip(copies, slots):
            if tuple(grad.shape) != tuple(var.shape):
                raise InvalidArgumentError(
                    f"gradient shape {tuple(grad.shape)} does not match variable shape "
                    f"{tuple(var.shape)}"
                )
            self._check_slots(var, var_slots, step)
        if copies and grad.dtype != copies[0].dtype:
            grad = grad.astype(copies[0].dtype)
        self._update_copies(copies, grad, slots, step)

    def _update_copies(
        self, copies: list[Any], grad: Any, slots: list[dict[str, Any]], step: int
    ) -> None:
        """The dense formula on each copy; rules may share work across copies."""
        for var, var_slots in zip(copies, slots):
            self._update(var, grad, var_slots, step)

    def apply_sparse(
        self, var: Any, indices: Any, values: Any, slots: dict[str, Any], step: int
    ) -> None:
        """Applies gradient rows ``values`` at ``indices`` (lazy; see the module doc).

        Raises:
            InvalidArgumentError: bad indices or values shape; nothing is changed.
        """
        if var.ndim == 0:
            raise InvalidArgumentError("sparse updates need a variable of rank >= 1")
        if tuple(values.shape[1:]) != tuple(var.shape[1:]):
            raise InvalidArgumentError(
                f"sparse values shape {tuple(values.shape)} does not match rows of a "
                f"variable of shape {tuple(var.shape)}"
            )
        self._check_slots(var, slots, step)
        if values.dtype != var.dtype:
            values = values.astype(var.dtype)
        rows, summed = dedupe_rows(indices, values, var.shape[0])
        self._apply_rows(var, rows, summed, slots, step)

    def apply_rows(
        self, var: Any, rows: Any, values: Any, slots: dict[str, Any], step: int
    ) -> None:
        """:meth:`apply_sparse` for rows the caller made unique and in range (a
        dynamic table's slots): the same arithmetic, bit for bit, without the
        checks and the sort that summing repeated rows needs.

        Raises:
            InvalidArgumentError: values that do not match the rows, bad slots or step.
        """
        if var.ndim != 2 or tuple(values.shape) != (rows.shape[0], var.shape[1]):
            raise InvalidArgumentError(
                f"sparse values shape {tuple(values.shape)} does not match {rows.shape[0]} "
                f"rows of a variable of shape {tuple(var.shape)}"
            )
        self._check_slots(var, slots, step)
        if values.dtype != var.dtype:
            values = values.astype(var.dtype)
        self._apply_rows(var, rows, values, slots, step)

    def _apply_rows(
        self, var: Any, rows: Any, values: Any, slots: dict[str, Any], step: int
    ) -> None:
        # Gather the touched rows, run the dense formula on them, scatter back:
        # the rules are elementwise, so this is the dense update restricted to rows.
        var_rows = take_rows(var, rows)
        slot_rows = {k: take_rows(s, rows) for k, s in slots.items()}
        self._update(var_rows, values, slot_rows, step)
        put_rows(var, rows, var_rows)
        for k, s in slots.items():
            put_rows(s, rows, slot_rows[k])

    def _check_slots(self, var: Any, slots: dict[str, Any], step: int) -> None:
        if var.dtype.kind != "f":
            raise InvalidArgumentError(
                f"{self.name} updates need a floating-point variable, got dtype {var.dtype}"
            )
        if isinstance(step, bool) or int(step) != step or step < 1:
            raise InvalidArgumentError(f"step must be an integer >= 1, got {step!r}")
        missing = [n for n in self.slot_names if n not in slots]
        if missing:
            raise InvalidArgumentError(f"{self.name} update is missing slots {missing}")
        for n in self.slot_names:
            if tuple(slots[n].shape) != tuple(var.shape):
                raise InvalidArgumentError(
                    f"slot {n!r} shape {tuple(slots[n].shape)} does not match variable "
                    f"shape {tuple(var.shape)}"
                )

    def get_config(self) -> dict[str, Any]:
        """The rule as a JSON-able dict: ``{"name": ..., **hyperparameters}``."""
        return {"name": self.name, **dataclasses.asdict(self)}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> UpdateRule:
        """Builds the rule from :meth:`get_config`'s output (``name`` optional)."""
        config = dict(config)
        name = config.pop("name", cls.name)
        if str(name).lower() != cls.name:
            raise InvalidArgumentError(f"config for {name!r} given to rule {cls.name!r}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(config) - fields)
        if unknown:
            raise InvalidArgumentError(
                f"unknown {cls.name} hyperparameters {unknown}; accepted: {sorted(fields)}"
            )
        return cls(**config)

    # -- validation helpers -------------------------------------------------
    def _validate(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type in ("bool", bool):
                if not isinstance(value, bool):
                    raise InvalidArgumentError(
                        f"{self.name} {f.name} must be a bool, got {value!r}"
                    )
            elif isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidArgumentError(f"{self.name} {f.name} must be a number, got {value!r}")
            elif not _finite(value):
                raise InvalidArgumentError(
                    f"{self.name} {f.name} must be a finite float, got {_quote_number(value)}"
                )
        # Store floats as Python floats so get_config round-trips through JSON.
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, bool):
                object.__setattr__(self, f.name, float(value))

    def _require(self, ok: bool, field: str, rule: str) -> None:
        if not ok:
            raise InvalidArgumentError(
                f"{self.name} {field} must be {rule}, got {getattr(self, field)!r}"
            )


def _finite(value: int | float) -> bool:
    """Whether ``value`` is a finite number a float can hold (a 400-digit int is not)."""
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _quote_number(value: Any) -> str:
    """``repr(value)``, shortened for numbers thousands of digits long."""
    if isinstance(value, int) and value.bit_length() > 256:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@_register
@dataclasses.dataclass(frozen=True)
class SGD(UpdateRule):
    """Gradient descent with optional (Nesterov) momentum; Keras's ``SGD``.

    ``m = m * momentum - g * lr``; ``w += m`` (or ``w += m * momentum - g * lr``
    with Nesterov); without momentum ``w -= g * lr``.
    """

    name: ClassVar[str] = "sgd"
    learning_rate: float = 0.01
    momentum: float = 0.0
    nesterov: bool = False

    def _validate(self) -> None:
        super()._validate()
        self._require(self.learning_rate >= 0, "learning_rate", ">= 0")
        self._require(0.0 <= self.momentum <= 1.0, "momentum", "in [0, 1]")

    @property
    def slot_names(self) -> tuple[str, ...]:
        """``("momentum",)`` when momentum is used, else nothing."""
        return ("momentum",) if self.momentum != 0 else ()

    def _update_copies(self, copies, grad, slots, step):
        if self.momentum != 0 or not copies:
            super()._update_copies(copies, grad, slots, step)
            return
        # ``grad * lr`` once, in the caller's scratch, then one pass over each copy:
        # the same roundings as ``var -= grad * lr``
        xp = array_module(grad)
        xp.multiply(grad, _scalar(self.learning_rate, copies[0].dtype), out=grad)
        for var in copies:
            var -= grad

    def _update(self, var, grad, slots, step):
        lr = _scalar(self.learning_rate, var.dtype)
        if self.momentum == 0:
            if not compiled.sgd_update(var, grad, lr):
                var -= grad * lr
            return
        mom = _scalar(self.momentum, var.dtype)
        m = slots["momentum"]
        if compiled.sgd_update(var, grad, lr, m, mom, self.nesterov):
            return
        m *= mom
        m -= grad * lr
        if self.nesterov:
            var += m * mom - grad * lr
        else:
            var += m


@_register
@dataclasses.dataclass(frozen=True)
class Adam(UpdateRule):
    """Adam (optionally AMSGrad); Keras's ``Adam``.

    ``alpha = lr * sqrt(1 - b2^t) / (1 - b1^t)``; ``m += (g - m) * (1 - b1)``;
    ``v += (g^2 - v) * (1 - b2)``; ``w -= m * alpha / (sqrt(v) + eps)``
    (``v`` replaced by ``v_hat = max(v_hat, v)`` with AMSGrad).
    """

    name: ClassVar[str] = "adam"
    learning_rate: float = 0.001
    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-7
    amsgrad: bool = False

    def _validate(self) -> None:
        super()._validate()
        self._require(self.learning_rate >= 0, "learning_rate", ">= 0")
        self._require(0.0 <= self.beta_1 < 1.0, "beta_1", "in [0, 1)")
        self._require(0.0 <= self.beta_2 < 1.0, "beta_2", "in [0, 1)")
        self._require(self.epsilon >= 0, "epsilon", ">= 0")

    @property
    def slot_names(self) -> tuple[str, ...]:
        """``momentum``, ``velocity`` and, with AMSGrad, ``velocity_hat``."""
        return (
            ("momentum", "velocity", "velocity_hat") if self.amsgrad else ("momentum", "velocity")
        )

    def _update(self, var, grad, slots, step):
        xp = array_module(var)
        dt = var.dtype
        lr = _scalar(self.learning_rate, dt)
        t = _scalar(step, dt)
        one = _scalar(1, dt)
        beta_1_power = _scalar(self.beta_1, dt) ** t
        beta_2_power = _scalar(self.beta_2, dt) ** t
        alpha = lr * np.sqrt(one - beta_2_power) / (one - beta_1_power)
        m, v = slots["momentum"], slots["velocity"]
        b1c, b2c = _scalar(1 - self.beta_1, dt), _scalar(1 - self.beta_2, dt)
        eps = _scalar(self.epsilon, dt)
        if not self.amsgrad and compiled.adam_update(var, grad, m, v, alpha, b1c, b2c, eps):
            return
        m += (grad - m) * b1c
        v += (xp.square(grad) - v) * b2c
        if self.amsgrad:
            v_hat = slots["velocity_hat"]
            xp.maximum(v_hat, v, out=v_hat)
            v = v_hat
        var -= (m * alpha) / (xp.sqrt(v) + eps)


@_register
@dataclasses.dataclass(frozen=True)
class Adagrad(UpdateRule):
    """Adagrad; Keras's ``Adagrad``.

    ``acc += g^2``; ``w -= lr * g / sqrt(acc + eps)``; ``acc`` starts at
    ``initial_accumulator_value``.
    """

    name: ClassVar[str] = "adagrad"
    learning_rate: float = 0.001
    initial_accumulator_value: float = 0.1
    epsilon: float = 1e-7

    def _validate(self) -> None:
        super()._validate()
        self._require(self.learning_rate >= 0, "learning_rate", ">= 0")
        self._require(self.initial_accumulator_value >= 0, "initial_accumulator_value", ">= 0")
        self._require(self.epsilon >= 0, "epsilon", ">= 0")

    @property
    def slot_names(self) -> tuple[str, ...]:
        """``("accumulator",)``."""
        return ("accumulator",)

    def init_slots(self, var: Any) -> dict[str, Any]:
        """The accumulator, filled with ``initial_accumulator_value``."""
        xp = array_module(var)
        return {
            "accumulator": xp.full_like(var, _scalar(self.initial_accumulator_value, var.dtype))
        }

    def _update(self, var, grad, slots, step):
        xp = array_module(var)
        dt = var.dtype
        acc = slots["accumulator"]
        # the same operations in the same order as
        # ``var -= lr * g / sqrt(acc + eps)``, in two scratch arrays instead of five
        scratch = xp.square(grad)
        acc += scratch
        xp.add(acc, _scalar(self.epsilon, dt), out=scratch)
        xp.sqrt(scratch, out=scratch)
        step_size = xp.multiply(_scalar(self.learning_rate, dt), grad)
        step_size /= scratch
        var -= step_size


@_register
@dataclasses.dataclass(frozen=True)
class RMSprop(UpdateRule):
    """RMSprop (optionally centered, with momentum); Keras's ``RMSprop``.

    ``vel = rho * vel + (1 - rho) * g^2``; centered: ``avg = rho * avg + (1 - rho) * g``
    and ``denom = vel - avg^2 + eps``, else ``denom = vel + eps``;
    ``inc = lr * g / sqrt(denom)``; with momentum ``mom = momentum * mom + inc``,
    ``w -= mom``, else ``w -= inc``.
    """

    name: ClassVar[str] = "rmsprop"
    learning_rate: float = 0.001
    rho: float = 0.9
    momentum: float = 0.0
    epsilon: float = 1e-7
    centered: bool = False

    def _validate(self) -> None:
        super()._validate()
        self._require(self.learning_rate >= 0, "learning_rate", ">= 0")
        self._require(0.0 <= self.rho <= 1.0, "rho", "in [0, 1]")
        self._require(0.0 <= self.momentum <= 1.0, "momentum", "in [0, 1]")
        self._require(self.epsilon >= 0, "epsilon", ">= 0")

    @property
    def slot_names(self) -> tuple[str, ...]:
        """``velocity``, then ``momentum`` (momentum > 0), ``average_gradient`` (centered)."""
        names = ["velocity"]
        if self.momentum > 0:
            names.append("momentum")
        if self.centered:
            names.append("average_gradient")
        return tuple(names)

    def _update(self, var, grad, slots, step):
        xp = array_module(var)
        dt = var.dtype
        rho = _scalar(self.rho, dt)
        one_minus_rho = _scalar(1 - self.rho, dt)
        eps = _scalar(self.epsilon, dt)
        vel = slots["velocity"]
        vel *= rho
        vel += one_minus_rho * xp.square(grad)
        if self.centered:
            avg = slots["average_gradient"]
            avg *= rho
            avg += one_minus_rho * grad
            denominator = vel - xp.square(avg) + eps
        else:
            denominator = vel + eps
        increment = (_scalar(self.learning_rate, dt) * grad) / xp.sqrt(denominator)
        if self.momentum > 0:
            mom = slots["momentum"]
            mom *= _scalar(self.momentum, dt)
            mom += increment
            var -= mom
        else:
            var -= increment


@_register
@dataclasses.dataclass(frozen=True)
class Ftrl(UpdateRule):
    """FTRL-Proximal, the optimizer of wide (linear) CTR models; Keras's ``Ftrl``.

    ``n' = n + g^2``; ``z += g + 2*l2s*w - (n'^-p - n^-p) / lr * w``;
    ``w = (clip(z, -l1, l1) - z) / (n'^-p / lr + 2*(l2 + beta / (2*lr)))``;
    ``n = n'`` with ``p = learning_rate_power`` (``-0.5``: the square root).
    """

    name: ClassVar[str] = "ftrl"
    learning_rate: float = 0.001
    learning_rate_power: float = -0.5
    initial_accumulator_value: float = 0.1
    l1_regularization_strength: float = 0.0
    l2_regularization_strength: float = 0.0
    l2_shrinkage_regularization_strength: float = 0.0
    beta: float = 0.0

    def _validate(self) -> None:
        super()._validate()
        self._require(self.learning_rate > 0, "learning_rate", "> 0")
        self._require(self.learning_rate_power <= 0, "learning_rate_power", "<= 0")
        self._require(self.initial_accumulator_value >= 0, "initial_accumulator_value", ">= 0")
        for field in (
            "l1_regularization_strength",
            "l2_regularization_strength",
            "l2_shrinkage_regularization_strength",
            "beta",
        ):
            self._require(getattr(self, field) >= 0, field, ">= 0")

    @property
    def slot_names(self) -> tuple[str, ...]:
        """``accumulator`` (sum of squared gradients) and ``linear`` (the FTRL ``z``)."""
        return ("accumulator", "linear")

    def init_slots(self, var: Any) -> dict[str, Any]:
        """The accumulator filled with ``initial_accumulator_value``, ``linear`` zeros."""
        xp = array_module(var)
        return {
            "accumulator": xp.full_like(var, _scalar(self.initial_accumulator_value, var.dtype)),
            "linear": xp.zeros_like(var),
        }

    def _update(self, var, grad, slots, step):
        xp = array_module(var)
        dt = var.dtype
        lr = _scalar(self.learning_rate, dt)
        neg_power = _scalar(-self.learning_rate_power, dt)
        l1 = _scalar(self.l1_regularization_strength, dt)
        # Keras adds beta / (2 lr) to l2 in the variable's dtype.
        l2 = _scalar(self.l2_regularization_strength, dt) + _scalar(self.beta, dt) / (
            _scalar(2.0, dt) * lr
        )
        acc, linear = slots["accumulator"], slots["linear"]
        grad_to_use = grad + _scalar(2 * self.l2_shrinkage_regularization_strength, dt) * var
        new_acc = acc + xp.square(grad)
        new_pow = xp.power(new_acc, neg_power)
        linear += grad_to_use - (new_pow - xp.power(acc, neg_power)) / lr * var
        quadratic = new_pow / lr + _scalar(2, dt) * l2
        var[...] = (xp.clip(linear, -l1, l1) - linear) / quadratic
        acc[...] = new_acc


def rule_from_config(config: dict[str, Any] | str) -> UpdateRule:
    """Builds a rule from ``{"name": "adam", "learning_rate": ...}`` (or just a name).

    Names are case-insensitive (``"SGD"``, ``"sgd"``).

    Raises:
        InvalidArgumentError: not a dict, no or unknown ``name`` (the registered
            names are listed), unknown or out-of-range hyperparameters.
    """
    if isinstance(config, str):
        config = {"name": config}
    if not isinstance(config, dict):
        raise InvalidArgumentError(f"optimizer config must be a dict, got {config!r}")
    name = config.get("name")
    if not isinstance(name, str):
        raise InvalidArgumentError(f"optimizer config needs a string 'name', got {name!r}")
    cls = _REGISTRY.get(name.lower())
    if cls is None:
        raise InvalidArgumentError(
            f"unknown optimizer {name!r}; registered: {list(registered_rules())}"
        )
    return cls.from_config({**config, "name": cls.name})

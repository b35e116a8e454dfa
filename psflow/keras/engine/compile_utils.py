"""What ``compile`` makes of losses, loss weights and metrics for a model with several outputs.

Keras's rules (Keras 3, as in TensorFlow 2.21): ``loss``, ``loss_weights``
and ``metrics`` may be one value for every output (loss only), a list in
output order, or a dict keyed by output name. The total loss is the weighted
sum of the per-output losses; each output's unweighted loss is logged as
``<output>_loss`` and each of its metrics as ``<output>_<metric>``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from psflow import errors
from psflow.framework.tensor import Tensor
from psflow.keras import losses as losses_lib
from psflow.keras import metrics as metrics_lib
from psflow.ops import math_ops
from psflow.util import nest


def per_output(value: Any, names: list[str], what: str, default: Any = None) -> list[Any]:
    """``value`` spread over the outputs: a dict by name, a list by position.

    Raises:
        InvalidArgumentError: a dict key that names no output, or a list of the
            wrong length; the message quotes the value and the output names.
    """
    if isinstance(value, dict):
        unknown = [k for k in value if k not in names]
        if unknown:
            raise errors.InvalidArgumentError(
                f"{what}: keys {unknown} name no output; the outputs are {names}"
            )
        return [value.get(n, default) for n in names]
    if isinstance(value, (list, tuple)):
        if len(value) != len(names):
            raise errors.InvalidArgumentError(
                f"{what} should have one entry per output ({len(names)}: {names}), got "
                f"{len(value)}: {value!r}"
            )
        return list(value)
    raise errors.InvalidArgumentError(
        f"{what} must be a list or a dict keyed by output name ({names}), got {value!r}"
    )


def split_by_output(value: Any, names: list[str], what: str) -> list[Any]:
    """A batch structure (targets, predictions, sample weights) as one entry per output."""
    if isinstance(value, dict):
        missing = [n for n in names if n not in value]
        if missing:
            raise errors.InvalidArgumentError(
                f"{what} has no entry for outputs {missing}; got keys {sorted(value)}"
            )
        return [value[n] for n in names]
    if isinstance(value, (list, tuple)) and len(value) == len(names):
        return list(value)
    raise errors.InvalidArgumentError(
        f"{what} must be a list of {len(names)} (one per output {names}) or a dict keyed by "
        f"output name, got {type(value).__name__}"
        + (f" of {len(value)}" if isinstance(value, (list, tuple)) else "")
    )


def select(names: list[str], index: int, y_true: Any, y_pred: Any, sample_weight: Any) -> tuple:
    """Output ``index``'s targets, predictions and sample weights (one weight array: shared)."""
    yt = split_by_output(y_true, names, "y")[index]
    yp = split_by_output(y_pred, names, "the model's outputs")[index]
    if sample_weight is None or not isinstance(sample_weight, (dict, list, tuple)):
        return yt, yp, sample_weight
    return yt, yp, split_by_output(sample_weight, names, "sample_weight")[index]


class OutputLosses:
    """The compiled loss of a model with several outputs.

    Args:
        loss: one loss for every output, a list, or a dict by output name
            (outputs left out of a dict get no loss).
        loss_weights: None (all 1), a list, or a dict by output name.
        names: the model's output names.
    """

    def __init__(self, loss: Any, loss_weights: Any, names: list[str]) -> None:
        self.names = list(names)
        if isinstance(loss, (dict, list, tuple)):
            specs = per_output(loss, self.names, "loss")
        else:
            specs = [loss] * len(self.names)
        self.losses = [None if s is None else losses_lib.get(s) for s in specs]
        if all(fn is None for fn in self.losses):
            raise errors.InvalidArgumentError(f"loss {loss!r} gives no output a loss")
        weights = (
            [1.0] * len(self.names)
            if loss_weights is None
            else per_output(loss_weights, self.names, "loss_weights", 1.0)
        )
        self.weights = [float(w) for w in weights]
        with metrics_lib.local_metrics():  # fit aggregates these itself, on the chief
            self.trackers = [
                None if fn is None else metrics_lib.Mean(name=f"{name}_loss")
                for fn, name in zip(self.losses, self.names)
            ]

    @property
    def metrics(self) -> list[metrics_lib.Metric]:
        """The per-output loss trackers."""
        return [t for t in self.trackers if t is not None]

    def __call__(self, y_true: Any, y_pred: Any, sample_weight: Any) -> Tensor:
        """The weighted total; records each output's unweighted loss on its tracker."""
        total = None
        batch = np.float64(_batch_size(y_pred))
        for i, fn in enumerate(self.losses):
            if fn is None:
                continue
            yt, yp, sw = select(self.names, i, y_true, y_pred, sample_weight)
            value = fn(yt, yp, sw)
            self.trackers[i].update_state(value, sample_weight=batch)
            weighted = (
                value if self.weights[i] == 1.0 else math_ops.multiply(value, self.weights[i])
            )
            total = weighted if total is None else math_ops.add(total, weighted)
        return total


def output_metrics(metrics: Any, names: list[str]) -> list[tuple[metrics_lib.Metric, int]]:
    """Compiled metrics of a multi-output model, each with the index of its output.

    Each metric is renamed ``<output>_<metric>``, as Keras logs it.

    Raises:
        InvalidArgumentError: ``metrics`` is neither a dict by output name nor a
            list with one entry (a metric, a list of them, or None) per output.
    """
    if metrics is None:
        return []
    out = []
    with metrics_lib.local_metrics():
        for index, entry in enumerate(per_output(metrics, names, "metrics")):
            for spec in nest.flatten(entry) if isinstance(entry, (list, tuple)) else [entry]:
                if spec is None:
                    continue
                metric = metrics_lib.get(spec)
                metric.name = f"{names[index]}_{metric.name}"
                out.append((metric, index))
    return out


def _batch_size(y_pred: Any) -> int:
    leaf = nest.flatten(y_pred)[0]
    shape = tuple(leaf.shape)
    return int(shape[0]) if shape else 1

"""Metric state on the parameter servers, for metrics created in a strategy's scope.

A metric keeps accumulating locally; when a worker's closure ends (or at once,
outside a closure) its local state is added to PS variables with
``assign_add`` and cleared. Exactly once: inside a closure those writes carry
request ids derived from the closure, so a closure re-run after its worker was
lost repeats the ids and the PS (in-process or a PS process) applies them
once. ``result()`` on the chief reads the PS variables, so it covers every
worker's updates.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from psflow.distribute.ps import session as session_lib


class PSMetricState:
    """The PS variables holding one metric's state.

    Args:
        metric: the metric (its ``_initial_state()`` gives the shapes).
        strategy: the ParameterServerStrategy whose scope created it.
    """

    def __init__(self, metric: Any, strategy: Any) -> None:
        from psflow.framework.variable import Variable

        with strategy.scope():
            self.variables = [
                Variable(
                    np.zeros_like(a),
                    trainable=False,
                    name=f"metrics/{metric.name}/{i}",
                    dtype="float64",
                )
                for i, a in enumerate(metric._initial_state())
            ]

    def after_update(self, metric: Any) -> None:
        """Flushes now, or when the running closure ends."""
        session = session_lib.current()
        if not session.defer_flush(metric):
            self.flush(metric)

    def flush(self, metric: Any) -> None:
        """Adds the local state to the PS variables and clears it."""
        local = metric._local_state()
        if not any(np.any(a) for a in local):
            return
        metric._clear_local()
        for var, arr in zip(self.variables, local):
            var.assign_add(arr)

    def state(self, metric: Any) -> tuple[np.ndarray, ...]:
        """The accumulated state of every worker (local pending updates flushed first)."""
        self.flush(metric)
        return tuple(np.asarray(v.numpy(), dtype=np.float64) for v in self.variables)

    def reset(self, metric: Any) -> None:
        """Zeroes the PS state."""
        for v, a in zip(self.variables, metric._initial_state()):
            v.assign(a)

    def add(self, metric: Any, deltas: list[np.ndarray]) -> None:
        """Adds a merged state."""
        for v, d in zip(self.variables, deltas):
            v.assign_add(np.asarray(d, dtype=np.float64))

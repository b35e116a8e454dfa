"""The base of every training callback, and the list ``fit`` calls their hooks through.

Its own module, below :mod:`psflow.keras.callbacks` and the callbacks that
live in modules of their own, so each of them imports it without a cycle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["Callback", "CallbackList"]


class Callback:
    """Base class: hooks called by ``fit``, ``evaluate`` and ``predict``."""

    def __init__(self) -> None:
        self.model: Any = None
        self.params: dict[str, Any] = {}

    def set_model(self, model: Any) -> None:
        """Attaches the model being trained."""
        self.model = model

    def set_params(self, params: dict[str, Any]) -> None:
        """Receives ``epochs``, ``steps`` and ``verbose``."""
        self.params = params

    def on_train_begin(self, logs: dict | None = None) -> None:
        """Called once when training starts."""

    def on_train_end(self, logs: dict | None = None) -> None:
        """Called once when training ends."""

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        """Called at the start of each epoch."""

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Called at the end of each epoch with its logs (validation ones too)."""

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        """Called before each training step."""

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Called after each training step with the running logs."""

    def on_test_begin(self, logs: dict | None = None) -> None:
        """Called when evaluation starts."""

    def on_test_end(self, logs: dict | None = None) -> None:
        """Called when evaluation ends."""

    def on_test_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        """Called before each evaluation step."""

    def on_test_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Called after each evaluation step."""

    def on_predict_begin(self, logs: dict | None = None) -> None:
        """Called when prediction starts."""

    def on_predict_end(self, logs: dict | None = None) -> None:
        """Called when prediction ends."""

    def on_predict_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        """Called before each prediction step."""

    def on_predict_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Called after each prediction step."""

    def on_membership_change(self, logs: dict | None = None) -> None:
        """Called when an elastic group changed (``logs``: generation, members, reason,
        ``resumed_step``, ``num_replicas_in_sync``, ``global_batch_scale``): e.g. to scale
        the learning rate with the global batch."""

    def settle_after(self, batch: int) -> bool:
        """Whether ``on_train_batch_end(batch)`` needs the model settled: every
        step up to ``batch`` applied and none after it started (a backup taken
        there).  A runner that keeps steps in flight waits for them first."""
        return False


class CallbackList:
    """Calls a hook on every callback in order."""

    def __init__(
        self, callbacks: list[Callback] | None, model: Any, params: dict[str, Any]
    ) -> None:
        self.callbacks = list(callbacks or [])
        for cb in self.callbacks:
            if not isinstance(cb, Callback):
                raise TypeError(f"callbacks must be keras Callback objects, got {cb!r}")
            cb.set_model(model)
            cb.set_params(params)

    def settle_after(self, batch: int) -> bool:
        """Whether any callback needs the model settled after training step ``batch``."""
        return any(cb.settle_after(batch) for cb in self.callbacks)

    def __getattr__(self, hook: str) -> Callable[..., None]:
        if not hook.startswith("on_"):
            raise AttributeError(hook)

        # Keras always passes ``logs`` positionally, so LambdaCallback's documented
        # lambdas (``lambda logs: ...``, ``lambda epoch, logs: ...``) can rely on it.
        arity = 2 if hook.startswith(_INDEXED_HOOKS) else 1

        def call(*args: Any, **kwargs: Any) -> None:
            if "logs" in kwargs:
                args = (*args, kwargs.pop("logs"))
            if len(args) >= arity:  # every hook fit calls: nothing to pad
                for cb in self.callbacks:
                    getattr(cb, hook)(*args, **kwargs)
                return
            for cb in self.callbacks:  # each callback gets its own empty logs
                padded = args + tuple({} for _ in range(arity - len(args)))
                getattr(cb, hook)(*padded, **kwargs)

        return call


_INDEXED_HOOKS = ("on_epoch_", "on_train_batch_", "on_test_batch_", "on_predict_batch_")

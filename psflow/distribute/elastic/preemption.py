"""TensorFlow's ``PreemptionCheckpointHandler``: save when a worker is preempted, then go on.

In TensorFlow a preemption notice (SIGTERM) makes every worker save a
checkpoint at the next step and exit, and the job is restarted from it.  In
an elastic psflow group the preempted worker drains instead: at the next
step boundary the group saves (the chief writes, the others' variables are
the same), the preempted worker leaves, and the others keep training,
without a restart.  Outside an elastic group it behaves as TensorFlow's:
save at the next ``run`` and exit (status 0).
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from psflow import errors

__all__ = ["PreemptionCheckpointHandler"]


class PreemptionCheckpointHandler:
    """Saves a checkpoint when a worker is preempted (TensorFlow's API).

    Args:
        cluster_resolver: the strategy's cluster resolver (kept for TensorFlow's signature).
        checkpoint_or_checkpoint_manager: a ``Checkpoint`` (then ``checkpoint_dir``
            is needed) or a ``CheckpointManager``.
        checkpoint_dir: where a bare ``Checkpoint`` is saved.
        termination_config: unused (TensorFlow's platform hooks).
        strategy: the strategy (default: the one whose scope is entered: create the handler
            inside ``strategy.scope()``, as TensorFlow's guide does).

    Raises:
        InvalidArgumentError: a bare ``Checkpoint`` without ``checkpoint_dir``.

    Example:
        >>> import psflow as pf, tempfile
        >>> ckpt = pf.train.Checkpoint(step=pf.Variable(0))
        >>> handler = pf.distribute.experimental.PreemptionCheckpointHandler(
        ...     None, ckpt, tempfile.mkdtemp())
        >>> handler.run(lambda: 1), handler.total_run_calls
        (1, 1)
    """

    def __init__(
        self,
        cluster_resolver: Any,
        checkpoint_or_checkpoint_manager: Any,
        checkpoint_dir: str | None = None,
        termination_config: Any = None,
        *,
        strategy: Any = None,
    ) -> None:
        from psflow.distribute import distribute_lib
        from psflow.train.manager import CheckpointManager

        target = checkpoint_or_checkpoint_manager
        if isinstance(target, CheckpointManager):
            self._manager = target
        else:
            if checkpoint_dir is None:
                raise errors.InvalidArgumentError(
                    "PreemptionCheckpointHandler: a Checkpoint needs a checkpoint_dir"
                )
            self._manager = CheckpointManager(target, checkpoint_dir, max_to_keep=1)
        self._resolver = cluster_resolver
        self._strategy = strategy if strategy is not None else distribute_lib.get_strategy()
        self.total_run_calls = 0
        self.saves = 0
        self._preempted = False
        self._manager.restore_or_initialize()  # TensorFlow restores the latest checkpoint
        from psflow.distribute.multi_worker_mirrored_strategy import MultiWorkerMirroredStrategy

        controller = (
            self._strategy.elastic
            if isinstance(self._strategy, MultiWorkerMirroredStrategy)
            else None
        )
        self._controller = controller
        if controller is not None:
            controller.add_drain_listener(self._on_drain)
        elif threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._preempted = True

    def _save(self) -> None:
        if self._strategy.extended.should_checkpoint:  # the chief; the others hold the same
            self._manager.save()
        self.saves += 1

    def _on_drain(self, leaving: list[int]) -> None:
        self._save()

    def run(self, distributed_train_function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Runs one step (``distributed_train_function(*args, **kwargs)``) and counts it.

        Outside an elastic group, a preemption noticed before the step saves and exits.
        """
        if self._preempted:
            self._save()
            sys.exit(0)
        self.total_run_calls += 1
        return distributed_train_function(*args, **kwargs)

    def watch_preemption_scope(self) -> Any:
        """TensorFlow's context for code that may be preempted (nothing to set up here)."""
        import contextlib

        return contextlib.nullcontext()

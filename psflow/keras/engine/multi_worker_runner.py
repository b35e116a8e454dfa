"""``fit`` under MultiWorkerMirroredStrategy: every worker runs the same steps in lockstep.

Each worker reads the same global batches; the strategy's distributed input
gives each of its replicas its slice (DATA sharding, see
:mod:`psflow.distribute.multi_worker_input`), the loss of a replica is scaled
by its share of the *global* batch, and gradients are summed over every
worker's replicas, so all workers apply the same update.  Logged metrics are
every worker's metric states summed (:meth:`MultiWorkerExtended.metric_results`),
so each worker reports the same numbers.
"""

from __future__ import annotations

from typing import Any

from psflow.keras.engine.runner import MirroredRunner


class MultiWorkerRunner(MirroredRunner):
    """A :class:`MirroredRunner` whose batches are cut across every worker's replicas."""

    def __init__(self, model: Any, strategy: Any) -> None:
        super().__init__(model, strategy)
        self._prepared: Any = None

    def prepare(self, source: Any) -> Any:
        """Cuts each global batch of ``source`` across the workers' replicas."""
        from psflow.distribute import multi_worker_input
        from psflow.keras.engine import data_adapter

        if data_adapter.is_distributed(getattr(source, "dataset", None)):
            return source
        if self.strategy.elastic is not None:
            from psflow.distribute.elastic.input import ElasticDataset

            self._prepared = ElasticDataset(
                source,
                list(self.strategy._devices),
                self.strategy.elastic,
                policy_of=getattr(source, "dataset", None),
            )
            return self._prepared
        self._prepared = multi_worker_input.MultiWorkerDataset(
            source,
            list(self.strategy._devices),
            self.strategy._group.size,
            self.strategy._group.rank,
            self.strategy._ring,
            policy_of=getattr(source, "dataset", None),
        )
        return self._prepared

    def first_epoch(self, initial_epoch: int) -> int:
        """A worker that joined a running elastic group starts in the group's epoch."""
        controller = self.strategy.elastic
        if controller is None:
            return initial_epoch
        # its optimizer takes the group's step and slots now, even if no step is left for it
        self.strategy.extended.prepare_optimizer(self.model.optimizer)
        return max(initial_epoch, controller.initial_epoch)

    def _run(self, fn: Any, batch: Any) -> Any:
        prepared = self._prepared

        def scaled(*args: Any) -> Any:
            # the loss of each replica is scaled by its share of the global batch, of every
            # worker: read when the step runs (an elastic group may cut the step again)
            self.model._global_batch_size = prepared.global_batch_size if prepared else None
            return fn(*args)

        try:
            return self.strategy.run(scaled, args=(batch,))
        finally:
            self.model._global_batch_size = None

    def train_epoch(
        self,
        source: Any,
        steps: int | None,
        callbacks: Any,
        epoch: int | None = None,
        first_step: int = 0,
    ) -> int:
        """As :class:`MirroredRunner`; callbacks' ``on_membership_change`` sees each change."""
        controller = self.strategy.elastic
        if controller is None:
            return super().train_epoch(source, steps, callbacks, epoch, first_step)
        remove = controller.add_listener(
            lambda change: callbacks.on_membership_change(change.as_logs())
        )
        try:
            return super().train_epoch(source, steps, callbacks, epoch, first_step)
        finally:
            remove()

    def _execution_size(self) -> int:
        # one step per execution: the workers agree on an uneven last batch step by step
        return 1

    def _execute(self, fn: Any, batches: list[Any]) -> list[Any]:
        return [self._run(fn, batch) for batch in batches]

    def predict(self, source: Any, steps: int | None, callbacks: Any) -> list[Any]:
        """Every worker's predictions of each global batch, in order, on every worker."""
        import numpy as np

        from psflow.util import nest

        ring = self.strategy._ring
        local = super().predict(source, steps, callbacks)
        return [nest.map_structure(lambda a: ring.all_gather(np.asarray(a), 0), o) for o in local]

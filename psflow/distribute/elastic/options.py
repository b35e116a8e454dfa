"""What an elastic group may do, parsed once: sizes, batch policy, timing, the drain signal."""

from __future__ import annotations

import dataclasses
import enum
import os
import signal
from collections.abc import Mapping

from psflow import errors

__all__ = ["MAX_WORKERS_ENV", "BatchPolicy", "ElasticOptions", "MembershipChange"]

MAX_WORKERS_ENV = "PSFLOW_ELASTIC_MAX_WORKERS"
"""The launcher's bound on an elastic group (``psflow local --workers-max``)."""


class BatchPolicy(enum.Enum):
    """What stays fixed when the number of workers changes.

    ``KEEP_PER_REPLICA`` (the default): each replica keeps its batch, so the
    global batch shrinks or grows with the group (scale the learning rate in
    ``on_membership_change``).  ``KEEP_GLOBAL``: the dataset's global batches
    stay as they are and are cut over fewer (or more) replicas.
    """

    KEEP_PER_REPLICA = "keep_per_replica"
    KEEP_GLOBAL = "keep_global"


@dataclasses.dataclass(frozen=True)
class ElasticOptions:
    """Makes a ``MultiWorkerMirroredStrategy`` group elastic.

    Without it a lost worker is an error on every survivor (as in TensorFlow);
    with it the survivors agree on a new membership and go on from the last
    completed step, in the same processes.

    Attributes:
        min_workers: fewer members than this after a change is an
            ``UnavailableError`` on every survivor (set it above half the
            workers to rule out two groups after a network partition).
        max_workers: the most members the group may have (None: the launcher's
            ``PSFLOW_ELASTIC_MAX_WORKERS`` where it sets one, as ``psflow local
            --workers-max`` does, else as many as ``TF_CONFIG`` lists).
        batch_policy: see :class:`BatchPolicy`.
        rendezvous_seconds: how long the agreement waits for members nobody suspects.
        drain_signal: the signal that makes this worker leave at the next step
            boundary (None: no handler is installed).

    Example:
        >>> import psflow as pf
        >>> pf.distribute.experimental.ElasticOptions(min_workers=2).batch_policy.value
        'keep_per_replica'
    """

    min_workers: int = 1
    max_workers: int | None = None
    batch_policy: BatchPolicy = BatchPolicy.KEEP_PER_REPLICA
    rendezvous_seconds: float = 10.0
    drain_signal: int | None = int(signal.SIGTERM)

    def most_workers(self, listed: int, environ: Mapping[str, str] | None = None) -> int:
        """The group's bound: :attr:`max_workers`, the launcher's, or ``listed``.

        Raises:
            InvalidArgumentError: ``PSFLOW_ELASTIC_MAX_WORKERS`` is not a number >=
                ``min_workers`` (naming it).
        """
        if self.max_workers is not None:
            return self.max_workers
        text = (os.environ if environ is None else environ).get(MAX_WORKERS_ENV, "").strip()
        if not text:
            return listed
        if not text.isdigit() or int(text) < self.min_workers:
            raise errors.InvalidArgumentError(
                f"{MAX_WORKERS_ENV}={text!r} must be a number >= min_workers ({self.min_workers})"
            )
        return max(int(text), listed)

    def __post_init__(self) -> None:
        if not isinstance(self.min_workers, int) or self.min_workers < 1:
            raise errors.InvalidArgumentError(f"min_workers must be >= 1, got {self.min_workers!r}")
        if self.max_workers is not None and (
            not isinstance(self.max_workers, int) or self.max_workers < self.min_workers
        ):
            raise errors.InvalidArgumentError(
                f"max_workers must be >= min_workers ({self.min_workers}), got {self.max_workers!r}"
            )
        if not isinstance(self.batch_policy, BatchPolicy):
            try:
                object.__setattr__(self, "batch_policy", BatchPolicy(self.batch_policy))
            except ValueError:
                raise errors.InvalidArgumentError(
                    f"batch_policy must be one of {[p.value for p in BatchPolicy]}, "
                    f"got {self.batch_policy!r}"
                ) from None
        if not self.rendezvous_seconds > 0:
            raise errors.InvalidArgumentError(
                f"rendezvous_seconds must be > 0, got {self.rendezvous_seconds!r}"
            )


@dataclasses.dataclass(frozen=True)
class MembershipChange:
    """One change of the group, as callbacks see it (``logs`` of ``on_membership_change``).

    Attributes:
        generation: the new generation.
        members: the worker ids (their index in ``TF_CONFIG``) of the new group.
        previous_members: those of the generation before.
        reason: ``"lost"`` (a failure) or ``"drained"`` (a worker left at a step boundary).
        resumed_step: the step count training goes on from.
        num_replicas_in_sync: replicas after the change.
        global_batch_scale: new global batch / old (1.0 under ``KEEP_GLOBAL``).
    """

    generation: int
    members: tuple[int, ...]
    previous_members: tuple[int, ...]
    reason: str
    resumed_step: int
    num_replicas_in_sync: int
    global_batch_scale: float

    def as_logs(self) -> dict[str, object]:
        """The dict Keras callbacks receive."""
        return dataclasses.asdict(self)

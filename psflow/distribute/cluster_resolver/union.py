"""``UnionClusterResolver``: several resolvers merged into one cluster."""

from __future__ import annotations

from psflow.distribute.cluster_resolver.base import (
    ClusterResolver,
    check_rpc_layer,
    check_task_id,
    check_task_type,
)
from psflow.distribute.cluster_resolver.cluster_spec import ClusterSpec, ClusterTypeError
from psflow.errors import InvalidArgumentError


class ClusterMergeError(InvalidArgumentError, KeyError):
    """Two resolvers define the same task of a job (TF raises ``KeyError`` here)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return InvalidArgumentError.__str__(self)


def merge_cluster_specs(*specs: ClusterSpec) -> ClusterSpec:
    """Returns the union of ``specs``, with TensorFlow's ``UnionResolver`` rules.

    A job that every spec defines as a list (dense) gets the lists
    concatenated in order.  A job that any spec defines sparsely is merged as
    ``{index: address}`` (lists counting as ``{0: ..., 1: ...}``) and two specs
    giving the same index is an error.

    Raises:
        ClusterMergeError: two specs define the same task index of a job;
            the message names the job and the indices.
    """
    dicts = [spec.as_dict() for spec in specs]
    sparse_jobs = {job for d in dicts for job, tasks in d.items() if isinstance(tasks, dict)}
    dense: dict[str, list[str]] = {}
    sparse: dict[str, dict[int, str]] = {}
    order: dict[str, None] = {}  # first-seen job order
    for d in dicts:
        for job, tasks in d.items():
            order.setdefault(job)
            if job not in sparse_jobs:
                dense.setdefault(job, []).extend(tasks)
                continue
            target = sparse.setdefault(job, {})
            incoming = dict(enumerate(tasks)) if isinstance(tasks, list) else tasks
            clash = sorted(set(target) & set(incoming))
            if clash:
                raise ClusterMergeError(
                    f"job {job!r} defines task indices {clash} in more than one resolver"
                )
            target.update(incoming)
    merged = {job: dense[job] if job in dense else sparse[job] for job in order}
    return ClusterSpec(merged)


class UnionClusterResolver(ClusterResolver):
    """The union of several resolvers' clusters, with the first one's task.

    ``cluster_spec()`` merges every resolver's cluster (see
    :func:`merge_cluster_specs`) each time it is called.  ``task_type``,
    ``task_id`` and ``rpc_layer`` are the explicit arguments when given, else
    the first resolver's; ``environment``, ``num_accelerators`` and ``master``
    (when no task is named) are the first resolver's.  Unlike TF, an explicit
    ``task_id=0`` does win over the first resolver's index.

    Args:
        *resolvers: one or more ``ClusterResolver``s.
        task_type: overrides the first resolver's task type.
        task_id: overrides the first resolver's task index.
        rpc_layer: overrides the first resolver's RPC layer.

    Raises:
        InvalidArgumentError: no resolver was given, or an override is invalid.
        ClusterTypeError: an argument is not a ``ClusterResolver``.

    Example:
        >>> from psflow.distribute.cluster_resolver import SimpleClusterResolver
        >>> workers = SimpleClusterResolver({"worker": ["w0:1", "w1:1"]},
        ...                                 task_type="worker", task_id=0)
        >>> ps = SimpleClusterResolver({"ps": ["p0:1"]}, task_type="ps", task_id=0)
        >>> union = UnionClusterResolver(workers, ps)
        >>> union.cluster_spec().as_dict()
        {'worker': ['w0:1', 'w1:1'], 'ps': ['p0:1']}
        >>> union.task_type, union.task_id
        ('worker', 0)
    """

    def __init__(
        self,
        *resolvers: ClusterResolver,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
    ) -> None:
        if not resolvers:
            raise InvalidArgumentError("UnionClusterResolver needs at least one ClusterResolver")
        for position, resolver in enumerate(resolvers):
            if not isinstance(resolver, ClusterResolver):
                raise ClusterTypeError(
                    f"argument {position} ({resolver!r}) is a {type(resolver).__name__}, "
                    "not a ClusterResolver"
                )
        self._resolvers = tuple(resolvers)
        self._task_type = check_task_type(task_type)
        self._task_id = check_task_id(task_id)
        self._rpc_layer = check_rpc_layer(rpc_layer)

    @property
    def resolvers(self) -> tuple[ClusterResolver, ...]:
        """The merged resolvers, in order."""
        return self._resolvers

    def cluster_spec(self) -> ClusterSpec:
        """Returns the union of the resolvers' clusters.

        Raises:
            ClusterMergeError: two resolvers define the same task of a job.
        """
        return merge_cluster_specs(*(resolver.cluster_spec() for resolver in self._resolvers))

    def _master_override(self, named: bool, rpc_layer: str | None) -> str | None:
        # a task named in full: its address in the union; else the first resolver's master
        return None if named else self._resolvers[0].master(rpc_layer=rpc_layer)

    @property
    def task_type(self) -> str | None:
        """The explicit task type, else the first resolver's."""
        return self._task_type if self._task_type is not None else self._resolvers[0].task_type

    @task_type.setter
    def task_type(self, task_type: str | None) -> None:
        self._task_type = check_task_type(task_type)

    @property
    def task_id(self) -> int | None:
        """The explicit task index, else the first resolver's."""
        return self._task_id if self._task_id is not None else self._resolvers[0].task_id

    @task_id.setter
    def task_id(self, task_id: int | None) -> None:
        self._task_id = check_task_id(task_id)

    @property
    def rpc_layer(self) -> str | None:
        """The explicit RPC layer, else the first resolver's."""
        return self._rpc_layer if self._rpc_layer is not None else self._resolvers[0].rpc_layer

    @rpc_layer.setter
    def rpc_layer(self, rpc_layer: str | None) -> None:
        self._rpc_layer = check_rpc_layer(rpc_layer)

    @property
    def environment(self) -> str:
        """The first resolver's environment."""
        return self._resolvers[0].environment

    def num_accelerators(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        config_proto: object = None,
    ) -> dict[str, int]:
        """Returns the first resolver's ``num_accelerators``."""
        return self._resolvers[0].num_accelerators(task_type, task_id, config_proto)

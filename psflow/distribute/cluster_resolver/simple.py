"""``SimpleClusterResolver``: a resolver that returns what it was given."""

from __future__ import annotations

from collections.abc import Mapping

from psflow.distribute.cluster_resolver.base import (
    ClusterResolver,
    check_rpc_layer,
    check_task_id,
    check_task_type,
    format_master_url,
)
from psflow.distribute.cluster_resolver.cluster_spec import ClusterSpec, ClusterTypeError
from psflow.errors import InvalidArgumentError


def _check_num_accelerators(value: object) -> dict[str, int] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise InvalidArgumentError(
            f"num_accelerators {value!r} must be a mapping like {{'GPU': 2}} or None"
        )
    result: dict[str, int] = {}
    for kind, count in value.items():
        if not isinstance(kind, str) or isinstance(count, bool) or not isinstance(count, int):
            raise InvalidArgumentError(
                f"num_accelerators entry {kind!r}: {count!r} must map a device type to an int"
            )
        if count < 0:
            raise InvalidArgumentError(f"num_accelerators[{kind!r}] = {count} is negative")
        result[kind] = count
    return result


class SimpleClusterResolver(ClusterResolver):
    """A resolver holding an explicit cluster, task and accelerator count.

    Args:
        cluster_spec: the cluster (a ``ClusterSpec`` or a mapping accepted by
            ``ClusterSpec``).
        master: the address ``master()`` returns when no task is named.
        task_type: this process's job.
        task_id: this process's index within its job.
        environment: the value of the ``environment`` property.
        num_accelerators: what ``num_accelerators()`` returns (``{}`` when
            ``None``, as in TF: nothing is probed).
        rpc_layer: the protocol prefix ``master()`` adds.

    Raises:
        ClusterTypeError: ``cluster_spec`` or ``master`` has the wrong type.
        InvalidArgumentError: another argument is invalid.

    Example:
        >>> from psflow.distribute.cluster_resolver import ClusterSpec
        >>> spec = ClusterSpec({"worker": ["w0:2222", "w1:2222"]})
        >>> resolver = SimpleClusterResolver(spec, task_type="worker", task_id=1,
        ...                                  num_accelerators={"GPU": 8}, rpc_layer="grpc")
        >>> resolver.master("worker", 0)
        'grpc://w0:2222'
        >>> resolver.num_accelerators()
        {'GPU': 8}
    """

    def __init__(
        self,
        cluster_spec: ClusterSpec | Mapping,
        master: str = "",
        task_type: str | None = None,
        task_id: int | None = None,
        environment: str = "",
        num_accelerators: Mapping[str, int] | None = None,
        rpc_layer: str | None = None,
    ) -> None:
        if isinstance(cluster_spec, Mapping):
            cluster_spec = ClusterSpec(cluster_spec)
        if not isinstance(cluster_spec, ClusterSpec):
            raise ClusterTypeError(
                f"cluster_spec must be a ClusterSpec or a mapping, not "
                f"{type(cluster_spec).__name__} ({cluster_spec!r})"
            )
        if not isinstance(master, str):
            raise ClusterTypeError(f"master {master!r} must be a string")
        if not isinstance(environment, str):
            raise InvalidArgumentError(f"environment {environment!r} must be a string")
        self._cluster_spec = cluster_spec
        self._master = master
        self._task_type = check_task_type(task_type)
        self._task_id = check_task_id(task_id)
        self._environment = environment
        self._num_accelerators = _check_num_accelerators(num_accelerators)
        self._rpc_layer = check_rpc_layer(rpc_layer)

    def cluster_spec(self) -> ClusterSpec:
        """Returns the cluster given to the constructor."""
        return self._cluster_spec

    def _master_override(self, named: bool, rpc_layer: str | None) -> str | None:
        # TF's rule: a task's address only when both task_type and task_id are
        # given, else the master given at construction
        return None if named else format_master_url(self._master, rpc_layer or self._rpc_layer)

    @property
    def environment(self) -> str:
        """The ``environment`` given to the constructor."""
        return self._environment

    def num_accelerators(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        config_proto: object = None,
    ) -> dict[str, int]:
        """Returns a copy of the ``num_accelerators`` given (``{}`` if none); probes nothing."""
        del task_type, task_id, config_proto
        return dict(self._num_accelerators or {})

"""``ClusterResolver``: the interface every cluster resolver implements.

A resolver answers three questions for a process: what the cluster looks like
(:meth:`ClusterResolver.cluster_spec`), which task this process is
(``task_type``, ``task_id``) and how many accelerators it has
(:meth:`ClusterResolver.num_accelerators`).  The interface is TensorFlow's
``tf.distribute.cluster_resolver.ClusterResolver``.
"""

from __future__ import annotations

import abc
from typing import Any

from psflow.distribute.cluster_resolver.accelerators import GpuProbe, cupy_gpu_count, probe_gpus
from psflow.distribute.cluster_resolver.cluster_spec import ClusterSpec, coerce_task_index
from psflow.errors import InvalidArgumentError


def format_master_url(master: str, rpc_layer: str | None = None) -> str:
    """Returns ``"<rpc_layer>://<master>"``, or ``master`` when there is no RPC layer.

    Example:
        >>> format_master_url("ps0:2222", "grpc")
        'grpc://ps0:2222'
    """
    return f"{rpc_layer}://{master}" if rpc_layer else master


def check_task_type(task_type: Any, what: str = "task_type") -> str | None:
    """Returns ``task_type`` if it is ``None`` or a non-empty string.

    Raises:
        InvalidArgumentError: anything else; the message names the value.
    """
    if task_type is None or (isinstance(task_type, str) and task_type):
        return task_type
    raise InvalidArgumentError(f"{what} {task_type!r} must be a non-empty string or None")


def check_task_id(task_id: Any, what: str = "task_id") -> int | None:
    """Returns ``task_id`` as an ``int`` (``None`` stays ``None``).

    Raises:
        InvalidArgumentError: ``task_id`` is not a non-negative integer.
    """
    return None if task_id is None else coerce_task_index(task_id, what)


def check_rpc_layer(rpc_layer: Any) -> str | None:
    """Returns ``rpc_layer`` if it is ``None`` or a string.

    Raises:
        InvalidArgumentError: anything else.
    """
    if rpc_layer is None or isinstance(rpc_layer, str):
        return rpc_layer
    raise InvalidArgumentError(f"rpc_layer {rpc_layer!r} must be a string or None")


class ClusterResolver(abc.ABC):
    """Abstract base of all cluster resolvers.

    Subclasses implement :meth:`cluster_spec`; :meth:`master` has a default.  The
    ``task_type``, ``task_id`` and ``rpc_layer`` properties read (and their
    setters write, after validation) ``self._task_type``, ``self._task_id``
    and ``self._rpc_layer``.

    ``num_accelerators`` counts this machine's GPUs through ``gpu_probe``
    (CuPy by default, imported only when asked; 0 without it).  psflow does not
    query remote tasks, so its ``task_type``/``task_id`` arguments are accepted
    for TF compatibility and ignored; a cluster whose machines differ should
    say so explicitly (``SimpleClusterResolver(num_accelerators=...)``, or a
    ``UnionClusterResolver`` with such an override first).
    """

    _task_type: str | None = None
    _task_id: int | None = None
    _rpc_layer: str | None = None
    _gpu_probe: GpuProbe | None = None

    @abc.abstractmethod
    def cluster_spec(self) -> ClusterSpec:
        """Returns the cluster as a :class:`ClusterSpec`."""

    def master(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
    ) -> str:
        """Returns the address (with ``rpc_layer://`` if any) of a task, TF 1.x's "master".

        One rule for every resolver, in order: the resolver's own answer
        (:meth:`_master_override`: ``TF_CONFIG``'s ``session_master``, a
        ``SimpleClusterResolver``'s ``master`` when no task is named...); else
        the task :meth:`_master_task` picks (the one named, completed by this
        resolver's own task): ``""`` when there is none, else its address in
        :meth:`cluster_spec`.

        Args:
            task_type: the task's job; this resolver's task by default.
            task_id: the task's index; this resolver's task by default.
            rpc_layer: the protocol prefix; this resolver's ``rpc_layer`` by
                default.

        Raises:
            TaskNotFoundError: the task is not in the cluster.
        """
        named = task_type is not None and task_id is not None
        override = self._master_override(named, rpc_layer)
        if override is not None:
            return override
        task_type, task_id = self._master_task(task_type, task_id)
        if task_type is None or task_id is None:
            return ""
        address = self.cluster_spec().task_address(task_type, task_id)
        return format_master_url(address, rpc_layer or self.rpc_layer)

    def _master_override(self, named: bool, rpc_layer: str | None) -> str | None:
        """:meth:`master`'s answer before any task is looked up (None: look one up).

        ``named``: the caller gave both ``task_type`` and ``task_id``.
        """
        del named, rpc_layer
        return None

    def _master_task(
        self, task_type: str | None, task_id: int | None
    ) -> tuple[str | None, int | None]:
        """The task :meth:`master` looks up: the one given, completed by this resolver's."""
        return (
            task_type if task_type is not None else self.task_type,
            task_id if task_id is not None else self.task_id,
        )

    def num_accelerators(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        config_proto: Any = None,
    ) -> dict[str, int]:
        """Returns ``{"GPU": n}``, the GPUs this machine has; never raises.

        Args:
            task_type: accepted for TF compatibility; unused.
            task_id: accepted for TF compatibility; unused.
            config_proto: accepted for TF compatibility; unused.
        """
        del task_type, task_id, config_proto
        return {"GPU": probe_gpus(self.gpu_probe)}

    @property
    def gpu_probe(self) -> GpuProbe:
        """The callable that counts this machine's GPUs (CuPy's count by default)."""
        return self._gpu_probe if self._gpu_probe is not None else cupy_gpu_count

    @gpu_probe.setter
    def gpu_probe(self, probe: GpuProbe | None) -> None:
        if probe is not None and not callable(probe):
            raise InvalidArgumentError(f"gpu_probe {probe!r} must be callable or None")
        self._gpu_probe = probe

    @property
    def environment(self) -> str:
        """The environment psflow runs in: ``""`` unless a resolver says otherwise."""
        return ""

    @property
    def task_type(self) -> str | None:
        """This process's job (``"chief"``, ``"worker"``, ``"ps"``...), or ``None``."""
        return self._task_type

    @task_type.setter
    def task_type(self, task_type: str | None) -> None:
        self._task_type = check_task_type(task_type)

    @property
    def task_id(self) -> int | None:
        """This process's index within its job, or ``None``."""
        return self._task_id

    @task_id.setter
    def task_id(self, task_id: int | None) -> None:
        self._task_id = check_task_id(task_id)

    @property
    def rpc_layer(self) -> str | None:
        """The protocol tasks talk over (``"grpc"``), or ``None``."""
        return self._rpc_layer

    @rpc_layer.setter
    def rpc_layer(self, rpc_layer: str | None) -> None:
        self._rpc_layer = check_rpc_layer(rpc_layer)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(task_type={self.task_type!r}, task_id={self.task_id!r}, "
            f"rpc_layer={self.rpc_layer!r})"
        )

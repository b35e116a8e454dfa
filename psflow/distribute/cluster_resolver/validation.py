"""Checks on a whole cluster, and task strings (``"ps:0"``).

:func:`validate_ps_cluster` holds the rules a parameter-server cluster must
satisfy before any process starts talking to another; the parameter-server
strategy and the ``ps_server``/``worker``/``chief`` entrypoints call it.  They
are TensorFlow's rules (``ParameterServerStrategy`` and
``multi_worker_util``), plus one TF leaves to a hang: no two tasks may share an
address.

Example:
    >>> from psflow.distribute.cluster_resolver import ClusterSpec, validate_ps_cluster
    >>> validate_ps_cluster(ClusterSpec({"ps": ["h:1"], "worker": ["h:2"]}))
    >>> task_string("ps", 0)
    'ps:0'
"""

from __future__ import annotations

from collections.abc import Mapping

from psflow.distribute.cluster_resolver.cluster_spec import (
    ClusterSpec,
    TaskNotFoundError,
    coerce_task_index,
)
from psflow.errors import InvalidArgumentError

# The job names TF gives the roles of a parameter-server cluster.
CHIEF = "chief"
WORKER = "worker"
PS = "ps"
EVALUATOR = "evaluator"

PS_CLUSTER_JOBS = (CHIEF, WORKER, PS, EVALUATOR)
"""The jobs a parameter-server cluster may have."""


def task_string(task_type: str, task_id: int) -> str:
    """Returns ``"<task_type>:<task_id>"``, the name psflow gives a task in errors and logs.

    Raises:
        InvalidArgumentError: ``task_type`` is not a non-empty string without
            ``":"``, or ``task_id`` is not a non-negative integer.
    """
    if not isinstance(task_type, str) or not task_type or ":" in task_type:
        raise InvalidArgumentError(
            f"task type {task_type!r} must be a non-empty string without ':'"
        )
    return f"{task_type}:{coerce_task_index(task_id, 'task id')}"


def parse_task_string(task: str) -> tuple[str, int]:
    """Returns ``(task_type, task_id)`` from ``"<task_type>:<task_id>"``.

    Raises:
        InvalidArgumentError: ``task`` is not of that form.
    """
    if not isinstance(task, str) or task.count(":") != 1:
        raise InvalidArgumentError(f"task {task!r} must look like 'ps:0'")
    task_type, _, index = task.partition(":")
    if not task_type:
        raise InvalidArgumentError(f"task {task!r} has an empty task type")
    return task_type, coerce_task_index(index, f"task id in {task!r}")


def validate_unique_addresses(spec: ClusterSpec) -> None:
    """Checks that no two tasks of ``spec`` share an address.

    Raises:
        InvalidArgumentError: naming the address and both tasks.
    """
    seen: dict[str, str] = {}
    for job, index, address in spec.tasks():
        task = f"{job}:{index}"
        if address in seen:
            raise InvalidArgumentError(
                f"duplicate address {address!r}: tasks {seen[address]} and {task} share it"
            )
        seen[address] = task


def _count(spec: ClusterSpec, job: str) -> int:
    return spec.num_tasks(job) if job in spec.jobs else 0


def validate_task(spec: ClusterSpec, task_type: str, task_id: int) -> None:
    """Checks that task ``task_type:task_id`` exists in ``spec``.

    An ``evaluator`` is exempt when ``spec`` has no ``evaluator`` job: it is
    not part of the training cluster (TF's rule).

    Raises:
        TaskNotFoundError: the job or the index is not in ``spec``.
        InvalidArgumentError: ``task_id`` is not a non-negative integer.
    """
    index = coerce_task_index(task_id, f"task index of {task_type!r}")
    if task_type == EVALUATOR and EVALUATOR not in spec.jobs:
        return
    if task_type not in spec.jobs:
        raise TaskNotFoundError(
            f"task type {task_type!r} is not a job of the cluster (jobs: {spec.jobs})"
        )
    if index not in spec.task_indices(task_type):
        raise TaskNotFoundError(
            f"task index {index} is out of range for job {task_type!r} "
            f"(indices: {spec.task_indices(task_type)})"
        )


def validate_ps_cluster(
    spec: ClusterSpec | Mapping,
    *,
    task_type: str | None = None,
    task_id: int | None = None,
) -> None:
    """Checks that ``spec`` describes a parameter-server cluster.

    The cluster must have only ``chief``/``worker``/``ps``/``evaluator`` jobs,
    at least one ``ps`` and one ``worker`` task, at most one ``chief`` and one
    ``evaluator``, and no address used twice.  When ``task_type`` is given, the
    task ``task_type:task_id`` must be in the cluster too (an ``evaluator``
    may be outside it).

    Raises:
        InvalidArgumentError: a rule is broken; the message names the job,
            count or address at fault.
        TaskNotFoundError: the given task is not in the cluster.
    """
    if not isinstance(spec, ClusterSpec):
        if not isinstance(spec, Mapping):
            raise InvalidArgumentError(
                f"cluster spec {spec!r} must be a ClusterSpec or a mapping of jobs"
            )
        spec = ClusterSpec(spec)
    if not spec:
        raise InvalidArgumentError(
            "the cluster spec is empty; a parameter-server cluster needs at least one "
            "'ps' and one 'worker' task"
        )
    for job in spec.jobs:
        if job not in PS_CLUSTER_JOBS:
            raise InvalidArgumentError(
                f"job {job!r} is not allowed in a parameter-server cluster "
                f"(allowed: {list(PS_CLUSTER_JOBS)})"
            )
    for job in (PS, WORKER):
        if _count(spec, job) < 1:
            raise InvalidArgumentError(
                f"a parameter-server cluster needs at least one {job!r} task; jobs are "
                f"{ {j: spec.num_tasks(j) for j in spec.jobs} }"
            )
    for job in (CHIEF, EVALUATOR):
        if _count(spec, job) > 1:
            raise InvalidArgumentError(
                f"there must be at most one {job!r} task, found {_count(spec, job)}: "
                f"{spec.as_dict()[job]!r}"
            )
    validate_unique_addresses(spec)
    if task_type is not None:
        if task_id is None:
            raise InvalidArgumentError(f"task type {task_type!r} given without a task id")
        validate_task(spec, task_type, task_id)

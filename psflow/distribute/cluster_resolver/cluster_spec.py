"""``ClusterSpec``: the jobs of a cluster and the network address of each task.

A cluster is a set of *jobs* (``"ps"``, ``"worker"``, ``"chief"``...), each a set
of *tasks* numbered from 0.  A job is *dense* when its task indices are exactly
``0..n-1`` and *sparse* otherwise (a task that only knows some of its peers).
The semantics are those of TensorFlow's ``tf.train.ClusterSpec``; unlike it, a
``ClusterSpec`` is immutable and hashable, validates every job name, index and
address when it is built, and its errors name the offending value.

Example:
    >>> from psflow.distribute.cluster_resolver import ClusterSpec
    >>> spec = ClusterSpec({"ps": ["ps0:2222"], "worker": {1: "w1:2222"}})
    >>> spec.jobs
    ['ps', 'worker']
    >>> spec.task_address("worker", 1)
    'w1:2222'
    >>> spec.as_dict()
    {'ps': ['ps0:2222'], 'worker': {1: 'w1:2222'}}
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any, TypeAlias, Union

from psflow.errors import InvalidArgumentError, NotFoundError

# Letters, digits, "_", "-" and ".": TF accepts any string, but a job name ends
# up inside task strings ("ps:0") and device names ("/job:ps/task:0"), where ":"
# "/" or whitespace would be ambiguous.  TF's own tests use a numeric job name.
_JOB_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")

TasksLike: TypeAlias = Sequence[str] | Mapping[Any, str]
# A string forward reference cannot take "|" at runtime, hence Union.
ClusterLike: TypeAlias = Union["ClusterSpec", Mapping[str, TasksLike]]


class ClusterTypeError(InvalidArgumentError, TypeError):
    """A cluster definition has the wrong type (e.g. a job given as a string).

    Both an ``InvalidArgumentError`` and a ``TypeError``, as TensorFlow raises
    ``TypeError`` for these.
    """


class TaskNotFoundError(NotFoundError, ValueError):
    """A job or a task index that the cluster does not define.

    Both a ``NotFoundError`` and a ``ValueError``, as TensorFlow raises
    ``ValueError`` for these.
    """


def _check_job_name(job: Any) -> str:
    if not isinstance(job, str):
        raise ClusterTypeError(f"job name {job!r} must be a string, not {type(job).__name__}")
    if not _JOB_NAME.match(job):
        raise InvalidArgumentError(
            f"job name {job!r} is invalid: use letters, digits, '_', '-' and '.' "
            "(no ':', '/' or whitespace)"
        )
    return job


def coerce_task_index(index: Any, what: str = "task index") -> int:
    """Returns ``index`` as a non-negative ``int``.

    Accepts an integer (anything with ``__index__``) or a string of decimal
    digits (JSON object keys and some ``TF_CONFIG`` writers give indices as
    strings).

    Raises:
        InvalidArgumentError: ``index`` is negative, a ``bool``, or not an
            integer; the message names ``what`` and the value.
    """
    if isinstance(index, bool):
        raise InvalidArgumentError(f"{what} {index!r} must be an integer, not a bool")
    if isinstance(index, str):
        text = index.strip()
        if not (text.isascii() and text.isdigit()):
            raise InvalidArgumentError(f"{what} {index!r} must be a non-negative integer")
        value = int(text)
    else:
        try:
            value = operator.index(index)
        except TypeError:
            raise InvalidArgumentError(f"{what} {index!r} must be a non-negative integer") from None
    if value < 0:
        raise InvalidArgumentError(f"{what} {index!r} must be non-negative")
    return value


def _check_address(job: str, index: int, address: Any) -> str:
    if not isinstance(address, str):
        raise ClusterTypeError(
            f"address of task {job}:{index} must be a string, not {type(address).__name__} "
            f"({address!r})"
        )
    if not address or any(c.isspace() for c in address):
        raise InvalidArgumentError(
            f"address {address!r} of task {job}:{index} must be non-empty without whitespace"
        )
    return address


def _normalize_tasks(job: str, tasks: Any) -> dict[int, str]:
    """Returns ``{index: address}`` for one job given as a list or a mapping."""
    if isinstance(tasks, (list, tuple)):
        return {i: _check_address(job, i, address) for i, address in enumerate(tasks)}
    if isinstance(tasks, Mapping):
        result: dict[int, str] = {}
        for raw_index, address in tasks.items():
            index = coerce_task_index(raw_index, f"task index of job {job!r}")
            if index in result:
                raise InvalidArgumentError(
                    f"job {job!r} defines task index {index} twice (key {raw_index!r})"
                )
            result[index] = _check_address(job, index, address)
        return dict(sorted(result.items()))
    raise ClusterTypeError(
        f"the tasks of job {job!r} must be a list of addresses or a mapping from task "
        f"index to address, not {type(tasks).__name__} ({tasks!r})"
    )


class ClusterSpec:
    """An immutable map from job names to their tasks' network addresses.

    Args:
        cluster: a mapping from job name to either a list of addresses (task
            ``i`` at position ``i``) or a mapping from task index to address (a
            sparse job; indices may be ints or digit strings, as in JSON); or
            another ``ClusterSpec`` (copied).  ``ClusterSpec({})`` is empty.

    Raises:
        ClusterTypeError: ``cluster``, a job's tasks or an address has the
            wrong type.
        InvalidArgumentError: a job name, task index or address is invalid, or
            a sparse job names the same index twice.

    Jobs keep the order they were given in; equality ignores order, as in TF.
    """

    __slots__ = ("_hash", "_jobs")

    _jobs: dict[str, MappingProxyType[int, str]]

    def __init__(self, cluster: ClusterLike) -> None:
        if isinstance(cluster, ClusterSpec):
            jobs = dict(cluster._jobs)
        elif isinstance(cluster, Mapping):
            jobs = {}
            for job, tasks in cluster.items():
                name = _check_job_name(job)
                jobs[name] = MappingProxyType(_normalize_tasks(name, tasks))
        else:
            raise ClusterTypeError(
                "cluster must be a ClusterSpec or a mapping from job name to a list or "
                f"mapping of addresses, not {type(cluster).__name__} ({cluster!r})"
            )
        object.__setattr__(self, "_jobs", jobs)
        object.__setattr__(self, "_hash", None)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"ClusterSpec is immutable; cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"ClusterSpec is immutable; cannot delete {name!r}")

    def __reduce__(self):
        return (ClusterSpec, (self.as_dict(),))

    # -- queries -------------------------------------------------------------

    @property
    def jobs(self) -> list[str]:
        """The job names, in the order they were given."""
        return list(self._jobs)

    def _job(self, job: str) -> Mapping[int, str]:
        try:
            return self._jobs[job]
        except (KeyError, TypeError):
            raise TaskNotFoundError(f"no job {job!r} in the cluster (jobs: {self.jobs})") from None

    def num_tasks(self, job: str) -> int:
        """Returns how many tasks ``job`` defines.

        Raises:
            TaskNotFoundError: ``job`` is not in the cluster.
        """
        return len(self._job(job))

    def task_indices(self, job: str) -> list[int]:
        """Returns the sorted task indices of ``job``.

        Raises:
            TaskNotFoundError: ``job`` is not in the cluster.
        """
        return list(self._job(job))

    def task_address(self, job: str, index: int) -> str:
        """Returns the address of task ``index`` of ``job``.

        Raises:
            TaskNotFoundError: ``job`` is not in the cluster or has no task
                ``index``.
            InvalidArgumentError: ``index`` is not a non-negative integer.
        """
        tasks = self._job(job)
        task = coerce_task_index(index, f"task index for job {job!r}")
        try:
            return tasks[task]
        except KeyError:
            raise TaskNotFoundError(
                f"no task with index {index!r} in job {job!r} (indices: {list(tasks)})"
            ) from None

    def job_tasks(self, job: str) -> list[str | None]:
        """Returns the addresses of ``job`` as a list indexed by task index.

        As in TF, a sparse job's list has ``None`` at the missing indices.

        Raises:
            TaskNotFoundError: ``job`` is not in the cluster.
        """
        tasks = self._job(job)
        result: list[str | None] = [None] * (max(tasks) + 1 if tasks else 0)
        for index, address in tasks.items():
            result[index] = address
        return result

    def is_dense(self, job: str) -> bool:
        """Returns whether ``job``'s task indices are exactly ``0..n-1``.

        Raises:
            TaskNotFoundError: ``job`` is not in the cluster.
        """
        tasks = self._job(job)
        return not tasks or max(tasks) + 1 == len(tasks)

    def tasks(self) -> Iterator[tuple[str, int, str]]:
        """Yields ``(job, index, address)`` for every task, job by job."""
        for job, tasks in self._jobs.items():
            for index, address in tasks.items():
                yield job, index, address

    def as_dict(self) -> dict[str, list[str] | dict[int, str]]:
        """Returns a new dict from job name to its tasks, as TF's ``as_dict``.

        A dense job becomes a list of addresses; a sparse one a dict from task
        index to address; a job with no tasks an empty dict.
        """
        result: dict[str, list[str] | dict[int, str]] = {}
        for job, tasks in self._jobs.items():
            if tasks and self.is_dense(job):
                result[job] = list(tasks.values())
            else:
                result[job] = dict(tasks)
        return result

    # -- protocol ------------------------------------------------------------

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def _key(self) -> dict[str, dict[int, str]]:
        return {job: dict(tasks) for job, tasks in self._jobs.items()}

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ClusterSpec):
            return self._key() == other._key()
        if isinstance(other, Mapping):
            try:
                return self._key() == ClusterSpec(other)._key()
            except (InvalidArgumentError, TypeError):
                return False
        return NotImplemented

    def __hash__(self) -> int:
        if self._hash is None:
            value = hash(
                frozenset((job, frozenset(tasks.items())) for job, tasks in self._jobs.items())
            )
            object.__setattr__(self, "_hash", value)
        return self._hash

    def __repr__(self) -> str:
        values = self.as_dict()
        items = ", ".join(f"{job!r}: {values[job]!r}" for job in sorted(values))
        return f"ClusterSpec({{{items}}})"

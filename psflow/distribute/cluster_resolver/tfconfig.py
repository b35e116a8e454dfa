"""``TFConfigClusterResolver``: the cluster and task from the ``TF_CONFIG`` variable.

``TF_CONFIG`` is the JSON object TensorFlow, Kubeflow's TFJob and most
launchers use to tell each process its cluster and role::

    {
      "cluster": {"chief": ["c0:2222"], "ps": ["p0:2222"], "worker": ["w0:2222", "w1:2222"]},
      "task": {"type": "worker", "index": 1},
      "rpc_layer": "grpc",            # optional: protocol prefix for master()
      "environment": "cloud",         # optional: Kubeflow sets it
      "session_master": "host:2222"   # optional: TF 1.x's master override
    }

Kubeflow's TFJob with ``enableDynamicWorker`` writes ``"sparseCluster"``
instead of ``"cluster"``: a worker gets every ``ps`` and only itself as
``{"<index>": address}``; a ``ps`` gets only itself, as a one-element list.
Both forms are read here; in the sparse one, a one-element list for the task's
own job is taken to be the task's own address at its own index.

Differences from TF, on purpose:

* ``TF_CONFIG`` is parsed and validated once, at construction, into a frozen
  :class:`TFConfig`; malformed JSON (or a repeated key), a wrong type, a task
  that is not in the cluster, more than one chief, or two tasks with one
  address raise a typed error naming the key or value, where TF re-parses on
  every read and fails late or not at all.  A missing or blank ``TF_CONFIG``
  still means an empty cluster and no task, as in TF.
* The legacy ``master`` job (TF 1.x, Kubeflow's ``Master`` replica) is the
  chief, as in TF's Estimator: it must have one task, cannot coexist with a
  ``chief`` job, and is reported under the name ``chief`` (also as
  ``task_type``), so strategies see a single name.
* The ``evaluator`` is not part of the training cluster (TF's distribute
  coordinator and Estimator): ``cluster_spec()`` leaves the ``evaluator`` job
  out, except for the evaluator itself, which sees only its own job;
  ``full_cluster_spec()`` returns everything.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from psflow import settings
from psflow.distribute.cluster_resolver.accelerators import GpuProbe
from psflow.distribute.cluster_resolver.base import (
    ClusterResolver,
    check_rpc_layer,
    check_task_id,
    check_task_type,
)
from psflow.distribute.cluster_resolver.cluster_spec import (
    ClusterSpec,
    coerce_task_index,
)
from psflow.distribute.cluster_resolver.validation import (
    CHIEF,
    EVALUATOR,
    WORKER,
    validate_task,
    validate_unique_addresses,
)
from psflow.errors import FailedPreconditionError, InvalidArgumentError, OpError

TF_CONFIG = "TF_CONFIG"
"""The name of the environment variable."""

MASTER = "master"
"""TF 1.x's name for the chief job."""

_CLUSTER = "cluster"
_SPARSE_CLUSTER = "sparseCluster"
_TASK = "task"
_STRING_KEYS = ("rpc_layer", "environment", "session_master")
_SNIPPET = 200


@dataclasses.dataclass(frozen=True)
class TFConfig:
    """The content of ``TF_CONFIG``, validated.

    Attributes:
        cluster: every job, ``evaluator`` included, ``master`` renamed ``chief``.
        task_type: the ``task.type`` (``"master"`` read as ``"chief"``), or None.
        task_id: the ``task.index``, or None.
        rpc_layer: the ``rpc_layer`` key, or None.
        environment: the ``environment`` key, or None.
        session_master: the ``session_master`` key, or None.
        sparse: whether the cluster came from Kubeflow's ``sparseCluster``.
    """

    cluster: ClusterSpec = dataclasses.field(default_factory=lambda: ClusterSpec({}))
    task_type: str | None = None
    task_id: int | None = None
    rpc_layer: str | None = None
    environment: str | None = None
    session_master: str | None = None
    sparse: bool = False


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise InvalidArgumentError(f"TF_CONFIG repeats the key {key!r}")
        result[key] = value
    return result


def _snippet(text: str) -> str:
    return text if len(text) <= _SNIPPET else text[:_SNIPPET] + "..."


def _parse_task(task: Any) -> tuple[str | None, int | None]:
    if task is None:
        return None, None
    if not isinstance(task, dict):
        raise InvalidArgumentError(
            f"TF_CONFIG['task'] must be an object like {{'type': 'worker', 'index': 0}}, "
            f"not {task!r}"
        )
    task_type = task.get("type")
    index = task.get("index")
    if isinstance(task_type, int) and not isinstance(task_type, bool):
        task_type = str(task_type)  # TF casts; its tests use a numeric job name
    if task_type is not None and (not isinstance(task_type, str) or not task_type):
        raise InvalidArgumentError(
            f"TF_CONFIG['task']['type'] {task_type!r} must be a non-empty string"
        )
    if index is not None:
        index = coerce_task_index(index, "TF_CONFIG['task']['index']")
    if task_type is None and index is not None:
        raise InvalidArgumentError(f"TF_CONFIG['task'] {task!r} has an 'index' but no 'type'")
    if task_type is not None and index is None:
        raise InvalidArgumentError(f"TF_CONFIG['task'] {task!r} has a 'type' but no 'index'")
    return (CHIEF if task_type == MASTER else task_type), index


def _parse_cluster(
    key: str, cluster: Any, task_type: str | None, task_id: int | None
) -> ClusterSpec:
    if cluster is None:
        return ClusterSpec({})
    if not isinstance(cluster, dict):
        raise InvalidArgumentError(
            f"TF_CONFIG[{key!r}] must be an object mapping job names to addresses, not {cluster!r}"
        )
    # Go's encoder writes an unset job as null (Kubeflow's sparse form): no job.
    jobs = {job: tasks for job, tasks in cluster.items() if tasks is not None}
    if MASTER in jobs and CHIEF in jobs:
        raise InvalidArgumentError(
            f"TF_CONFIG[{key!r}] has more than one chief: both a 'chief' job "
            f"{jobs[CHIEF]!r} and a 'master' job {jobs[MASTER]!r}"
        )
    jobs = {(CHIEF if job == MASTER else job): tasks for job, tasks in jobs.items()}
    own = jobs.get(task_type) if task_type is not None else None
    if key == _SPARSE_CLUSTER and isinstance(own, list) and len(own) == 1 and task_id:
        jobs[task_type] = {task_id: own[0]}  # Kubeflow's sparse ps: only itself
    try:
        spec = ClusterSpec(jobs)
    except OpError as error:
        raise type(error)(f"TF_CONFIG[{key!r}]: {error.message}") from None
    for job in (CHIEF, EVALUATOR):
        if job in spec.jobs and spec.num_tasks(job) > 1:
            name = MASTER if job == CHIEF and MASTER in cluster else job
            raise InvalidArgumentError(
                f"TF_CONFIG[{key!r}] has more than one {job}: job {name!r} lists "
                f"{spec.as_dict()[job]!r}"
            )
    try:
        validate_unique_addresses(spec)
    except InvalidArgumentError as error:
        raise InvalidArgumentError(f"TF_CONFIG[{key!r}]: {error.message}") from None
    return spec


def parse_tf_config(text: str | None) -> TFConfig:
    """Parses and validates the text of ``TF_CONFIG``.

    ``None`` or blank text gives an empty :class:`TFConfig`.  Unknown keys
    (``service``, ``model_dir``...) are ignored, as in TF.  Whether the task is
    in the cluster is checked by the resolver, after explicit overrides.

    Raises:
        InvalidArgumentError: the JSON is malformed or repeats a key, a value
            has the wrong type, both ``cluster`` and ``sparseCluster`` are
            given, there is more than one chief or evaluator, or two tasks
            share an address.  The message names the key and value.

    Example:
        >>> config = parse_tf_config('{"cluster": {"worker": ["w0:1", "w1:1"]},'
        ...                          ' "task": {"type": "worker", "index": 1}}')
        >>> config.task_type, config.task_id, config.cluster.num_tasks("worker")
        ('worker', 1, 2)
    """
    if text is None or not text.strip():
        return TFConfig()
    try:
        data = json.loads(text, object_pairs_hook=_reject_duplicate_keys)
    except json.JSONDecodeError as error:
        raise InvalidArgumentError(
            f"TF_CONFIG is not valid JSON ({error.msg} at line {error.lineno} column "
            f"{error.colno}): {_snippet(text)!r}"
        ) from None
    if not isinstance(data, dict):
        raise InvalidArgumentError(f"TF_CONFIG must be a JSON object, not {_snippet(text)!r}")
    if _CLUSTER in data and _SPARSE_CLUSTER in data:
        raise InvalidArgumentError(
            "TF_CONFIG has both 'cluster' and 'sparseCluster'; give one of them"
        )
    strings: dict[str, str | None] = {}
    for key in _STRING_KEYS:
        value = data.get(key)
        if value is not None and not isinstance(value, str):
            raise InvalidArgumentError(f"TF_CONFIG[{key!r}] {value!r} must be a string")
        strings[key] = value
    task_type, task_id = _parse_task(data.get(_TASK))
    sparse = _SPARSE_CLUSTER in data
    key = _SPARSE_CLUSTER if sparse else _CLUSTER
    cluster = _parse_cluster(key, data.get(key), task_type, task_id)
    return TFConfig(
        cluster=cluster,
        task_type=task_type,
        task_id=task_id,
        sparse=sparse,
        **strings,
    )


def _check_task(cluster: ClusterSpec, task_type: str | None, task_id: int | None) -> None:
    """Checks the effective task (after overrides) against the whole cluster."""
    if task_type is None and task_id is None:
        return
    if task_type is None:
        raise InvalidArgumentError(f"task index {task_id} is given without a task type")
    if task_id is None:
        raise InvalidArgumentError(f"task type {task_type!r} is given without a task index")
    if not cluster:
        # Estimator's local mode: with no cluster, only the lone worker makes sense.
        if task_type == EVALUATOR or (task_type == WORKER and task_id == 0):
            return
        raise InvalidArgumentError(
            f"TF_CONFIG has no cluster, so task {task_type}:{task_id} cannot be in it "
            "(only worker:0 or an evaluator can run without one)"
        )
    validate_task(cluster, task_type, task_id)


class TFConfigClusterResolver(ClusterResolver):
    """Reads the cluster and this process's task from ``TF_CONFIG``, once.

    See the module docstring for the schema and for where this differs from
    TF.  Explicit arguments win over ``TF_CONFIG``.

    Args:
        task_type: overrides ``TF_CONFIG['task']['type']``.
        task_id: overrides ``TF_CONFIG['task']['index']``.
        rpc_layer: overrides ``TF_CONFIG['rpc_layer']``.
        environment: overrides ``TF_CONFIG['environment']``.
        environ: where to read ``TF_CONFIG``; the process environment (:func:`psflow.settings.environ`) by default.
        gpu_probe: counts this machine's GPUs for ``num_accelerators``.

    Raises:
        InvalidArgumentError: ``TF_CONFIG`` or an argument is invalid (see
            :func:`parse_tf_config`), or the task type and index do not come
            together.
        TaskNotFoundError: the task is not in the cluster.

    Example:
        >>> import json
        >>> environ = {"TF_CONFIG": json.dumps({
        ...     "cluster": {"ps": ["ps0:2222", "ps1:2222"],
        ...                 "worker": ["worker0:2222", "worker1:2222"]},
        ...     "task": {"type": "worker", "index": 1}, "rpc_layer": "grpc"})}
        >>> resolver = TFConfigClusterResolver(environ=environ)
        >>> resolver.task_type, resolver.task_id
        ('worker', 1)
        >>> resolver.master()
        'grpc://worker1:2222'
    """

    def __init__(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
        environment: str | None = None,
        *,
        environ: Mapping[str, str] | None = None,
        gpu_probe: GpuProbe | None = None,
    ) -> None:
        env = settings.environ() if environ is None else environ
        config = parse_tf_config(env.get(TF_CONFIG))
        task_type = check_task_type(task_type)
        task_id = check_task_id(task_id)
        if environment is not None and not isinstance(environment, str):
            raise InvalidArgumentError(f"environment {environment!r} must be a string or None")
        if task_type == MASTER:
            task_type = CHIEF
        effective_type = task_type if task_type is not None else config.task_type
        effective_id = task_id if task_id is not None else config.task_id
        _check_task(config.cluster, effective_type, effective_id)

        self._config = config
        self._task_type = effective_type
        self._task_id = effective_id
        self._rpc_layer = check_rpc_layer(rpc_layer if rpc_layer is not None else config.rpc_layer)
        self._environment = environment if environment is not None else config.environment
        self.gpu_probe = gpu_probe
        full = config.cluster.as_dict()
        evaluator = {EVALUATOR: full.pop(EVALUATOR)} if EVALUATOR in full else {}
        self._training_spec = ClusterSpec(full)
        self._evaluator_spec = ClusterSpec(evaluator)

    @property
    def tf_config(self) -> TFConfig:
        """The parsed ``TF_CONFIG`` (before explicit overrides)."""
        return self._config

    @property
    def is_sparse(self) -> bool:
        """Whether the cluster came from Kubeflow's ``sparseCluster`` (peers partly unknown)."""
        return self._config.sparse

    def cluster_spec(self) -> ClusterSpec:
        """Returns the training cluster; for an evaluator, only the ``evaluator`` job."""
        return self._evaluator_spec if self.task_type == EVALUATOR else self._training_spec

    def full_cluster_spec(self) -> ClusterSpec:
        """Returns every job of ``TF_CONFIG``, ``evaluator`` included."""
        return self._config.cluster

    def _master_override(self, named: bool, rpc_layer: str | None) -> str | None:
        # TF's rule: TF_CONFIG['session_master'] if set; "" when the cluster has
        # no job, or one job of one task (a local session)
        del named, rpc_layer
        if self._config.session_master is not None:
            return self._config.session_master
        spec = self.cluster_spec()
        if not spec.jobs or (len(spec.jobs) == 1 and len(spec.job_tasks(spec.jobs[0])) == 1):
            return ""
        return None

    def _master_task(
        self, task_type: str | None, task_id: int | None
    ) -> tuple[str | None, int | None]:
        """The task to look up (``master`` means ``chief``); raises when there is none.

        Raises:
            FailedPreconditionError: no task in ``TF_CONFIG`` and none given.
        """
        task_type, task_id = super()._master_task(
            CHIEF if task_type == MASTER else task_type, task_id
        )
        if task_type is None or task_id is None:
            raise FailedPreconditionError(
                f"no task to look up (task_type={task_type!r}, task_id={task_id!r}): set "
                "TF_CONFIG['task'] or pass task_type and task_id"
            )
        return task_type, task_id

    @property
    def environment(self) -> str:
        """The explicit ``environment``, else ``TF_CONFIG['environment']``, else ``""``."""
        return self._environment or ""

"""``ClusterFileResolver``: the cluster from a JSON file that a supervisor rewrites.

``psflow local --ps-max N`` publishes its cluster this way: the file holds the
``cluster`` part of ``TF_CONFIG`` (same schema, same validation) and is
replaced atomically (:func:`write_cluster_file`: a temporary file, then
``rename``) whenever the launcher starts or drains parameter servers, so a
reader sees the old view or the new one, never half of one.  The chief's
cluster watch (:mod:`psflow.distribute.coordinator.elastic_watch`) refreshes
the resolver and resizes the parameter servers to the count it lists.

The task of this process does not change and is not in the file: it is given
to the constructor, or taken from ``TF_CONFIG`` by :meth:`ClusterFileResolver.from_environment`.

Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "cluster.json")
    >>> write_cluster_file(path, {"ps": ["127.0.0.1:5000"], "worker": ["127.0.0.1:5001"],
    ...                           "chief": ["127.0.0.1:5002"]})
    >>> resolver = ClusterFileResolver(path, task_type="chief", task_id=0)
    >>> resolver.cluster_spec().num_tasks("ps")
    1
    >>> write_cluster_file(path, {"ps": ["127.0.0.1:5000", "127.0.0.1:5003"],
    ...                           "worker": ["127.0.0.1:5001"], "chief": ["127.0.0.1:5002"]})
    >>> resolver.refresh().num_tasks("ps"), resolver.version
    (2, 1)
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
from collections.abc import Mapping, Sequence

from psflow.distribute.cluster_resolver.accelerators import GpuProbe
from psflow.distribute.cluster_resolver.base import (
    ClusterResolver,
    check_rpc_layer,
    check_task_id,
    check_task_type,
)
from psflow.distribute.cluster_resolver.cluster_spec import ClusterSpec
from psflow.distribute.cluster_resolver.tfconfig import TF_CONFIG, parse_tf_config
from psflow.distribute.cluster_resolver.validation import validate_task
from psflow.errors import InvalidArgumentError, NotFoundError

CLUSTER_FILE_ENV = "PSFLOW_CLUSTER_FILE"
"""The environment variable ``psflow local --ps-max`` sets in the chief: the file's path."""

MAX_CLUSTER_FILE_BYTES = 1 << 20
"""A cluster file larger than this is refused (a guard against reading the wrong file)."""


def write_cluster_file(path: str, cluster: Mapping[str, Sequence[str]]) -> None:
    """Writes ``{"cluster": cluster}`` to ``path`` atomically (temporary file, fsync, rename).

    Raises:
        InvalidArgumentError: ``cluster`` is not a valid cluster (checked
            before anything is written).
        OSError: the directory is not writable.
    """
    text = json.dumps({"cluster": {job: list(tasks) for job, tasks in cluster.items()}})
    parse_tf_config(text)  # validate first: a bad view is never published
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".cluster-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # the temporary file must not stay behind
            os.unlink(tmp)
        raise


def read_cluster_file(path: str) -> ClusterSpec:
    """Reads and validates the cluster in ``path``.

    Raises:
        NotFoundError: ``path`` does not exist or cannot be read.
        InvalidArgumentError: the content is not a ``{"cluster": ...}`` object
            of TF_CONFIG's schema, or is larger than
            :data:`MAX_CLUSTER_FILE_BYTES` (the message names the file).
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(MAX_CLUSTER_FILE_BYTES + 1)
    except OSError as e:
        raise NotFoundError(f"cluster file {path!r} cannot be read: {e}") from None
    if len(text) > MAX_CLUSTER_FILE_BYTES:
        raise InvalidArgumentError(
            f"cluster file {path!r} is larger than {MAX_CLUSTER_FILE_BYTES} bytes"
        )
    try:
        config = parse_tf_config(text)
    except InvalidArgumentError as e:
        raise InvalidArgumentError(f"cluster file {path!r}: {e}") from None
    if config.task_type is not None:
        raise InvalidArgumentError(
            f"cluster file {path!r} names a task ({config.task_type}:{config.task_id}); it is "
            "shared by every task and holds only the cluster"
        )
    return config.cluster


class ClusterFileResolver(ClusterResolver):
    """The cluster from a file that can be rewritten; this process's task given explicitly.

    ``cluster_spec()`` returns the view read at construction or by the last
    :meth:`refresh`; it does not touch the file (see
    :mod:`psflow.distribute.cluster_resolver.refreshable`).

    Args:
        path: the cluster file (see :func:`write_cluster_file`).
        task_type: this process's job (``"chief"``...), or None.
        task_id: this process's index, or None.
        rpc_layer: the protocol prefix ``master()`` adds.
        gpu_probe: counts this machine's GPUs for ``num_accelerators``.

    Raises:
        NotFoundError: the file cannot be read.
        InvalidArgumentError: the file or an argument is invalid.
        TaskNotFoundError: the task is not in the file's cluster.
    """

    def __init__(
        self,
        path: str,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = "grpc",
        *,
        gpu_probe: GpuProbe | None = None,
    ) -> None:
        if not isinstance(path, str) or not path:
            raise InvalidArgumentError(f"cluster file path {path!r} must be a non-empty string")
        task_type = check_task_type(task_type)
        task_id = check_task_id(task_id)
        if (task_type is None) != (task_id is None):
            raise InvalidArgumentError(
                f"give task_type and task_id together (got {task_type!r}, {task_id!r})"
            )
        spec = read_cluster_file(path)
        if task_type is not None:
            validate_task(spec, task_type, task_id)
        self._path = path
        self._task_type, self._task_id = task_type, task_id
        self._rpc_layer = check_rpc_layer(rpc_layer)
        self.gpu_probe = gpu_probe
        self._lock = threading.Lock()
        self._spec = spec
        self._version = 0

    @classmethod
    def from_environment(
        cls, environ: Mapping[str, str] | None = None, **kwargs: object
    ) -> ClusterFileResolver:
        """The resolver for ``$PSFLOW_CLUSTER_FILE``, this task from ``TF_CONFIG``'s ``task``.

        Raises:
            NotFoundError: ``PSFLOW_CLUSTER_FILE`` is not set, or the file
                cannot be read.
            InvalidArgumentError: the file or ``TF_CONFIG`` is invalid.
        """
        env = os.environ if environ is None else environ
        path = env.get(CLUSTER_FILE_ENV)
        if not path:
            raise NotFoundError(
                f"{CLUSTER_FILE_ENV} is not set: no cluster file to watch (psflow local "
                "--ps-max N sets it in the chief)"
            )
        config = parse_tf_config(env.get(TF_CONFIG))
        return cls(path, config.task_type, config.task_id, **kwargs)  # type: ignore[arg-type]

    @property
    def path(self) -> str:
        """The cluster file."""
        return self._path

    @property
    def version(self) -> int:
        """How many times :meth:`refresh` found a different cluster (0 at construction)."""
        return self._version

    def refresh(self) -> ClusterSpec:
        """Re-reads the file; returns the cluster (the previous view is kept on an error).

        Raises:
            NotFoundError: the file cannot be read.
            InvalidArgumentError: its content is invalid.
        """
        spec = read_cluster_file(self._path)
        with self._lock:
            if spec.as_dict() != self._spec.as_dict():
                self._spec = spec
                self._version += 1
            return self._spec

    def cluster_spec(self) -> ClusterSpec:
        """The cluster as of the last :meth:`refresh`."""
        with self._lock:
            return self._spec

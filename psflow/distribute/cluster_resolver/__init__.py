"""Cluster resolvers: how each psflow process finds its role and its peers.

The names and semantics are TensorFlow's ``tf.distribute.cluster_resolver``
(plus ``tf.train.ClusterSpec``), with configuration parsed and validated once
and errors that name the offending value:

* :class:`ClusterSpec` - jobs and the addresses of their tasks;
* :class:`ClusterResolver` - the interface;
* :class:`TFConfigClusterResolver` - the ``TF_CONFIG`` variable (TF, Kubeflow);
* :class:`SlurmClusterResolver` - a Slurm job step;
* :class:`KubernetesClusterResolver` - StatefulSets behind headless Services;
* :class:`ClusterFileResolver` - a cluster file a supervisor rewrites (elastic
  parameter servers); :class:`RefreshableResolver` - resolvers whose view can change;
* :class:`SimpleClusterResolver`, :class:`UnionClusterResolver` - explicit
  clusters and merges;
* :func:`validate_ps_cluster`, :func:`task_string` - checks and names used by
  the parameter-server strategy and the process entrypoints.

Example:
    >>> import json
    >>> from psflow.distribute import cluster_resolver
    >>> resolver = cluster_resolver.TFConfigClusterResolver(environ={"TF_CONFIG": json.dumps({
    ...     "cluster": {"ps": ["ps0:2222"], "worker": ["w0:2222"]},
    ...     "task": {"type": "ps", "index": 0}})})
    >>> cluster_resolver.validate_ps_cluster(resolver.cluster_spec())
    >>> cluster_resolver.task_string(resolver.task_type, resolver.task_id)
    'ps:0'
"""

from psflow.distribute.cluster_resolver.accelerators import (
    GpuProbe,
    cupy_gpu_count,
    visible_gpu_count,
)
from psflow.distribute.cluster_resolver.base import ClusterResolver, format_master_url
from psflow.distribute.cluster_resolver.cluster_file import (
    CLUSTER_FILE_ENV,
    ClusterFileResolver,
    read_cluster_file,
    write_cluster_file,
)
from psflow.distribute.cluster_resolver.cluster_spec import (
    ClusterSpec,
    ClusterTypeError,
    TaskNotFoundError,
)
from psflow.distribute.cluster_resolver.kubernetes import KubernetesClusterResolver
from psflow.distribute.cluster_resolver.refreshable import RefreshableResolver
from psflow.distribute.cluster_resolver.registry import RESOLVERS, make_resolver
from psflow.distribute.cluster_resolver.simple import SimpleClusterResolver
from psflow.distribute.cluster_resolver.slurm import (
    SlurmClusterResolver,
    expand_hostlist,
    expand_tasks_per_node,
)
from psflow.distribute.cluster_resolver.tfconfig import (
    TF_CONFIG,
    TFConfig,
    TFConfigClusterResolver,
    parse_tf_config,
)
from psflow.distribute.cluster_resolver.union import (
    ClusterMergeError,
    UnionClusterResolver,
    merge_cluster_specs,
)
from psflow.distribute.cluster_resolver.validation import (
    PS_CLUSTER_JOBS,
    parse_task_string,
    task_string,
    validate_ps_cluster,
    validate_task,
    validate_unique_addresses,
)

UnionResolver = UnionClusterResolver  # TF exports it under this name too

__all__ = [
    "CLUSTER_FILE_ENV",
    "PS_CLUSTER_JOBS",
    "RESOLVERS",
    "RefreshableResolver",
    "TF_CONFIG",
    "ClusterFileResolver",
    "ClusterMergeError",
    "ClusterResolver",
    "ClusterSpec",
    "ClusterTypeError",
    "GpuProbe",
    "KubernetesClusterResolver",
    "SimpleClusterResolver",
    "SlurmClusterResolver",
    "TFConfig",
    "TFConfigClusterResolver",
    "TaskNotFoundError",
    "UnionClusterResolver",
    "UnionResolver",
    "cupy_gpu_count",
    "expand_hostlist",
    "expand_tasks_per_node",
    "format_master_url",
    "make_resolver",
    "merge_cluster_specs",
    "parse_task_string",
    "parse_tf_config",
    "read_cluster_file",
    "task_string",
    "validate_ps_cluster",
    "validate_task",
    "validate_unique_addresses",
    "visible_gpu_count",
    "write_cluster_file",
]

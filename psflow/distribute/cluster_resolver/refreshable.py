"""``RefreshableResolver``: a resolver whose view of the cluster can change while a job runs.

Most resolvers describe a cluster fixed at start (``TF_CONFIG``, Slurm).  An
elastic job needs a view that can change: the parameter servers a supervisor
started or drained (:class:`~psflow.distribute.cluster_resolver.ClusterFileResolver`),
the pods of a scaled StatefulSet
(:class:`~psflow.distribute.cluster_resolver.KubernetesClusterResolver` with a
Kubernetes API).  Such a resolver keeps a snapshot: ``cluster_spec()`` returns
the view as of the last :meth:`RefreshableResolver.refresh`, so that a caller
who decided on a count (the chief's cluster watch) and then resizes reads the
same view the resize reads.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from psflow.distribute.cluster_resolver.cluster_spec import ClusterSpec


@runtime_checkable
class RefreshableResolver(Protocol):
    """A cluster resolver that can re-read its source (see the module docstring)."""

    def refresh(self) -> ClusterSpec:
        """Re-reads the cluster from the source; returns it (also ``cluster_spec()`` from now on).

        Raises:
            OpError: the source cannot be read or is invalid; the previous view
                is kept.
        """
        ...

    def cluster_spec(self) -> ClusterSpec:
        """The cluster as of the last :meth:`refresh` (or construction)."""
        ...

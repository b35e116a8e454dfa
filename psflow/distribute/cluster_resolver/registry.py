"""Resolvers by name, for command lines and configuration files.

Example:
    >>> resolver = make_resolver("tfconfig", environ={})
    >>> type(resolver).__name__, bool(resolver.cluster_spec())
    ('TFConfigClusterResolver', False)
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from psflow.distribute.cluster_resolver.base import ClusterResolver
from psflow.distribute.cluster_resolver.kubernetes import KubernetesClusterResolver
from psflow.distribute.cluster_resolver.simple import SimpleClusterResolver
from psflow.distribute.cluster_resolver.slurm import SlurmClusterResolver
from psflow.distribute.cluster_resolver.tfconfig import TFConfigClusterResolver
from psflow.errors import InvalidArgumentError

RESOLVERS: MappingProxyType[str, type[ClusterResolver]] = MappingProxyType(
    {
        "tfconfig": TFConfigClusterResolver,
        "slurm": SlurmClusterResolver,
        "kubernetes": KubernetesClusterResolver,
        "simple": SimpleClusterResolver,
    }
)
"""Resolver classes by the name a command line uses for them."""


def make_resolver(name: str, /, **kwargs: Any) -> ClusterResolver:
    """Returns ``RESOLVERS[name](**kwargs)``.

    Raises:
        InvalidArgumentError: ``name`` is not registered; the message lists
            the registered names.
    """
    try:
        cls = RESOLVERS[name]
    except (KeyError, TypeError):
        raise InvalidArgumentError(
            f"unknown cluster resolver {name!r} (choose from {sorted(RESOLVERS)})"
        ) from None
    return cls(**kwargs)

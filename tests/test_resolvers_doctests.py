"""The examples in the resolvers' docstrings run and give what they show."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "psflow.distribute.cluster_resolver",
    "psflow.distribute.cluster_resolver.base",
    "psflow.distribute.cluster_resolver.cluster_spec",
    "psflow.distribute.cluster_resolver.kubernetes",
    "psflow.distribute.cluster_resolver.registry",
    "psflow.distribute.cluster_resolver.simple",
    "psflow.distribute.cluster_resolver.slurm",
    "psflow.distribute.cluster_resolver.tfconfig",
    "psflow.distribute.cluster_resolver.union",
    "psflow.distribute.cluster_resolver.validation",
    "psflow.exit_codes",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0

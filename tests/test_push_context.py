"""A push carries its update rule: each push applies at the rate it names, on every backend."""

from __future__ import annotations

import json

import numpy as np
import pytest

from psflow import errors
from psflow.distribute.ps.connection import Grad, VarSpec
from psflow.distribute.ps.inprocess import InProcessPSConnection
from psflow.ps.push_types import PushContext


def _sgd(lr: float) -> str:
    return json.dumps({"name": "sgd", "learning_rate": lr}, sort_keys=True)


def test_each_push_applies_at_the_learning_rate_its_context_names():
    conn = InProcessPSConnection()
    conn.create([VarSpec("w", np.dtype("float32"), (3,), True)], [np.zeros(3, np.float32)])
    g = [Grad("w", np.ones(3, np.float32))]
    expected = np.zeros(3, np.float32)
    for i, lr in enumerate([0.5, 0.5, 0.25, 0.125]):  # a schedule: a new rate most steps
        conn.push(g, PushContext(("c", i), rule_json=_sgd(lr)))
        expected -= np.float32(lr)
        np.testing.assert_allclose(conn.pull(["w"])[0][0], expected)  # plain NumPy SGD


def test_a_bad_rule_in_the_context_is_rejected_and_changes_nothing():
    conn = InProcessPSConnection()
    conn.create([VarSpec("w", np.dtype("float32"), (3,), True)], [np.zeros(3, np.float32)])
    g = [Grad("w", np.ones(3, np.float32))]
    conn.push(g, PushContext(("c", 0), rule_json=_sgd(1.0)))
    with pytest.raises(errors.InvalidArgumentError, match="nosuchrule"):
        conn.push(g, PushContext(("c", 1), rule_json=json.dumps({"name": "nosuchrule"})))
    np.testing.assert_allclose(conn.pull(["w"])[0][0], -np.ones(3, np.float32))
    conn.push(g, PushContext(("c", 2), rule_json=_sgd(1.0)))  # the old rule still in place
    np.testing.assert_allclose(conn.pull(["w"])[0][0], -2 * np.ones(3, np.float32))

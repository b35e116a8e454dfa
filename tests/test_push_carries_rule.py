"""Every push carries its update rule; the PS applies that push with that rule.

Two workers at different steps of a schedule push to one variable in turn:
each push must move the variable by its own rate (the rule travels in the
push header, not through a separate configure call whose effect another
worker's call may replace in between). A rule the PS cannot parse, or one
that does not fit the variable's slots, is rejected with nothing applied.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from psflow import errors
from psflow.distribute.ps.connection import Grad, VarSpec
from psflow.distribute.ps.grpc_connection import GrpcPSConnection
from psflow.distribute.ps.inprocess import InProcessPSConnection
from psflow.ps.push_types import PushContext
from psflow.ps.rule_cache import RuleCache
from psflow.ps.store import VariableMeta, VariableStore
from psflow.transport.client import PSClient


def _rule(lr: float, momentum: float = 0.9) -> str:
    return json.dumps({"name": "sgd", "learning_rate": lr, "momentum": momentum}, sort_keys=True)


def _decay(step: int) -> float:
    """A rate that changes every step (an exponential decay)."""
    return 0.2 * 0.8**step


def _interleaved_pushes(conns, rng) -> tuple[np.ndarray, list[tuple[float, np.ndarray]]]:
    """Worker 0 at steps 10.., worker 1 at steps 0..: six pushes, taking turns."""
    w0 = np.linspace(-1, 1, 6).astype(np.float32)
    conns[0].create([VarSpec("w", np.dtype("float32"), (6,), True)], [w0])
    applied = []
    steps = [10, 0]
    for i in range(6):
        k = i % 2
        lr = _decay(steps[k])
        grad = rng.normal(size=6).astype(np.float32)
        reply = conns[k].push(
            [Grad("w", grad)], PushContext((f"worker-{k}", i + 1), rule_json=_rule(lr))
        )
        assert reply.applied
        applied.append((lr, grad))
        steps[k] += 1
    return w0, applied


def _momentum_reference(w0: np.ndarray, applied) -> np.ndarray:
    """Keras SGD with momentum 0.9 in plain NumPy, each push with its own rate."""
    w, m = w0.astype(np.float64), np.zeros(w0.shape)
    for lr, grad in applied:
        m = 0.9 * m - lr * grad
        w = w + m
    return w


@pytest.mark.slow
@pytest.mark.parametrize("shm", ["on", "off"])
def test_two_workers_at_different_steps_each_apply_their_own_rate(start_ps, monkeypatch, shm):
    monkeypatch.setenv("PSFLOW_SHM", "1" if shm == "on" else "0")  # header-only or in-message
    ps = start_ps()
    conns = [GrpcPSConnection(ps.address, task="ps:0", timeout=30.0) for _ in range(2)]
    try:
        w0, applied = _interleaved_pushes(conns, np.random.default_rng(5))
        ((got, version),) = conns[1].pull(["w"])
        (info,) = conns[0].list_variables()
    finally:
        for c in conns:
            c.close()
    np.testing.assert_allclose(got, _momentum_reference(w0, applied), rtol=1e-5, atol=1e-6)
    assert version == 6
    assert info["slot_names"] == ("momentum",)  # created by the first push, kept through rates
    # worker 1's rates alone, or worker 0's, would end elsewhere: the test can tell
    for lr in (applied[0][0], applied[1][0]):
        same = [(lr, g) for _, g in applied]
        assert not np.allclose(_momentum_reference(w0, same), got, atol=1e-4)


def test_in_process_pushes_apply_their_own_rate_like_the_ps_process():
    conns = [InProcessPSConnection(VariableStore())]
    conns.append(conns[0])  # one store, two callers taking turns
    w0, applied = _interleaved_pushes(conns, np.random.default_rng(5))
    ((got, _),) = conns[0].pull(["w"])
    np.testing.assert_allclose(got, _momentum_reference(w0, applied), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(
    "rule_json",
    ['{"name": "sgd", "learning_rate": 0.1', "[1, 2]", '{"name": "nope"}', '{"name": "adam"}'],
    ids=["not_json", "not_object", "unknown_rule", "other_slots"],
)
def test_push_with_a_bad_rule_is_invalid_argument_and_applies_nothing(start_ps, rule_json):
    ps = start_ps()
    client = PSClient(ps.address, timeout=30.0)
    try:
        client.create_variables({"w": np.ones(3, np.float32)})
        first = client.push({"w": np.ones(3, np.float32)}, push_id=1, rule_json=_rule(0.5))
        before = client.list_variables()[0]
        with pytest.raises(errors.InvalidArgumentError) as info:
            client.push({"w": np.ones(3, np.float32)}, push_id=2, rule_json=rule_json)
        after = client.list_variables()[0]
        value = client.pull(["w"])[0]
    finally:
        client.close()
    assert first.applied
    if rule_json == '{"name": "adam"}':  # names the variable and both rules
        assert all(s in str(info.value) for s in ("'w'", "'sgd'", "'adam'"))
    assert (after.version, after.optimizer, after.slot_names, after.optimizer_step) == (
        before.version,
        before.optimizer,
        before.slot_names,
        before.optimizer_step,
    )
    np.testing.assert_allclose(value, np.full(3, 0.5, np.float32))


def test_store_rejects_a_rule_with_other_slots_and_changes_nothing():
    store = VariableStore()
    store.create([VariableMeta("a", np.dtype("float32"), (2,))], [np.zeros(2, np.float32)])
    store.create([VariableMeta("b", np.dtype("float32"), (2,))], [np.zeros(2, np.float32)])
    one = np.ones(2, np.float32)
    store.push([Grad("b", one)], push_id=("c", 1), rule_json=_rule(0.1, momentum=0.0))
    with pytest.raises(errors.InvalidArgumentError, match="'b'"):
        # "a" would take the rule (no rule yet); "b" cannot: neither is touched
        store.push([Grad("a", one), Grad("b", one)], push_id=("c", 2), rule_json=_rule(0.1))
    infos = {i.meta.name: i for i in store.list_variables()}
    assert infos["a"].optimizer_json == "" and infos["a"].version == 0
    assert infos["b"].slot_names == () and infos["b"].version == 1


def test_rule_cache_parses_each_text_once_and_stays_bounded():
    cache = RuleCache(size=3)
    first = cache.get(_rule(0.1))
    assert cache.get(_rule(0.1)) is first  # a dict lookup, no second parse
    for lr in (0.2, 0.3, 0.4):
        cache.get(_rule(lr))
    assert cache.get(_rule(0.1)) is not first  # forgotten (bounded), parsed again
    assert cache.get(_rule(0.1)) == first


def test_a_push_rejected_as_too_stale_leaves_the_rule_as_it_was():
    store = VariableStore()
    store.create([VariableMeta("w", np.dtype("float32"), (2,))], [np.zeros(2, np.float32)])
    one = np.ones(2, np.float32)
    store.push([Grad("w", one, base_version=0)], push_id=("c", 1), rule_json=_rule(0.1, 0.0))
    with pytest.raises(errors.AbortedError):
        store.push(
            [Grad("w", one, base_version=0)],
            push_id=("c", 2),
            max_staleness=0,
            rule_json=_rule(0.5, 0.0),
        )
    (info,) = store.list_variables()
    assert json.loads(info.optimizer_json)["learning_rate"] == 0.1
    np.testing.assert_allclose(store.pull(["w"])[0].value, np.full(2, -0.1, np.float32))

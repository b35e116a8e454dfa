"""A step's pulls and pushes to several PS tasks, sent from the calling thread.

A chief trains in process against two real ``ps_server`` processes (with and
without shared memory): after the first step, which asks each task for its data
plane, every pull and push of a step is started on every task before any reply
is read, with no hand-off to the session's thread pool, and the weights equal a
single-process run of the same steps.
"""

from __future__ import annotations

import signal

import numpy as np
import pytest

import psflow as pf
from psflow import errors
from psflow.distribute.cluster_resolver import ClusterSpec, SimpleClusterResolver

pytestmark = pytest.mark.slow


def _model() -> pf.keras.Model:
    init = pf.keras.initializers.GlorotUniform
    return pf.keras.Sequential(
        [
            pf.keras.layers.Dense(16, activation="relu", kernel_initializer=init(seed=1)),
            pf.keras.layers.Dense(1, kernel_initializer=init(seed=2)),
        ]
    )


def _data(steps: int, batch: int = 32):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((steps * batch, 8)).astype(np.float32)
    y = rng.standard_normal((steps * batch, 1)).astype(np.float32)
    return [(x[s * batch : (s + 1) * batch], y[s * batch : (s + 1) * batch]) for s in range(steps)]


def _step(model, optimizer, xb, yb) -> None:
    with pf.GradientTape() as tape:
        loss = pf.reduce_mean(pf.square(model(pf.constant(xb)) - yb))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))


def _on_two_ps(start_ps, shm: str, make_optimizer):
    """``(servers, strategy, model, optimizer)``: the model's variables on two real PS."""
    servers = [start_ps("--shm", shm, "--task", f"ps:{i}") for i in range(2)]
    # the worker is never reached: the chief runs the steps itself
    spec = ClusterSpec(
        {"ps": [s.address for s in servers], "worker": ["127.0.0.1:2"], "chief": ["127.0.0.1:1"]}
    )
    strategy = pf.distribute.ParameterServerStrategy(
        SimpleClusterResolver(spec, task_type="chief", task_id=0)
    )
    with strategy.scope():
        model = _model()
        model.build((None, 8))
        optimizer = make_optimizer()
    assert len({v.ps_index for v in model.trainable_variables}) == 2  # both tasks
    return servers, strategy, model, optimizer


@pytest.mark.parametrize("shm", ["on", "off"])
def test_steps_fan_out_with_no_thread_hand_off_and_equal_one_process(start_ps, shm):
    _, strategy, model, optimizer = _on_two_ps(
        start_ps, shm, lambda: pf.keras.optimizers.Adam(0.01)
    )
    batches = _data(6)
    session = strategy._session
    reference = _model()
    reference.build((None, 8))
    reference.set_weights(model.get_weights())
    ref_optimizer = pf.keras.optimizers.Adam(0.01)

    handed_off = []
    submit = session._pool.submit
    for s, (xb, yb) in enumerate(batches):
        if s == 1:  # the first step asked for the data planes; from now on no hand-off
            session._pool.submit = lambda *a, **k: handed_off.append(a) or submit(*a, **k)
        with session.step(s):
            strategy.run(_step, args=(model, optimizer, xb, yb))
        _step(reference, ref_optimizer, xb, yb)
    assert handed_off == []
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("killed", [0, 1])
def test_a_task_killed_for_good_fails_the_step_naming_it_and_the_other_is_unharmed(
    start_ps, killed
):
    # either task first in the replies' order: the other's call still runs to its end
    servers, strategy, model, optimizer = _on_two_ps(
        start_ps, "off", lambda: pf.keras.optimizers.SGD(0.1)
    )
    batches = _data(3)
    session = strategy._session
    for s, (xb, yb) in enumerate(batches[:2]):
        with session.step(s):
            strategy.run(_step, args=(model, optimizer, xb, yb))
    servers[killed].proc.send_signal(signal.SIGKILL)
    servers[killed].proc.wait(10)
    with (
        pytest.raises(
            (errors.UnavailableError, errors.DeadlineExceededError), match=f"ps:{killed}"
        ),
        session.step(2),
    ):
        strategy.run(_step, args=(model, optimizer, *batches[2]))
    # the other still answers on the same session: its connections were not left half-read
    alive = [v for v in model.trainable_variables if v.ps_index == 1 - killed]
    assert alive and all(np.all(np.isfinite(v.numpy())) for v in alive)

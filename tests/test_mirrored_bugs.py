"""Two mirrored-training bugs, each checked against single-device training.

* A replica whose batch touches no row of an embedding shard has a ``None``
  gradient for it while the others have one: every replica must still take
  part in the same all-reduce (the shard gets the others' rows), and a
  variable with no gradient on any replica is skipped, as on one device.
* A model built lazily inside ``strategy.run`` (the first call creates the
  variables, on every replica thread at once) must list each variable once on
  every replica, so that the replicas reduce the same gradients and each
  variable is updated once per step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import psflow as pf
from tests.test_mirrored_training import (
    RTOL,
    assert_matches_reference,
    assert_trained,
    copies,
    logical_cpus,
)

ROWS, DIM = 6, 3
# replica 0 of 2 gets the first half of each global batch: rows 0..2 only (shard 0);
# replica 1 gets rows of both shards. Global batches of 4, three steps.
IDS = np.array([0, 1, 3, 5, 2, 0, 4, 1, 1, 2, 0, 2], dtype=np.int64)
TARGETS = np.random.default_rng(5).normal(size=(IDS.size, DIM)).astype(np.float32)
TABLE = np.random.default_rng(6).normal(size=(ROWS, DIM)).astype(np.float32)
SPARE = np.random.default_rng(7).normal(size=(2,)).astype(np.float32)

# rules for which a sparse update equals the dense one with zero rows (mirrored replicas sum
# sparse gradients densely, as the all-reduce does); momentum and Adam would decay every row
OPTIMIZERS: dict[str, Callable[[], Any]] = {
    "sgd": lambda: pf.keras.optimizers.SGD(learning_rate=0.5),
    "adagrad": lambda: pf.keras.optimizers.Adagrad(learning_rate=0.5),
}


def _shard_loop(strategy: Any, optimizer: str, fused: bool = True) -> list[Any]:
    """Trains two row shards of a table (and an unused variable) with a custom loop."""
    with strategy.scope():
        shards = [pf.Variable(TABLE[:3], name="s0"), pf.Variable(TABLE[3:], name="s1")]
        unused = pf.Variable(SPARE, name="unused")  # no gradient on any replica
        opt = OPTIMIZERS[optimizer]()

    def step(ids: Any, targets: Any) -> Any:
        with pf.GradientTape() as tape:
            rows = pf.nn.embedding_lookup(shards, ids)
            loss = pf.reduce_sum(pf.square(rows - targets)) / 4.0
        variables = [*shards, unused]
        grads = tape.gradient(loss, variables)
        opt.apply_gradients(zip(grads, variables))
        return loss

    ds = pf.data.Dataset.from_tensor_slices((IDS, TARGETS)).batch(4)
    if strategy is None:
        for ids, targets in ds:
            step(ids, targets)
    else:
        for ids, targets in strategy.experimental_distribute_dataset(ds):
            strategy.run(step, args=(ids, targets))
    return [*shards, unused]


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("ops", ["ring_fused", "ring", "reduce_to_one"])
def test_a_replica_without_a_gradient_for_a_shard_still_reduces_with_the_others(
    optimizer: str, ops: str
) -> None:
    with pf.device("/cpu:0"):
        reference = [v.numpy() for v in _shard_loop(pf.distribute.get_strategy(), optimizer)]
    assert_trained([TABLE[:3], TABLE[3:]], reference[:2])
    np.testing.assert_array_equal(reference[2], SPARE)  # one device skips a None gradient
    cross_device_ops = {
        "ring_fused": None,  # CPU replicas: the fused reduce-and-update
        "ring": None,
        "reduce_to_one": pf.distribute.ReductionToOneDevice(),
    }[ops]
    with logical_cpus(2):
        strategy = pf.distribute.MirroredStrategy(cross_device_ops=cross_device_ops)
        if ops == "ring":
            strategy._fused_update = False  # the all-reduce then update path
        variables = _shard_loop(strategy, optimizer)
    assert_matches_reference(variables, reference, 2)


def test_the_step_count_stays_when_no_replica_has_any_gradient() -> None:
    with logical_cpus(2):
        strategy = pf.distribute.MirroredStrategy()
        with strategy.scope():
            v = pf.Variable([1.0, 2.0])
            opt = pf.keras.optimizers.Adam(0.1)
        strategy.run(lambda: opt.apply_gradients([(None, v)]))
    assert int(opt.iterations) == 0
    for part in copies(v):
        np.testing.assert_array_equal(part, [1.0, 2.0])


# -- lazily built models ---------------------------------------------------------------------------
FEATURES, UNITS, GLOBAL_BATCH = 4, 3, 8
X = np.random.default_rng(8).normal(size=(24, FEATURES)).astype(np.float32)
Y = np.random.default_rng(9).normal(size=(24, UNITS)).astype(np.float32)
KERNEL = np.random.default_rng(10).normal(size=(FEATURES, UNITS)).astype(np.float32)


def _lazy_loop(strategy: Any, delay_replica: int | None = None) -> Any:
    """A custom loop whose model is built by its first call, inside ``strategy.run``.

    ``delay_replica`` sleeps on that replica between the first forward pass and
    reading the variable list, the window in which the others finish building.
    """
    import time

    with strategy.scope():
        model = pf.keras.Sequential(
            [
                pf.keras.layers.Dense(
                    UNITS,
                    kernel_initializer=lambda shape, dtype=None, **kw: KERNEL,
                    kernel_regularizer=pf.keras.regularizers.L2(0.1),
                )
            ]
        )
        opt = pf.keras.optimizers.SGD(0.1)

    def step(x: Any, y: Any) -> Any:
        with pf.GradientTape() as tape:
            pred = model(x)
            loss = pf.reduce_sum(pf.square(pred - y)) / GLOBAL_BATCH
            loss += pf.add_n(model.losses) / strategy.num_replicas_in_sync
        ctx = pf.distribute.get_replica_context()
        if delay_replica is not None and int(ctx.replica_id_in_sync_group) == delay_replica:
            time.sleep(0.05)
        variables = model.trainable_variables
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return len(variables)

    ds = pf.data.Dataset.from_tensor_slices((X, Y)).batch(GLOBAL_BATCH)
    counts = []
    for x, y in strategy.experimental_distribute_dataset(ds):
        counts.append(strategy.experimental_local_results(strategy.run(step, args=(x, y))))
    return model, counts


@pytest.mark.parametrize("delay_replica", [None, 0, 1])
def test_a_model_built_inside_run_lists_each_variable_once_and_trains_like_one_device(
    delay_replica: int | None,
) -> None:
    reference, _ = _lazy_loop(pf.distribute.get_strategy())
    assert len(reference.trainable_variables) == 2
    want = [v.numpy() for v in reference.trainable_variables]
    assert_trained([KERNEL], want[:1])
    for _ in range(3):  # fresh strategies: the build races differently each time
        with logical_cpus(2):
            model, counts = _lazy_loop(pf.distribute.MirroredStrategy(), delay_replica)
        assert [{int(n) for n in c} for c in counts] == [{2}] * 3  # on every replica
        assert len(model.losses) == 1  # the regularizer counted once, not once per replica
        assert_matches_reference(model.trainable_variables, want, 2)
    np.testing.assert_allclose(copies(model.trainable_variables[0])[1], want[0], rtol=RTOL)


# -- the collective's agreement -------------------------------------------------------------------
def _on_two_threads(fn: Callable[[int], Any]) -> list[Any]:
    import threading

    out: list[Any] = [None, None]

    def target(rank: int) -> None:
        try:
            out[rank] = fn(rank)
        except Exception as e:  # compared by the test
            out[rank] = e

    threads = [threading.Thread(target=target, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    return out


@pytest.mark.parametrize("ops", ["ring", "reduce_to_one"])
def test_all_reduce_drops_the_arrays_no_rank_has_and_sums_the_others(ops: str) -> None:
    from psflow.collective import Communicator

    comm = Communicator(2, ops)
    present = [[False, False, True], [True, False, True]]

    def call(rank: int) -> Any:
        arrays = [np.full(3, 5.0 * rank), np.zeros(2), np.full(4, rank + 1.0)]
        return comm.all_reduce(rank, arrays, present=present[rank])

    for got in _on_two_threads(call):
        np.testing.assert_array_equal(got[0], [5.0, 5.0, 5.0])
        assert got[1] is None
        np.testing.assert_array_equal(got[2], [3.0] * 4)


def test_reduce_and_update_skips_the_arrays_no_rank_has() -> None:
    from psflow.collective import Communicator

    comm = Communicator(2)
    seen: list[tuple[int, int]] = []

    def call(rank: int) -> Any:
        arrays = [np.zeros(64, np.float32), np.ones(32, np.float32)]
        done = comm.reduce_and_update(
            rank, arrays, lambda k, lo, hi, s: seen.append((k, float(s.sum()))), [False, rank == 1]
        )
        return done

    assert _on_two_threads(call) == [[False, True], [False, True]]
    assert {k for k, _ in seen} == {1}
    assert sum(total for _, total in seen) == 64.0  # ones from both ranks, summed once


def test_bad_present_flags_fail_every_rank_naming_them() -> None:
    from psflow.collective import Communicator

    comm = Communicator(2)
    flags = [[True], [True, False]]
    got = _on_two_threads(lambda r: comm.all_reduce(r, [np.ones(2)], present=flags[r]))
    assert all(isinstance(e, pf.errors.InvalidArgumentError) for e in got)
    assert all("present must be a list of 1 booleans" in str(e) for e in got)

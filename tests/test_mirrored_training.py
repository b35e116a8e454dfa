"""MirroredStrategy with N replicas trains exactly like one device on the same global batches.

Every case trains the same small classifier two ways from the same initial
weights: on one device with no strategy (the reference), and under a
MirroredStrategy over N logical CPU devices, then compares every replica's
copy of every variable with the reference (relative error <= 1e-5) and the
copies with each other (bitwise). Global batches of 4 over 10 examples give
batch sizes not divisible by N and a partial last batch (4, 4, 2), so some
replicas get one example, and with N = 3 or 4 some get none.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import psflow as pf
from psflow.distribute.values import MirroredVariable

N_EXAMPLES, FEATURES, CLASSES, GLOBAL_BATCH, EPOCHS = 10, 5, 3, 4, 2
RTOL = 1e-5

OPTIMIZERS: dict[str, Callable[[], Any]] = {
    "sgd": lambda: pf.keras.optimizers.SGD(learning_rate=0.1),
    "sgd_momentum": lambda: pf.keras.optimizers.SGD(learning_rate=0.1, momentum=0.9),
    "adam": lambda: pf.keras.optimizers.Adam(learning_rate=0.01),
}


@contextlib.contextmanager
def logical_cpus(n: int) -> Iterator[None]:
    """Splits the CPU into ``n`` logical devices for the duration (restored afterwards)."""
    cpu = pf.config.list_physical_devices("CPU")[0]
    pf.config.set_logical_device_configuration(
        cpu, [pf.config.LogicalDeviceConfiguration() for _ in range(n)]
    )
    try:
        yield
    finally:
        pf.config.set_logical_device_configuration(cpu, None)


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N_EXAMPLES, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=(N_EXAMPLES,)).astype(np.int64)
    return x, y


def make_model() -> Any:
    model = pf.keras.Sequential(
        [pf.keras.layers.Dense(8, activation="relu"), pf.keras.layers.Dense(CLASSES)]
    )
    model.build((None, FEATURES))
    return model


def initial_weights() -> list[np.ndarray]:
    pf.random.set_seed(1)
    return [np.array(w) for w in make_model().get_weights()]


def copies(variable: Any) -> list[np.ndarray]:
    """Every replica's copy of ``variable`` as a host array (one for a plain variable)."""
    parts = variable.values if isinstance(variable, MirroredVariable) else (variable,)
    return [np.array(pf.backend.to_numpy(p._value)) for p in parts]


def assert_matches_reference(
    variables: list[Any], reference: list[np.ndarray], replicas: int
) -> None:
    assert len(variables) == len(reference)
    for v, ref in zip(variables, reference):
        parts = copies(v)
        assert len(parts) == replicas, v
        for p in parts[1:]:  # identical on every replica
            np.testing.assert_array_equal(p, parts[0])
        scale = max(float(np.max(np.abs(ref))), 1e-12)
        err = float(np.max(np.abs(parts[0] - ref))) / scale
        assert err <= RTOL, f"{v.name}: relative error {err:.3g} against one device"


def assert_trained(before: list[np.ndarray], after: list[np.ndarray]) -> None:
    """The comparison means something only if training moved the weights."""
    assert any(float(np.max(np.abs(a - b))) > 1e-3 for a, b in zip(before, after))


# -- Keras fit -------------------------------------------------------------------------------------
def fit_reference(optimizer: str, distributed_input: bool) -> tuple[list[np.ndarray], list[float]]:
    x, y = data()
    model = make_model()
    model.set_weights(initial_weights())
    model.compile(
        optimizer=OPTIMIZERS[optimizer](),
        loss=pf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    if distributed_input:
        ds = pf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
        history = model.fit(ds, epochs=EPOCHS, verbose=0)
    else:
        history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return [np.array(w) for w in model.get_weights()], history.history["loss"]


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("distributed_input", [False, True], ids=["arrays", "distributed_dataset"])
@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
def test_fit_matches_single_device(replicas: int, distributed_input: bool, optimizer: str) -> None:
    reference, reference_loss = fit_reference(optimizer, distributed_input)
    assert_trained(initial_weights(), reference)
    x, y = data()
    with logical_cpus(replicas):
        strategy = pf.distribute.MirroredStrategy()
        assert strategy.num_replicas_in_sync == replicas
        with strategy.scope():
            model = make_model()
            model.set_weights(initial_weights())
            model.compile(
                optimizer=OPTIMIZERS[optimizer](),
                loss=pf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
        if distributed_input:
            ds = pf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
            history = model.fit(
                strategy.experimental_distribute_dataset(ds), epochs=EPOCHS, verbose=0
            )
        else:
            history = model.fit(
                x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0
            )
    if replicas > 1:
        assert all(isinstance(v, MirroredVariable) for v in model.trainable_variables)
    assert_matches_reference(model.trainable_variables, reference, replicas)
    # the logged loss is the mean over each epoch's examples, as on one device
    np.testing.assert_allclose(history.history["loss"], reference_loss, rtol=RTOL)


# -- TensorFlow's custom training loop ------------------------------------------------------------
def custom_loop(strategy: Any, optimizer: str) -> tuple[Any, list[float]]:
    """TensorFlow's custom-loop tutorial, as written for tf.distribute; returns (model, losses)."""
    x, y = data()
    with strategy.scope():
        model = make_model()
        model.set_weights(initial_weights())
        opt = OPTIMIZERS[optimizer]()
        loss_object = pf.keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="none"
        )

    def compute_loss(labels: Any, predictions: Any) -> Any:
        per_example_loss = loss_object(labels, predictions)
        return pf.nn.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH)

    def train_step(inputs: Any) -> Any:
        features, labels = inputs
        with pf.GradientTape() as tape:
            predictions = model(features, training=True)
            loss = compute_loss(labels, predictions)
        gradients = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    @pf.function
    def distributed_train_step(dist_inputs: Any) -> Any:
        per_replica_losses = strategy.run(train_step, args=(dist_inputs,))
        return strategy.reduce("SUM", per_replica_losses, axis=None)

    dataset = pf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    dist_dataset = strategy.experimental_distribute_dataset(dataset)
    losses = []
    for _ in range(EPOCHS):
        for dist_inputs in dist_dataset:
            losses.append(float(distributed_train_step(dist_inputs)))
    return model, losses


def custom_loop_reference(optimizer: str) -> tuple[list[np.ndarray], list[float]]:
    """The same loop with no strategy at all: one device, global batches."""
    x, y = data()
    model = make_model()
    model.set_weights(initial_weights())
    opt = OPTIMIZERS[optimizer]()
    loss_object = pf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    losses = []
    for _ in range(EPOCHS):
        for features, labels in pf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH):
            with pf.GradientTape() as tape:
                loss = pf.nn.compute_average_loss(
                    loss_object(labels, model(features, training=True)),
                    global_batch_size=GLOBAL_BATCH,
                )
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            losses.append(float(loss))
    return [np.array(w) for w in model.get_weights()], losses


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
def test_custom_loop_matches_single_device(replicas: int, optimizer: str) -> None:
    reference, reference_losses = custom_loop_reference(optimizer)
    assert_trained(initial_weights(), reference)
    with logical_cpus(replicas):
        strategy = pf.distribute.MirroredStrategy()
        model, losses = custom_loop(strategy, optimizer)
    assert_matches_reference(model.trainable_variables, reference, replicas)
    # strategy.reduce(SUM) of the per-replica averaged losses is the global batch's mean loss
    np.testing.assert_allclose(losses, reference_losses, rtol=RTOL)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("replicas", [2, 3])
def test_fused_reduce_and_update_on_replica_threads_matches_single_device(
    replicas: int, optimizer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the ring's per-replica threshold at 0 every replica thread sums and updates
    its own range of every copy (the path large models take); each step is one
    ``reduce_and_update`` and no separate all-reduce."""
    from psflow.collective import Communicator, RingAllReduce

    calls: list[str] = []
    for name in ("reduce_and_update", "all_reduce"):
        original = getattr(Communicator, name)

        def spy(self: Any, *args: Any, _name: str = name, _f: Any = original, **kw: Any) -> Any:
            calls.append(_name)
            return _f(self, *args, **kw)

        monkeypatch.setattr(Communicator, name, spy)
    reference, reference_losses = custom_loop_reference(optimizer)
    with logical_cpus(replicas):
        strategy = pf.distribute.MirroredStrategy(
            cross_device_ops=RingAllReduce(replica_parallel_threshold_bytes=0)
        )
        model, losses = custom_loop(strategy, optimizer)
    assert_matches_reference(model.trainable_variables, reference, replicas)
    np.testing.assert_allclose(losses, reference_losses, rtol=RTOL)
    steps = EPOCHS * -(-N_EXAMPLES // GLOBAL_BATCH)
    assert calls.count("reduce_and_update") == steps * replicas
    assert "all_reduce" not in calls


def test_custom_loop_with_reduction_to_one_device_matches_ring() -> None:
    with logical_cpus(3):
        ring_model, ring_losses = custom_loop(pf.distribute.MirroredStrategy(), "adam")
        rto = pf.distribute.MirroredStrategy(cross_device_ops=pf.distribute.ReductionToOneDevice())
        rto_model, rto_losses = custom_loop(rto, "adam")
    np.testing.assert_allclose(rto_losses, ring_losses, rtol=RTOL)
    for a, b in zip(ring_model.trainable_variables, rto_model.trainable_variables):
        np.testing.assert_allclose(copies(a)[0], copies(b)[2], rtol=RTOL, atol=1e-7)


@pytest.mark.parametrize("aggregate", [True, False], ids=["in_replica", "merge_call"])
def test_each_step_updates_once_with_one_step_count(aggregate: bool) -> None:
    """Both update paths (each replica its own copy after the all-reduce, or a merge when
    the caller aggregated) count one step per call and apply Adam as one device would."""
    with logical_cpus(3):
        strategy = pf.distribute.MirroredStrategy()
        with strategy.scope():
            v = pf.Variable([1.0, 2.0])
            opt = pf.keras.optimizers.Adam(learning_rate=0.1)

        def step() -> None:
            ctx = pf.distribute.get_replica_context()
            g = pf.constant([1.0, -1.0]) * float(ctx.replica_id_in_sync_group + 1)
            if not aggregate:
                g = ctx.all_reduce("SUM", g)
            opt.apply_gradients([(g, v)], experimental_aggregate_gradients=aggregate)

        for _ in range(5):
            strategy.run(step)
    ref_v = pf.Variable([1.0, 2.0])
    ref_opt = pf.keras.optimizers.Adam(learning_rate=0.1)
    for _ in range(5):
        ref_opt.apply_gradients([(pf.constant([6.0, -6.0]), ref_v)])
    assert int(opt.iterations) == int(ref_opt.iterations) == 5
    for part in copies(v):
        np.testing.assert_array_equal(part, ref_v.numpy())

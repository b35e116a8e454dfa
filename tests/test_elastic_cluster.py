"""Elastic parameter servers with real processes: redirects, resizes while training, failures."""

from __future__ import annotations

import contextlib
import signal
import threading
import time

import cloudpickle
import numpy as np
import pytest

import psflow as pf
from psflow import errors
from psflow.distribute.cluster_resolver import ClusterSpec, SimpleClusterResolver
from psflow.distribute.ps import session as session_lib
from psflow.distribute.ps.grpc_connection import GrpcPSConnection

pytestmark = pytest.mark.slow

NOWHERE = "127.0.0.1:2"  # a worker address for strategies that schedule nothing


class _Listing(SimpleClusterResolver):
    """The cluster as a cluster manager lists it now: the first ``num_ps`` PS tasks.

    It reads afresh on every call, as a resolver watching Kubernetes does; this
    process is the chief.
    """

    def __init__(self, cluster, num_ps: int, workers: list[str] | None = None) -> None:
        self.cluster = cluster
        self.num_ps = num_ps
        self.workers = workers
        super().__init__(self._spec(), task_type="chief", task_id=0)

    def _spec(self) -> ClusterSpec:
        workers = self.workers or [w.address for w in self.cluster.workers]
        ps = [p.address for p in self.cluster.ps[: self.num_ps]]
        return ClusterSpec({"ps": ps, "worker": workers, "chief": ["127.0.0.1:1"]})

    def cluster_spec(self) -> ClusterSpec:
        return self._spec()


def _optimizer_steps(strategy) -> dict[str, int]:
    """Each variable's optimizer step, as the PS task holding it reports it."""
    out = {}
    for c in strategy._session.connections:
        for v in c.list_variables():
            out[v["name"]] = v["optimizer_step"]
    return out


def _drained(server, timeout: float = 30.0) -> str:
    """Waits for a drained PS process to exit 0; returns the rest of its stdout."""
    assert server.proc.wait(timeout) == 0, server.log_tail()
    return server.proc.stdout.read().decode()


def test_a_client_with_a_stale_map_is_redirected_and_its_push_lands_once(start_cluster):
    cluster = start_cluster(num_ps=3, num_workers=0)
    resolver = _Listing(cluster, 2, workers=[NOWHERE])
    strategy = pf.distribute.ParameterServerStrategy(resolver)
    with strategy.scope():
        variables = [pf.Variable(np.full(4, i, "float32"), name=f"v{i}") for i in range(6)]
    # another process's view (a worker's), taken before the resize
    stale = pf.distribute.ParameterServerStrategy._for_worker(
        [p.address for p in cluster.ps[:2]], 1, "worker:7"
    )
    with session_lib.using(stale._session):
        stale_vars = cloudpickle.loads(cloudpickle.dumps(variables))
        before = [v.numpy() for v in stale_vars]
    old_owner = {v.key: v.ps_index for v in stale_vars}

    resolver.num_ps = 3
    report = strategy.resize_parameter_servers(3, timeout=60)
    assert (report.old_num_ps, report.new_num_ps, report.version_after) == (2, 3, 1)
    moved = [v for v in variables if v.ps_index == 2]
    assert len(moved) == report.shards_moved == 2

    # at the wire: the old owner answers a typed redirect naming the new owner
    m = moved[0]
    probe = GrpcPSConnection(cluster.ps[old_owner[m.key]].address, task="ps:old")
    try:
        with pytest.raises(errors.MovedError) as e:
            probe.client.pull([m.key])
        assert (e.value.key, e.value.owner, e.value.address, e.value.version) == (
            m.key,
            2,
            cluster.ps[2].address,
            1,
        )
    finally:
        probe.close()

    # the stale client reads and pushes by its old map: redirected, each push applied once
    optimizer = pf.keras.optimizers.SGD(0.5)
    with session_lib.using(stale._session):
        for v, want in zip(stale_vars, before):
            np.testing.assert_array_equal(v.numpy(), want)
        ones = pf.constant(np.ones(4, "float32"))
        stale._session.apply_optimizer(optimizer, [(ones, v) for v in stale_vars], step=0)
    assert [v.ps_index for v in stale_vars] == [v.ps_index for v in variables]
    assert len(stale._session.connections) == 3
    for i, v in enumerate(variables):
        np.testing.assert_array_equal(v.numpy(), np.full(4, i - 0.5, "float32"))
    assert set(_optimizer_steps(strategy).values()) == {1}
    stale._session.close()


def _model() -> pf.keras.Model:
    return pf.keras.Sequential(
        [
            pf.keras.layers.Dense(
                8,
                activation="tanh",
                input_shape=(5,),
                kernel_initializer=pf.keras.initializers.GlorotUniform(seed=1),
            ),
            pf.keras.layers.Dense(
                3, kernel_initializer=pf.keras.initializers.GlorotUniform(seed=2)
            ),
            pf.keras.layers.Dense(
                1, kernel_initializer=pf.keras.initializers.GlorotUniform(seed=3)
            ),
        ]
    )


def _train(
    cluster,
    resolver,
    mode: str,
    resizes: dict[int, int],
    steps_per_phase: int = 2,
    on_scheduled=None,
):
    """Three phases of steps (one closure per worker per step), resizing between them.

    ``on_scheduled(coordinator, n)`` runs in this thread after the n-th closure is scheduled.
    Returns the weights, each variable's optimizer step, the closures run and the reports.
    """
    rng = np.random.default_rng(3)
    x = rng.normal(size=(96, 5)).astype(np.float32)
    y = (x @ rng.normal(size=(5, 1))).astype(np.float32)
    pf.random.set_seed(0)
    strategy = pf.distribute.ParameterServerStrategy(resolver, mode=mode)
    with strategy.scope():
        model = _model()
        optimizer = pf.keras.optimizers.Adam(0.01)
    coordinator = pf.distribute.coordinator.ClusterCoordinator(strategy)

    def dataset_fn(ctx):
        ds = pf.data.Dataset.from_tensor_slices((x, y))
        return ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id).batch(4).repeat()

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    def step(iterator):
        xb, yb = next(iterator)

        def replica(xb, yb):
            with pf.GradientTape() as tape:
                loss = pf.reduce_mean(pf.square(model(xb, training=True) - yb))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        return strategy.run(replica, args=(xb, yb))

    reports, closures = [], 0
    for phase in range(3):
        for _ in range(steps_per_phase * coordinator.num_workers):
            coordinator.schedule(step, args=(iterator,))
            closures += 1
            if on_scheduled is not None:
                on_scheduled(coordinator, closures)
        if phase in resizes:  # closures still in flight: the resize waits for the boundary
            resolver.num_ps = max(resolver.num_ps, resizes[phase])
            reports.append(coordinator.resize_parameter_servers(resizes[phase], timeout=60))
    coordinator.join()
    weights = [w.numpy() for w in model.weights]
    steps = _optimizer_steps(strategy)
    coordinator.shutdown()
    return weights, steps, closures, reports


def test_sync_training_through_2_3_1_servers_equals_a_fixed_2_server_layout_bit_for_bit(
    start_cluster,
):
    fixed_cluster = start_cluster(num_ps=2, num_workers=2)
    fixed, fixed_steps, _, _ = _train(fixed_cluster, _Listing(fixed_cluster, 2), "sync", {})

    cluster = start_cluster(num_ps=3, num_workers=2)
    elastic, steps, _, reports = _train(cluster, _Listing(cluster, 2), "sync", {0: 3, 1: 1})

    for a, b in zip(fixed, elastic):
        np.testing.assert_array_equal(a, b)
    # (the layer names differ: the second model's counters went on)
    assert len(steps) == len(fixed_steps) == 6
    assert set(steps.values()) == set(fixed_steps.values()) == {6}  # 3 phases x 2 sync steps
    assert [(r.old_num_ps, r.new_num_ps) for r in reports] == [(2, 3), (3, 1)]
    assert [r.version_after for r in reports] == [1, 2]
    assert all(r.shards_moved > 0 and r.bytes_moved > 0 for r in reports)
    # the drained tasks exit cleanly and say so, so a supervisor does not restart them
    for server in cluster.ps[1:]:
        assert "PSFLOW_DRAINED" in _drained(server)
    assert cluster.ps[0].proc.poll() is None


def test_sync_training_resized_2_3_2_from_another_thread_equals_a_fixed_layout(start_cluster):
    fixed_cluster = start_cluster(num_ps=2, num_workers=2)
    fixed, fixed_steps, _, _ = _train(fixed_cluster, _Listing(fixed_cluster, 2), "sync", {})

    cluster = start_cluster(num_ps=3, num_workers=2)
    resolver = _Listing(cluster, 2)
    coordinators: list = []
    # asked mid-step (closure 3 and 7, 2 per step): the fence lets that step finish first
    reached = {3: threading.Event(), 7: threading.Event()}
    asked = {3: threading.Event(), 7: threading.Event()}
    reports, failures = [], []

    def on_scheduled(coordinator, n):
        if n in reached:
            coordinators.append(coordinator)
            reached[n].set()
            assert asked[n].wait(90)  # then it schedules at once, racing the resize

    def resizer():
        try:
            for n, num_ps in ((3, 3), (7, 2)):
                assert reached[n].wait(90)
                resolver.num_ps = 3
                asked[n].set()
                reports.append(coordinators[0].resize_parameter_servers(num_ps, timeout=60))
        except BaseException as e:  # raised by the test's thread below
            failures.append(e)
        finally:
            for event in asked.values():
                event.set()

    thread = threading.Thread(target=resizer, daemon=True)
    thread.start()
    elastic, steps, closures, _ = _train(cluster, resolver, "sync", {}, on_scheduled=on_scheduled)
    thread.join(90)
    assert not failures, failures
    # the first resize ended before closure 8 was scheduled: it ran mid-training
    assert [(r.old_num_ps, r.new_num_ps) for r in reports] == [(2, 3), (3, 2)]
    assert closures == 12 and all(r.shards_moved > 0 for r in reports)
    for a, b in zip(fixed, elastic):
        np.testing.assert_array_equal(a, b)
    assert set(steps.values()) == set(fixed_steps.values()) == {6}
    assert "PSFLOW_DRAINED" in _drained(cluster.ps[2])


def test_async_training_through_a_resize_applies_every_push_exactly_once(start_cluster):
    cluster = start_cluster(num_ps=3, num_workers=2)
    _, steps, closures, reports = _train(
        cluster, _Listing(cluster, 2), "async", {0: 3, 1: 1}, steps_per_phase=3
    )
    # every variable took one update per closure: none lost in a move, none applied twice
    assert set(steps.values()) == {closures} and closures == 18
    assert [r.new_num_ps for r in reports] == [3, 1]


def test_a_ps_killed_mid_resize_leaves_a_consistent_map_that_checkpoint_recovery_restores(
    start_cluster, tmp_path
):
    cluster = start_cluster(num_ps=3, num_workers=0)
    resolver = _Listing(cluster, 2, workers=[NOWHERE])
    strategy = pf.distribute.ParameterServerStrategy(resolver)
    with strategy.scope():
        variables = [pf.Variable(np.full(4, i, "float32"), name=f"v{i}") for i in range(6)]
    optimizer = pf.keras.optimizers.Adam(0.1)
    ones = pf.constant(np.ones(4, "float32"))
    optimizer.apply_gradients([(ones, v) for v in variables])
    checkpoint = pf.train.Checkpoint(**{f"v{i}": v for i, v in enumerate(variables)})
    path = checkpoint.write(str(tmp_path / "ckpt"))
    saved = [v.numpy() for v in variables]

    cluster.ps[1].stop(signal.SIGKILL)  # lost while the resize moves its variables
    resolver.num_ps = 3
    with pytest.raises((errors.UnavailableError, errors.DeadlineExceededError)):
        strategy.resize_parameter_servers(3, timeout=3)
    # consistent: what moved before the failure is where the map says, the rest stayed
    placement = strategy.placement()
    assert placement.version == 1
    on_2 = placement.keys_of(2)
    assert on_2 and all(v.ps_index in (1, 2) for v in variables if v.key in on_2)
    probe = GrpcPSConnection(cluster.ps[2].address, task="ps:2")
    try:
        assert sorted(d["name"] for d in probe.list_variables()) == on_2
    finally:
        probe.close()

    # the recovery of today: the lost task comes back empty, the checkpoint is restored
    # into the map's layout, the resize is run again
    cluster.restart_ps(1)
    checkpoint.restore(path)
    for v, want in zip(variables, saved):
        np.testing.assert_array_equal(v.numpy(), want)
    report = strategy.resize_parameter_servers(3, timeout=60)
    assert report.version_after == 2
    for v, want in zip(variables, saved):
        np.testing.assert_array_equal(v.numpy(), want)
    optimizer.apply_gradients([(ones, v) for v in variables])  # training goes on
    assert set(_optimizer_steps(strategy).values()) == {2}


def test_resize_beyond_the_listed_tasks_is_refused_naming_both_counts(start_cluster):
    cluster = start_cluster(num_ps=2, num_workers=0)
    resolver = _Listing(cluster, 2, workers=[NOWHERE])
    strategy = pf.distribute.ParameterServerStrategy(resolver)
    with strategy.scope():
        pf.Variable([1.0, 2.0], name="v")
    before = strategy.placement()
    with pytest.raises(errors.InvalidArgumentError, match=r"num_ps=3.*lists 2 ps tasks"):
        strategy.resize_parameter_servers(3)
    assert strategy.placement() == before


def test_a_push_arriving_during_a_handover_is_applied_once_at_the_new_owner(start_cluster):
    cluster = start_cluster(num_ps=2, num_workers=0)
    strategy = pf.distribute.ParameterServerStrategy(_Listing(cluster, 2, workers=[NOWHERE]))
    with strategy.scope():
        variables = [pf.Variable(np.full(4, i, "float32"), name=f"v{i}") for i in range(2)]
    v = variables[0]
    source, target = strategy._session.connections
    assert v.ps_index == 0
    worker = pf.distribute.ParameterServerStrategy._for_worker(
        [p.address for p in cluster.ps], 1, "worker:3"
    )
    with session_lib.using(worker._session):
        (w,) = cloudpickle.loads(cloudpickle.dumps([v]))
    optimizer = pf.keras.optimizers.SGD(0.5)
    ones = pf.constant(np.ones(4, "float32"))

    state = source.export_shard([v.key])  # the fence begins: writes to v wait
    pushed = []

    def push():
        with session_lib.using(worker._session):
            worker._session.apply_optimizer(optimizer, [(ones, w)], step=0)
        pushed.append(True)

    thread = threading.Thread(target=push)
    thread.start()
    deadline = time.monotonic() + 10
    while not source.stats()["rejected"].get("handover") and time.monotonic() < deadline:
        time.sleep(0.02)  # the push reached the old owner and is being retried
    assert source.stats()["rejected"].get("handover"), "the push never met the fence"
    target.import_shard(state, 1)
    source.release_shard([v.key], 1, cluster.ps[1].address, 1)
    thread.join(30)
    assert pushed and w.ps_index == 1  # redirected, and the worker learned where v is
    np.testing.assert_array_equal(target.pull([v.key])[0][0], np.full(4, -0.5, "float32"))
    assert {d["name"]: d["optimizer_step"] for d in target.list_variables()}[v.key] == 1
    worker._session.close()


def test_bad_move_requests_get_typed_statuses_and_change_nothing(start_ps):
    from psflow.transport.client import PSClient

    server = start_ps()
    client = PSClient(server.address, task="ps:0", timeout=10)
    try:
        client.create_variables({"w": np.ones(3, "float32")})
        with pytest.raises(errors.NotFoundError, match="nope"):
            client.export_shard(["w", "nope"])
        with pytest.raises(errors.DataLossError):
            client.import_shard(b"\x02\x00\x00\x00\x00\x00\x00\x00{}", 1)
        with pytest.raises(errors.NotFoundError, match="nope"):
            client.release_shard(["w", "nope"], 1, "127.0.0.1:9", 1)
        with pytest.raises(errors.FailedPreconditionError, match="still holds 1"):
            client.drain()
        np.testing.assert_array_equal(client.pull(["w"])[0], np.ones(3, "float32"))
        client.assign({"w": np.zeros(3, "float32")})  # not fenced, still served
        assert server.proc.poll() is None
        # a real drain: give w away, then the task exits 0 and says so
        client.release_shard(["w"], 1, "127.0.0.1:9", 1)
        with pytest.raises(errors.MovedError):
            client.pull(["w"])
        client.drain()
    finally:
        client.close()
    assert "PSFLOW_DRAINED" in _drained(server)


def test_a_variable_larger_than_a_message_moves_in_chunks_with_its_slots(start_ps):
    from psflow.transport.client import PSClient

    source, target = start_ps(), start_ps("--task", "ps:1")
    a = PSClient(source.address, task="ps:0", chunk_bytes=256 << 10)
    b = PSClient(target.address, task="ps:1", chunk_bytes=256 << 10)
    try:
        value = np.random.default_rng(0).normal(size=(1 << 20,)).astype("float32")  # 4 MB
        a.create_variables({"big": value})
        a.configure_optimizer(["big"], {"name": "adam", "learning_rate": 0.01})
        a.push({"big": np.ones_like(value)})
        state = a.export_shard(["big"])
        assert len(state) > 3 * value.nbytes  # value and two slots, many chunks each way
        assert b.import_shard(state, 1) == ["big"]
        a.release_shard(["big"], 1, target.address, 1)
        for client in (a, b):  # one more step at each: only the new owner takes it
            with contextlib.suppress(errors.MovedError):
                client.push({"big": np.ones_like(value)})
        reference = PSClient(start_ps().address, task="ref")
        try:
            reference.create_variables({"big": value})
            reference.configure_optimizer(["big"], {"name": "adam", "learning_rate": 0.01})
            reference.push({"big": np.ones_like(value)})
            reference.push({"big": np.ones_like(value)})
            np.testing.assert_array_equal(b.pull(["big"])[0], reference.pull(["big"])[0])
        finally:
            reference.close()
    finally:
        a.close()
        b.close()

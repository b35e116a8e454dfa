"""``MirroredStrategy``: synchronous data parallelism over one machine's devices.

One replica per device, each in its own thread. Variables created in
``scope()`` become :class:`MirroredVariable`s (a copy per device). Inside
``run``, replicas compute on their slice of the batch; ``all_reduce`` (the ring
by default) sums their gradients, and the optimizer applies the same update
to every copy, so N replicas train exactly like one device on the global batch.

Example:
    >>> import psflow as tf
    >>> strategy = tf.distribute.MirroredStrategy()
    >>> print(strategy.num_replicas_in_sync)
    1
"""

from __future__ import annotations

import enum
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from psflow import backend, errors, thread_budget
from psflow import config as config_lib
from psflow.collective import (
    CommunicationOptions,
    Communicator,
    CrossDeviceOps,
    create_cross_device_ops,
    default_cross_device_ops,
)
from psflow.distribute import distribute_lib, input_lib, reduce_util
from psflow.distribute.protocols import GroupUpdated, UpdateGroup
from psflow.distribute.reduce_util import ReduceOp
from psflow.distribute.replica_pool import ReplicaPool
from psflow.distribute.sync_on_read import SyncOnReadVariable, check_aggregation
from psflow.distribute.values import (
    MirroredVariable,
    PerReplica,
    local_results,
    regroup,
    select_replica,
)
from psflow.framework import variable as variable_lib
from psflow.framework.indexed_slices import IndexedSlices
from psflow.framework.product_gradient import ProductGradient, multiplied_out
from psflow.framework.tensor import Tensor, to_array
from psflow.util import nest


class _MergeRendezvous:
    """Meets the N replicas' ``merge_call``s; the last to arrive runs the merge function.

    While the merge function runs, the other replicas wait here; the merge
    function may hand each of them a piece of work with :meth:`for_each_replica`
    (the optimizer updates every replica's copy of the variables this way, on
    the replicas' own threads, in parallel).
    """

    def __init__(self, num_replicas: int, timeout: float) -> None:
        self._n = num_replicas
        self._timeout = timeout
        self._cond = threading.Condition(threading.Lock())
        self._round = 0
        self._args: dict[int, Any] = {}
        self._outcome: tuple[Any, BaseException | None] = (None, None)
        self._aborted = False
        self._merger: int | None = None  # thread ident of the replica running the merge
        self._tasks: dict[int, Callable[[], None]] = {}
        self._tasks_left = 0
        self._task_errors: list[BaseException] = []

    def abort(self) -> None:
        """Fails every replica waiting here now (another replica failed)."""
        with self._cond:
            self._aborted = True
            self._cond.notify_all()

    def call(self, replica: int, args: Any, run: Callable[[list[Any]], Any]) -> Any:
        """Hands in ``replica``'s arguments; returns what ``run(all arguments)`` returned.

        Raises:
            DeadlineExceededError: some replica did not arrive within the timeout (named).
            CancelledError: another replica failed meanwhile.
            The merge function's own error, on every replica.
        """
        with self._cond:
            if self._aborted:
                raise errors.CancelledError("merge_call cancelled: another replica failed")
            my_round = self._round
            self._args[replica] = args
            merging = len(self._args) == self._n
            if merging:
                ordered = [self._args[i] for i in range(self._n)]
                self._args = {}
                self._merger = threading.get_ident()
            else:
                self._wait_for_merge(my_round)
                value, error = self._outcome
        if merging:  # outside the lock, so that the others can take work from for_each_replica
            try:
                outcome: tuple[Any, BaseException | None] = (run(ordered), None)
            except BaseException as e:  # every replica sees the failure
                outcome = (None, e)
            with self._cond:
                self._outcome = outcome
                self._merger = None
                self._round += 1
                self._cond.notify_all()
            value, error = outcome
        if error is not None:
            raise error
        return value

    def _wait_for_merge(self, my_round: int) -> None:
        """Waits (holding the lock) for round ``my_round``'s outcome, doing work handed out."""
        me = threading.get_ident()
        deadline = time.monotonic() + self._timeout
        while self._round == my_round:
            if self._aborted:
                raise errors.CancelledError("merge_call cancelled: another replica failed")
            task = self._tasks.pop(me, None)
            if task is not None:
                self._cond.release()
                try:
                    task()
                    failure = None
                except BaseException as e:  # handed back to the merging replica
                    failure = e
                finally:
                    self._cond.acquire()
                if failure is not None:
                    self._task_errors.append(failure)
                self._tasks_left -= 1
                self._cond.notify_all()
                continue
            if self._merger is not None:  # everyone is here; the merge runs (its own bound)
                self._cond.wait(self._timeout)
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(self._n)) - set(self._args))
                raise errors.DeadlineExceededError(
                    f"merge_call: replica(s) {missing} did not arrive within {self._timeout}s"
                )
            self._cond.wait(left)

    def for_each_replica(self, threads: list[int], fn: Callable[[int], None]) -> None:
        """Runs ``fn(i)`` for every replica ``i``, on replica ``i``'s thread when possible.

        Called by the merge function: the waiting replicas (whose thread idents
        are ``threads[i]``) each run their own ``fn(i)`` while this thread runs
        its own. Elsewhere (no merge running in this thread) it runs them all here.

        Raises:
            The first error of any ``fn(i)``, after all of them finished.
        """
        me = threading.get_ident()
        if self._merger != me or len(threads) != self._n:
            for i in range(self._n):
                fn(i)
            return
        mine = [i for i, t in enumerate(threads) if t == me]
        with self._cond:
            self._task_errors = []
            self._tasks = {t: (lambda i=i: fn(i)) for i, t in enumerate(threads) if t != me}
            self._tasks_left = len(self._tasks)
            self._cond.notify_all()
        failure: BaseException | None = None
        for i in mine:
            try:
                fn(i)
            except BaseException as e:
                failure = failure or e
        with self._cond:
            while self._tasks_left > 0 and not self._aborted:
                self._cond.wait(self._timeout)
            self._tasks = {}
            failure = failure or (self._task_errors[0] if self._task_errors else None)
            if failure is None and self._tasks_left > 0:
                failure = errors.CancelledError("merge_call cancelled: another replica failed")
        if failure is not None:
            raise failure


class _UpdatePath(enum.Enum):
    """The three ways a replica's update happens (see :meth:`MirroredExtended.apply_update`)."""

    FUSED = "fused"  # one collective sums and applies, range by range
    IN_REPLICA = "in_replica"  # all-reduce, then each replica updates its own copies
    MERGE = "merge"  # handed to the cross-replica update in one merge_call


class MirroredReplicaContext(distribute_lib.ReplicaContext):
    """The replica context inside ``MirroredStrategy.run``: collectives across devices."""

    def all_reduce(self, reduce_op: Any, value: Any, options: Any = None) -> Any:
        """Sums (or averages) ``value`` across replicas; sparse gradients are densified first."""
        op = ReduceOp.from_value(reduce_op)
        strategy: MirroredStrategy = self._strategy  # type: ignore[assignment]
        flat = nest.flatten(value)
        arrays = [x.dense_array() if isinstance(x, IndexedSlices) else to_array(x) for x in flat]
        if op is ReduceOp.MEAN and any(a.dtype.kind in "iu" for a in arrays):
            # the collective's MEAN is float-only; TF sums and true-divides (int32 -> float64;
            # one replica: the value itself). Every replica has the same dtypes: same branch.
            summed = strategy._communicator.all_reduce(self._replica_id, arrays, "SUM")
            n = strategy.num_replicas_in_sync
            out = [Tensor._wrap(a) for a in summed]
            return nest.pack_sequence_as(
                value, out if n == 1 else [reduce_util.mean(t, n) for t in out]
            )
        reduced = strategy._communicator.all_reduce(self._replica_id, arrays, op.value)
        return nest.pack_sequence_as(value, [Tensor._wrap(a) for a in reduced])

    def _all_reduce_gradients(self, grads: list[Any], variables: list[Any]) -> list[Any]:
        """Sums gradients across replicas; ``None`` where no replica has one.

        A replica without a gradient for a variable (its batch touched no row of
        that shard) adds zeros, so every replica reduces the same list; the
        variables no replica has a gradient for are agreed on in the same
        rendezvous (see :mod:`psflow.collective.absent`).
        """
        strategy: MirroredStrategy = self._strategy  # type: ignore[assignment]
        present = [g is not None for g in grads]
        arrays = [
            _zeros_for(v)
            if g is None
            else g.dense_array()
            if isinstance(g, IndexedSlices)
            else to_array(g)
            for g, v in zip(grads, variables)
        ]
        reduced = strategy._communicator.all_reduce(
            self._replica_id, arrays, "SUM", present=present
        )
        return [None if r is None else Tensor._wrap(r) for r in reduced]

    def all_gather(self, value: Any, axis: int, options: Any = None) -> Any:
        """Concatenates ``value`` from every replica along ``axis``."""
        strategy: MirroredStrategy = self._strategy  # type: ignore[assignment]
        flat = nest.flatten(value)
        out = [
            Tensor._wrap(strategy._communicator.all_gather(self._replica_id, to_array(x), axis))
            for x in flat
        ]
        return nest.pack_sequence_as(value, out)

    def merge_call(
        self, merge_fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        """Runs ``merge_fn(strategy, *args)`` once, with per-replica arguments grouped.

        Every replica gets the result with each ``PerReplica`` in it replaced by
        that replica's own component (TensorFlow's ``select_replica``).
        """
        strategy: MirroredStrategy = self._strategy  # type: ignore[assignment]
        kwargs = kwargs or {}

        def run(all_args: list[Any]) -> Any:
            grouped_args, grouped_kwargs = regroup(all_args) if len(all_args) > 1 else all_args[0]
            with distribute_lib._enter(distribute_lib._Context(strategy, None)):
                return merge_fn(strategy, *grouped_args, **grouped_kwargs)

        if strategy.num_replicas_in_sync == 1:
            return run([(args, kwargs)])
        result = strategy._merge.call(self._replica_id, (args, kwargs), run)
        return select_replica(self._replica_id, result)

    def _all_reduce_and_apply(
        self, optimizer: Any, grads: list[Any], variables: list[Any], step: int
    ) -> bool:
        """Sums the gradients across replicas, then updates this replica's own copies.

        After the all-reduce every replica holds the same sums, and each copy is
        only ever written by its own replica, so no merge (two more rendezvous
        and a hand-off between threads per step) is needed.  Only for variables
        mirrored by this strategy (:meth:`MirroredExtended.apply_update` chose).
        Returns whether any variable had a gradient.
        """
        reduced = self._all_reduce_gradients(grads, variables)
        i = self._replica_id
        applied = False
        with backend.device(self._strategy.extended._devices[i]):
            for grad, var in zip(reduced, variables):
                if grad is not None:
                    optimizer._apply_local(var, grad, step, replica=i, array=var.values[i]._value)
                    applied = True
        return applied

    def _reduce_and_apply(
        self, optimizer: Any, grads: list[Any], variables: list[Any], step: int
    ) -> int:
        """Sums the replicas' gradients and updates every copy, split by elements.

        One :meth:`Communicator.reduce_and_update` call replaces the all-reduce and
        the per-replica updates: each replica thread sums one range of the
        flattened gradients and applies it to that range of every replica's
        copies (weights and optimizer slots), so the reduced gradients are never
        written out and each copy is updated by one pass over its memory.  The
        copies stay bitwise identical.  Only for variables :func:`_fusable` here
        (:meth:`MirroredExtended.apply_update` chose), whatever the gradients:
        sparse ones are densified as the all-reduce would, a missing one adds
        zeros (see :meth:`_all_reduce_gradients`).  Returns how many variables
        were updated.
        """
        strategy: MirroredStrategy = self._strategy  # type: ignore[assignment]
        arrays = []
        for g, v in zip(grads, variables):
            dtype = v.values[0]._value.dtype
            if g is None:
                arrays.append(np.zeros(v.values[0]._value.shape, dtype))
                continue
            if type(g) is ProductGradient:
                # factors of this dtype go on (every replica decides alike): the reduce
                # multiplies out each rank's rows of them while it sums
                if g.left.dtype == dtype and g.right.dtype == dtype:
                    arrays.append(g)
                    continue
                g = g.dense_array()
            a = g.dense_array() if isinstance(g, IndexedSlices) else to_array(g)
            arrays.append(np.asarray(backend.to_numpy(a), dtype=dtype))
        rule = optimizer.rule
        # every replica's slots exist before the rendezvous (creating them is idempotent)
        targets = [
            [
                (c._value.reshape(-1), {k: s.reshape(-1) for k, s in slots.items()})
                for q, c in enumerate(v.values)
                for slots in (optimizer.slot_arrays(v, q, c._value),)
            ]
            for v in variables
        ]

        def update(k: int, lo: int, hi: int, summed: Any) -> None:
            rule.apply_dense_to_copies(
                [flat[lo:hi] for flat, _ in targets[k]],
                summed,
                [{name: s[lo:hi] for name, s in slots.items()} for _, slots in targets[k]],
                step,
            )

        done = strategy._communicator.reduce_and_update(
            self._replica_id, arrays, update, present=[g is not None for g in grads]
        )
        return sum(done)


class MirroredExtended(distribute_lib.StrategyExtended, UpdateGroup):
    """MirroredStrategy's internals: mirrored variables and their updates."""

    def __init__(self, strategy: MirroredStrategy, devices: list[backend.Device]) -> None:
        super().__init__(strategy)
        self._devices = devices

    @property
    def worker_devices(self) -> tuple[str, ...]:
        return tuple(d.name for d in self._devices)

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        return self.worker_devices

    def _create_variable(self, next_creator: Callable[..., Any], **kwargs: Any) -> Any:
        strategy: MirroredStrategy = self._container_strategy()  # type: ignore[assignment]
        ctx = distribute_lib.get_replica_context()
        if isinstance(ctx, MirroredReplicaContext) and strategy.num_replicas_in_sync > 1:
            # every replica asks; one creates (with replica 0's arguments), all receive it
            return ctx.merge_call(
                lambda s, kw: self._create_mirrored(next_creator, select_replica(0, kw)),
                args=(kwargs,),
            )
        return self._create_mirrored(next_creator, kwargs)

    def _create_mirrored(
        self, next_creator: Callable[..., Any], kwargs: dict[str, Any]
    ) -> MirroredVariable | SyncOnReadVariable:
        """One copy per device: a mirrored variable, or a sync-on-read one for ON_READ.

        Raises:
            InvalidArgumentError: ON_READ with MEAN of a non-floating dtype (as TensorFlow).
        """
        kwargs = dict(kwargs)
        aggregation = variable_lib.VariableAggregation(
            kwargs.get("aggregation") or variable_lib.VariableAggregation.NONE
        )
        on_read = (
            variable_lib.VariableSynchronization(
                kwargs.get("synchronization") or variable_lib.VariableSynchronization.AUTO
            )
            is variable_lib.VariableSynchronization.ON_READ
        )
        base = (kwargs.get("name") or "Variable").split(":")[0]
        copies: list[variable_lib.Variable] = []
        for i, dev in enumerate(self._devices):
            with backend.device(dev):
                if i == 0:
                    copies.append(next_creator(**kwargs))
                    if on_read:
                        check_aggregation(aggregation, copies[0]._value.dtype, base)
                else:
                    copies.append(
                        next_creator(
                            **{
                                **kwargs,
                                "initial_value": backend.place(copies[0]._value, dev),
                                "name": f"{base}/replica_{i}",
                            }
                        )
                    )
        if on_read:
            return SyncOnReadVariable(self._container_strategy(), copies, aggregation=aggregation)
        return MirroredVariable(self._container_strategy(), copies, aggregation=aggregation)

    def apply_update(
        self,
        optimizer: Any,
        step: int,
        grads_and_vars: Sequence[tuple[Any, Any]],
        *,
        aggregate: bool = True,
    ) -> bool:
        """Chooses how a replica's update happens; every replica calls it with its gradients.

        In a replica of this strategy with several replicas, in order:

        1. fused: the cross-device ops fuse updates (``fuses_updates``, the ring
           on CPU devices) and every variable is mirrored here, unconstrained,
           in contiguous host memory: one collective sums and applies
           (:meth:`MirroredReplicaContext._reduce_and_apply`);
        2. all-reduce (ring or NCCL, as configured), then each replica updates
           its own copies, when every variable is mirrored here
           (:meth:`MirroredReplicaContext._all_reduce_and_apply`);
        3. otherwise (a parameter server's variables on a multi-device worker,
           or ``aggregate=False``) one ``merge_call`` hands the (all-reduced,
           with ``aggregate``) gradients to the cross-replica update
           (:meth:`StrategyExtended.apply_update`).

        The choice (:meth:`_update_path`) depends on the variables and the
        options only, so every replica takes the same, and each path's
        function just does its work. Elsewhere (cross-replica context, one
        replica) it is the base class's update.
        """
        ctx = distribute_lib.get_replica_context()
        strategy = self._container_strategy()
        if not (
            isinstance(ctx, MirroredReplicaContext)
            and ctx.strategy is strategy
            and strategy.num_replicas_in_sync > 1
        ):
            return super().apply_update(optimizer, step, grads_and_vars, aggregate=aggregate)
        grads = [g for g, _ in grads_and_vars]
        variables = [v for _, v in grads_and_vars]
        path = self._update_path(variables, aggregate)
        if path is _UpdatePath.FUSED:
            return ctx._reduce_and_apply(optimizer, grads, variables, step) > 0
        grads = [multiplied_out(g) for g in grads]  # only the fused path takes factors
        if path is _UpdatePath.IN_REPLICA:
            return ctx._all_reduce_and_apply(optimizer, grads, variables, step)
        if aggregate:
            reduced = ctx._all_reduce_gradients(grads, variables)
            pairs = [(g, v) for g, v in zip(reduced, variables) if g is not None]
            if not pairs:
                return False
            grads, variables = [g for g, _ in pairs], [v for _, v in pairs]

        def merged(strategy: Any, gs: Any, vs: list[Any]) -> bool:
            # regrouped: a list of PerReplica (or shared) gradients, one per variable
            per_var = gs if isinstance(gs, list) else [gs] * len(vs)
            return strategy.extended.apply_update(optimizer, step, list(zip(per_var, vs)))

        return bool(ctx.merge_call(merged, args=(grads, variables)))

    def _takes_product_gradients(self, variables: Sequence[Any]) -> bool:
        """Yes in a replica of several whose update is the fused reduce-and-update: each
        rank multiplies out its rows of every replica's product as it sums them
        (:mod:`psflow.collective.reduce_update`)."""
        ctx = distribute_lib.get_replica_context()
        strategy = self._container_strategy()
        return (
            isinstance(ctx, MirroredReplicaContext)
            and ctx.strategy is strategy
            and strategy.num_replicas_in_sync > 1
            and self._update_path(list(variables), True) is _UpdatePath.FUSED
        )

    def _update_path(self, variables: list[Any], aggregate: bool) -> _UpdatePath:
        """How a replica's update of ``variables`` happens: see :meth:`apply_update`."""
        if not aggregate or not all(_is_mirrored_here(v, self) for v in variables):
            return _UpdatePath.MERGE
        if self._container_strategy()._fused_update and all(_fusable(v) for v in variables):
            return _UpdatePath.FUSED
        return _UpdatePath.IN_REPLICA

    def apply_optimizer(self, optimizer: Any, pairs: list[tuple[Any, Any]], step: int) -> None:
        """Applies reduced gradients to every replica's copy (called in cross-replica context).

        Inside ``merge_call`` each replica's thread updates its own copies, in
        parallel, on its own device; the call returns when all are updated.
        """
        strategy: MirroredStrategy = self._container_strategy()  # type: ignore[assignment]

        def update_replica(i: int) -> None:
            with backend.device(self._devices[i]):
                for grad, var in pairs:
                    g = grad.values[i] if isinstance(grad, PerReplica) else grad
                    if g is None:  # this replica had no gradient (not aggregated)
                        continue
                    optimizer._apply_local(var, g, step, replica=i, array=var.values[i]._value)

        strategy._merge.for_each_replica(strategy._replica_threads(), update_replica)

    def reduce_to(self, reduce_op: Any, value: Any, destinations: Any) -> Any:
        return self._container_strategy().reduce(reduce_op, value, axis=None)

    def read_var(self, v: Any) -> Any:
        """The aggregate of a sync-on-read variable (also inside ``run``); others' value.

        Inside ``run`` only with copies no replica writes meanwhile (reading them
        for inference, say): the other replicas' copies are read as they are.
        """
        if isinstance(v, SyncOnReadVariable):
            return Tensor._wrap(v._aggregate())
        return v.read_value()


class MirroredStrategy(distribute_lib.Strategy):
    """Synchronous training on several devices of one machine (``tf.distribute.MirroredStrategy``).

    Args:
        devices: device names (default: every GPU, else every logical CPU device).
        cross_device_ops: a ``psflow.collective.CrossDeviceOps`` (ring, reduce-to-one,
            NCCL) or its registered name; chosen from the devices by default.
        cluster_spec: a cluster spec naming this machine's single task (optional).
        compute_devices: the subset of ``devices`` replicas run on (default: all).
        communication_options: ``CommunicationOptions(bytes_per_pack, timeout_seconds,
            implementation)``.

    Raises:
        InvalidArgumentError: unknown or duplicate devices, compute devices not
            among ``devices``, or a cluster of more than one task.
    """

    # what a subclass (MultiWorkerMirroredStrategy) builds instead
    _extended_type: type[MirroredExtended] = MirroredExtended
    _replica_context_type: type[MirroredReplicaContext] = MirroredReplicaContext

    def __init__(
        self,
        devices: list[str] | None = None,
        cross_device_ops: Any = None,
        cluster_spec: Any = None,
        compute_devices: list[str] | None = None,
        communication_options: CommunicationOptions | None = None,
    ) -> None:
        names = list(devices) if devices is not None else config_lib.default_devices()
        if not names:
            raise errors.InvalidArgumentError("MirroredStrategy needs at least one device")
        parsed = [backend.parse_device(d) for d in names]
        if len(set(parsed)) != len(parsed):
            raise errors.InvalidArgumentError(f"MirroredStrategy: duplicate devices in {names}")
        available = {backend.parse_device(d.name) for d in config_lib.list_logical_devices()}
        for name, dev in zip(names, parsed):
            if dev not in available:
                raise errors.InvalidArgumentError(
                    f"MirroredStrategy: device {name!r} does not exist; logical devices are "
                    f"{sorted(d.name for d in config_lib.list_logical_devices())}"
                )
        if compute_devices is not None:
            compute = [backend.parse_device(d) for d in compute_devices]
            for name, dev in zip(compute_devices, compute):
                if dev not in parsed:
                    raise errors.InvalidArgumentError(
                        f"MirroredStrategy: compute device {name!r} is not among devices {names}"
                    )
            parsed = compute
        self._cluster_spec = self._check_cluster_spec(cluster_spec)
        options = communication_options or CommunicationOptions()
        if not isinstance(options, CommunicationOptions):
            raise errors.InvalidArgumentError(
                f"communication_options must be a CommunicationOptions, got {options!r}"
            )
        if cross_device_ops is None:
            # the choice depends on the physical GPUs: logical GPUs split from one GPU are not
            # distinct devices (NCCL needs one GPU per replica)
            physical = [
                f"/gpu:{backend.physical_gpu(d.index)}" if d.is_gpu else d.name for d in parsed
            ]
            ops = default_cross_device_ops(physical, options=options)
        elif isinstance(cross_device_ops, str):
            ops = create_cross_device_ops(cross_device_ops)
        elif isinstance(cross_device_ops, CrossDeviceOps):
            ops = cross_device_ops
        else:
            raise errors.InvalidArgumentError(
                f"cross_device_ops must be a CrossDeviceOps or a name, got {cross_device_ops!r}"
            )
        super().__init__(self._extended_type(self, parsed))
        self._devices = parsed
        self._cross_device_ops = ops
        self._options = options
        # The ring's work on CPU devices, fused with the optimizer's update (see
        # MirroredReplicaContext._reduce_and_apply); other ops keep their own algorithm.
        self._fused_update = ops.fuses_updates and not any(d.is_gpu for d in parsed)
        self._reset_collectives()
        self._pool: ReplicaPool | None = None
        self._pool_lock = threading.Lock()
        self._finalizer = weakref.finalize(self, MirroredStrategy._shutdown, [None])

    def _reset_collectives(self) -> None:
        n = len(self._devices)
        self._communicator = Communicator(n, self._cross_device_ops, self._options)
        self._merge = _MergeRendezvous(n, self._communicator.timeout)

    def _abort_collectives(self) -> None:
        """A replica failed: wake the replicas waiting for it instead of letting them time out."""
        self._communicator.close()
        self._merge.abort()

    @staticmethod
    def _shutdown(holder: list[Any]) -> None:
        pool = holder[0]
        if pool is not None:
            pool.close()

    @staticmethod
    def _check_cluster_spec(cluster_spec: Any) -> Any:
        if cluster_spec is None:
            return None
        from psflow.distribute.cluster_resolver import ClusterSpec

        spec = cluster_spec if isinstance(cluster_spec, ClusterSpec) else ClusterSpec(cluster_spec)
        tasks = sum(spec.num_tasks(job) for job in spec.jobs)
        if tasks > 1:
            raise errors.InvalidArgumentError(
                f"MirroredStrategy trains on one machine, but cluster_spec {spec.as_dict()} has "
                f"{tasks} tasks; use MultiWorkerMirroredStrategy or ParameterServerStrategy for several machines"
            )
        return spec

    # -- properties ------------------------------------------------------------------
    @property
    def num_replicas_in_sync(self) -> int:
        return len(self._devices)

    @property
    def devices(self) -> tuple[str, ...]:
        """The devices replicas compute on."""
        return tuple(d.name for d in self._devices)

    @property
    def cluster_spec(self) -> Any:
        """The cluster spec given at construction (or None)."""
        return self._cluster_spec

    @property
    def cross_device_ops(self) -> CrossDeviceOps:
        """The cross-device ops used for all-reduce."""
        return self._cross_device_ops

    # -- run -------------------------------------------------------------------------
    def _replica_threads(self) -> list[int]:
        """The thread ident of each replica (empty before the first multi-replica ``run``)."""
        pool = self._pool
        return pool.thread_idents if pool is not None else []

    def _replica_pool(self) -> ReplicaPool:
        if self._pool is None:
            with self._pool_lock:
                if self._pool is None:
                    n = len(self._devices)
                    on_cpu = not any(d.is_gpu for d in self._devices)
                    self._pool = ReplicaPool(
                        n,
                        name="mirrored-replica",
                        # replicas share the process's BLAS budget (its cores by default)
                        blas_threads=max(1, thread_budget.process_threads() // n)
                        if on_cpu
                        else None,
                    )
                    self._finalizer.detach()
                    self._finalizer = weakref.finalize(
                        self, MirroredStrategy._shutdown, [self._pool]
                    )
        return self._pool

    def run(
        self,
        fn: Callable[..., Any],
        args: tuple = (),
        kwargs: dict | None = None,
        options: Any = None,
    ) -> Any:
        """Runs ``fn`` on every replica with its share of ``args``; returns per-replica results.

        ``PerReplica`` arguments (from a distributed dataset) give each replica
        its own component; other arguments go to every replica as they are.
        """
        kwargs = kwargs or {}
        n = len(self._devices)
        first_failure: list[BaseException] = []  # the error that made the others fail
        failure_lock = threading.Lock()

        def replica_call(i: int) -> Callable[[], Any]:
            def call() -> Any:
                my_args = select_replica(i, args)
                my_kwargs = select_replica(i, kwargs)
                ctx = self._replica_context_type(self, i)
                with (
                    backend.device(self._devices[i]),
                    distribute_lib._enter(distribute_lib._Context(self, ctx)),
                    variable_lib.variable_creator_scope(self._variable_creator),
                ):
                    return fn(*my_args, **my_kwargs)

            def guarded() -> Any:
                try:
                    return call()
                except BaseException as e:
                    with failure_lock:
                        if not first_failure:
                            first_failure.append(e)
                    self._abort_collectives()
                    raise

            return call if n == 1 else guarded

        if n == 1:
            return replica_call(0)()
        outcomes = self._replica_pool().run_collecting([replica_call(i) for i in range(n)])
        errors_seen = [e for _, e in outcomes if e is not None]
        if errors_seen:
            self._reset_collectives()
            # the replica that failed first made the others fail (cancelled, or finding the
            # communicator closed when they reached it): report it
            raise first_failure[0] if first_failure else errors_seen[0]
        return regroup([v for v, _ in outcomes])

    # -- reduce and gather -------------------------------------------------------------
    def reduce(self, reduce_op: Any, value: Any, axis: int | None) -> Any:
        """Combines per-replica values into one tensor (TF's numerator/denominator MEAN with ``axis``).

        Raises:
            InvalidArgumentError: SUM of a value that is not per-replica, with several
                replicas; per-replica parts of different shapes (TF does not broadcast them).
        """
        op = ReduceOp.from_value(reduce_op)

        def reduce_leaf(v: Any) -> Any:
            # a sync-on-read variable's copies are per-replica values (TensorFlow sums them)
            parts = list(v.values) if isinstance(v, (PerReplica, SyncOnReadVariable)) else None
            if parts is None:
                if op is ReduceOp.SUM and self.num_replicas_in_sync > 1:
                    raise errors.InvalidArgumentError(
                        f"A non-distributed value {v!r} cannot be reduced with SUM across "
                        f"{self.num_replicas_in_sync} replicas; return it from strategy.run"
                    )
                if axis is None:
                    return v
                return reduce_util.reduce_over_axis(op, v, axis)
            host = [backend.place(to_array(p), self._devices[0]) for p in parts]
            xp = backend.xp_of(host[0])
            if axis is None:
                reduce_util.check_same_shapes([h.shape for h in host], f"reduce({op.value})")
                total = host[0].copy()
                for h in host[1:]:
                    total = total + h
                if op is ReduceOp.MEAN:  # true division, as TF: an int32 mean is float64
                    return reduce_util.mean(Tensor._wrap(xp.asarray(total)), len(host))
                return Tensor._wrap(xp.asarray(total))
            sums = [h.sum(axis=axis, dtype=h.dtype) for h in host]  # int32 stays int32, as TF
            reduce_util.check_same_shapes(
                [s.shape for s in sums], f"reduce({op.value}, axis={axis})"
            )
            total = sums[0]
            for s in sums[1:]:
                total = total + s
            if op is ReduceOp.MEAN:
                count = sum(h.shape[axis] for h in host)
                return reduce_util.mean(Tensor._wrap(total), max(count, 1))
            return Tensor._wrap(total)

        if isinstance(value, (PerReplica, SyncOnReadVariable)):
            return reduce_leaf(value)
        return nest.map_structure(reduce_leaf, value)

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        return local_results(value, self.num_replicas_in_sync)

    def gather(self, value: Any, axis: int) -> Any:
        from psflow.ops import array_ops

        parts = [
            Tensor._wrap(backend.place(to_array(p), self._devices[0]))
            for p in self.experimental_local_results(value)
        ]
        return parts[0] if len(parts) == 1 else array_ops.concat(parts, axis=axis)

    # -- input -----------------------------------------------------------------------
    def experimental_distribute_dataset(
        self, dataset: Any, options: Any = None
    ) -> input_lib.DistributedDataset:
        """Splits every global batch of ``dataset`` across the replicas."""
        return input_lib.DistributedDataset(dataset, list(self._devices))

    def distribute_datasets_from_function(
        self, dataset_fn: Callable[[Any], Any], options: Any = None
    ) -> input_lib.DistributedDatasetsFromFunction:
        """Calls ``dataset_fn(InputContext)`` once; replicas take consecutive per-replica batches."""
        ctx = distribute_lib.InputContext(1, 0, self.num_replicas_in_sync)
        return input_lib.DistributedDatasetsFromFunction(dataset_fn, ctx, list(self._devices))

    def experimental_distribute_values_from_function(self, value_fn: Callable[[Any], Any]) -> Any:
        """``PerReplica`` of ``value_fn(ValueContext(i, N))`` for every replica."""
        n = self.num_replicas_in_sync
        values = [value_fn(distribute_lib.ValueContext(i, n)) for i in range(n)]
        return values[0] if n == 1 else PerReplica(values)

    def __repr__(self) -> str:
        return f"MirroredStrategy(devices={list(self.devices)})"


def _zeros_for(variable: Any) -> Any:
    """Zeros shaped like ``variable``, on this replica's device: a missing gradient."""
    xp = backend.xp_for(backend.current_device())
    return xp.zeros(tuple(variable.shape), dtype=variable.dtype.np)


def _fusable(variable: Any) -> bool:
    """Whether a fused update can write ``variable``'s copies: unconstrained, each copy
    one contiguous NumPy array (a constraint needs the whole updated value)."""
    return variable.constraint is None and all(
        isinstance(c._value, np.ndarray) and c._value.flags.c_contiguous for c in variable.values
    )


def _is_mirrored_here(variable: Any, extended: MirroredExtended) -> bool:
    """Whether ``variable``'s copies belong to this strategy (not a PS's, not another's)."""
    return isinstance(variable, GroupUpdated) and variable.update_group is extended

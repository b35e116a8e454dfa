"""``MultiWorkerMirroredStrategy``: synchronous data parallelism across worker processes.

Every worker runs the same script; ``TF_CONFIG`` lists the ``worker`` tasks
(and an optional ``chief``, which then is worker 0 of the group, as in
TensorFlow) and says which one this process is.  Each worker mirrors the
variables over its local devices as :class:`MirroredStrategy` does; a
gradient is summed inside the process first, then across the workers by a
ring over framed TCP (:mod:`psflow.collective.cross_host`), so all
``workers x local devices`` replicas apply the same update and keep the same
bits.  Variables start from worker 0's initial values (a broadcast when they
are created).  Every collective has a deadline (``timeout_seconds``): a dead
or stalled worker gives every survivor an error naming it, never a hang.

Without ``TF_CONFIG`` (or for an ``evaluator`` task) it is a single-worker
strategy over the local devices, as in TensorFlow.

With ``elastic=ElasticOptions(...)`` (a psflow extension) a lost or drained
worker does not stop the group: the survivors re-form and go on from the
last completed step (:mod:`psflow.distribute.elastic`).

With ``ps`` tasks in the cluster (a psflow extension, the hybrid mode) the
``DynamicEmbedding`` tables created in scope live on the PS tasks and each
step's table gradient is applied there once, while the dense variables stay
mirrored (:mod:`psflow.distribute.hybrid`).

Example:
    >>> import psflow as tf
    >>> strategy = tf.distribute.MultiWorkerMirroredStrategy()
    >>> strategy.num_replicas_in_sync, strategy.extended.should_checkpoint
    (1, True)
"""

from __future__ import annotations

import dataclasses
import logging
import os
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from psflow import backend, errors
from psflow.collective import CommunicationOptions, Communicator
from psflow.collective.arrays import is_cupy_array
from psflow.collective.cross_host import CrossHostRing
from psflow.collective.hierarchical import HierarchicalCommunicator, NcclRoutedCommunicator
from psflow.collective.peer_link import PeerLinks
from psflow.distribute import distribute_lib, multi_worker_input, reduce_util
from psflow.distribute.mirrored_strategy import (
    MirroredExtended,
    MirroredReplicaContext,
    MirroredStrategy,
    _MergeRendezvous,
)
from psflow.distribute.reduce_util import ReduceOp
from psflow.distribute.sync_on_read import SyncOnReadVariable
from psflow.distribute.values import PerReplica
from psflow.framework.indexed_slices import IndexedSlices
from psflow.framework.tensor import Tensor, to_array
from psflow.util import nest

__all__ = ["MultiWorkerMirroredStrategy", "WorkerGroup"]

log = logging.getLogger("psflow.distribute")

_GROUP_JOBS = ("chief", "worker")


@dataclasses.dataclass(frozen=True)
class WorkerGroup:
    """The workers that train together, read once from a cluster resolver.

    Attributes:
        addresses: every member's ``host:port``: the chief first (if any), then the workers.
        rank: this process's index in ``addresses`` (0 for a single worker).
        task_type, task_id: this process's task (None without a cluster).
        ps_addresses: the cluster's ``ps`` tasks, in task order: where the
            embedding tables live (the hybrid mode, :mod:`psflow.distribute.hybrid`).
    """

    addresses: tuple[str, ...]
    rank: int
    task_type: str | None
    task_id: int | None
    ps_addresses: tuple[str, ...] = ()

    @property
    def size(self) -> int:
        """How many workers train together."""
        return max(1, len(self.addresses))

    @classmethod
    def from_resolver(cls, resolver: Any) -> WorkerGroup:
        """Reads the group from ``resolver`` (its cluster spec and task).

        Raises:
            InvalidArgumentError: a task that is not a chief, worker or evaluator, no
                task given for a cluster, or a missing ps task (each named).
        """
        spec = resolver.cluster_spec()
        jobs = set(spec.jobs)
        task_type, task_id = resolver.task_type, resolver.task_id
        if not jobs & set(_GROUP_JOBS) or task_type == "evaluator":
            return cls((), 0, task_type, task_id)  # a single worker (TF: the evaluator too)
        ps: list[str] = []
        if "ps" in jobs:  # the hybrid mode: the tables live on these
            for index, address in enumerate(spec.job_tasks("ps")):
                if address is None:
                    raise errors.InvalidArgumentError(
                        f"MultiWorkerMirroredStrategy: job 'ps' has no task {index} in "
                        f"{spec.as_dict()}; every ps task must be listed"
                    )
                ps.append(address)
        if task_type not in _GROUP_JOBS or task_id is None:
            raise errors.InvalidArgumentError(
                f"MultiWorkerMirroredStrategy: this task is {task_type!r}:{task_id!r}; "
                f"TF_CONFIG['task'] must name a chief or worker task of {spec.as_dict()}"
            )
        members: list[tuple[str, int, str]] = []
        for job in _GROUP_JOBS:
            if job in jobs:
                for index, address in enumerate(spec.job_tasks(job)):
                    if address is None:
                        raise errors.InvalidArgumentError(
                            f"MultiWorkerMirroredStrategy: job {job!r} has no task {index} "
                            f"(a sparse cluster); every worker must be listed"
                        )
                    members.append((job, index, address))
        rank = next(
            (i for i, (j, k, _) in enumerate(members) if (j, k) == (task_type, task_id)), None
        )
        if rank is None:
            raise errors.InvalidArgumentError(
                f"MultiWorkerMirroredStrategy: task {task_type}:{task_id} is not in "
                f"{spec.as_dict()}"
            )
        return cls(tuple(a for _, _, a in members), rank, task_type, task_id, tuple(ps))


class MultiWorkerReplicaContext(MirroredReplicaContext):
    """A replica inside ``run``: collectives span every worker's replicas."""

    @property
    def replica_id_in_sync_group(self) -> Any:
        """This replica's index among all workers' replicas (an int32 scalar tensor)."""
        from psflow.framework.tensor import constant

        strategy: MultiWorkerMirroredStrategy = self._strategy  # type: ignore[assignment]
        return constant(strategy._global_replica(self._replica_id), dtype="int32")

    def _all_reduce_gradients(self, grads: list[Any], variables: list[Any]) -> list[Any]:
        """Sums dense gradients; gathers sparse ones (``IndexedSlices``) instead of densifying.

        The replicas first agree, in one tiny all-reduce, which variables got a
        dense gradient somewhere and which only sparse ones, and how many rows
        each replica has.  A sparse-only variable's rows and indices are
        gathered in replica order (a replica without a gradient adds no rows),
        so every worker applies the same sparse update, as one process would
        with the global batch's gradient; the others take the dense all-reduce
        (sparse ones densified).  On CPU devices the dense sums ride in the
        gather (see :meth:`_reduce_in_gather`): one ring round, not two.
        """
        strategy: MultiWorkerMirroredStrategy = self._strategy  # type: ignore[assignment]
        comm = strategy._communicator
        group = strategy._group
        me = strategy._global_replica(self._replica_id)
        # [dense count, sparse count, rows of each replica]: the sizes of the gathers below
        # ride on this all-reduce instead of one more round per sparse variable
        kinds = np.zeros((len(grads), 2 + strategy.num_replicas_in_sync), np.int64)
        for i, g in enumerate(grads):
            if g is not None:
                sparse_grad = isinstance(g, IndexedSlices)
                kinds[i, 1 if sparse_grad else 0] = 1
                if sparse_grad:
                    kinds[i, 2 + me] = int(np.prod(np.shape(to_array(g.indices))))
        (counts,) = comm.all_reduce(self._replica_id, [kinds], "SUM")
        sparse = [i for i, (dense, rows, *_) in enumerate(counts) if dense == 0 and rows > 0]
        if not sparse:
            return super()._all_reduce_gradients(grads, variables)
        dense = [i for i in range(len(grads)) if i not in set(sparse)]
        packed = self._reduce_in_gather(grads, variables, dense, sparse, counts, me)
        if packed is not None:
            return packed
        out: list[Any] = [None] * len(grads)
        if dense:
            reduced = super()._all_reduce_gradients(
                [grads[i] for i in dense], [variables[i] for i in dense]
            )
            for i, r in zip(dense, reduced):
                out[i] = r
        for i in sparse:
            g, v = grads[i], variables[i]
            shape = tuple(v.shape)
            if g is None:  # this replica's batch touched no row
                values = np.zeros((0, *shape[1:]), v.dtype.np)
                indices = np.zeros((0,), np.int64)
            else:
                values = np.asarray(backend.to_numpy(to_array(g.values)))
                indices = np.asarray(backend.to_numpy(to_array(g.indices))).astype(np.int64)
                indices = indices.reshape(-1)
            # one all-gather, not two: each row's bytes, then its index's 8 bytes
            row_bytes = values.dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))
            packed = np.empty((indices.size, row_bytes + 8), np.uint8)
            packed[:, :row_bytes] = (
                np.ascontiguousarray(values).view(np.uint8).reshape(-1, row_bytes)
            )
            packed[:, row_bytes:] = indices.view(np.uint8).reshape(-1, 8)
            if isinstance(comm, HierarchicalCommunicator):
                lengths = counts[i, 2:].reshape(group.size, -1).sum(axis=1)  # per worker
                gathered = comm.all_gather(self._replica_id, packed, 0, lengths)
            else:
                gathered = comm.all_gather(self._replica_id, packed, 0)
            all_values = np.ascontiguousarray(gathered[:, :row_bytes]).view(values.dtype)
            all_indices = np.ascontiguousarray(gathered[:, row_bytes:]).view(np.int64).reshape(-1)
            out[i] = IndexedSlices(all_values.reshape(-1, *shape[1:]), all_indices, shape)
        return out

    def _reduce_in_gather(
        self,
        grads: list[Any],
        variables: list[Any],
        dense: list[int],
        sparse: list[int],
        counts: np.ndarray,
        me: int,
    ) -> list[Any] | None:
        """The dense sums and the sparse gathers in one all-gather; None where it cannot.

        Each replica sends one block: its dense gradients (zeros where it has
        none), a presence byte for each, then its rows and indices of each
        sparse variable (``counts`` gave every replica's row count, so every
        block's size is known beforehand).  Every worker then sums the dense
        gradients itself, in replica order: the same bits on every worker, and
        with two workers the same bits as the ring's all-reduce (``a + b`` is
        ``b + a``).  One ring round a step instead of two, for the same bytes on
        two workers; with more, each dense byte travels ``n - 1`` times instead
        of about twice, so only a small dense model (``_PACK_DENSE_BYTES``, where
        a step's time goes to the rounds, not the bytes) takes it.  CPU devices
        only (NCCL reduces CuPy gradients itself).
        """
        strategy: MultiWorkerMirroredStrategy = self._strategy  # type: ignore[assignment]
        comm = strategy._communicator
        group = strategy._group
        if (
            not dense
            or group.size < 2
            or not isinstance(comm, HierarchicalCommunicator)
            or any(d.is_gpu for d in strategy._devices)
        ):
            return None
        # the layout depends on the variables alone: every replica decides alike
        kinds = [np.dtype(variables[i].dtype.np) for i in dense]
        shapes = [tuple(variables[i].shape) for i in dense]
        sizes = [k.itemsize * int(np.prod(s, dtype=np.int64)) for k, s in zip(kinds, shapes)]
        dense_bytes = sum(sizes)
        if dense_bytes > _PACK_DENSE_BYTES and group.size > 2:
            return None
        row_bytes = [
            np.dtype(variables[i].dtype.np).itemsize
            * int(np.prod(tuple(variables[i].shape)[1:], dtype=np.int64))
            for i in sparse
        ]
        head = dense_bytes + len(dense)
        rows = counts[sparse, 2:]  # [sparse variable, replica]: rows
        blocks = head + (rows * (np.asarray(row_bytes, np.int64) + 8)[:, None]).sum(axis=0)
        block = np.empty(int(blocks[me]), np.uint8)
        pos = 0
        for i, kind, size in zip(dense, kinds, sizes):
            g = grads[i]
            if g is None:
                block[pos : pos + size] = 0
            else:
                a = g.dense_array() if isinstance(g, IndexedSlices) else to_array(g)
                a = np.ascontiguousarray(backend.to_numpy(a), kind)
                block[pos : pos + size] = a.view(np.uint8).reshape(-1)
            pos += size
        block[pos : pos + len(dense)] = [grads[i] is not None for i in dense]
        pos += len(dense)
        for k, (i, width) in enumerate(zip(sparse, row_bytes)):
            n = int(rows[k, me])
            g = grads[i]
            if g is None or n == 0:  # this replica's batch touched no row
                continue
            kind = np.dtype(variables[i].dtype.np)
            values = np.ascontiguousarray(backend.to_numpy(to_array(g.values)), kind)
            indices = np.asarray(backend.to_numpy(to_array(g.indices))).astype(np.int64)
            block[pos : pos + n * width] = values.view(np.uint8).reshape(-1)
            pos += n * width
            block[pos : pos + 8 * n] = indices.reshape(-1).view(np.uint8)
            pos += 8 * n
        lengths = blocks.reshape(group.size, -1).sum(axis=1)  # per worker
        gathered = comm.all_gather(self._replica_id, block, 0, lengths)
        starts = np.concatenate([[0], np.cumsum(blocks)])
        out: list[Any] = [None] * len(grads)
        sums: list[Any] = [None] * len(dense)
        for r in range(blocks.size):  # in replica order: the same sum on every worker
            pos = int(starts[r])
            flags = gathered[pos + dense_bytes : pos + head]
            for j, (kind, shape, size) in enumerate(zip(kinds, shapes, sizes)):
                if flags[j]:
                    part = gathered[pos : pos + size].view(kind).reshape(shape)
                    sums[j] = part.copy() if sums[j] is None else np.add(sums[j], part)
                pos += size
        for i, total in zip(dense, sums):
            out[i] = None if total is None else Tensor._wrap(total)
        offsets = starts[:-1] + head
        for k, (i, width) in enumerate(zip(sparse, row_bytes)):
            v = variables[i]
            shape = tuple(v.shape)
            total = int(rows[k].sum())
            values = np.empty(total * width, np.uint8)
            indices = np.empty(total * 8, np.uint8)
            at = 0
            for r in range(blocks.size):
                n = int(rows[k, r])
                pos = int(offsets[r])
                values[at * width : (at + n) * width] = gathered[pos : pos + n * width]
                indices[at * 8 : (at + n) * 8] = gathered[pos + n * width : pos + n * (width + 8)]
                offsets[r] += n * (width + 8)
                at += n
            kind = np.dtype(v.dtype.np)
            out[i] = IndexedSlices(
                values.view(kind).reshape(-1, *shape[1:]), indices.view(np.int64), shape
            )
        return out


# the largest dense gradient (bytes) gathered rather than all-reduced on more than 2 workers
_PACK_DENSE_BYTES = 4 << 20


class MultiWorkerExtended(MirroredExtended):
    """Internals: variables initialised from worker 0, and who writes checkpoints."""

    def _create_mirrored(self, next_creator: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
        variable = super()._create_mirrored(next_creator, kwargs)
        strategy: MultiWorkerMirroredStrategy = self._container_strategy()  # type: ignore[assignment]
        # a worker that joined a running group takes the value it received instead
        received = strategy._elastic is not None and strategy._elastic.state.track_variable(
            variable
        )
        ring = strategy._ring
        group = getattr(strategy, "_nccl", None)
        copies = [c._value for c in variable.values]
        if (
            group is not None
            and not received
            and all(is_cupy_array(c) and c.flags.c_contiguous for c in copies)
        ):  # every GPU takes worker 0's first copy, straight from GPU to GPU
            group.broadcast(copies)
        elif ring.size > 1 and not received:  # every worker starts from worker 0's bits
            first = variable.values[0]._value
            host = np.ascontiguousarray(backend.to_numpy(first))
            (value,) = ring.broadcast([host], root=0)
            for copy in variable.values:
                if isinstance(copy._value, np.ndarray) and copy._value.flags.writeable:
                    np.copyto(copy._value, value)
                else:
                    copy._value = backend.place(value.copy(), backend.device_of(copy._value))
        return variable

    def apply_update(
        self,
        optimizer: Any,
        step: int,
        grads_and_vars: Any,
        *,
        aggregate: bool = True,
    ) -> bool:
        """As :meth:`MirroredExtended.apply_update`; in hybrid mode the tables' gradients
        (all-gathered over the workers) are pushed to the PS by :mod:`psflow.distribute.hybrid`."""
        strategy: MultiWorkerMirroredStrategy = self._container_strategy()  # type: ignore[assignment]
        hybrid = strategy._hybrid
        if hybrid is not None and not aggregate:
            held = [v for _, v in grads_and_vars if hybrid.holds(v)]
            if held:  # each replica's rows would be pushed as they are, not the step's sum
                raise errors.UnimplementedError(
                    f"{held[0].name}: a table on the PS takes the whole step's gradient "
                    "(hybrid mode); apply_gradients without aggregation is not supported"
                )
        ctx = distribute_lib.get_replica_context()
        if hybrid is None or (
            isinstance(ctx, MultiWorkerReplicaContext)
            and ctx.strategy is strategy
            and strategy.num_replicas_in_sync > 1
        ):  # a replica's update: its merge comes back here, cross-replica, once per worker
            return super().apply_update(optimizer, step, grads_and_vars, aggregate=aggregate)
        tables = [(g, v) for g, v in grads_and_vars if g is not None and hybrid.holds(v)]
        rest = [(g, v) for g, v in grads_and_vars if not (g is not None and hybrid.holds(v))]
        applied = bool(rest) and super().apply_update(optimizer, step, rest, aggregate=aggregate)
        if tables:
            hybrid.apply(optimizer, tables, strategy)
        return applied or bool(tables)

    def prepare_optimizer(self, optimizer: Any) -> None:
        """An elastic group records the optimizer (its step and slots are training state)."""
        controller = self._container_strategy()._elastic  # type: ignore[attr-defined]
        if controller is not None:
            controller.state.track_optimizer(optimizer)

    def _group(self) -> WorkerGroup:
        return self._container_strategy()._group  # type: ignore[attr-defined]

    @property
    def _in_multi_worker_mode(self) -> bool:
        return self._group().size > 1

    @property
    def should_checkpoint(self) -> bool:
        """Whether this worker writes checkpoints: the chief, else worker 0 (as TF)."""
        return self._group().rank == 0

    @property
    def should_save_summary(self) -> bool:
        """Whether this worker writes summaries: the same worker as :attr:`should_checkpoint`."""
        return self._group().rank == 0

    def keras_runner(self, model: Any) -> Any:
        """``fit`` runs the same steps on every worker, each global batch cut across all replicas."""
        from psflow.keras.engine.multi_worker_runner import MultiWorkerRunner

        return MultiWorkerRunner(model, self._container_strategy())

    def metric_results(self, metrics: Any) -> dict[str, float]:
        """Each metric's result over every worker's state (one all-reduce for all of them).

        Every worker must ask at the same points (``fit`` does, after each step).
        Metrics that keep no summable state report this worker's own result.
        """
        strategy: MultiWorkerMirroredStrategy = self._container_strategy()  # type: ignore[assignment]
        if strategy._elastic is not None:
            return strategy._elastic.call(lambda _: self._metric_results(metrics))
        return self._metric_results(metrics)

    def _metric_results(self, metrics: Any) -> dict[str, float]:
        ring: CrossHostRing = self._container_strategy()._ring  # type: ignore[attr-defined]
        states, sizes = [], []
        for m in metrics:
            try:
                state = [np.asarray(x, np.float64).reshape(-1) for x in m.get_state()]
            except NotImplementedError:
                state = []
            states.append(state)
            sizes.append([x.size for x in state])
        flat = [x for state in states for x in state]
        if ring.size == 1 or not flat:
            return super().metric_results(metrics)
        (summed,) = ring.all_reduce([np.concatenate(flat)])
        logs, pos = {}, 0
        for m, state, shape in zip(metrics, states, sizes):
            if not state:
                logs[m.name] = float(m.result()._value)
                continue
            parts = []
            for x, k in zip(m.get_state(), shape):
                parts.append(summed[pos : pos + k].reshape(np.shape(x)))
                pos += k
            logs[m.name] = float(m.result_of_state(parts)._value)
        return logs

    @property
    def should_init(self) -> bool:
        """Every worker initialises its variables (from worker 0's values)."""
        return True

    @property
    def experimental_should_init(self) -> bool:
        """TensorFlow's name of :attr:`should_init`."""
        return True


def _apply_thread_budget() -> None:
    """Gives this peer the BLAS threads its launcher planned (``PSFLOW_BLAS_THREADS``).

    A peer runs the user's script, not a psflow entrypoint that applies its
    budget at start; without this two peers on a 2-core host each ran
    OpenBLAS's 2 spinning threads (MLP at batch 64: 20 steps/s instead of 80).
    """
    from psflow import thread_budget

    thread_budget.apply_budget(thread_budget.resolve_budget("worker"))


class MultiWorkerMirroredStrategy(MirroredStrategy):
    """Synchronous training on the devices of several worker processes.

    TensorFlow's ``tf.distribute.MultiWorkerMirroredStrategy``.

    Args:
        cluster_resolver: where the workers and this task are read (default:
            ``TFConfigClusterResolver()``, i.e. ``TF_CONFIG``; with
            ``PSFLOW_CLUSTER_FILE`` set, as ``psflow local --ps-max`` does, a
            ``ClusterFileResolver`` of that file, whose PS count a hybrid group
            follows: see :mod:`psflow.distribute.hybrid`).
        communication_options: ``CommunicationOptions(bytes_per_pack,
            timeout_seconds, implementation)``; ``timeout_seconds`` bounds every
            collective and the initial connection to the neighbours.
        elastic: ``ElasticOptions``: the group survives lost and drained workers
            (psflow only; without it a lost worker is an error, as in TensorFlow).

    Raises:
        InvalidArgumentError: a bad cluster or task (see :meth:`WorkerGroup.from_resolver`).
        UnauthenticatedError: a neighbour refused this worker's token (or TLS certificate).
        DeadlineExceededError / UnavailableError: a neighbour did not connect in time (named).

    Example:
        >>> import psflow as tf
        >>> strategy = tf.distribute.MultiWorkerMirroredStrategy()
        >>> with strategy.scope():
        ...     v = tf.Variable(1.0)
        >>> float(strategy.reduce("SUM", strategy.run(lambda: v * 2), axis=None))
        2.0
    """

    _extended_type = MultiWorkerExtended
    _replica_context_type = MultiWorkerReplicaContext

    def __init__(
        self,
        cluster_resolver: Any = None,
        communication_options: CommunicationOptions | None = None,
        elastic: Any = None,
    ) -> None:
        from psflow.distribute.elastic.options import ElasticOptions

        if elastic is not None and not isinstance(elastic, ElasticOptions):
            raise errors.InvalidArgumentError(f"elastic must be an ElasticOptions, got {elastic!r}")
        self._elastic: Any = None
        watched = False  # the cluster comes from the launcher's file: follow its PS count
        if cluster_resolver is None:
            from psflow.distribute.cluster_resolver import (
                CLUSTER_FILE_ENV,
                ClusterFileResolver,
                TFConfigClusterResolver,
            )

            if os.environ.get(CLUSTER_FILE_ENV):
                cluster_resolver = ClusterFileResolver.from_environment()
                watched = True
            else:
                cluster_resolver = TFConfigClusterResolver()
        options = communication_options or CommunicationOptions()
        if not isinstance(options, CommunicationOptions):
            raise errors.InvalidArgumentError(
                f"communication_options must be a CommunicationOptions, got {options!r}"
            )
        group = WorkerGroup.from_resolver(cluster_resolver)
        links = None
        door = None
        running = None  # the view of a group that already trains: this worker joins it
        if group.size > 1:
            _apply_thread_budget()
            from psflow.security.config import default_security

            security = default_security()
            if elastic is not None:
                from psflow.collective.door import Door
                from psflow.collective.membership import running_view

                door = Door(group.addresses[group.rank], security, f"worker:{group.rank}")
                running = running_view(door, group.addresses, group.rank)
            if running is not None:
                pass  # a group of one until it is admitted (below)
            elif door is not None:
                links = PeerLinks(
                    group.rank,
                    group.addresses,
                    security,
                    generation=0,
                    ids=range(group.size),
                    incoming=door.take_ring,
                )
            else:
                links = PeerLinks(group.rank, group.addresses, security)
            try:
                if links is not None:
                    links.connect(options.timeout)
            except BaseException:
                if links is not None:
                    links.close()
                if door is not None:
                    door.close()
                raise
        self._resolver = cluster_resolver
        self._group = group
        self._ring = CrossHostRing(links, options.timeout)
        # the links' sockets and threads go when the strategy does (or at exit)
        self._ring_finalizer = weakref.finalize(self, self._ring.close)
        # NCCL asked for across workers: the in-process level only carries what NCCL does
        # not (NumPy arrays); whether every worker can use NCCL is agreed below, so a worker
        # without it gets the same typed error as the others instead of failing alone here
        local_ops = "ring" if group.size > 1 and options.implementation.name == "NCCL" else None
        try:
            super().__init__(communication_options=options, cross_device_ops=local_ops)
        except BaseException:  # e.g. NCCL asked for without CuPy: free the port at once
            self._ring.close()
            raise
        self._fused_update = False  # the fused ring is in-process only
        self._nccl: Any = None
        if group.size > 1:
            try:
                self._connect_nccl(options, elastic is not None)
            except BaseException:
                if door is not None:
                    door.close()
                raise
        if elastic is not None and door is not None:
            from psflow.collective.membership import View
            from psflow.distribute.elastic.controller import ElasticController

            self._elastic = ElasticController(
                self,
                elastic,
                door,
                View(0, tuple(range(group.size)), group.addresses),
                group.rank,
                options.timeout,
            )
            weakref.finalize(self, door.close)
            if running is not None:
                self._elastic.join(running)
        self._hybrid: Any = None
        if group.ps_addresses:
            from psflow.distribute.hybrid import HybridTables

            self._hybrid = HybridTables(
                group.ps_addresses, f"{group.task_type}:{group.task_id}", options.timeout
            )
            if running is not None:  # a joiner: the group's run id came with its state
                self._hybrid.take_run_id(self._elastic.state)
            else:
                self._hybrid.agree_run_id(self._ring)
            if watched:  # psflow scale --ps K rewrites the file: resize with it
                from psflow.distribute.hybrid import ViewWatch

                self._hybrid.watch = ViewWatch(cluster_resolver)
            if self._elastic is not None:
                self._elastic.hybrid = self._hybrid
                # it travels with every state broadcast: a later joiner names its pushes alike
                self._elastic.state.extra[HybridTables.RUN_ID_KEY] = self._hybrid.run_id

    def _connect_nccl(self, options: CommunicationOptions, elastic: bool) -> None:
        """Moves the GPU collectives to NCCL across the workers where every one can.

        The local level then keeps the ring for the NumPy arrays that still go
        through the two-level path (see :mod:`psflow.collective.nccl_cross_host`).
        """
        from psflow.collective import nccl_cross_host
        from psflow.collective.registry import create_cross_device_ops

        try:
            group = nccl_cross_host.connect(
                self._ring, self._devices, options, self._group.addresses, elastic=elastic
            )
        except BaseException:
            self._ring.close()
            raise
        if group is None:
            return
        self._nccl = group
        weakref.finalize(self, group.destroy)
        self._cross_device_ops = create_cross_device_ops("ring")
        self._reset_collectives()

    @property
    def nccl(self) -> Any:
        """The NCCL group across the workers' GPUs (psflow only), or None on the TCP ring."""
        return self._nccl

    @property
    def hybrid(self) -> Any:
        """The PS side of the hybrid mode (:class:`~psflow.distribute.hybrid.HybridTables`:
        its ``session`` reaches the PS tasks), or None without ``ps`` tasks."""
        return self._hybrid

    def resize_parameter_servers(self, num_ps: int, *, timeout: float = 300.0) -> Any:
        """Hybrid mode: moves the embedding tables' rows onto PS tasks ``0..num_ps-1``.

        Every worker calls it at the same step boundary (outside ``run``), as
        every worker runs the same program: the workers pass a barrier (an
        elastic group pushes its committed step first), worker 0 moves the rows
        with the parameter-server mode's resize (the tasks are read afresh
        from worker 0's cluster resolver, job ``ps``; the tasks removed drain
        and exit), the new tasks reach every worker over the ring and each
        re-points its tables; then training goes on (see
        :mod:`psflow.distribute.hybrid`).

        Example (every worker of a hybrid cluster, between two steps)::

            strategy.resize_parameter_servers(2, timeout=60)

        Returns:
            The resize's ``ResizeReport`` (the same on every worker).

        Raises:
            FailedPreconditionError: not the hybrid mode (no ``ps`` tasks), or
                called inside ``run``.
            InvalidArgumentError: ``num_ps`` < 1, a bad ``timeout``, or more PS
                tasks than the cluster lists (each named; nothing changed).
            UnavailableError, DeadlineExceededError: a PS task did not answer
                within ``timeout`` (raised on every worker; the group stays on
                the old tasks and can train on).
        """
        if self._hybrid is None:
            raise errors.FailedPreconditionError(
                "resize_parameter_servers needs the hybrid mode (ps tasks in the cluster); "
                f"this MultiWorkerMirroredStrategy of {self._group.size} worker(s) has none, "
                "its variables are all mirrored"
            )
        ctx = distribute_lib._current()
        if ctx is not None and ctx.replica_context is not None:
            raise errors.FailedPreconditionError(
                f"resize_parameter_servers({num_ps!r}) was called inside strategy.run; "
                "every worker calls it between steps"
            )
        try:
            return self._hybrid.resize(self._ring, self._resolver, num_ps, timeout)
        finally:
            if self._elastic is not None:  # a later joiner takes the tasks with the state
                placement = self._hybrid.session.placement
                self._elastic.state.extra[self._hybrid.PS_KEY] = {
                    "addresses": list(placement.addresses),
                    "version": placement.version,
                }

    def _follow_view(self) -> None:
        """Every worker, at the same step boundary: resizes to the launcher's view."""
        num_ps = self._hybrid.take_pending(self._ring.size)
        if num_ps is None:
            return
        log.info("the cluster view lists %d ps tasks: resizing before this step", num_ps)
        try:
            report = self.resize_parameter_servers(num_ps)
        except errors.OpError as e:  # every worker got it: train on over the old tasks
            log.error("resizing to the view's %d ps tasks failed, training goes on: %s", num_ps, e)
            return
        log.info("resized the ps tasks %d -> %d", report.old_num_ps, report.new_num_ps)

    @property
    def elastic(self) -> Any:
        """The elastic controller (membership changes in ``.changes``), or None when not elastic."""
        return self._elastic

    def run(
        self,
        fn: Callable[..., Any],
        args: tuple = (),
        kwargs: dict | None = None,
        options: Any = None,
    ) -> Any:
        """As :meth:`MirroredStrategy.run`; an elastic group redoes it on the re-formed group."""
        if self._hybrid is not None and self._hybrid.pending_ps is not None:
            self._follow_view()
        controller = self._elastic
        if controller is None:
            return super().run(fn, args, kwargs, options)
        return controller.call(
            lambda sub: MirroredStrategy.run(self, fn, sub(args), sub(kwargs or {}), options)
        )

    def _reset_collectives(self) -> None:
        local = Communicator(len(self._devices), self._cross_device_ops, self._options)
        group = getattr(self, "_nccl", None)
        if group is not None:  # aborted communicators stay aborted: their error is raised
            self._communicator = NcclRoutedCommunicator(  # type: ignore[assignment]
                local, self._ring, self._options.bytes_per_pack, group
            )
        else:
            self._communicator = HierarchicalCommunicator(  # type: ignore[assignment]
                local, self._ring, self._options.bytes_per_pack
            )
        self._merge = _MergeRendezvous(len(self._devices), local.timeout)

    def _global_replica(self, local: int) -> int:
        return self._group.rank * len(self._devices) + local

    # -- properties ------------------------------------------------------------------
    @property
    def num_replicas_in_sync(self) -> int:
        """Workers x local devices."""
        return self._group.size * len(self._devices)

    @property
    def cluster_resolver(self) -> Any:
        """The resolver the cluster and this task were read from."""
        return self._resolver

    # -- cross-replica collectives ---------------------------------------------------
    def reduce(self, reduce_op: Any, value: Any, axis: int | None) -> Any:
        """Combines per-replica values of every worker (every worker must call it).

        Raises:
            InvalidArgumentError: SUM of a non-distributed value with several local replicas.
            UnavailableError / DeadlineExceededError: a worker died or stalled (named).
        """
        if self._elastic is not None:
            return self._elastic.call(lambda sub: self._reduce(reduce_op, sub(value), axis))
        return self._reduce(reduce_op, value, axis)

    def _reduce(self, reduce_op: Any, value: Any, axis: int | None) -> Any:
        op = ReduceOp.from_value(reduce_op)
        n_local = len(self._devices)

        def parts_of(v: Any) -> list[Any]:
            if isinstance(v, (PerReplica, SyncOnReadVariable)):
                return list(v.values)
            if n_local == 1:
                return [v]  # one local replica: its bare value
            if op is ReduceOp.SUM:
                raise errors.InvalidArgumentError(
                    f"A non-distributed value {v!r} cannot be reduced with SUM across "
                    f"{self.num_replicas_in_sync} replicas; return it from strategy.run"
                )
            return [v] * n_local

        def reduce_leaf(v: Any) -> Any:
            host = [np.asarray(backend.to_numpy(to_array(p))) for p in parts_of(v)]
            if axis is None:
                reduce_util.check_same_shapes([h.shape for h in host], f"reduce({op.value})")
                total = host[0].copy()
                for h in host[1:]:
                    total = total + h
                (total,) = self._ring.all_reduce([total])
                if op is ReduceOp.MEAN:  # on the host, where the ring left the sum (not a GPU)
                    with backend.device("/cpu:0"):
                        return reduce_util.mean(Tensor._wrap(total), self.num_replicas_in_sync)
                return Tensor._wrap(total)
            sums = [h.sum(axis=axis, dtype=h.dtype) for h in host]
            total = sums[0]
            for s in sums[1:]:
                total = total + s
            count = np.asarray([sum(h.shape[axis] for h in host)], np.int64)
            total, count = self._ring.all_reduce([np.asarray(total), count])
            if op is ReduceOp.MEAN:
                with backend.device("/cpu:0"):
                    return reduce_util.mean(Tensor._wrap(total), max(int(count[0]), 1))
            return Tensor._wrap(total)

        if isinstance(value, (PerReplica, SyncOnReadVariable)):
            return reduce_leaf(value)
        return nest.map_structure(reduce_leaf, value)

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenates every replica's value of every worker along ``axis``, in replica order."""
        if self._elastic is not None:
            return self._elastic.call(lambda sub: self._gather(sub(value), axis))
        return self._gather(value, axis)

    def _gather(self, value: Any, axis: int) -> Any:

        def gather_leaf(v: Any) -> Any:
            parts = [
                np.asarray(backend.to_numpy(to_array(p)))
                for p in (v.values if isinstance(v, PerReplica) else [v])
            ]
            local = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=axis)
            return Tensor._wrap(self._ring.all_gather(local, axis))

        if isinstance(value, PerReplica):
            return gather_leaf(value)
        return nest.map_structure(gather_leaf, value)

    # -- input -----------------------------------------------------------------------
    def experimental_distribute_dataset(self, dataset: Any, options: Any = None) -> Any:
        """Shards ``dataset`` by worker (its ``auto_shard_policy``) and splits each global batch.

        See :mod:`psflow.distribute.multi_worker_input` for the policies (an
        elastic group: :mod:`psflow.distribute.elastic.input`).
        """
        if self._elastic is not None:
            from psflow.distribute.elastic.input import ElasticDataset

            return ElasticDataset(dataset, list(self._devices), self._elastic)
        return multi_worker_input.MultiWorkerDataset(
            dataset, list(self._devices), self._group.size, self._group.rank, self._ring
        )

    def distribute_datasets_from_function(
        self, dataset_fn: Callable[[Any], Any], options: Any = None
    ) -> Any:
        """Calls ``dataset_fn(InputContext(workers, this worker, replicas))`` on this worker.

        Raises:
            UnimplementedError: in an elastic group (its shards would change with it).
        """
        if self._elastic is not None:
            raise errors.UnimplementedError(
                "distribute_datasets_from_function: an elastic group re-shards the epoch "
                "itself; use experimental_distribute_dataset"
            )
        ctx = distribute_lib.InputContext(
            self._group.size, self._group.rank, self.num_replicas_in_sync
        )
        return multi_worker_input.MultiWorkerDatasetsFromFunction(
            dataset_fn, ctx, list(self._devices), self._ring
        )

    def experimental_distribute_values_from_function(self, value_fn: Callable[[Any], Any]) -> Any:
        """``PerReplica`` of ``value_fn(ValueContext(global id, N))`` for this worker's replicas."""
        n = self.num_replicas_in_sync
        values = [
            value_fn(distribute_lib.ValueContext(self._global_replica(i), n))
            for i in range(len(self._devices))
        ]
        return values[0] if len(values) == 1 else PerReplica(values)

    def __repr__(self) -> str:
        return (
            f"MultiWorkerMirroredStrategy(worker {self._group.rank} of {self._group.size}, "
            f"devices={list(self.devices)})"
        )

"""``ParameterServerStrategy``: variables on parameter servers, steps on workers.

Variables created in ``scope()`` are placed on the PS tasks round-robin (in
creation order, as TensorFlow does), or split into shards by a
``variable_partitioner``. Workers pull values, compute gradients and push
them; each PS applies the optimizer's update rule next to its variables.

Training modes (psflow's additions; TensorFlow 2 has only the first):

* ``"async"``: every push is applied on arrival (the default);
* ``"sync"``: each step takes one gradient from every worker and applies
  their mean once (the PS's aggregation primitive);
* ``"bounded"`` with ``staleness=k``: asynchronous, but no worker starts a
  step more than ``k`` steps ahead of the slowest.

With no cluster resolver and no ``TF_CONFIG`` the strategy runs *embedded*:
a parameter server inside this process and this process as the only worker,
so scripts written for a cluster run anywhere.

Example:
    >>> import psflow as tf
    >>> strategy = tf.distribute.ParameterServerStrategy()
    >>> with strategy.scope():
    ...     v = tf.Variable([1, 2, 3, 4, 5], name="weights")
    >>> print(v)
    <psflow.Variable 'weights:0' shape=(5,) dtype=int32, numpy=array([1, 2, 3, 4, 5], dtype=int32)>
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from psflow import backend, errors
from psflow import compression as compression_lib
from psflow.distribute import distribute_lib, input_lib
from psflow.distribute.ps import session as session_lib
from psflow.distribute.ps.placement import PlacementMap, ResizeReport
from psflow.distribute.ps.values import PSVariable, ShardedVariable, split_rows
from psflow.framework import variable as variable_lib
from psflow.transport.options import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS

log = logging.getLogger("psflow.distribute")
_embedded_logged = threading.Event()


class PSExtended(distribute_lib.StrategyExtended):
    """ParameterServerStrategy's internals: placement, partitioning, workers, datasets."""

    def __init__(
        self,
        strategy: ParameterServerStrategy,
        session: session_lib.PSSession,
        *,
        partitioner: Any,
        staleness: int | None,
        worker_addresses: list[str],
        embedded: bool,
        num_replicas: int,
    ) -> None:
        super().__init__(strategy)
        self._session = session
        self._partitioner = partitioner
        self.staleness = staleness
        self._worker_addresses = worker_addresses
        self.embedded = embedded
        self._num_replicas = num_replicas
        self._next_ps = itertools.count()
        self._names: dict[str, int] = {}
        self._names_lock = threading.Lock()
        # the strategy's ClusterCoordinator, once one was created (there is one at most)
        self.coordinator: Any = None

    @property
    def num_ps(self) -> int:
        """Parameter-server tasks."""
        return len(self._session.connections)

    @property
    def num_workers(self) -> int:
        """Worker tasks (1 when embedded)."""
        return 1 if self.embedded else len(self._worker_addresses)

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        return tuple(f"/job:ps/replica:0/task:{i}/device:CPU:0" for i in range(self.num_ps))

    # -- variables -----------------------------------------------------------------------
    def _unique_key(self, base: str) -> str:
        with self._names_lock:
            n = self._names.get(base, 0)
            self._names[base] = n + 1
        return base if n == 0 else f"{base}_{n}"

    def _create_variable(self, next_creator: Callable[..., Any], **kwargs: Any) -> Any:
        initial = kwargs.get("initial_value")
        if initial is None:
            raise errors.InvalidArgumentError("Variable needs an initial_value")
        value = variable_lib.initial_array(initial, kwargs.get("dtype"), kwargs.get("shape"))
        host = backend.to_contiguous_numpy(value)
        name = (kwargs.get("name") or "Variable").split(":")[0]
        sync = kwargs.get("synchronization") or variable_lib.VariableSynchronization.AUTO
        trainable = kwargs.get("trainable")
        if trainable is None:
            trainable = (
                variable_lib.VariableSynchronization(sync)
                is not variable_lib.VariableSynchronization.ON_READ
            )
        common = {
            "synchronization": sync,
            "aggregation": kwargs.get("aggregation") or variable_lib.VariableAggregation.NONE,
            "constraint": kwargs.get("constraint"),
        }
        num_shards = 1
        if self._partitioner is not None and host.ndim >= 1 and host.shape[0] > 1:
            parts = self._partitioner(shape=host.shape, dtype=host.dtype.name)
            num_shards = int(parts[0])
        if num_shards <= 1:
            key = self._unique_key(name)
            handle = PSVariable(
                self._session,
                key,
                name,
                next(self._next_ps) % self.num_ps,
                host.shape,
                host.dtype,
                trainable,
                **common,
            )
            self._session.create([handle], [host])
            return self._session.handle(key)
        shards = []
        values = split_rows(host, num_shards)
        for i, part in enumerate(values):
            key = self._unique_key(f"{name}/part_{i}")
            shards.append(
                PSVariable(
                    self._session,
                    key,
                    f"{name}/part_{i}",
                    next(self._next_ps) % self.num_ps,
                    part.shape,
                    host.dtype,
                    trainable,
                    **common,
                )
            )
        self._session.create(shards, [backend.to_contiguous_numpy(v) for v in values])
        return ShardedVariable([self._session.handle(s.key) for s in shards], name)

    # -- workers and datasets ------------------------------------------------------------
    def _make_workers(
        self,
        *,
        keepalive_time: float = KEEPALIVE_TIME_MS / 1000,
        keepalive_timeout: float = KEEPALIVE_TIMEOUT_MS / 1000,
    ) -> list[Any]:
        """The coordinator's workers; ``keepalive_*``: seconds, for the gRPC workers' channels."""
        from psflow.distribute.coordinator.workers import GrpcWorker, InProcessWorker

        if self.embedded:
            session = self._session

            def enter(step: int, closure_key: str) -> Any:
                return session.step(step, closure_key)

            return [InProcessWorker(0, "worker:0", enter=enter)]
        # each closure carries the chief's training mode to the worker that runs it
        training = self._session.sync
        compression = self._container_strategy()._compression
        return [
            GrpcWorker(
                i,
                addr,
                training=training,
                compression=compression,
                keepalive_time=keepalive_time,
                keepalive_timeout=keepalive_timeout,
            )
            for i, addr in enumerate(self._worker_addresses)
        ]

    def _dataset_factory(self, dataset_fn: Any, num_workers: int) -> Callable[[int], Any]:
        """A picklable ``make(worker_index) -> dataset`` for ``create_per_worker_dataset``."""
        if isinstance(dataset_fn, _PSDistributedDataset):
            return functools.partial(_shard_dataset, dataset_fn._dataset, num_workers)
        if isinstance(dataset_fn, input_lib.DistributedDataset):
            return functools.partial(_shard_dataset, dataset_fn._dataset, num_workers)
        if isinstance(dataset_fn, _DatasetFromFunction):
            return functools.partial(
                _call_dataset_fn, lambda ctx, f=dataset_fn: f, num_workers, self._num_replicas
            )
        if callable(dataset_fn) and not hasattr(dataset_fn, "cardinality"):
            return functools.partial(_call_dataset_fn, dataset_fn, num_workers, self._num_replicas)
        return functools.partial(_replicate_dataset, dataset_fn)

    def metric_backing(self, metric: Any) -> Any:
        """Puts a metric's state on the parameter servers (metrics created in scope)."""
        from psflow.distribute.ps.metric_state import PSMetricState

        return PSMetricState(metric, self._container_strategy())


def _for_local_replicas(dataset: Any, per_replica_elements: bool = False) -> Any:
    """On a worker with several devices, splits the dataset across its replicas.

    Global batches are split TensorFlow's way (``experimental_distribute_dataset``);
    with ``per_replica_elements`` consecutive elements go to the replicas in turn
    (``distribute_datasets_from_function``). One device: the dataset as it is.
    """
    strategy = session_lib.current().strategy
    if strategy is None or strategy.num_replicas_in_sync <= 1:
        return dataset
    mirrored = strategy._mirrored()
    if per_replica_elements:
        return mirrored.distribute_datasets_from_function(lambda ctx: dataset)
    return mirrored.experimental_distribute_dataset(dataset)


def _shard_dataset(dataset: Any, num_workers: int, worker: int) -> Any:
    sharded = dataset.shard(num_workers, worker) if num_workers > 1 else dataset
    return _for_local_replicas(sharded)


def _replicate_dataset(dataset: Any, worker: int) -> Any:
    return _for_local_replicas(dataset)


def _call_dataset_fn(
    fn: Callable[..., Any], num_workers: int, num_replicas: int, worker: int
) -> Any:
    try:
        params = inspect.signature(fn).parameters
        takes_context = len(params) >= 1
    except (TypeError, ValueError):
        takes_context = True
    context = distribute_lib.InputContext(num_workers, worker, num_replicas)
    result = fn(context) if takes_context else fn()
    if isinstance(result, _DatasetFromFunction):  # TF's per_worker_dataset_fn pattern
        return _for_local_replicas(result._fn(context), per_replica_elements=True)
    if isinstance(result, _PSDistributedDataset):
        return _for_local_replicas(result._dataset)
    return _for_local_replicas(result)


class _PSDistributedDataset:
    """What ``experimental_distribute_dataset`` returns: sharded per worker when scheduled."""

    def __init__(self, dataset: Any) -> None:
        self._dataset = dataset

    def __iter__(self) -> Iterator[Any]:
        return iter(self._dataset)

    def cardinality(self) -> Any:
        """The underlying dataset's cardinality."""
        return self._dataset.cardinality()


class _DatasetFromFunction(input_lib.DatasetFunction):
    """What ``distribute_datasets_from_function`` returns: a function for the workers to call.

    A :class:`~psflow.distribute.input_lib.DatasetFunction`, so ``fit`` takes it
    as it takes a ``DatasetCreator``.
    """

    def __init__(self, fn: Callable[..., Any], strategy: ParameterServerStrategy) -> None:
        super().__init__(fn)
        self._fn = fn
        self._strategy = strategy

    def __iter__(self) -> Iterator[Any]:
        ctx = distribute_lib.InputContext(1, 0, self._strategy.num_replicas_in_sync)
        return iter(self._fn(ctx))


class ParameterServerStrategy(distribute_lib.Strategy):
    """Parameter-server training (TensorFlow's ``tf.distribute.ParameterServerStrategy``).

    Args:
        cluster_resolver: where the PS, worker and chief tasks are
            (``TFConfigClusterResolver()`` by default); an empty cluster means
            embedded mode.
        variable_partitioner: splits large variables into shards (see
            ``psflow.distribute.experimental.partitioners``).
        mode: ``"async"`` (default), ``"sync"`` or ``"bounded"``.
        staleness: with ``mode="bounded"``, the most steps a worker may run ahead.
        sync_timeout: seconds a synchronous step waits for every worker's gradient.
        compression: ``"bf16"`` or ``"fp16"`` to push dense gradients as 16-bit
            values with error feedback (decoded on the PS), or
            ``{ps_variable_name: codec}``; None (default) or ``"none"``: off.
            It matters across hosts, where pushes are bound by the network; the
            embedded default has no wire and ignores it.

    Raises:
        InvalidArgumentError: a cluster without ps or worker tasks, a bad mode,
            an unknown codec, or this process being a ps or worker task.
    """

    def __init__(
        self,
        cluster_resolver: Any = None,
        variable_partitioner: Any = None,
        *,
        mode: str = "async",
        staleness: int | None = None,
        sync_timeout: float = 300.0,
        compression: str | Mapping[str, str] | None = None,
    ) -> None:
        from psflow.distribute.cluster_resolver import TFConfigClusterResolver

        if mode not in ("async", "sync", "bounded"):
            raise errors.InvalidArgumentError(
                f"Unknown mode {mode!r}; expected 'async', 'sync' or 'bounded'"
            )
        if mode == "bounded":
            if staleness is None or int(staleness) < 0:
                raise errors.InvalidArgumentError(
                    f"mode='bounded' needs staleness >= 0, got {staleness!r}"
                )
        elif staleness is not None:
            raise errors.InvalidArgumentError(f"staleness={staleness} needs mode='bounded'")
        feedback = compression_lib.feedback_from_option(compression)  # validates first
        resolver = cluster_resolver if cluster_resolver is not None else TFConfigClusterResolver()
        spec = resolver.cluster_spec()
        embedded = not spec.jobs
        self._cluster_resolver = resolver
        self._mode = mode
        self._compression = compression
        if embedded:
            session, workers, replicas = self._embedded_session(mode, sync_timeout)
        else:
            session, workers, replicas = self._cluster_session(resolver, spec, mode, sync_timeout)
            for connection in session.connections:
                connection.compression = feedback
        super().__init__(
            PSExtended(
                self,
                session,
                partitioner=variable_partitioner,
                staleness=int(staleness) if staleness is not None else None,
                worker_addresses=workers,
                embedded=embedded,
                num_replicas=replicas,
            )
        )
        session.strategy = self
        session.connect_with(self._connect_added if not embedded else _connect_in_process)
        session_lib.set_default(session)
        self._local_mirrored: Any = None

    @staticmethod
    def _embedded_session(
        mode: str, sync_timeout: float
    ) -> tuple[session_lib.PSSession, list[str], int]:
        from psflow import config
        from psflow.distribute.ps.inprocess import InProcessPSConnection

        if not _embedded_logged.is_set():
            _embedded_logged.set()
            log.info(
                "ParameterServerStrategy: no cluster configured; running embedded "
                "(an in-process PS, this process as the only worker)"
            )
        connection = InProcessPSConnection(task="ps:0")
        sync = session_lib.SyncConfig(mode, num_workers=1, timeout=sync_timeout)
        replicas = len(config.default_devices()) if backend.gpu_count() else 1
        return session_lib.PSSession([connection], sync, task="chief:0"), [], replicas

    @staticmethod
    def _cluster_session(
        resolver: Any, spec: Any, mode: str, sync_timeout: float
    ) -> tuple[session_lib.PSSession, list[str], int]:
        from psflow.distribute.cluster_resolver import validate_ps_cluster
        from psflow.distribute.ps.grpc_connection import GrpcPSConnection

        validate_ps_cluster(spec)
        task_type = getattr(resolver, "task_type", None)
        if task_type in ("ps", "worker"):
            raise errors.InvalidArgumentError(
                f"This process is task {task_type}:{resolver.task_id} of the cluster; "
                f"ParameterServerStrategy runs on the chief. Start {task_type} tasks with "
                f"`python -m {'ps_server' if task_type == 'ps' else 'worker'}`"
            )
        ps_addresses = [spec.task_address("ps", i) for i in sorted(spec.task_indices("ps"))]
        workers = [spec.task_address("worker", i) for i in sorted(spec.task_indices("worker"))]
        connections = [
            GrpcPSConnection(addr, task=f"ps:{i}") for i, addr in enumerate(ps_addresses)
        ]
        sync = session_lib.SyncConfig(mode, num_workers=len(workers), timeout=sync_timeout)
        gpus = (
            int(resolver.num_accelerators().get("GPU", 0))
            if hasattr(resolver, "num_accelerators")
            else 0
        )
        return session_lib.PSSession(connections, sync, task="chief:0"), workers, max(gpus, 1)

    @classmethod
    def _for_worker(
        cls,
        ps_addresses: list[str],
        num_workers: int,
        task: str,
        mode: str = "async",
        sync_timeout: float = 300.0,
        security: Any = None,
        ps_timeout: float = 60.0,
    ) -> ParameterServerStrategy:
        """The strategy a worker process runs closures with (no cluster resolution).

        ``security`` (a ``psflow.security.config.SecurityConfig``; default: the
        environment's) is what the worker presents to the parameter servers;
        ``ps_timeout`` is the deadline of each of its calls to them (a push).
        """
        from psflow.distribute.ps.grpc_connection import GrpcPSConnection

        self = cls.__new__(cls)
        self._cluster_resolver = None
        self._mode = mode
        self._compression = None  # the chief's option arrives with its closures
        connections = [
            GrpcPSConnection(addr, task=f"ps:{i}", security=security, timeout=ps_timeout)
            for i, addr in enumerate(ps_addresses)
        ]
        session = session_lib.PSSession(
            connections, session_lib.SyncConfig(mode, num_workers, sync_timeout), task=task
        )
        from psflow import config

        # this worker's own devices: its GPUs, else its logical CPU devices
        replicas = len(config.default_devices())
        distribute_lib.Strategy.__init__(
            self,
            PSExtended(
                self,
                session,
                partitioner=None,
                staleness=None,
                worker_addresses=[],
                embedded=False,
                num_replicas=replicas,
            ),
        )
        session.strategy = self

        def connect(address: str, index: int) -> Any:
            # a task a resize added: same credentials, the chief's codec (sent per closure)
            connection = GrpcPSConnection(
                address, task=f"ps:{index}", security=security, timeout=ps_timeout
            )
            connection.compression = session.connections[0].compression
            return connection

        session.connect_with(connect)
        self._local_mirrored = None
        return self

    # -- properties ------------------------------------------------------------------------
    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas per worker: its GPUs, else 1 (as TensorFlow)."""
        return self._extended._num_replicas  # type: ignore[attr-defined]

    @property
    def cluster_resolver(self) -> Any:
        return self._cluster_resolver

    @property
    def mode(self) -> str:
        """``"async"``, ``"sync"`` or ``"bounded"``."""
        return self._mode

    @property
    def _session(self) -> session_lib.PSSession:
        return self._extended._session  # type: ignore[attr-defined]

    # -- running ---------------------------------------------------------------------------
    def _mirrored(self) -> Any:
        if self._local_mirrored is None:
            from psflow import config
            from psflow.distribute.mirrored_strategy import MirroredStrategy

            self._local_mirrored = MirroredStrategy(
                config.default_devices()[: self.num_replicas_in_sync]
            )
        return self._local_mirrored

    def run(
        self,
        fn: Callable[..., Any],
        args: tuple = (),
        kwargs: dict | None = None,
        options: Any = None,
    ) -> Any:
        """Runs ``fn`` on this worker's replicas (inside a scheduled closure, or here).

        With several devices, replicas' gradients are all-reduced on the worker
        and pushed once.
        """
        kwargs = kwargs or {}
        if self.num_replicas_in_sync > 1:
            return self._mirrored().run(fn, args, kwargs)
        with (
            self.scope(),
            distribute_lib._enter(distribute_lib._Context(self, self._default_replica_context)),
        ):
            return fn(*args, **kwargs)

    def reduce(self, reduce_op: Any, value: Any, axis: int | None) -> Any:
        if self._local_mirrored is not None and self.num_replicas_in_sync > 1:
            return self._local_mirrored.reduce(reduce_op, value, axis)
        return super().reduce(reduce_op, value, axis)

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        if self._local_mirrored is not None:
            return self._local_mirrored.experimental_local_results(value)
        return super().experimental_local_results(value)

    # -- input -----------------------------------------------------------------------------
    def experimental_distribute_dataset(self, dataset: Any, options: Any = None) -> Any:
        """Marks ``dataset`` to be sharded across workers by ``create_per_worker_dataset``."""
        return _PSDistributedDataset(dataset)

    def distribute_datasets_from_function(
        self, dataset_fn: Callable[..., Any], options: Any = None
    ) -> Any:
        """Wraps ``dataset_fn`` for ``create_per_worker_dataset`` (each worker calls it)."""
        return _DatasetFromFunction(dataset_fn, self)

    # -- elastic parameter servers --------------------------------------------------------------
    def placement(self) -> PlacementMap:
        """Which PS task holds each variable, and the tasks' addresses, with the map's version."""
        return self._session.placement

    def resize_parameter_servers(self, num_ps: int, *, timeout: float = 300.0) -> ResizeReport:
        """Moves the variables onto PS tasks ``0..num_ps-1`` of the cluster as it is now.

        The tasks are read afresh from ``cluster_resolver.cluster_spec()``
        (job ``ps``). Added tasks take a balanced share of the variables;
        tasks ``>= num_ps`` give all of theirs away, then exit (code 0,
        ``PSFLOW_DRAINED`` on stdout). Values, optimizer slots, versions and
        push records move with each variable. With a
        :class:`~psflow.distribute.coordinator.ClusterCoordinator` the resize
        waits for a step boundary (see its ``resize_parameter_servers``).
        Embedded mode resizes in-process stores.

        Example:
            >>> import psflow as pf
            >>> strategy = pf.distribute.ParameterServerStrategy()
            >>> with strategy.scope():
            ...     v = pf.Variable([1.0, 2.0], name="v")
            >>> strategy.resize_parameter_servers(2).new_num_ps
            2

        Raises:
            InvalidArgumentError: ``num_ps`` < 1, or the cluster lists fewer
                ``ps`` tasks than ``num_ps`` (both counts named).
            UnimplementedError: something in use cannot move (the session's
                ``refuse_resize``); dynamic embedding tables do move (see
                ``psflow.distribute.ps.table_moves.move_tables``), at a step boundary.
            UnavailableError, DeadlineExceededError: a task involved was lost
                or slow; the placement map holds every move completed.
        """
        coordinator = self._extended.coordinator  # type: ignore[attr-defined]
        if coordinator is not None:
            return coordinator.resize_parameter_servers(num_ps, timeout=timeout)
        return self._resize(num_ps, timeout)

    def _resize(
        self, num_ps: int, timeout: float, before_drain: Callable[[float], None] | None = None
    ) -> ResizeReport:
        """The resize itself (``before_drain``: see :func:`psflow.distribute.ps.resize.resize`)."""
        from psflow.distribute.ps import resize as resize_lib

        if isinstance(num_ps, bool) or not isinstance(num_ps, int) or num_ps < 1:
            raise errors.InvalidArgumentError(f"num_ps must be an integer >= 1, got {num_ps!r}")
        if self._extended.embedded:  # type: ignore[attr-defined]
            addresses = [_in_process_address(i) for i in range(num_ps)]
        else:
            if self._cluster_resolver is None:
                raise errors.FailedPreconditionError(
                    "only the chief's strategy (with a cluster resolver) can resize"
                )
            spec = self._cluster_resolver.cluster_spec()
            listed = sorted(spec.task_indices("ps")) if "ps" in spec.jobs else []
            if len(listed) < num_ps or listed[:num_ps] != list(range(num_ps)):
                raise errors.InvalidArgumentError(
                    f"resizing to num_ps={num_ps} parameter servers, but the cluster spec "
                    f"lists {len(listed)} ps tasks ({listed}); it must list tasks 0..{num_ps - 1}"
                )
            addresses = [spec.task_address("ps", i) for i in range(num_ps)]
        return resize_lib.resize(
            self._session, addresses, timeout=timeout, before_drain=before_drain
        )

    def _connect_added(self, address: str, index: int) -> Any:
        """A connection to a PS task a resize added (the chief's codec)."""
        from psflow.distribute.ps.grpc_connection import GrpcPSConnection

        connection = GrpcPSConnection(address, task=f"ps:{index}")
        connection.compression = compression_lib.feedback_from_option(self._compression)
        return connection

    # -- checkpoints and stats -----------------------------------------------------------------
    def ps_stats(self, include_log: bool = False) -> list[dict[str, Any]]:
        """Every PS task's counters (bytes, pushes, staleness; the push log on request)."""
        return self._session.stats(include_log)

    def __reduce__(self) -> tuple:
        # a reference: the receiving process's own strategy, changed in nothing (the
        # training mode and compression travel with each closure: RunClosureRequest.training)
        return (_current_strategy, ())

    def _adopt_training_mode(
        self, sync: session_lib.SyncConfig, compression: str | Mapping[str, str] | None = None
    ) -> None:
        """Applies the chief's training mode (sent with a closure) to this worker's pushes."""
        current = self._session.sync
        if (current.mode, current.num_workers, current.timeout) != (
            sync.mode,
            sync.num_workers,
            sync.timeout,
        ):
            self._session.sync = sync
            self._mode = sync.mode
        if self._compression != compression:
            # a new option: fresh residuals; the same one: keep them across closures
            self._compression = compression
            feedback = compression_lib.feedback_from_option(compression)
            for connection in self._session.connections:
                connection.compression = feedback

    def __repr__(self) -> str:
        ext = self._extended
        where = "embedded" if ext.embedded else f"{ext.num_ps} ps, {ext.num_workers} workers"  # type: ignore[attr-defined]
        return f"ParameterServerStrategy({where}, mode={self._mode!r})"


def _in_process_address(index: int) -> str:
    """The placement-map address of embedded PS task ``index``."""
    return f"in-process:ps:{index}"


def _connect_in_process(address: str, index: int) -> Any:
    """A new in-process store, for an embedded resize that adds task ``index``."""
    from psflow.distribute.ps.inprocess import InProcessPSConnection

    return InProcessPSConnection(task=f"ps:{index}")


def _current_strategy() -> ParameterServerStrategy:
    """Unpickles a strategy reference as this process's strategy (no state is changed).

    Raises:
        FailedPreconditionError: this process has no ParameterServerStrategy.
    """
    strategy = session_lib.current().strategy
    if strategy is None:
        raise errors.FailedPreconditionError("No ParameterServerStrategy in this process")
    return strategy

"""The strategy base classes and the contexts that say which strategy is active.

A :class:`Strategy` is entered with ``scope()``; inside it ``get_strategy()``
returns it and ``Variable(...)`` goes through its variable creator. Code run by
``strategy.run`` executes in a replica context (:class:`ReplicaContext`), one
per replica, each in the thread that computes on that replica's device.

Outside any scope the *default strategy* is active: one replica, the current
device, no distribution — so code written for strategies runs unchanged.

Example:
    >>> import psflow as pf
    >>> pf.distribute.get_strategy().num_replicas_in_sync
    1
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from psflow import errors
from psflow.distribute import reduce_util
from psflow.distribute.protocols import GroupUpdated, UpdateGroup
from psflow.distribute.reduce_util import ReduceOp
from psflow.framework import variable as variable_lib
from psflow.util import nest

_local = threading.local()


class _Context:
    """What one thread sees: the strategy, and the replica context when inside ``run``."""

    __slots__ = ("replica_context", "strategy")

    def __init__(self, strategy: Strategy, replica_context: ReplicaContext | None) -> None:
        self.strategy = strategy
        self.replica_context = replica_context


def _stack() -> list[_Context]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def _current() -> _Context | None:
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def _enter(context: _Context) -> Iterator[None]:
    stack = _stack()
    stack.append(context)
    try:
        yield
    finally:
        stack.pop()


def get_strategy() -> Strategy:
    """The strategy of the innermost ``scope()`` (or ``run``), else the default strategy."""
    ctx = _current()
    return ctx.strategy if ctx is not None else _default_strategy()


def has_strategy() -> bool:
    """Whether a non-default strategy is active in this thread."""
    ctx = _current()
    return ctx is not None and not isinstance(ctx.strategy, _DefaultStrategy)


def in_cross_replica_context() -> bool:
    """Whether this thread is inside a strategy's scope but not inside ``run``."""
    ctx = _current()
    return ctx is not None and ctx.replica_context is None


def get_replica_context() -> ReplicaContext | None:
    """The replica context inside ``run`` (or the default one outside any scope), else None."""
    ctx = _current()
    if ctx is None:
        return _default_strategy()._default_replica_context
    return ctx.replica_context


def get_cross_replica_context() -> Strategy | None:
    """The strategy when in cross-replica context, else None."""
    ctx = _current()
    if ctx is None:
        return _default_strategy()
    return ctx.strategy if ctx.replica_context is None else None


def experimental_set_strategy(strategy: Strategy | None) -> None:
    """Makes ``strategy`` current for this thread until called again with ``None``."""
    stack = _stack()
    stack.clear()
    if strategy is not None:
        stack.append(_Context(strategy, None))


class InputContext:
    """What an input function needs to know to read its share of the data.

    Args:
        num_input_pipelines: how many pipelines read in parallel (workers).
        input_pipeline_id: this pipeline's index.
        num_replicas_in_sync: replicas fed from all pipelines together.
    """

    def __init__(
        self,
        num_input_pipelines: int = 1,
        input_pipeline_id: int = 0,
        num_replicas_in_sync: int = 1,
    ) -> None:
        self.num_input_pipelines = num_input_pipelines
        self.input_pipeline_id = input_pipeline_id
        self.num_replicas_in_sync = num_replicas_in_sync

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """``global_batch_size / num_replicas_in_sync``.

        Raises:
            InvalidArgumentError: the global batch does not divide evenly.
        """
        if global_batch_size % self.num_replicas_in_sync:
            raise errors.InvalidArgumentError(
                f"The global batch size ({global_batch_size}) is not divisible by "
                f"num_replicas_in_sync ({self.num_replicas_in_sync})"
            )
        return global_batch_size // self.num_replicas_in_sync

    def __repr__(self) -> str:
        return (
            f"InputContext(num_input_pipelines={self.num_input_pipelines}, "
            f"input_pipeline_id={self.input_pipeline_id}, "
            f"num_replicas_in_sync={self.num_replicas_in_sync})"
        )


class InputOptions:
    """Options for distributing datasets (accepted for TensorFlow compatibility)."""

    def __init__(
        self,
        experimental_fetch_to_device: bool | None = None,
        experimental_replication_mode: Any = None,
        experimental_place_dataset_on_device: bool = False,
        experimental_per_replica_buffer_size: int = 1,
    ) -> None:
        self.experimental_fetch_to_device = experimental_fetch_to_device
        self.experimental_replication_mode = experimental_replication_mode
        self.experimental_place_dataset_on_device = experimental_place_dataset_on_device
        self.experimental_per_replica_buffer_size = experimental_per_replica_buffer_size


class RunOptions:
    """Options for ``Strategy.run`` (accepted for TensorFlow compatibility)."""

    def __init__(
        self,
        experimental_enable_dynamic_batch_size: bool = True,
        experimental_bucketizing_dynamic_shape: bool = False,
        experimental_xla_options: Any = None,
    ) -> None:
        self.experimental_enable_dynamic_batch_size = experimental_enable_dynamic_batch_size
        self.experimental_bucketizing_dynamic_shape = experimental_bucketizing_dynamic_shape


class StrategyExtended:
    """Strategy internals: variable creation and placement (``strategy.extended``)."""

    def __init__(self, container_strategy: Strategy) -> None:
        self._container_strategy_ref = container_strategy
        # the variables created in scope, by id (weakly: a registry must not keep them)
        self._created: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()

    def _container_strategy(self) -> Strategy:
        return self._container_strategy_ref

    def _create_variable(self, next_creator: Callable[..., Any], **kwargs: Any) -> Any:
        return next_creator(**kwargs)

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """Where variables live."""
        return ("/job:localhost/replica:0/task:0/device:CPU:0",)

    @property
    def worker_devices(self) -> tuple[str, ...]:
        """Where replicas compute."""
        return ("/job:localhost/replica:0/task:0/device:CPU:0",)

    def variable_created_in_scope(self, v: Any) -> bool:
        """Whether ``v`` was created under this strategy."""
        return self._created.get(id(v)) is v

    def colocate_vars_with(self, colocate_with_variable: Any) -> contextlib.AbstractContextManager:
        """Accepted for compatibility; placement follows the strategy's own rules."""
        return contextlib.nullcontext()

    def reduce_to(self, reduce_op: Any, value: Any, destinations: Any) -> Any:
        """Reduces a per-replica value (single-replica strategies return it)."""
        return self._container_strategy_ref.reduce(reduce_op, value, axis=None)

    def update(
        self,
        var: Any,
        fn: Callable[..., Any],
        args: tuple = (),
        kwargs: dict | None = None,
        group: bool = True,
    ) -> Any:
        """Runs ``fn(var, *args)`` to update ``var``."""
        return fn(var, *args, **(kwargs or {}))

    def value_container(self, value: Any) -> Any:
        """The distributed container of a per-replica component (itself here)."""
        return value

    def read_var(self, v: Any) -> Any:
        """``v``'s value as a tensor, aggregated across replicas for a sync-on-read variable."""
        return v.read_value()

    def metric_backing(self, metric: Any) -> Any:
        """Where a metric created in this strategy's scope keeps its state (None: in itself)."""
        return None

    def keras_runner(self, model: Any) -> Any:
        """A runner for ``model.fit`` and friends (None: the engine picks by strategy)."""
        return None

    def metric_results(self, metrics: Sequence[Any]) -> dict[str, float]:
        """The logs ``fit`` reports for ``metrics``: each one's result, here in this process.

        A multi-process strategy combines every process's metric state first.
        """
        return {m.name: float(m.result()._value) for m in metrics}

    @property
    def should_checkpoint(self) -> bool:
        """Whether this process writes checkpoints (TF: the chief; here the only process)."""
        return True

    @property
    def should_save_summary(self) -> bool:
        """Whether this process writes summaries."""
        return True

    def prepare_optimizer(self, optimizer: Any) -> None:
        """Called by an optimizer just before it reads its step count for an update.

        Nothing here; an elastic group records the optimizer (and a worker that
        joined a running group gives it the group's step and slots first).
        """

    def _takes_product_gradients(self, variables: Sequence[Any]) -> bool:
        """Whether :meth:`apply_update` takes a matrix weight's gradient as its two factors
        (:class:`~psflow.framework.product_gradient.ProductGradient`) for ``variables``
        here: no, unless a strategy's update multiplies them out itself."""
        return False

    def apply_update(
        self,
        optimizer: Any,
        step: int,
        grads_and_vars: Sequence[tuple[Any, Any]],
        *,
        aggregate: bool = True,
    ) -> bool:
        """Applies an optimizer's clipped ``(gradient, variable)`` pairs as update ``step``.

        The one place a strategy decides how updates happen; the optimizer
        clips, then calls this. Here (one replica, or cross-replica context):
        a plain variable is updated in place with the optimizer's rule; a
        :class:`~psflow.distribute.protocols.GroupUpdated` one goes, with the
        others of its group, to its :class:`~psflow.distribute.protocols.UpdateGroup`
        (a PS session pushes them; a mirrored strategy updates every copy).
        A ``None`` gradient skips its variable. ``aggregate`` matters only to
        strategies with several replicas.

        Returns:
            Whether any variable was updated (the optimizer then counts the step).
        """
        local: list[tuple[Any, Any]] = []
        groups: dict[int, tuple[UpdateGroup, list[tuple[Any, Any]]]] = {}
        for g, v in grads_and_vars:
            if g is None:  # no replica had a gradient for it (merged without aggregation)
                continue
            if isinstance(v, GroupUpdated):
                group = v.update_group
                groups.setdefault(id(group), (group, []))[1].append((g, v))
            else:
                local.append((g, v))
        for g, v in local:
            optimizer._apply_local(v, g, step)
        # every group's update in flight before waiting for any (a table push
        # beside the dense push); each finish() raises its group's error
        finishes = [
            group.start_optimizer(optimizer, pairs, step) for group, pairs in groups.values()
        ]
        for finish in finishes:
            finish()
        return bool(local or groups)


class Strategy:
    """Base of the distribution strategies (TensorFlow's ``tf.distribute.Strategy``).

    Subclasses set ``num_replicas_in_sync`` and override ``run``, ``reduce``
    and the dataset methods; the default implementations run one replica.
    """

    def __init__(self, extended: StrategyExtended | None = None) -> None:
        self._extended = extended or StrategyExtended(self)
        self._scope_depth = 0
        self._default_replica_context = ReplicaContext(self, 0)

    @property
    def extended(self) -> StrategyExtended:
        """Internals: variable creation, devices, updates."""
        return self._extended

    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas whose gradients are combined every step."""
        return 1

    @property
    def cluster_resolver(self) -> Any:
        """The cluster resolver, for multi-process strategies."""
        return None

    def _variable_creator(self, next_creator: Callable[..., Any], **kwargs: Any) -> Any:
        v = self._extended._create_variable(next_creator, **kwargs)
        with contextlib.suppress(TypeError):  # a kind that cannot be weakly referenced
            self._extended._created[id(v)] = v
        return v

    @contextlib.contextmanager
    def scope(self) -> Iterator[Strategy]:
        """Makes this the current strategy; variables created inside belong to it.

        Raises:
            InvalidArgumentError: another non-default strategy's scope is already active.
        """
        ctx = _current()
        if (
            ctx is not None
            and ctx.strategy is not self
            and not isinstance(ctx.strategy, _DefaultStrategy)
        ):
            raise errors.InvalidArgumentError(
                f"Mixing different tf.distribute.Strategy objects: {self!r} inside the scope of "
                f"{ctx.strategy!r}"
            )
        replica = ctx.replica_context if ctx is not None and ctx.strategy is self else None
        with (
            _enter(_Context(self, replica)),
            variable_lib.variable_creator_scope(self._variable_creator),
        ):
            yield self

    def run(
        self,
        fn: Callable[..., Any],
        args: tuple = (),
        kwargs: dict | None = None,
        options: RunOptions | None = None,
    ) -> Any:
        """Runs ``fn`` once per replica; one replica returns the bare result."""
        kwargs = kwargs or {}
        with self.scope(), _enter(_Context(self, self._default_replica_context)):
            return fn(*args, **kwargs)

    def reduce(self, reduce_op: Any, value: Any, axis: int | None) -> Any:
        """Combines a per-replica value into one tensor (here: itself, reduced over ``axis``)."""
        op = ReduceOp.from_value(reduce_op)
        if axis is None:
            return value
        # sum / count, as TF: an integer MEAN over an axis is a float, not reduce_mean's int
        return nest.map_structure(lambda v: reduce_util.reduce_over_axis(op, v, axis), value)

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """The per-replica components of ``value`` on this worker, as a tuple.

        A nested structure of per-replica values gives one structure per replica
        (TensorFlow's tuple of per-replica structures), not the structure itself.
        """
        from psflow.distribute.values import local_results  # values imports this module

        return local_results(value, len(self.extended.worker_devices))

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenates per-replica values along ``axis``."""
        from psflow.ops import array_ops

        parts = self.experimental_local_results(value)
        return parts[0] if len(parts) == 1 else array_ops.concat(list(parts), axis=axis)

    def experimental_distribute_dataset(
        self, dataset: Any, options: InputOptions | None = None
    ) -> Any:
        """The dataset, unchanged, for one replica."""
        return dataset

    def distribute_datasets_from_function(
        self, dataset_fn: Callable[[InputContext], Any], options: InputOptions | None = None
    ) -> Any:
        """Calls ``dataset_fn`` with an :class:`InputContext` for the single pipeline."""
        return dataset_fn(InputContext(1, 0, self.num_replicas_in_sync))

    def experimental_distribute_values_from_function(self, value_fn: Callable[[Any], Any]) -> Any:
        """Calls ``value_fn`` with a value context for replica 0."""
        return value_fn(ValueContext(0, self.num_replicas_in_sync))

    def __deepcopy__(self, memo: dict) -> Strategy:
        raise errors.UnimplementedError("A distribution strategy cannot be deep-copied")


class ValueContext:
    """The replica a value function produces a value for."""

    def __init__(self, replica_id_in_sync_group: int = 0, num_replicas_in_sync: int = 1) -> None:
        self.replica_id_in_sync_group = replica_id_in_sync_group
        self.num_replicas_in_sync = num_replicas_in_sync


class ReplicaContext:
    """What code inside ``strategy.run`` sees of its replica (``tf.distribute.ReplicaContext``).

    Collective methods (``all_reduce``, ``all_gather``, ``merge_call``) must be
    called by every replica, in the same order.
    """

    def __init__(self, strategy: Strategy, replica_id_in_sync_group: int) -> None:
        self._strategy = strategy
        self._replica_id = replica_id_in_sync_group

    @property
    def strategy(self) -> Strategy:
        """The strategy this replica belongs to."""
        return self._strategy

    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas in the group."""
        return self._strategy.num_replicas_in_sync

    @property
    def replica_id_in_sync_group(self) -> int:
        """This replica's index, as a scalar int32 tensor (TensorFlow returns a tensor)."""
        from psflow.framework.tensor import constant

        return constant(self._replica_id, dtype="int32")

    @property
    def devices(self) -> tuple[str, ...]:
        """The devices this replica computes on."""
        return self._strategy.extended.worker_devices[self._replica_id : self._replica_id + 1]

    def all_reduce(self, reduce_op: Any, value: Any, options: Any = None) -> Any:
        """Reduces ``value`` (a nest of tensors) across replicas; every replica gets the result."""
        ReduceOp.from_value(reduce_op)
        return value

    def all_gather(self, value: Any, axis: int, options: Any = None) -> Any:
        """Concatenates ``value`` from every replica along ``axis``."""
        return value

    def merge_call(
        self, merge_fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        """Runs ``merge_fn(strategy, *args)`` once in cross-replica context; every replica gets its result."""
        with _enter(_Context(self._strategy, None)):
            return merge_fn(self._strategy, *args, **(kwargs or {}))

    def __enter__(self) -> ReplicaContext:
        _stack().append(_Context(self._strategy, self))
        return self

    def __exit__(self, *exc: object) -> None:
        _stack().pop()


class _DefaultStrategy(Strategy):
    """The strategy in effect outside every scope: one replica, no distribution."""

    @contextlib.contextmanager
    def scope(self) -> Iterator[Strategy]:
        with _enter(_Context(self, None)):
            yield self

    def run(
        self,
        fn: Callable[..., Any],
        args: tuple = (),
        kwargs: dict | None = None,
        options: RunOptions | None = None,
    ) -> Any:
        return fn(*args, **(kwargs or {}))


_DEFAULT: list[_DefaultStrategy] = []
_default_lock = threading.Lock()


def _default_strategy() -> _DefaultStrategy:
    if not _DEFAULT:
        with _default_lock:
            if not _DEFAULT:
                _DEFAULT.append(_DefaultStrategy())
    return _DEFAULT[0]


class OneDeviceStrategy(Strategy):
    """All computation and variables on one device (TensorFlow's ``tf.distribute.OneDeviceStrategy``).

    Example:
        >>> import psflow as pf
        >>> s = pf.distribute.OneDeviceStrategy("/cpu:0")
        >>> s.num_replicas_in_sync
        1
    """

    def __init__(self, device: str) -> None:
        from psflow import backend

        super().__init__()
        self._device = backend.parse_device(device)

    @contextlib.contextmanager
    def scope(self) -> Iterator[Strategy]:
        from psflow import backend

        with super().scope(), backend.device(self._device):
            yield self

    def run(
        self,
        fn: Callable[..., Any],
        args: tuple = (),
        kwargs: dict | None = None,
        options: RunOptions | None = None,
    ) -> Any:
        from psflow import backend

        with backend.device(self._device):
            return super().run(fn, args, kwargs, options)

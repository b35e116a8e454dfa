"""The Keras optimizer classes: hyperparameters, step counter, slots, ``apply_gradients``.

Where the update happens depends on the variable: an in-process variable is
updated here with :mod:`psflow.update_rules`; a variable that belongs to an
update group (a parameter-server handle, a mirrored variable) is handed to its
group, which applies the very same rule where the value lives.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from psflow import backend, errors, update_rules
from psflow.distribute import distribute_lib
from psflow.distribute.protocols import GroupUpdated, ReplicatedVariable
from psflow.framework.indexed_slices import IndexedSlices
from psflow.framework.product_gradient import ProductGradient, multiplied_out
from psflow.framework.tensor import Tensor, to_array
from psflow.framework.variable import Variable
from psflow.keras.optimizers.learning_rate import LearningRate
from psflow.keras.optimizers.schedules import LearningRateSchedule
from psflow.ops import clip_ops, kernel_pool
from psflow.train.trackable import Kind, Trackable


class Optimizer(Trackable):
    """Base optimizer (Keras 3's ``keras.optimizers.Optimizer``).

    A checkpoint saves it as one value (``checkpoint_kind``): its step count,
    learning rate and the slots of the variables it updates.

    Args:
        learning_rate: a float or a :class:`LearningRateSchedule`.
        clipnorm: clip each gradient to this L2 norm.
        clipvalue: clip each gradient element into ``[-clipvalue, clipvalue]``.
        global_clipnorm: clip all gradients together to this global norm.
        name: the optimizer's name.
    """

    _rule_cls: type[update_rules.UpdateRule] | None = None
    checkpoint_kind = Kind.OPTIMIZER

    def __init__(
        self,
        learning_rate: Any = 0.001,
        name: str | None = None,
        clipnorm: float | None = None,
        clipvalue: float | None = None,
        global_clipnorm: float | None = None,
        **hyper: Any,
    ) -> None:
        self.name = name or type(self).__name__.lower()
        if sum(c is not None for c in (clipnorm, clipvalue, global_clipnorm)) > 1:
            raise errors.InvalidArgumentError(
                "Only one of clipnorm, clipvalue and global_clipnorm can be set, got "
                f"clipnorm={clipnorm}, clipvalue={clipvalue}, global_clipnorm={global_clipnorm}"
            )
        self.clipnorm, self.clipvalue, self.global_clipnorm = clipnorm, clipvalue, global_clipnorm
        self._learning_rate = self._check_lr(learning_rate)
        self._hyper = hyper
        self._iterations = 0
        self._slots: dict[tuple[int, int], dict[str, Any]] = {}
        self._slot_owner: dict[tuple[int, int], Any] = {}
        # restored slots waiting for their variable's first update: id -> (variable, values, done)
        self._pending_slots: dict[int, tuple[Any, dict[str, Any], Callable[[], None]]] = {}
        self._lock = threading.Lock()
        self._rule_cache: tuple[float, update_rules.UpdateRule] | None = None
        # id(slots) -> (array, rule) whose dense update passed the rule's checks
        self._checked: dict[int, tuple[Any, update_rules.UpdateRule]] = {}
        _ = self.rule  # validates the hyperparameters now, naming a bad one

    @staticmethod
    def _check_lr(lr: Any) -> Any:
        if isinstance(lr, LearningRateSchedule) or callable(lr):
            return lr
        try:
            value = float(lr)
        except (TypeError, ValueError):
            raise errors.InvalidArgumentError(
                f"learning_rate must be a number or a schedule, got {lr!r}"
            ) from None
        if value < 0:
            raise errors.InvalidArgumentError(f"learning_rate must be >= 0, got {lr!r}")
        return value

    # -- hyperparameters -------------------------------------------------------------
    @property
    def learning_rate(self) -> LearningRate:
        """The learning rate at the current step (a schedule is evaluated).

        A float that also has TensorFlow's ``numpy()`` and ``assign()``
        (:class:`~psflow.keras.optimizers.learning_rate.LearningRate`).
        """
        return LearningRate(self._current_lr(), self)

    @learning_rate.setter
    def learning_rate(self, value: Any) -> None:
        self._learning_rate = self._check_lr(value)

    lr = learning_rate

    @property
    def learning_rate_schedule(self) -> Any:
        """The learning rate as set: a float (a constant schedule) or a schedule of the step.

        Unlike :attr:`learning_rate` it is not evaluated: a copy of this
        optimizer given it and a step evaluates the rate at that step itself.
        """
        return self._learning_rate

    def _current_lr(self) -> float:
        lr = self._learning_rate
        if isinstance(lr, (int, float)):
            return float(lr)
        return float(lr(self._iterations))

    @property
    def iterations(self) -> Tensor:
        """How many updates were applied, an int64 scalar tensor."""
        return Tensor._wrap(np.asarray(self._iterations, dtype=np.int64))

    @iterations.setter
    def iterations(self, value: Any) -> None:
        self._iterations = int(value)

    @property
    def rule(self) -> update_rules.UpdateRule:
        """The update rule with the current learning rate."""
        lr = self._current_lr()
        cached = self._rule_cache
        if cached is not None and cached[0] == lr:
            return cached[1]
        if self._rule_cls is None:
            raise errors.UnimplementedError(f"{type(self).__name__} has no update rule")
        try:
            rule = self._rule_cls(learning_rate=lr, **self._hyper)
        except TypeError as e:
            raise errors.InvalidArgumentError(f"{type(self).__name__}: {e}") from None
        self._rule_cache = (lr, rule)
        return rule

    def get_config(self) -> dict[str, Any]:
        """Constructor arguments (a schedule is serialized by class name and config)."""
        lr = self._learning_rate
        if isinstance(lr, LearningRateSchedule):
            lr = {"class_name": type(lr).__name__, "config": lr.get_config()}
        return {
            "name": self.name,
            "learning_rate": lr,
            "clipnorm": self.clipnorm,
            "clipvalue": self.clipvalue,
            "global_clipnorm": self.global_clipnorm,
            **self._hyper,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Optimizer:
        """Rebuilds from :meth:`get_config`."""
        config = dict(config)
        lr = config.get("learning_rate")
        if isinstance(lr, dict):
            from psflow.keras.optimizers import schedules

            config["learning_rate"] = getattr(schedules, lr["class_name"]).from_config(lr["config"])
        return cls(**config)

    # -- state -----------------------------------------------------------------------
    def slot_arrays(self, var: Any, replica: int = 0, array: Any = None) -> dict[str, Any]:
        """The slot arrays of ``var``'s copy on ``replica`` (created on first use)."""
        key = (id(var), replica)
        slots = self._slots.get(key)
        restored = None
        if slots is None:
            with self._lock:
                slots = self._slots.get(key)
                if slots is None:
                    arr = var._array() if array is None else array
                    slots = self.rule.init_slots(arr)
                    self._slots[key] = slots
                    self._slot_owner[key] = var
                    pending = self._pending_slots.get(id(var))
                    if pending is not None and pending[0] is var:  # restored before they existed
                        _copy_slots(slots, pending[1])
                        restored = pending[2]
                        copies = len(var.values) if isinstance(var, ReplicatedVariable) else 1
                        if sum(k[0] == id(var) for k in self._slots) >= copies:
                            del self._pending_slots[id(var)]
        if restored is not None:  # outside the lock: the restore takes its own
            restored()
        return slots

    def _restore_slots(
        self, var: Any, saved: dict[str, np.ndarray], restored: Callable[[], None]
    ) -> None:
        """Gives ``var``'s slots (every replica's) the values ``saved`` by slot name:
        at once where they exist, else when they are created; calls ``restored`` then."""
        with self._lock:
            found = [slots for key, slots in self._slots.items() if self._slot_owner[key] is var]
            for slots in found:
                _copy_slots(slots, saved)
            if found:
                self._pending_slots.pop(id(var), None)
            else:
                self._pending_slots[id(var)] = (var, saved, restored)
        if found:
            restored()

    def _slots_for_checkpoint(self) -> list[tuple[Any, dict[str, np.ndarray]]]:
        """``(variable, {slot: host array})`` per variable with slots here; one copy of a
        replicated variable's (every replica applies the same updates)."""
        out = []
        with self._lock:
            for key, slots in self._slots.items():
                if key[1] == 0:
                    out.append(
                        (self._slot_owner[key], {n: backend.to_numpy(a) for n, a in slots.items()})
                    )
        return out

    def build(self, var_list: Iterable[Any]) -> None:
        """Creates the slots of in-process variables now rather than at the first update."""
        for v in var_list:
            if not isinstance(v, GroupUpdated):  # a group keeps its variables' slots
                self.slot_arrays(v)

    @property
    def variables(self) -> list[Any]:
        """Slot arrays wrapped as tensors, in creation order (for inspection and checkpoints)."""
        out = []
        for slots in self._slots.values():
            out.extend(Tensor._wrap(a) for a in slots.values())
        return out

    # -- applying --------------------------------------------------------------------
    def _clip(self, grads: list[Any]) -> list[Any]:
        if self.global_clipnorm is not None:
            grads, _ = clip_ops.clip_by_global_norm(grads, self.global_clipnorm)
            return grads
        if self.clipnorm is not None:
            return [
                None if g is None else clip_ops.clip_by_global_norm([g], self.clipnorm)[0][0]
                for g in grads
            ]
        if self.clipvalue is not None:
            c = self.clipvalue
            return [
                None
                if g is None
                else IndexedSlices._raw(
                    backend.xp_of(g._values).clip(g._values, -c, c), g._indices, g._dense_shape
                )
                if isinstance(g, IndexedSlices)
                else clip_ops.clip_by_value(g, -c, c)
                for g in grads
            ]
        return grads

    def apply_gradients(
        self,
        grads_and_vars: Iterable[tuple[Any, Any]],
        name: str | None = None,
        skip_gradients_aggregation: bool = False,
        **kwargs: Any,
    ) -> Tensor:
        """Applies ``(gradient, variable)`` pairs; returns the new step count.

        Inside ``strategy.run`` with several replicas, gradients are first
        summed across replicas (all-reduce), then every replica's copy gets
        the same update (TensorFlow's rule; scale losses by the global batch).

        Raises:
            InvalidArgumentError: a gradient whose shape differs from its variable's.
        """
        all_pairs = list(grads_and_vars)
        deferred = False
        for g, v in all_pairs:
            if g is None:
                continue
            if isinstance(g, IndexedSlices):
                gshape = g._dense_shape
            elif type(g) is ProductGradient:
                gshape, deferred = g.shape, True
            else:
                gshape = to_array(g).shape
            if tuple(gshape) != _shape_of(v):
                raise errors.InvalidArgumentError(
                    f"Gradient of shape {list(gshape)} does not match variable {v.name} of shape "
                    f"{list(v.shape)}"
                )
        ctx = distribute_lib.get_replica_context()
        if deferred and not self._takes_product_gradients([v for _, v in all_pairs]):
            all_pairs = [(multiplied_out(g), v) for g, v in all_pairs]  # none goes further
        if not (ctx is not None and ctx.num_replicas_in_sync > 1 and distribute_lib.has_strategy()):
            pairs = [(g, v) for g, v in all_pairs if g is not None]
            if pairs:
                grads = self._clip([g for g, _ in pairs])
                extended = distribute_lib.get_strategy().extended
                extended.prepare_optimizer(self)
                step = self._iterations + 1
                # the large dense updates wait, and then run together on the kernel threads
                batch = _ChunkedUpdates()
                _collecting.batch = batch
                try:
                    updated = extended.apply_update(
                        self, step, list(zip(grads, [v for _, v in pairs]))
                    )
                finally:  # the local updates land even where a group's update failed
                    _collecting.batch = None
                    batch.run()
                if updated:
                    self._iterations = step
            return self.iterations
        # Several replicas: each keeps its None gradients in place, so that all of them
        # reduce (or merge) the same list; a variable is skipped only when no replica has
        # a gradient for it, which the collective agrees on (as one device skips a None).
        grads = self._clip_present([g for g, _ in all_pairs])
        variables = [v for _, v in all_pairs]
        if not variables:
            return self.iterations
        aggregate = not (
            skip_gradients_aggregation or kwargs.get("experimental_aggregate_gradients") is False
        )
        # Read before the strategy's collectives: no replica can update the count until
        # every replica has arrived there, so all of them apply the same step.
        ctx.strategy.extended.prepare_optimizer(self)
        step = self._iterations + 1
        if ctx.strategy.extended.apply_update(
            self, step, list(zip(grads, variables)), aggregate=aggregate
        ):
            self._iterations = step
        return self.iterations

    def _takes_product_gradients(self, variables: Sequence[Any]) -> bool:
        """Whether :meth:`apply_gradients` may be handed :class:`ProductGradient` s (a weight's
        gradient as its two factors) for ``variables``, to multiply out as it updates.

        True for this class's own apply with no clipping (which needs whole gradients)
        and an elementwise rule, where the update is local (no strategy, every variable
        in this process) or the strategy's own update takes them
        (``StrategyExtended._takes_product_gradients``: MirroredStrategy's fused
        reduce-and-update). ``Model.train_step`` then asks its tape for them
        (:meth:`GradientTape._gradient_for_update`). A subclass that replaces
        ``apply_gradients`` or ``_apply_local`` gets arrays.
        """
        cls = type(self)
        if not (
            cls.apply_gradients is Optimizer.apply_gradients
            and cls._apply_local is Optimizer._apply_local
            and self.clipnorm is None
            and self.clipvalue is None
            and self.global_clipnorm is None
            and type(self.rule) in _ELEMENTWISE_RULES
        ):
            return False
        if not distribute_lib.has_strategy():
            return all(type(v) is Variable for v in variables)
        return distribute_lib.get_strategy().extended._takes_product_gradients(variables)

    def _clip_present(self, grads: list[Any]) -> list[Any]:
        """Clips the gradients that are not ``None``, keeping the ``None`` ones in place."""
        present = [g for g in grads if g is not None]
        if not present:
            return list(grads)
        clipped = iter(self._clip(present))
        return [None if g is None else next(clipped) for g in grads]

    def _apply_local(
        self, var: Any, grad: Any, step: int, replica: int = 0, array: Any = None
    ) -> None:
        """Updates one in-process array with the rule (``array`` defaults to the variable's)."""
        arr = var._array() if array is None else array
        slots = self.slot_arrays(var, replica, arr)
        rule = self.rule
        if type(grad) is ProductGradient:
            batch = _collecting.batch
            if batch is not None and batch.add_product(
                rule, arr, grad, slots, step, var.constraint
            ):
                return  # multiplied out and applied chunk by chunk with the batch
            grad = grad.dense_array()
        if isinstance(grad, IndexedSlices):
            values = grad._values
            if values.dtype != arr.dtype:
                values = values.astype(arr.dtype)
            rule.apply_sparse(arr, grad._indices, values, slots, step)
        else:
            g = to_array(grad)
            if g.dtype != arr.dtype:
                g = g.astype(arr.dtype)
            batch = _collecting.batch
            if batch is not None and batch.add(rule, arr, g, slots, step, var.constraint):
                return  # applied (and constrained) with the batch's other large updates
            checked = self._checked.get(id(slots))
            if (
                checked is not None
                and checked[0] is arr
                and checked[1] is rule
                and g.shape == arr.shape
                and type(step) is int
                and step >= 1
            ):
                # this array, its slots and this rule passed the rule's checks at an earlier
                # step (a step's small updates: the checks cost more than the arithmetic)
                rule._update(arr, g, slots, step)
            else:
                rule.apply_dense(arr, g, slots, step)
                self._checked[id(slots)] = (arr, rule)
        _constrain(var.constraint, arr)

    def apply(self, grads: list[Any], trainable_variables: list[Any] | None = None) -> Tensor:
        """Keras 3's form: gradients and variables as two lists."""
        if trainable_variables is None:
            raise errors.InvalidArgumentError("apply needs trainable_variables")
        return self.apply_gradients(zip(grads, trainable_variables))

    def minimize(self, loss: Any, var_list: Any, tape: Any = None) -> Tensor:
        """Computes gradients of ``loss`` (a tensor with ``tape``, or a callable) and applies them."""
        from psflow.framework.tape import GradientTape

        if callable(var_list):
            var_list = var_list()
        if tape is None:
            if not callable(loss):
                raise errors.InvalidArgumentError("minimize needs a tape when loss is a tensor")
            with GradientTape() as tape:
                loss = loss()
        var_list = list(var_list)
        if self._takes_product_gradients(var_list):  # the gradients go nowhere but here
            grads = tape._gradient_for_update(loss, var_list)
        else:
            grads = tape.gradient(loss, var_list)
        return self.apply_gradients(zip(grads, var_list))

    def __getstate__(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d.pop("_lock", None)
        d["_slots"] = {}
        d["_slot_owner"] = {}
        d["_pending_slots"] = {}
        d["_rule_cache"] = None
        d["_checked"] = {}
        return d

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__dict__.update(d)
        self._lock = threading.Lock()


_ELEMENTWISE_RULES = (
    update_rules.SGD,
    update_rules.Adam,
    update_rules.Adagrad,
    update_rules.RMSprop,
)
"""Rules whose dense update computes each element from the same element of the variable,
the gradient and the slots, with correctly rounded operations only (``+ - * /``, square
root): applied slice by slice they give the bits they give on the whole array."""

CHUNKED_UPDATE_MIN_BYTES = 1 << 20
"""The smallest variable whose update joins the chunked batch: below it the update takes
tens of microseconds, no more than handing chunks to another thread."""

CHUNKED_UPDATE_CHUNK_BYTES = 2 << 20
"""Bytes of variable, gradient and slots a chunk of an update covers: each chunk costs
tens of microseconds of hand-off and GIL traffic between threads on a virtual machine,
so a chunk holds a few hundred microseconds of work. At 512 kB the 784-512-512-10 MLP's
SGD update took 641 us on 2 threads against 328 on one (chunks of 64k elements, the
compiled loop: ~17 us of work each); at 2 MB 327 against 323, and Adam's 1268 against
1809 (median of 6 rounds of 100, one process, an Intel Xeon VM with 2 cores)."""


class _Collecting(threading.local):
    """Per thread: the batch that large dense updates join during a local apply, or None."""

    def __init__(self) -> None:
        self.batch: _ChunkedUpdates | None = None


_collecting = _Collecting()


def _constrain(constraint: Any, arr: Any) -> None:
    if constraint is not None:
        projected = to_array(constraint(Tensor._wrap(arr)))
        backend.xp_of(arr).copyto(arr, projected)


class _ChunkedUpdates:
    """The large dense updates of one ``apply_gradients``, run together in chunks.

    An update is elementwise and memory-bound: one thread streams the variable,
    the gradient and the slots through memory, with a temporary as large as the
    variable per operation. Cut into chunks, the temporaries stay in cache, and
    the chunks of every variable run in one pass over the kernel threads
    (:func:`psflow.ops.kernel_pool.run_chunks`: one hand-off per step, not one
    per variable). Each chunk is ``rule.apply_dense`` on slices, so the bits are
    those of the rule on the whole array (elementwise rules only), and the
    variables are independent, so their order does not matter. The rule's checks run
    once per variable (:meth:`add`), its formula once per chunk.

    A gradient kept as its two factors (:meth:`add_product`) is multiplied out chunk by
    chunk of the weight's rows, each chunk's rows by the thread that then updates them.
    """

    def __init__(self) -> None:
        # (rule, flat arrays, slot names, step, lo, hi, product rows or None)
        self._tasks: list[tuple[Any, tuple[Any, ...], tuple[str, ...], int, int, int, Any]] = []
        self._constraints: list[tuple[Any, Any]] = []
        self._taken: set[int] = set()  # ids of the variables' arrays taken

    def add(
        self,
        rule: update_rules.UpdateRule,
        arr: Any,
        grad: Any,
        slots: dict[str, Any],
        step: int,
        constraint: Any,
    ) -> bool:
        """Takes the update of ``arr`` (then its constraint) into the batch; False where it
        does not apply (another rule or array type, a small or non-contiguous variable, one
        kernel thread): the caller then applies the rule to the whole array itself."""
        arrays = (arr, grad, *slots.values())
        if kernel_pool.width() < 2 or not _chunkable(rule, arrays):
            return False
        self._take(rule, arr, slots, step, constraint)
        flat = tuple(a.reshape(-1) for a in arrays)  # views: contiguous arrays reshape in place
        names = tuple(slots)
        per_item = sum(a.itemsize for a in arrays)
        for lo, hi in kernel_pool.chunk_bounds(arr.size, per_item, CHUNKED_UPDATE_CHUNK_BYTES):
            self._tasks.append((rule, flat, names, step, lo, hi, None))
        return True

    def add_product(
        self,
        rule: update_rules.UpdateRule,
        arr: Any,
        grad: ProductGradient,
        slots: dict[str, Any],
        step: int,
        constraint: Any,
    ) -> bool:
        """Takes the update of ``arr`` by a gradient kept as its factors: each chunk of
        ``arr``'s rows gets its rows of the product (one single-threaded BLAS call) and
        the rule at once, while they are in cache. False where it does not apply (another
        rule or array type, a small or non-contiguous variable, factors of another dtype):
        the caller then multiplies the gradient out and applies it as any other.

        Unlike :meth:`add`, one kernel thread is enough: the gain is the passes over
        memory that the chunks save, not the threads."""
        left, right = grad.left, grad.right
        if not (
            _chunkable(rule, (arr, *slots.values()))
            and type(left) is np.ndarray
            and type(right) is np.ndarray
            and left.dtype == arr.dtype == right.dtype
            and grad.shape == arr.shape
        ):
            return False
        self._take(rule, arr, slots, step, constraint)
        flat = (arr.reshape(-1), None, *(a.reshape(-1) for a in slots.values()))
        names = tuple(slots)
        m, n = arr.shape
        for lo, hi in kernel_pool.row_chunks(m, left.shape[0], n):
            self._tasks.append((rule, flat, names, step, lo * n, hi * n, (grad, lo, hi)))
        return True

    def _take(
        self,
        rule: update_rules.UpdateRule,
        arr: Any,
        slots: dict[str, Any],
        step: int,
        constraint: Any,
    ) -> None:
        """Enters ``arr``'s update (and its constraint) into the batch, its checks done."""
        # checked once here, so that each chunk runs the rule's formula alone (the chunks
        # are slices of arrays of one shape and dtype: nothing a chunk could find wrong)
        rule._check_slots(arr, slots, step)
        if id(arr) in self._taken:  # the same variable twice: its first update lands first
            self.run()
        self._taken.add(id(arr))
        if constraint is not None:
            self._constraints.append((constraint, arr))

    def run(self) -> None:
        """Applies every update taken, then their constraints (in the order taken); empties
        the batch."""
        tasks, constraints = self._tasks, self._constraints
        self._tasks, self._constraints, self._taken = [], [], set()
        if not tasks:
            return

        def chunk(i: int, _: int) -> None:
            rule, flat, names, step, lo, hi, rows = tasks[i]
            part = {n: f[lo:hi] for n, f in zip(names, flat[2:])}
            if rows is None:
                g = flat[1][lo:hi]
            else:
                product, r0, r1 = rows
                g = product.rows(r0, r1).reshape(-1)
            rule._update(flat[0][lo:hi], g, part, step)

        bounds = [(i, i + 1) for i in range(len(tasks))]
        if any(t[6] is not None for t in tasks):  # BLAS calls: held to one thread meanwhile
            kernel_pool.run_gemm_chunks(chunk, bounds)
        else:
            kernel_pool.run_chunks(chunk, bounds)
        for constraint, arr in constraints:
            _constrain(constraint, arr)


def _chunkable(rule: update_rules.UpdateRule, arrays: tuple[Any, ...]) -> bool:
    """Whether an update of ``arrays[0]`` with the rest (its gradient, its slots) can run in
    chunks: an elementwise rule, a large NumPy variable, and every array C-contiguous of its
    shape and dtype (else the whole-array path checks, and names, what is wrong)."""
    arr = arrays[0]
    if (
        type(rule) not in _ELEMENTWISE_RULES
        or type(arr) is not np.ndarray
        or arr.nbytes < CHUNKED_UPDATE_MIN_BYTES
    ):
        return False
    return all(
        type(a) is np.ndarray
        and a.shape == arr.shape
        and a.dtype == arr.dtype
        and a.flags.c_contiguous
        for a in arrays
    )


def _copy_slots(slots: dict[str, Any], saved: dict[str, np.ndarray]) -> None:
    """Copies saved slot values into live slot arrays of the same name and shape."""
    for name, value in saved.items():
        target = slots.get(name)
        if target is not None and tuple(target.shape) == tuple(value.shape):
            backend.xp_of(target).copyto(target, backend.place(value, backend.device_of(target)))


def _shape_of(variable: Any) -> tuple[int, ...]:
    """A variable's shape as a plain tuple (no TensorShape for the common kinds)."""
    if type(variable) is Variable:
        return variable._value.shape
    if isinstance(variable, ReplicatedVariable):  # every copy has the shape
        return variable.values[0]._value.shape
    return tuple(variable.shape)


class SGD(Optimizer):
    """Gradient descent with optional (Nesterov) momentum; Keras's defaults (lr 0.01)."""

    _rule_cls = update_rules.SGD

    def __init__(
        self,
        learning_rate: Any = 0.01,
        momentum: float = 0.0,
        nesterov: bool = False,
        name: str = "SGD",
        **kwargs: Any,
    ) -> None:
        super().__init__(learning_rate, name, momentum=momentum, nesterov=nesterov, **kwargs)


class Adam(Optimizer):
    """Adam; Keras's defaults (lr 0.001, beta_1 0.9, beta_2 0.999, epsilon 1e-7)."""

    _rule_cls = update_rules.Adam

    def __init__(
        self,
        learning_rate: Any = 0.001,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        amsgrad: bool = False,
        name: str = "adam",
        **kwargs: Any,
    ) -> None:
        super().__init__(
            learning_rate,
            name,
            beta_1=beta_1,
            beta_2=beta_2,
            epsilon=epsilon,
            amsgrad=amsgrad,
            **kwargs,
        )


class Adagrad(Optimizer):
    """Adagrad; Keras's defaults (lr 0.001, initial accumulator 0.1, epsilon 1e-7)."""

    _rule_cls = update_rules.Adagrad

    def __init__(
        self,
        learning_rate: Any = 0.001,
        initial_accumulator_value: float = 0.1,
        epsilon: float = 1e-7,
        name: str = "adagrad",
        **kwargs: Any,
    ) -> None:
        super().__init__(
            learning_rate,
            name,
            initial_accumulator_value=initial_accumulator_value,
            epsilon=epsilon,
            **kwargs,
        )


class RMSprop(Optimizer):
    """RMSprop; Keras's defaults (lr 0.001, rho 0.9, momentum 0, epsilon 1e-7)."""

    _rule_cls = update_rules.RMSprop

    def __init__(
        self,
        learning_rate: Any = 0.001,
        rho: float = 0.9,
        momentum: float = 0.0,
        epsilon: float = 1e-7,
        centered: bool = False,
        name: str = "rmsprop",
        **kwargs: Any,
    ) -> None:
        super().__init__(
            learning_rate,
            name,
            rho=rho,
            momentum=momentum,
            epsilon=epsilon,
            centered=centered,
            **kwargs,
        )


_BY_NAME: dict[str, type[Optimizer]] = {
    "sgd": SGD,
    "adam": Adam,
    "adagrad": Adagrad,
    "rmsprop": RMSprop,
}


def get(identifier: Any) -> Optimizer:
    """An optimizer from a name (``"sgd"``, ``"adam"``...), an instance, or a config dict.

    Raises:
        ValueError: an unknown name, quoted with the known ones.
    """
    if isinstance(identifier, Optimizer):
        return identifier
    if isinstance(identifier, str):
        cls = _BY_NAME.get(identifier.lower())
        if cls is None:
            raise errors.InvalidArgumentError(
                f"Unknown optimizer {identifier!r}; known: {sorted(_BY_NAME)}"
            )
        return cls()
    if isinstance(identifier, dict):
        return deserialize(identifier)
    raise TypeError(f"Could not interpret optimizer {identifier!r}")


def serialize(optimizer: Optimizer) -> dict[str, Any]:
    """An optimizer's class name and config."""
    return {"class_name": type(optimizer).__name__, "config": optimizer.get_config()}


def deserialize(config: dict[str, Any]) -> Optimizer:
    """Rebuilds an optimizer from :func:`serialize`'s output."""
    name = config.get("class_name", "")
    cls = _BY_NAME.get(str(name).lower())
    if cls is None:
        raise errors.InvalidArgumentError(f"Unknown optimizer class {name!r}")
    return cls.from_config(config.get("config", {}))

"""Reverse-mode automatic differentiation: ``psflow.GradientTape``.

Ops hand every recording tape of the current thread their inputs, their
output and a backward function (one vector-Jacobian product per op; see
``psflow.ops._core.out``). A tape that watches one of the inputs keeps the
record; ``gradient`` replays the records backwards from the target.

Backward functions have the signature ``backward(upstream, needs)``, where
``upstream`` is the gradient array of the op's output and ``needs`` a tuple of
booleans saying which inputs want a gradient (so a matmul skips the product it
does not need). They return one entry per input: an array, an
:class:`IndexedSlices` for sparse row gradients, or ``None`` (and, while
:meth:`GradientTape._gradient_for_update` runs, a matrix weight's gradient may be
a :class:`~psflow.framework.product_gradient.ProductGradient`: see
:func:`products_deferred`).

Example:
    >>> import psflow as pf
    >>> x = pf.Variable(3.0)
    >>> with pf.GradientTape() as tape:
    ...     y = x * x
    >>> float(tape.gradient(y, x))
    6.0
"""

from __future__ import annotations

import contextlib
import enum
import threading
from collections.abc import Callable, Iterator
from typing import Any

from psflow import backend, errors, memory
from psflow.framework.indexed_slices import IndexedSlices
from psflow.framework.product_gradient import ProductGradient
from psflow.framework.tensor import Tensor, to_array
from psflow.framework.variable import Variable
from psflow.util import nest


class _TapeStack(threading.local):
    """Per thread: the tapes recording there, innermost last."""

    def __init__(self) -> None:
        # made on a thread's first access, so an op never pays for a missing attribute
        self.tapes: list[GradientTape] = []
        # the tape whose GradientTape._gradient_for_update runs now, if any
        self.deferring: GradientTape | None = None


_local = _TapeStack()

Backward = Callable[[Any, tuple[bool, ...]], tuple[Any, ...]]


class UnconnectedGradients(enum.Enum):
    """What ``gradient`` returns for a source the target does not depend on."""

    NONE = "none"
    ZERO = "zero"


def _tapes() -> list[GradientTape]:
    return _local.tapes


def products_deferred() -> bool:
    """Whether a backward function running now may return a matrix weight's gradient as a
    :class:`ProductGradient` (its two factors) instead of their product: only inside
    :meth:`GradientTape._gradient_for_update`, whose caller's optimizer takes them."""
    return _local.deferring is not None


def _dense(g: Any) -> Any:
    """A sparse or deferred gradient as a dense array (any other one as it is)."""
    if isinstance(g, IndexedSlices) or type(g) is ProductGradient:
        return g.dense_array()
    return g


def _is_float(node: Any) -> bool:
    if getattr(node, "_is_variable", False):
        return node.dtype.is_floating  # no read: a variable may live on a parameter server
    return node._array().dtype.kind == "f"


def _auto_watched(variable: Any) -> bool:
    """Whether a tape watches ``variable`` on first read: trainable and floating point."""
    if type(variable) is Variable:
        return variable._trainable and variable._value.dtype.kind == "f"
    copies = getattr(variable, "_copies", None)  # a mirrored variable: as its copies
    if copies is not None:
        return variable._trainable and copies[0]._value.dtype.kind == "f"
    return variable.trainable and _is_float(variable)


def _accumulate(a: Any, b: Any) -> Any:
    if a is None:
        return b
    if isinstance(a, IndexedSlices) and isinstance(b, IndexedSlices):
        xp = backend.xp_of(a._values)
        return IndexedSlices._raw(
            xp.concatenate([a._values, b._values]),
            xp.concatenate([a._indices, b._indices]),
            a._dense_shape,
        )
    return _dense(a) + _dense(b)


def _is_node(x: Any) -> bool:
    """Whether ``x`` is a tensor or a variable (anything an op records)."""
    return type(x) is Tensor or type(x) is Variable or getattr(x, "_is_variable", None) is not None


def _flatten_nodes(x: Any, what: str = "") -> list[Any]:
    """``nest.flatten`` with fast paths for a node and a flat list or tuple of nodes.

    Raises:
        InvalidArgumentError: with ``what`` set, a flattened entry that is not a
            tensor or variable (named, with ``what`` saying which argument).
    """
    if _is_node(x):
        return [x]
    if type(x) in (list, tuple):
        for e in x:
            if not (type(e) is Tensor or type(e) is Variable or _is_node(e)):
                break
        else:
            return list(x)
    flat = nest.flatten(x)
    if what:
        for e in flat:
            if not _is_node(e):
                raise errors.InvalidArgumentError(
                    f"gradient {what} must be tensors or variables, got {type(e).__name__}: {e!r}"
                )
    return flat


class GradientTape:
    """Records ops for automatic differentiation (TensorFlow's ``tf.GradientTape``).

    Args:
        persistent: allow several ``gradient`` calls on this tape.
        watch_accessed_variables: watch every trainable variable an op reads.

    Example:
        >>> import psflow as pf
        >>> w = pf.Variable([[1.0], [2.0]])
        >>> x = pf.constant([[3.0, 4.0]])
        >>> with pf.GradientTape() as tape:
        ...     loss = pf.reduce_sum(pf.matmul(x, w))
        >>> tape.gradient(loss, w).numpy().ravel().tolist()
        [3.0, 4.0]
    """

    def __init__(self, persistent: bool = False, watch_accessed_variables: bool = True) -> None:
        self._persistent = persistent
        self._watch_accessed = watch_accessed_variables
        self._recording = False
        self._used = False
        self._watched: dict[int, Any] = {}  # every watched node: roots and recorded outputs
        self._roots: dict[int, Any] = {}  # the watched nodes that no recorded op produced
        self._late_watch = False  # watch() after the first record: needs are not final
        self._variables: dict[int, Any] = {}
        # (input ids, output id, inputs, output, backward, which inputs were watched)
        self._ops: list[tuple[tuple[int, ...], int, tuple[Any, ...], Any, Backward, tuple]] = []

    def __enter__(self) -> GradientTape:
        memory.ensure_tuned()  # training has started: reuse freed pages (see psflow.memory)
        self._recording = True
        _tapes().append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._recording = False
        tapes = _tapes()
        if self in tapes:
            tapes.remove(self)

    # -- what to watch ---------------------------------------------------------------
    def watch(self, tensor: Any) -> None:
        """Watches a tensor or variable (or a nest of them) so gradients reach it."""
        for t in nest.flatten(tensor):
            if not isinstance(t, (Tensor, Variable)):
                raise errors.InvalidArgumentError(
                    f"GradientTape.watch takes tensors or variables, got {type(t).__name__}: {t!r}"
                )
            if _is_float(t):
                self._watched[id(t)] = t
                self._roots[id(t)] = t
                self._late_watch = self._late_watch or bool(self._ops)
                if isinstance(t, Variable):
                    self._variables[id(t)] = t

    def watched_variables(self) -> tuple[Any, ...]:
        """The variables this tape watched, in the order it first saw them."""
        return tuple(self._variables.values())

    @contextlib.contextmanager
    def stop_recording(self) -> Iterator[None]:
        """Pauses recording inside the ``with`` block."""
        prev = self._recording
        self._recording = False
        try:
            yield
        finally:
            self._recording = prev

    def reset(self) -> None:
        """Forgets everything recorded so far."""
        self._watched.clear()
        self._roots.clear()
        self._late_watch = False
        self._variables.clear()
        self._ops.clear()
        self._used = False

    def _record(self, inputs: tuple[Any, ...], output: Any, backward: Backward) -> None:
        # The hot path of every op under a tape: one and two inputs are unrolled.
        watched = self._watched
        n = len(inputs)
        if n == 2:
            x, y = inputs
            ids = (id(x), id(y))
            needs = (
                ids[0] in watched or (x._is_variable and self._watch_first_read(ids[0], x)),
                ids[1] in watched or (y._is_variable and self._watch_first_read(ids[1], y)),
            )
        elif n == 1:
            x = inputs[0]
            ids = (id(x),)
            needs = (ids[0] in watched or (x._is_variable and self._watch_first_read(ids[0], x)),)
        else:
            ids = tuple([id(x) for x in inputs])
            needs = tuple(
                [
                    key in watched or (x._is_variable and self._watch_first_read(key, x))
                    for key, x in zip(ids, inputs)
                ]
            )
        if True in needs and output._value.dtype.kind == "f":
            out_id = id(output)
            watched[out_id] = output
            # the ids are computed once here; the record keeps the objects alive so
            # their ids stay unique while the tape holds it
            self._ops.append((ids, out_id, inputs, output, backward, needs))

    def _watch_first_read(self, key: int, variable: Any) -> bool:
        """Watches a variable an op reads for the first time, when this tape does that."""
        if self._watch_accessed and _auto_watched(variable):
            self._watched[key] = self._roots[key] = self._variables[key] = variable
            return True
        return False

    # -- differentiation -------------------------------------------------------------
    def gradient(
        self,
        target: Any,
        sources: Any,
        output_gradients: Any = None,
        unconnected_gradients: UnconnectedGradients | str = UnconnectedGradients.NONE,
    ) -> Any:
        """Gradients of ``target`` (summed over a nest of targets) w.r.t. ``sources``.

        Returns the structure of ``sources``: arrays as tensors, sparse row
        gradients as :class:`IndexedSlices`, ``None`` (or zeros) where unconnected.

        Raises:
            RuntimeError: a non-persistent tape is asked a second time.
            InvalidArgumentError: a source is not a tensor or variable.
        """
        if self._used and not self._persistent:
            raise RuntimeError(
                "A non-persistent GradientTape can only be used to compute one set of gradients"
                " (or jacobians); create it with persistent=True to call gradient() again"
            )
        self._used = True
        if unconnected_gradients is not UnconnectedGradients.NONE:
            unconnected_gradients = UnconnectedGradients(
                unconnected_gradients.value
                if isinstance(unconnected_gradients, UnconnectedGradients)
                else str(unconnected_gradients).lower()
            )
        flat_sources = _flatten_nodes(sources, "sources")
        flat_targets = _flatten_nodes(target)
        flat_upstream = (
            _flatten_nodes(output_gradients)
            if output_gradients is not None
            else [None] * len(flat_targets)
        )
        if len(flat_upstream) != len(flat_targets):
            raise errors.InvalidArgumentError(
                f"output_gradients has {len(flat_upstream)} entries for {len(flat_targets)} targets"
            )
        grads: dict[int, Any] = {}
        for t, up in zip(flat_targets, flat_upstream):
            if not _is_node(t) or id(t) not in self._watched:
                continue
            arr = t._array()
            xp = backend.xp_of(arr)
            if up is None:
                g = xp.ones(arr.shape, arr.dtype)
            else:
                g = xp.asarray(to_array(up), dtype=arr.dtype)
            grads[id(t)] = _accumulate(grads.get(id(t)), g)

        watched = self._watched
        keep = {id(s) for s in flat_sources}
        # Only tensors that depend on a requested source need gradients. When every
        # watched root is requested that is every recorded op, with the needs noted at
        # record time; otherwise one forward sweep finds them, so backward functions
        # skip the products nobody asked for.
        relevant: Any = None
        if self._late_watch or not keep.issuperset(self._roots):
            relevant = {k for k in keep if k in watched}
            for in_ids, out_id, _, _, _, _ in self._ops:
                if not relevant.isdisjoint(in_ids):
                    relevant.add(out_id)
        recording, self._recording = self._recording, False
        try:
            for in_ids, key, _, _, backward, needs in reversed(self._ops):
                if relevant is not None:
                    if key not in relevant:
                        continue
                    needs = tuple([k in relevant for k in in_ids])
                g = grads.get(key) if key in keep else grads.pop(key, None)
                if g is None:
                    continue
                g = _dense(g)
                if len(in_ids) == 1:  # unrolled: most ops have one input
                    gx = backward(g, needs)[0]
                    if gx is not None and needs[0]:
                        k = in_ids[0]
                        grads[k] = gx if k not in grads else _accumulate(grads[k], gx)
                    continue
                for k, gx, need in zip(in_ids, backward(g, needs), needs):
                    if need and gx is not None:
                        grads[k] = gx if k not in grads else _accumulate(grads[k], gx)
        finally:
            self._recording = recording

        results = []
        for s in flat_sources:
            g = grads.get(id(s))
            if g is None:
                if unconnected_gradients is UnconnectedGradients.ZERO:
                    arr = s._array()
                    results.append(Tensor._wrap(backend.xp_of(arr).zeros_like(arr)))
                else:
                    results.append(None)
            elif isinstance(g, IndexedSlices):
                results.append(g)
            elif type(g) is ProductGradient:  # only _gradient_for_update's own call gets one
                results.append(g if _local.deferring is self else Tensor._wrap(g.dense_array()))
            else:
                results.append(Tensor._wrap(g))
        if not self._persistent:
            self._ops = []
        if type(sources) is list:
            return results
        if type(sources) is tuple:
            return tuple(results)
        return nest.pack_sequence_as(sources, results)

    def _gradient_for_update(self, target: Any, sources: Any) -> list[Any]:
        """:meth:`gradient` of ``target`` w.r.t. the list ``sources``, for an optimizer that takes
        a :class:`ProductGradient`: a dense layer's (or a 2-D ``matmul``'s) weight gradient
        may come back as its two factors, for the optimizer to multiply out as it updates
        the weight (``Model.train_step`` calls this when its optimizer says it can)."""
        before, _local.deferring = _local.deferring, self
        try:
            return self.gradient(target, sources)
        finally:
            _local.deferring = before

    def jacobian(self, target: Any, sources: Any) -> Any:
        """Jacobian of every element of ``target`` w.r.t. ``sources`` (a slow, exact loop).

        Needs ``persistent=True`` when called more than once; the result for a
        source has shape ``target.shape + source.shape``.
        """
        t_arr = target._array()
        xp = backend.xp_of(t_arr)
        flat_sources = nest.flatten(sources)
        rows: list[list[Any]] = [[] for _ in flat_sources]
        persistent, self._persistent = self._persistent, True
        try:
            for i in range(t_arr.size):
                up = xp.zeros(t_arr.size, dtype=t_arr.dtype)
                up[i] = 1
                gs = self.gradient(target, flat_sources, output_gradients=up.reshape(t_arr.shape))
                for k, (s, g) in enumerate(zip(flat_sources, gs)):
                    if g is None:
                        g_arr = xp.zeros_like(s._array())
                    elif isinstance(g, IndexedSlices):
                        g_arr = g.dense_array()
                    else:
                        g_arr = g._array()
                    rows[k].append(g_arr)
        finally:
            self._persistent = persistent
        out = [
            Tensor._wrap(xp.stack(r).reshape(t_arr.shape + s._array().shape))
            if r
            else Tensor._wrap(xp.zeros(t_arr.shape + s._array().shape, t_arr.dtype))
            for r, s in zip(rows, flat_sources)
        ]
        return nest.pack_sequence_as(sources, out)

"""Transformations that call user functions: ``map``, ``filter``, ``flat_map``, ``reduce``.

User functions receive the element as psflow tensors, unpacked like
TensorFlow's: a tuple element is passed as positional arguments, anything else
(one tensor, a dict, a named tuple) as one argument. They run with CPU:0 as
the current device, as tf.data functions run on the host.

TensorFlow learns a ``map`` function's output structure by tracing it. psflow
takes it from the function's first real output while iterating, and checks
every later output against it; ``element_spec`` asked before that calls the
function on two placeholder elements (all ones with unknown dimensions 1
long, then all twos with unknown dimensions 2 long) and marks the output
dimensions that differ as unknown. A function that rejects the placeholders
gets one real element instead.
"""

from __future__ import annotations

import collections
import logging
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from psflow import backend, dtypes, errors
from psflow.data import structure
from psflow.data.dataset import AUTOTUNE, UNKNOWN_CARDINALITY, Dataset, int_arg
from psflow.data.structure import TensorSpec
from psflow.framework.tensor import Tensor, _place

logger = logging.getLogger(__name__)


def call_on_host(fn: Callable[..., Any], element: Any) -> Any:
    """Calls ``fn`` on an element, tuples unpacked, with CPU:0 as the current device."""
    with backend.device(backend.CPU0):
        if type(element) is tuple:
            return fn(*element)
        return fn(element)


def _dummy_element(spec: Any, fill: int) -> Any:
    """A placeholder element: every value ``fill``, unknown dimensions ``fill`` long.

    Two such calls (fill 1, then 2) reveal output dimensions that depend on
    the input's unknown dimensions or on its values (``pf.fill([x], x)``).
    An unknown rank becomes a scalar.
    """

    def placeholder(s: TensorSpec) -> Tensor:
        dims = () if s._dims is None else tuple(fill if d is None else d for d in s._dims)
        value = "" if s.dtype == dtypes.string else fill  # a string is never a number
        return Tensor._wrap(np.full(dims, value, dtype=s.dtype.np))

    return structure.map_structure(placeholder, spec)


def _relax(a: Any, b: Any) -> Any:
    """The spec nest covering two traced outputs: differing dimensions become unknown."""
    if not structure.same_structure(a, b):
        raise TypeError(f"The function's output structure depends on its input: {a!r} vs {b!r}")
    fa, fb = structure.flatten(a), structure.flatten(b)
    for x, y in zip(fa, fb):
        if x.dtype != y.dtype:
            raise TypeError(f"The function's output dtype depends on its input: {a!r} vs {b!r}")
    return structure.pack(a, [x.most_specific_common(y) for x, y in zip(fa, fb)])


class _Output:
    """Converts a function's return values to flat arrays, checked against the first one."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.template: Any = None
        self.dtypes: list[np.dtype] = []

    def convert(self, out: Any) -> tuple[np.ndarray, ...]:
        if isinstance(out, list):
            out = tuple(out)
        template = self.template
        if template is None:
            template, arrays = structure.normalize_output(out, self.what)
            self.dtypes = [a.dtype for a in arrays]
            self.template = template
            return tuple(arrays)
        parts = structure.flatten_up_to(template, out, self.what)
        arrays = tuple(structure.to_host_array(p, self.what) for p in parts)
        for a, dt in zip(arrays, self.dtypes):
            if a.dtype != dt:
                raise TypeError(f"The {self.what} changed dtype from {dt} to {a.dtype}: {out!r}")
        return arrays


class MapDataset(Dataset):
    """``Dataset.map``: ``map_func`` applied to every element, in order."""

    def __init__(
        self, input_dataset: Dataset, map_func: Callable[..., Any], num_parallel_calls: Any
    ) -> None:
        super().__init__(input_dataset)
        if not callable(map_func):
            raise TypeError(f"map: map_func must be callable, got {map_func!r}")
        self._fn = map_func
        workers = 1
        if num_parallel_calls is not None:
            n = int_arg(num_parallel_calls, "num_parallel_calls")
            if n == AUTOTUNE:
                workers = max(1, min(os.cpu_count() or 1, 8))
            elif n <= 0:
                raise errors.InvalidArgumentError(
                    f"map: num_parallel_calls must be positive or AUTOTUNE (-1), got {n}"
                )
            else:
                workers = n
        self._workers = workers
        self._out = _Output("map function output")

    @property
    def element_spec(self) -> Any:
        """The output spec (from two placeholder calls of the function; see module doc)."""
        if self._spec_cache is None:
            self._spec_cache = self._traced_spec()
        return self._spec_cache

    def _traced_spec(self) -> Any:
        in_spec = self._inputs[0].element_spec
        try:
            with np.errstate(all="ignore"):
                outs = [
                    structure.normalize_output(
                        call_on_host(self._fn, _dummy_element(in_spec, fill)), self._out.what
                    )[0]
                    for fill in (1, 2)
                ]
            return _relax(*outs)
        except Exception as e:  # the function may reject placeholders: use a real element
            if self._out.template is not None:
                return self._out.template
            logger.debug("map: placeholder call failed (%s); reading one real element", e)
            first = next(iter(self._iter_elements()), None)
            if first is None:
                raise errors.InvalidArgumentError(
                    f"Cannot determine the output of {self._fn!r}: calling it on placeholder "
                    f"elements failed ({e}) and the input is empty"
                ) from e
            return self._out.template

    def _template(self) -> Any:
        if self._out.template is not None:
            return self._out.template
        return self.element_spec

    def _iter_elements(self) -> Iterator[tuple[Any, ...]]:
        inp = self._inputs[0]
        src = inp._iter_flat()
        fn, out = self._fn, self._out

        def apply(flat: tuple[Any, ...]) -> tuple[np.ndarray, ...]:
            return out.convert(call_on_host(fn, inp._pack_tensors(flat)))

        if self._workers == 1:
            return (apply(flat) for flat in src)
        return _ordered_parallel(apply, src, self._workers)


def _ordered_parallel(fn: Callable[[Any], Any], src: Iterator[Any], workers: int) -> Iterator[Any]:
    """``map(fn, src)`` on a thread pool, at most ``2 * workers`` calls in flight, in order."""

    def gen() -> Iterator[Any]:
        with ThreadPoolExecutor(workers, thread_name_prefix="psflow-data-map") as pool:
            pending: collections.deque = collections.deque()
            try:
                for item in src:
                    pending.append(pool.submit(fn, item))
                    if len(pending) >= 2 * workers:
                        yield pending.popleft().result()
                while pending:
                    yield pending.popleft().result()
            finally:
                for f in pending:
                    f.cancel()

    return gen()


class FilterDataset(Dataset):
    """``Dataset.filter``: the elements whose predicate is a true scalar bool."""

    def __init__(self, input_dataset: Dataset, predicate: Callable[..., Any]) -> None:
        super().__init__(input_dataset)
        if not callable(predicate):
            raise TypeError(f"filter: predicate must be callable, got {predicate!r}")
        self._pred = predicate

    def _cardinality(self) -> int:
        return UNKNOWN_CARDINALITY

    def _iter_elements(self) -> Iterator[tuple[Any, ...]]:
        inp = self._inputs[0]
        src = inp._iter_flat()
        pred = self._pred

        def keep(flat: tuple[Any, ...]) -> bool:
            out = call_on_host(pred, inp._pack_tensors(flat))
            if out is True or out is False:
                return out
            arr = structure.to_host_array(out, "filter predicate result")
            if arr.dtype != np.bool_ or arr.ndim != 0:
                raise errors.InvalidArgumentError(
                    f"filter: the predicate must return a scalar bool, got "
                    f"{arr.dtype} of shape {arr.shape}: {out!r}"
                )
            return bool(arr)

        return (flat for flat in src if keep(flat))


class FlatMapDataset(Dataset):
    """``Dataset.flat_map``: each element mapped to a dataset whose elements follow in turn."""

    def __init__(self, input_dataset: Dataset, map_func: Callable[..., Any]) -> None:
        super().__init__(input_dataset)
        if not callable(map_func):
            raise TypeError(f"flat_map: map_func must be callable, got {map_func!r}")
        self._fn = map_func
        self._observed: Any = None

    _what = "flat_map"

    def _call(self, element: Any) -> Dataset:
        ds = call_on_host(self._fn, element)
        if not isinstance(ds, Dataset):
            raise TypeError(f"{self._what}: map_func must return a Dataset, got {ds!r}")
        return ds

    def _made_for_spec(self) -> Dataset:
        """The dataset the function returns for a placeholder element."""
        with np.errstate(all="ignore"):
            return self._call(_dummy_element(self._inputs[0].element_spec, 1))

    @property
    def element_spec(self) -> Any:
        """The spec of the datasets the function returns (one placeholder call)."""
        if self._spec_cache is None:
            self._spec_cache = self._made_for_spec().element_spec
        return self._spec_cache

    def _template(self) -> Any:
        return self._observed if self._observed is not None else self.element_spec

    def _cardinality(self) -> int:
        return UNKNOWN_CARDINALITY

    def _iter_elements(self) -> Iterator[tuple[Any, ...]]:
        inp = self._inputs[0]
        src = inp._iter_flat()

        def gen() -> Iterator[tuple[Any, ...]]:
            for flat in src:
                ds = self._call(inp._pack_tensors(flat))
                if self._observed is None:
                    self._observed = ds._template()
                yield from ds._iter_flat()

        return gen()


class InterleaveDataset(FlatMapDataset):
    """``Dataset.interleave``: ``cycle_length`` of the mapped datasets at once, taking
    ``block_length`` elements from each in turn (TensorFlow's order).

    A dataset that ends leaves its place in the cycle empty until the cycle
    comes back to it, when the next input element's dataset takes it.
    """

    _what = "interleave"

    def __init__(
        self,
        input_dataset: Dataset,
        map_func: Callable[..., Any],
        cycle_length: int,
        block_length: int,
    ) -> None:
        super().__init__(input_dataset, map_func)
        for name, value in (("cycle_length", cycle_length), ("block_length", block_length)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise errors.InvalidArgumentError(
                    f"interleave: {name} must be a positive integer, got {value!r}"
                )
        self._cycle, self._block = int(cycle_length), int(block_length)

    def _iter_elements(self) -> Iterator[tuple[Any, ...]]:
        inp = self._inputs[0]
        src = inp._iter_flat()

        def gen() -> Iterator[tuple[Any, ...]]:
            slots: list[Iterator[tuple[Any, ...]] | None] = [None] * self._cycle
            exhausted = False
            while True:
                active = False
                for k in range(self._cycle):
                    if slots[k] is None and not exhausted:
                        flat = next(src, None)
                        if flat is None:
                            exhausted = True
                        else:
                            ds = self._call(inp._pack_tensors(flat))
                            if self._observed is None:
                                self._observed = ds._template()
                            slots[k] = ds._iter_flat()
                    it = slots[k]
                    if it is None:
                        continue
                    active = True
                    for _ in range(self._block):
                        element = next(it, None)
                        if element is None:
                            slots[k] = None
                            break
                        yield element
                if not active and exhausted:
                    return

        return gen()


def run_reduce(dataset: Dataset, initial_state: Any, reduce_func: Callable[[Any, Any], Any]) -> Any:
    """``Dataset.reduce``: folds the elements into a state of fixed structure and dtypes."""
    if not callable(reduce_func):
        raise TypeError(f"reduce: reduce_func must be callable, got {reduce_func!r}")
    template, arrays = structure.normalize_output(initial_state, "initial_state")
    dtypes_ = [a.dtype for a in arrays]
    state = structure.pack(template, [Tensor._wrap(a) for a in arrays])
    for flat in dataset._iter_flat():
        element = dataset._pack_tensors(flat)
        with backend.device(backend.CPU0):
            new = reduce_func(state, element)
        new_template, new_arrays = structure.normalize_output(new, "reduce_func result")
        if (
            not structure.same_structure(template, new_template)
            or [a.dtype for a in new_arrays] != dtypes_
        ):
            raise TypeError(
                f"reduce: reduce_func must keep the state's structure and dtypes, "
                f"got {new_template!r} for the initial {template!r}"
            )
        state = structure.pack(template, [Tensor._wrap(a) for a in new_arrays])
    return structure.map_structure(lambda t: Tensor._wrap(_place(t._array())), state)

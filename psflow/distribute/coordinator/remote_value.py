"""Values that a closure will produce on some worker: ``RemoteValue`` and ``PerWorkerValues``."""

from __future__ import annotations

import abc
import enum
import threading
from collections.abc import Callable
from typing import Any

from psflow import errors
from psflow.util import nest


class RemoteValueStatus(enum.Enum):
    """Where a remote value stands."""

    NOT_READY = "NOT_READY"
    ABORTED = "ABORTED"
    READY = "READY"


class RemoteValue:
    """The future result of a scheduled closure (TensorFlow's ``RemoteValue``).

    ``fetch()`` waits and returns NumPy values; ``get()`` waits and returns the
    value as the closure returned it (tensors stay tensors).
    """

    def __init__(self, closure_id: int, description: str = "") -> None:
        self._closure_id = closure_id
        self._description = description
        self._event = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        self._status = RemoteValueStatus.NOT_READY
        self._callbacks: list[Callable[[RemoteValue], Any]] = []
        self._lock = threading.Lock()

    # -- producer side ---------------------------------------------------------------
    def _set_value(self, value: Any) -> None:
        self._value = value
        self._status = RemoteValueStatus.READY
        self._event.set()
        self._run_callbacks()

    def _set_error(self, error: BaseException) -> None:
        self._error = error
        self._status = RemoteValueStatus.ABORTED
        self._event.set()
        self._run_callbacks()

    def _run_callbacks(self) -> None:
        with self._lock:
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)

    def add_done_callback(self, fn: Callable[[RemoteValue], Any]) -> None:
        """Calls ``fn(self)`` once the value or an error arrives (now, if it already has).

        ``fn`` runs on the coordinator's thread that delivered the value: keep it short
        (e.g. put the value on a queue), which is how results are consumed as they
        complete rather than in scheduling order.
        """
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def _reset(self) -> None:
        """Makes the value pending again (its closure is being re-run)."""
        self._event.clear()
        self._value, self._error = None, None
        self._status = RemoteValueStatus.NOT_READY

    # -- consumer side ---------------------------------------------------------------
    def _wait(self, timeout: float | None) -> None:
        if not self._event.wait(timeout):
            raise errors.DeadlineExceededError(
                f"Remote value of closure {self._closure_id} {self._description} was not ready "
                f"after {timeout}s"
            )
        if self._error is not None:
            raise self._error

    def ready(self, timeout: float) -> bool:
        """Whether the value (or an error) arrived, waiting up to ``timeout`` seconds."""
        return self._event.wait(timeout)

    def get(self, timeout: float | None = None) -> Any:
        """Waits for the value and returns it as the closure returned it.

        Raises:
            The closure's error (or CancelledError if it was cancelled).
        """
        self._wait(timeout)
        return self._value

    def fetch(self, timeout: float | None = None) -> Any:
        """Waits for the value and returns it with tensors converted to NumPy."""
        value = self.get(timeout)
        return nest.map_structure(lambda v: v.numpy() if hasattr(v, "numpy") else v, value)

    def done(self) -> bool:
        """Whether the value (or an error) has arrived."""
        return self._event.is_set()

    def __repr__(self) -> str:
        return f"<RemoteValue closure={self._closure_id} status={self._status.value}>"


class PerWorkerArgument(abc.ABC):
    """A closure argument decided when a worker takes the closure, not when it is scheduled.

    The coordinator calls :meth:`for_worker` with the worker's index before it sends
    the closure, and sends what it returns. A re-run of the closure (after a failure,
    or a speculative one) calls it again: implementations return the same value
    every time, so a re-run repeats the same work (e.g. trains the same batch).
    """

    @abc.abstractmethod
    def for_worker(self, worker_index: int) -> Any:
        """The value the closure receives on worker ``worker_index``."""


class PerWorkerValues:
    """One value per worker (a dataset, an iterator...), resolved per closure.

    A closure scheduled with a ``PerWorkerValues`` argument receives the
    component of the worker it runs on.
    """

    def __init__(
        self, values: tuple[Any, ...], coordinator: Any = None, kind: str = "value"
    ) -> None:
        self._values = tuple(values)
        self._coordinator = coordinator
        self._kind = kind

    @property
    def values(self) -> tuple[Any, ...]:
        """The per-worker components, in worker order."""
        return self._values

    def __iter__(self) -> Any:
        """``iter(per_worker_dataset)``: an iterator on every worker (TensorFlow's pattern)."""
        if self._coordinator is None or self._kind != "dataset":
            raise TypeError("Only a per-worker dataset can be iterated")
        return self._coordinator._create_per_worker_iterators(self)

    def __next__(self) -> Any:
        raise TypeError(
            "A per-worker iterator lives on the workers: pass it to coordinator.schedule and "
            "call next() inside the scheduled function"
        )

    def __repr__(self) -> str:
        return f"PerWorkerValues({self._kind}, workers={len(self._values)})"

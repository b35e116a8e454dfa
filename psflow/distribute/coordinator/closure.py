"""Closures as they travel to workers: a cached function, per-call arguments, resources.

Functions are pickled (cloudpickle) once per coordinator and sent to each
worker once; a worker keeps them by key. Like a traced ``tf.function``, a
function's captured Python state is frozen when it is first shipped; state
that lives on the parameter servers (variables, PS-backed metrics) is shared.

Objects that live on a worker (datasets, iterators) travel as
:class:`ResourceHandle` keys and resolve to the worker's object on arrival.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import traceback
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import cloudpickle

from psflow import errors

_resolve_local = threading.local()


class MissingResourceError(errors.FailedPreconditionError):
    """A closure refers to a resource its worker does not hold (it restarted)."""

    def __init__(self, key: str, task: str | None = None) -> None:
        super().__init__(f"Resource {key!r} is not on this worker", task)
        self.key = key

    def __reduce__(self):
        return (type(self), (self.key, self.task))


@contextlib.contextmanager
def resolving(resources: dict[str, Any]) -> Iterator[None]:
    """Resolves :class:`ResourceHandle`s unpickled in this block against ``resources``."""
    prev = getattr(_resolve_local, "resources", None)
    _resolve_local.resources = resources
    try:
        yield
    finally:
        _resolve_local.resources = prev


def _resolve(key: str) -> Any:
    resources = getattr(_resolve_local, "resources", None)
    if resources is None:
        return ResourceHandle(key)
    if key not in resources:
        raise MissingResourceError(key)
    return resources[key]


class ResourceHandle:
    """Names an object held by a worker; unpickles to that object on the worker."""

    __slots__ = ("key",)

    def __init__(self, key: str) -> None:
        self.key = key

    def __reduce__(self):
        return (_resolve, (self.key,))

    def __repr__(self) -> str:
        return f"ResourceHandle({self.key!r})"


class FunctionCache:
    """Pickles each function once and gives it a key (by identity, held weakly)."""

    def __init__(self) -> None:
        self._keys: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self._bytes: dict[str, bytes] = {}
        self._counter = itertools.count()
        self._lock = threading.Lock()

    def key_and_bytes(self, fn: Callable[..., Any]) -> tuple[str, bytes]:
        """The key of ``fn`` and its pickled bytes (pickled on first sight)."""
        with self._lock:
            try:
                key = self._keys.get(fn)
            except TypeError:  # not weak-referenceable: pickle every time
                key = None
                return f"once-{next(self._counter)}", pickle_function(fn)
            if key is None:
                key = f"fn-{next(self._counter)}"
                self._bytes[key] = pickle_function(fn)
                self._keys[fn] = key
                weakref.finalize(fn, self._bytes.pop, key, None)
            return key, self._bytes[key]


def pickle_function(fn: Callable[..., Any]) -> bytes:
    """cloudpickle of ``fn``, with a clear error for what cannot travel.

    Raises:
        InvalidArgumentError: ``fn`` captures something that cannot be pickled.
    """
    try:
        return cloudpickle.dumps(fn)
    except Exception as e:
        raise errors.InvalidArgumentError(
            f"The scheduled function {getattr(fn, '__qualname__', fn)!r} cannot be sent to workers: "
            f"{type(e).__name__}: {e}"
        ) from None


def pickle_arguments(args: tuple, kwargs: dict) -> bytes:
    """cloudpickle of ``(args, kwargs)``."""
    try:
        return cloudpickle.dumps((args, kwargs))
    except Exception as e:
        raise errors.InvalidArgumentError(
            f"The arguments of a scheduled function cannot be sent to workers: {type(e).__name__}: {e}"
        ) from None


def describe_error(exc: BaseException) -> dict[str, Any]:
    """The fields of a ``ClosureError`` for an exception raised by a closure."""
    try:
        pickled = cloudpickle.dumps(exc)
        cloudpickle.loads(pickled)
    except Exception:
        pickled = b""
    code = exc.code.value if isinstance(exc, errors.OpError) else errors.Code.UNKNOWN.value
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        "pickled": pickled,
        "code": int(code),
    }


def rebuild_error(fields: Any, task: str) -> BaseException:
    """The exception a closure raised on ``task``, with the worker named in a note."""
    exc: BaseException | None = None
    if fields.pickled:
        try:
            exc = cloudpickle.loads(fields.pickled)
        except Exception:
            exc = None
    if exc is None:
        cls = errors.error_class(fields.code) if fields.code else errors.UnknownError
        exc = cls(f"{fields.type}: {fields.message}", task=task)
    if isinstance(exc, errors.OpError) and exc.task is None:
        exc.task = task
    note = f"Raised in a closure on {task}. Worker traceback:\n{fields.traceback}"
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    exc._psflow_task = task  # type: ignore[attr-defined]
    return exc

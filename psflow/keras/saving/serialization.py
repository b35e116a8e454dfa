"""Objects to and from JSON-able configs: ``{"class_name", "config"}``, resolved by name.

The protocol every layer follows (Keras's): ``get_config()`` returns the
constructor's keyword arguments as JSON-able values, and the classmethod
``from_config(config)`` is ``cls(**config)`` unless the layer needs more
(``Lambda`` resolves its function by name). A class is found, in order, in
the ``custom_objects`` given to ``load_model``, among the classes registered
with :func:`register_keras_serializable`, and among psflow's own layers and
models.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterator
from typing import Any

from psflow import errors

_lock = threading.Lock()
_registered: dict[str, Any] = {}  # "package>name" -> class or function
_names: dict[int, str] = {}  # id(object) -> its registered key
_scope: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "psflow_keras_custom_objects", default=None
)


def register_keras_serializable(
    package: str = "Custom", name: str | None = None
) -> Callable[[Any], Any]:
    """Decorator: makes a class or function loadable by name (``"<package>><name>"``).

    Example:
        >>> import psflow as pf
        >>> @pf.keras.utils.register_keras_serializable(package="demo")
        ... class Twice(pf.keras.layers.Layer):
        ...     def call(self, x):
        ...         return x * 2.0

    Raises:
        InvalidArgumentError: ``package`` contains ``">"``, or the key is taken by another object.
    """
    if ">" in package:
        raise errors.InvalidArgumentError(f"package must not contain '>', got {package!r}")

    def decorate(obj: Any) -> Any:
        key = f"{package}>{name or obj.__name__}"
        with _lock:
            previous = _registered.get(key)
            if (
                previous is not None
                and previous is not obj
                and (getattr(previous, "__qualname__", None) != getattr(obj, "__qualname__", None))
            ):
                raise errors.InvalidArgumentError(f"{key!r} is already registered to {previous!r}")
            _registered[key] = obj
            _names[id(obj)] = key
        return obj

    return decorate


def get_registered_name(obj: Any) -> str:
    """The name ``obj`` is saved under: its registered key, else its ``__name__``."""
    return _names.get(id(obj), getattr(obj, "__name__", type(obj).__name__))


@contextlib.contextmanager
def custom_object_scope(objects: dict[str, Any] | None) -> Iterator[None]:
    """Makes ``objects`` (name -> class or function) resolvable while loading."""
    merged = {**(_scope.get() or {}), **(objects or {})}
    token = _scope.set(merged)
    try:
        yield
    finally:
        _scope.reset(token)


def _builtins() -> dict[str, Any]:
    from psflow.keras import layers
    from psflow.keras.engine.functional import Functional
    from psflow.keras.engine.sequential import Sequential
    from psflow.keras.layers.base import Layer

    found: dict[str, Any] = {
        name: obj
        for name, obj in vars(layers).items()
        if isinstance(obj, type) and issubclass(obj, Layer)
    }
    found.update({"Sequential": Sequential, "Functional": Functional, "Model": Functional})
    return found


def _bare(name: str) -> str:
    """``"pkg>Name"`` -> ``"Name"``; other names (``"<lambda>"``) unchanged."""
    return name.split(">", 1)[1] if ">" in name and not name.startswith("<") else name


def get_registered_object(name: str, custom_objects: dict[str, Any] | None = None) -> Any:
    """The class or function saved as ``name``, or None.

    A registered key (``"pkg>Name"``) also matches its bare name in ``custom_objects``.
    """
    scope = {**(_scope.get() or {}), **(custom_objects or {})}
    bare = _bare(name)
    for key in (name, bare):
        if key in scope:
            return scope[key]
    with _lock:
        if name in _registered:
            return _registered[name]
    return _builtins().get(name)


def serialize_keras_object(obj: Any) -> dict[str, Any]:
    """``{"class_name", "config", "module"}`` of a layer or model."""
    return {
        "class_name": get_registered_name(type(obj)),
        "config": obj.get_config(),
        "module": type(obj).__module__,
    }


def deserialize_keras_object(
    config: Any, custom_objects: dict[str, Any] | None = None, what: str = "layer"
) -> Any:
    """Rebuilds an object from :func:`serialize_keras_object`'s output.

    Raises:
        InvalidArgumentError: a malformed entry, an unknown class (named, with how
            to make it known), or a config its class's ``from_config`` rejects.
    """
    if not isinstance(config, dict) or "class_name" not in config:
        raise errors.InvalidArgumentError(
            f"A {what} config must be a dict with 'class_name' and 'config', got {config!r:.200}"
        )
    class_name = config["class_name"]
    cls = get_registered_object(str(class_name), custom_objects)
    if cls is None:
        raise errors.InvalidArgumentError(
            f"Unknown {what} class {class_name!r}: register it with "
            f"keras.utils.register_keras_serializable or pass "
            f"custom_objects={{{_bare(str(class_name))!r}: ...}}"
        )
    inner = config.get("config", {})
    if not isinstance(inner, dict):
        raise errors.InvalidArgumentError(
            f"The config of {what} {class_name!r} must be a dict, got {inner!r:.200}"
        )
    try:
        return cls.from_config(inner)
    except TypeError as e:  # the constructor does not take what get_config wrote
        raise errors.InvalidArgumentError(
            f"Could not rebuild {what} {class_name!r} from its config ({e}); give the class "
            "get_config() returning its constructor arguments (and from_config if needed)"
        ) from e


def function_name(fn: Callable[..., Any]) -> str:
    """The name a function is saved under (its registered key, else ``__name__``)."""
    return get_registered_name(fn)


def resolve_function(name: str) -> Callable[..., Any]:
    """The function saved as ``name``.

    Raises:
        InvalidArgumentError: no registered or custom function of that name.
    """
    fn = get_registered_object(name)
    if fn is None or not callable(fn):
        raise errors.InvalidArgumentError(
            f"Unknown function {name!r}: register it with keras.utils.register_keras_serializable "
            f"or pass custom_objects={{{_bare(name)!r}: ...}} (anonymous lambdas "
            "cannot be loaded)"
        )
    return fn

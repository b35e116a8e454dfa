"""``psflow.function``: accepted for compatibility; functions run eagerly as written."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


def function(func: Callable[..., Any] | None = None, **kwargs: Any) -> Any:
    """Returns ``func`` unchanged (psflow has no graph mode), usable with or without arguments.

    Example:
        >>> import psflow as pf
        >>> @pf.function
        ... def f(x):
        ...     return x * 2
        >>> int(f(pf.constant(3)))
        6
    """
    del kwargs

    def wrap(f: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(f)
        def inner(*args: Any, **kw: Any) -> Any:
            return f(*args, **kw)

        inner.python_function = f  # type: ignore[attr-defined]
        return inner

    return wrap(func) if func is not None else wrap

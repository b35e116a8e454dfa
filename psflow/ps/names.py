"""Variable names as a parameter server accepts and quotes them.

A PS is a long-lived service shared by many clients, so the names it keeps
are bounded: a name longer than :data:`MAX_NAME_BYTES` (UTF-8) is refused
before anything is stored, which keeps ``ListVariables`` replies and the
metrics' label values small.  Error messages quote names (and other caller
text) through :func:`quote`, which shortens long ones: a message must fit in
gRPC's status metadata, whatever a caller sent.

Example:
    >>> quote("w")
    "'w'"
    >>> quote("x" * 5000).endswith("... (5000 chars)")
    True
"""

from __future__ import annotations

from typing import Any

from psflow.errors import InvalidArgumentError

__all__ = ["MAX_NAME_BYTES", "QUOTE_CHARS", "check_name", "quote"]

MAX_NAME_BYTES = 1024
QUOTE_CHARS = 120


def quote(value: Any, limit: int = QUOTE_CHARS) -> str:
    """``repr(value)`` of a string, cut to about ``limit`` characters with its length noted."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} chars)"
    text = repr(value)
    return text if len(text) <= limit + 2 else f"{text[:limit]}... ({len(text)} chars)"


def check_name(name: Any, what: str = "variable name") -> str:
    """Returns ``name`` if it is a non-empty string of at most :data:`MAX_NAME_BYTES`.

    Raises:
        InvalidArgumentError: anything else, quoted (shortened).
    """
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(f"{what} must be a non-empty string, not {quote(name)}")
    size = len(name.encode("utf-8", "surrogatepass"))
    if size > MAX_NAME_BYTES:
        raise InvalidArgumentError(
            f"{what} {quote(name)} is {size} bytes long, above the limit of {MAX_NAME_BYTES}"
        )
    return name

"""A call's failure status as the typed psflow error a client raises.

One mapping for every client edge (the gRPC stubs of :class:`PSClient` and the
raw TCP data plane), so the same failure raises the same error whichever way
the bytes travelled: the error class of the status code, the message naming
the method, the task and its address, and a :class:`MovedError` with its
redirect fields when the trailing metadata carries them.
"""

from __future__ import annotations

from collections.abc import Iterable

from psflow.errors import Code, MovedError, OpError, error_class

__all__ = ["status_error"]


def status_error(
    method: str,
    task: str | None,
    address: str,
    code: Code | int | None,
    details: str,
    metadata: Iterable[tuple[str, str]] = (),
) -> OpError:
    """The error a failed ``method`` call to ``task`` at ``address`` raises.

    Args:
        code: the canonical status code (None: no status, i.e. UNKNOWN).
        details: the status message.
        metadata: the trailing metadata pairs.
    """
    cls = error_class(Code.UNKNOWN if code is None else code)
    details = details or (Code(int(code)).name if code is not None else "no status")
    moved = MovedError.from_metadata(
        f"{method} to {task} at {address}: {details}", tuple(metadata or ()), task
    )
    if moved is not None:  # a redirect: the variable lives on another task now
        return moved
    return cls(f"{method} to {task} at {address} failed: {details}", task=task)

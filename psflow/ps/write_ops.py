"""The in-place writes a PS applies (``assign``, ``assign_add``, ``assign_sub``), in one table.

The store, the server's wire translation and the client-side connection all
name these ops; their names, their wire codes and their arithmetic live here
so the three cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from psflow.errors import InvalidArgumentError
from psflow.proto import ps_pb2


def _assign(dst: np.ndarray, part: np.ndarray) -> None:
    dst[...] = part


def _assign_add(dst: np.ndarray, part: np.ndarray) -> None:
    dst += part


def _assign_sub(dst: np.ndarray, part: np.ndarray) -> None:
    dst -= part


# name -> (wire code, in-place arithmetic); the order is the documented one.
_TABLE: dict[str, tuple[int, Callable[[np.ndarray, np.ndarray], None]]] = {
    "assign": (ps_pb2.WRITE_OP_ASSIGN, _assign),
    "assign_add": (ps_pb2.WRITE_OP_ASSIGN_ADD, _assign_add),
    "assign_sub": (ps_pb2.WRITE_OP_ASSIGN_SUB, _assign_sub),
}
WRITE_OPS: tuple[str, ...] = tuple(_TABLE)
_BY_CODE = {code: name for name, (code, _) in _TABLE.items()}


def check(op: str) -> str:
    """Returns ``op`` when it names a write op.

    Raises:
        InvalidArgumentError: ``op`` is not one of :data:`WRITE_OPS` (quoted).
    """
    if op not in _TABLE:
        raise InvalidArgumentError(f"unknown write op {op!r}; expected one of {WRITE_OPS}")
    return op


def is_wire_write(code: int) -> bool:
    """Whether a ``WriteHeader.op`` code is one of the in-place writes (not CREATE)."""
    return code in _BY_CODE


def from_wire(code: int) -> str:
    """The op's name for a ``WriteHeader.op`` code.

    Raises:
        InvalidArgumentError: the code names no in-place write.
    """
    name = _BY_CODE.get(code)
    if name is None:
        raise InvalidArgumentError(f"unknown write op {code}")
    return name


def to_wire(op: str) -> int:
    """The ``WriteHeader.op`` code of write ``op``.

    Raises:
        InvalidArgumentError: ``op`` is not one of :data:`WRITE_OPS` (quoted).
    """
    return _TABLE[check(op)][0]


def apply(op: str, dst: np.ndarray, part: np.ndarray) -> None:
    """Applies write ``op`` of ``part`` onto ``dst`` in place (shapes already checked)."""
    _TABLE[check(op)][1](dst, part)

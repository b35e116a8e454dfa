"""Atomic file replacement: readers see the old file or the new one, never a torn one."""

from __future__ import annotations

import contextlib
import os
import pathlib
import uuid
from collections.abc import Iterator
from typing import BinaryIO

__all__ = ["atomic_write", "fsync_dir"]


def fsync_dir(directory: str | os.PathLike) -> None:
    """Flushes a directory entry (so a rename survives a crash)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, *, durable: bool = True) -> Iterator[BinaryIO]:
    """Opens a temporary file next to ``path``; on success fsyncs and renames it over ``path``.

    On an exception the temporary file is removed and ``path`` is untouched.
    ``durable=False`` skips both fsyncs: for state that only has to be whole,
    not to survive a crash of the machine (a launcher's status files).

    Example:
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "x.bin"
        >>> with atomic_write(p) as f:
        ...     _ = f.write(b"hello")
        >>> p.read_bytes()
        b'hello'
    """
    path = pathlib.Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    if durable:
        fsync_dir(path.parent)

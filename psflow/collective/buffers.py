"""A cache of NumPy result buffers, reused once the caller has dropped every view.

A fresh 64 MB ``numpy.empty`` costs its page faults on first touch: the kernel
zeroes every page, which on the reference machine halves an all-reduce's
throughput.  The all-reduce returns its results as views of one buffer per
dtype and replica; the pool keeps a reference to each buffer it handed out and
hands it out again once the only references left are its own, which CPython's
reference count tells exactly (every NumPy view of a buffer, and every view of
a view, holds a reference to the buffer that owns the memory).  Memory reached
only through raw pointers (``ctypes``) after the arrays are dropped is, as with
any freed NumPy array, not protected.

The pool is bounded: it tracks at most ``max_bytes`` of buffers; beyond that
new buffers are plain allocations, freed as usual.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict

import numpy as np


class BufferPool:
    """Reusable 1-D ``uint8`` buffers keyed by exact size.

    Args:
        max_bytes: the most memory the pool keeps track of (free or in use);
            0 disables the pool (every ``take`` allocates).

    Example:
        >>> pool = BufferPool(1 << 30)
        >>> a = pool.take(1024)
        >>> del a  # the next take(1024) reuses the same memory
    """

    def __init__(self, max_bytes: int = 1 << 30) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._by_size: OrderedDict[int, list[np.ndarray]] = OrderedDict()
        self._tracked = 0

    def take(self, nbytes: int) -> np.ndarray:
        """Returns an uninitialised buffer of ``nbytes`` bytes, reused when one is free."""
        if self.max_bytes <= 0 or nbytes == 0:
            return np.empty(nbytes, np.uint8)
        with self._lock:
            bufs = self._by_size.get(nbytes)
            if bufs is not None:
                self._by_size.move_to_end(nbytes)
                for buf in bufs:
                    # References: the list, the loop variable, getrefcount's argument.
                    if sys.getrefcount(buf) <= 3:
                        return buf
            if self._tracked + nbytes > self.max_bytes:
                self._evict(self._tracked + nbytes - self.max_bytes)
            buf = np.empty(nbytes, np.uint8)
            if self._tracked + nbytes <= self.max_bytes:
                self._by_size.setdefault(nbytes, []).append(buf)
                self._tracked += nbytes
            return buf

    def _evict(self, need: int) -> None:
        """Stops tracking free buffers, least recently used sizes first."""
        freed = 0
        for size in list(self._by_size):
            bufs = self._by_size[size]
            keep = []
            for buf in bufs:
                if freed < need and sys.getrefcount(buf) <= 3:
                    freed += size
                    self._tracked -= size
                else:
                    keep.append(buf)
            if keep:
                self._by_size[size] = keep
            else:
                del self._by_size[size]
            if freed >= need:
                return

    @property
    def tracked_bytes(self) -> int:
        """Bytes of buffers the pool keeps track of (free or in use)."""
        return self._tracked

    def clear(self) -> None:
        """Forgets every buffer (buffers in use stay valid; free ones are released)."""
        with self._lock:
            self._by_size.clear()
            self._tracked = 0

"""A Bloom filter over int64 ids: "certainly absent" without touching the disk.

Under a Zipf stream most of a request's ids that miss memory were never seen
at all (new rows); asking the disk tier's store about each costs a B-tree
descent.  An :class:`IdFilter` answers "certainly not on disk" for them from
memory: ``BITS_PER_ID`` bits per id added and ``HASHES`` probes give about 2%
false positives (each one costs a read that finds nothing; answers are never
wrong the other way).  Ids cannot be removed; the owner rebuilds the filter
from the store when the ids added pass its capacity.

Example:
    >>> import numpy as np
    >>> f = IdFilter(100)
    >>> f.add(np.array([5, -9], np.int64))
    >>> f.might_contain(np.array([5, -9, 6], np.int64)).tolist()[:2]
    [True, True]
"""

from __future__ import annotations

import numpy as np

from .key_index import mix64

__all__ = ["BITS_PER_ID", "HASHES", "IdFilter"]

BITS_PER_ID = 8
HASHES = 3


class IdFilter:
    """A Bloom filter sized for ``capacity`` ids (``BITS_PER_ID`` bits each).

    Attributes:
        added: ids added since it was made (the owner rebuilds past ``capacity``).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = max(int(capacity), 1024)
        bits = 1 << int(np.ceil(np.log2(self.capacity * BITS_PER_ID)))
        self._mask = np.uint64(bits - 1)
        self._bits = np.zeros(bits // 8, np.uint8)
        self.added = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the bit array."""
        return self._bits.nbytes

    def _positions(self, ids: np.ndarray) -> list[np.ndarray]:
        # two hashes, the probes h1 + i * h2 (Kirsch and Mitzenmacher): as good as
        # HASHES independent ones for a Bloom filter, at the cost of two
        h1 = mix64(ids)
        h2 = mix64(h1.view(np.int64)) | np.uint64(1)
        out = []
        for _ in range(HASHES):
            out.append((h1 & self._mask).astype(np.int64))
            h1 += h2
        return out

    def add(self, ids: np.ndarray) -> None:
        """Adds int64 ``ids``."""
        for pos in self._positions(ids):
            np.bitwise_or.at(self._bits, pos >> 3, (1 << (pos & 7)).astype(np.uint8))
        self.added += int(ids.shape[0])

    def might_contain(self, ids: np.ndarray) -> np.ndarray:
        """False where an id was certainly never added."""
        out = np.ones(ids.shape[0], bool)
        for pos in self._positions(ids):
            out &= (self._bits[pos >> 3] >> (pos & 7).astype(np.uint8)) & 1 == 1
        return out

    @property
    def full(self) -> bool:
        """Whether more ids were added than it was sized for."""
        return self.added > self.capacity

"""A worker-side cache of a dynamic table's hottest rows.

Click logs are skewed: with Zipf-distributed ids a few hundred ids make up a
large share of every batch.  The PS counts each row's traffic
(:meth:`psflow.ps.dynamic_table.DynamicTable.hot_ids`); a :class:`HotRowCache`
fetches the ``count`` busiest rows every ``refresh_every`` lookups and serves
those ids locally in between, so only the long tail travels.

The price is bounded staleness: a cached row is at most ``refresh_every - 1``
lookups old (``refresh_every=1`` reads exactly what the PS holds).  Gradients
are never cached: every push reaches the PS, which keeps the hot rows hot.

Example:
    >>> import numpy as np
    >>> fetch = lambda: (np.array([5, 9], np.int64), np.array([[1.0], [2.0]], np.float32))
    >>> cache = HotRowCache(HotRowPolicy(count=2, refresh_every=10), fetch)
    >>> hit, rows = cache.split(np.array([9, 4], np.int64))
    >>> hit.tolist(), rows.tolist()
    ([True, False], [[2.0]])
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable

import numpy as np

from psflow.errors import InvalidArgumentError

__all__ = ["HotRowCache", "HotRowCaches", "HotRowPolicy"]


@dataclasses.dataclass(frozen=True)
class HotRowPolicy:
    """How many hot rows a worker caches per table, and how often it refreshes them.

    Attributes:
        count: ids to cache per PS task (>= 1).
        refresh_every: lookups between refreshes (>= 1).
    """

    count: int = 256
    refresh_every: int = 10

    def __post_init__(self) -> None:
        for field in ("count", "refresh_every"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(
                    f"hot rows {field} must be an integer >= 1, got {value!r}"
                )


class HotRowCache:
    """The hot rows of one table, refreshed by ``fetch() -> (ids, rows)``.

    Thread-safe: lookups of several threads share one cache.
    """

    def __init__(
        self, policy: HotRowPolicy, fetch: Callable[[], tuple[np.ndarray, np.ndarray]]
    ) -> None:
        self.policy = policy
        self._fetch = fetch
        self._lock = threading.Lock()
        self._ids = np.zeros(0, np.int64)
        self._rows: np.ndarray | None = None
        self._lookups = 0
        self.refreshes = 0
        self.hits = 0

    def split(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(hit mask, rows of the hits)`` for unique int64 ``ids``, refreshing
        first when ``refresh_every`` lookups have passed."""
        with self._lock:
            if self._lookups % self.policy.refresh_every == 0:
                fetched_ids, fetched_rows = self._fetch()
                order = np.argsort(fetched_ids)
                self._ids, self._rows = fetched_ids[order], fetched_rows[order]
                self.refreshes += 1
            self._lookups += 1
            cached_ids, cached_rows = self._ids, self._rows
        if cached_ids.size == 0 or cached_rows is None:
            return np.zeros(ids.shape[0], bool), np.zeros((0, 0), np.float32)
        pos = np.minimum(np.searchsorted(cached_ids, ids), cached_ids.size - 1)
        hit = cached_ids[pos] == ids
        self.hits += int(hit.sum())
        return hit, cached_rows[pos[hit]]


class HotRowCaches:
    """A client's hot-row caches, one per table, each made on the table's first lookup.

    Args:
        default: every table's policy (None: no table is cached) unless
            :meth:`set_policy` gave it its own.
        fetch: ``fetch(table, count) -> (ids, rows)``, a table's ``count``
            busiest rows from the PS.

    Thread-safe.
    """

    def __init__(
        self,
        default: HotRowPolicy | None,
        fetch: Callable[[str, int], tuple[np.ndarray, np.ndarray]],
    ) -> None:
        self.default = default
        self._fetch = fetch
        self._lock = threading.Lock()
        self._caches: dict[str, HotRowCache] = {}
        self._policies: dict[str, HotRowPolicy] = {}

    def set_policy(self, table: str, policy: HotRowPolicy) -> None:
        """Caches ``table`` with ``policy`` from its next lookup on (a table's first
        policy stays)."""
        with self._lock:
            self._policies.setdefault(table, policy)

    def split(self, table: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """:meth:`HotRowCache.split` of ``table``'s cache; None where ``table`` is
        not cached or there are no ``ids``."""
        with self._lock:
            policy = self._policies.get(table, self.default)
            if policy is None or not ids.size:
                return None
            cache = self._caches.get(table)
            if cache is None:
                fetch = functools.partial(self._fetch, table, policy.count)
                cache = self._caches[table] = HotRowCache(policy, fetch)
        return cache.split(ids)

    def clear(self) -> None:
        """Forgets every cached row (the tables' owners changed)."""
        with self._lock:
            self._caches.clear()

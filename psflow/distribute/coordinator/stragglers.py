"""When a running closure counts as late: a threshold from the recent closure times.

A closure is late when it has run longer than ``factor`` times the 90th
percentile of the last ``window`` successful closure times, and never before
``min_seconds`` (so a fast model does not re-run closures on scheduling noise).
Until ``min_samples`` closures have finished nothing is late: the first steps of
a run (which build datasets, ship functions, configure optimizers) are slow for
reasons a re-run would not fix.

Example:
    >>> times = StepTimes(factor=4.0, min_seconds=0.5)
    >>> for _ in range(20):
    ...     times.record(0.01)
    >>> times.threshold()
    0.5
"""

from __future__ import annotations

import collections
import threading


class StepTimes:
    """The recent closure times of one coordinator (thread-safe)."""

    def __init__(
        self, factor: float, min_seconds: float, window: int = 200, min_samples: int = 10
    ) -> None:
        self.factor = factor
        self.min_seconds = min_seconds
        self.min_samples = min_samples
        self._times: collections.deque[float] = collections.deque(maxlen=window)
        self._lock = threading.Lock()

    def record(self, seconds: float) -> None:
        """Adds the time of one closure that finished."""
        with self._lock:
            self._times.append(seconds)

    def threshold(self) -> float | None:
        """Seconds after which a running closure is late; None: speculation is off or too early."""
        if self.factor <= 0:
            return None
        with self._lock:
            if len(self._times) < self.min_samples:
                return None
            ordered = sorted(self._times)
        p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
        return max(self.min_seconds, self.factor * p90)

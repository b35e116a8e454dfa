"""``Dataset.prefetch``: a background thread that keeps elements ready, in order.

One producer thread runs the input pipeline and feeds a bounded queue; the
consumer takes items in the order they were produced, so prefetching never
changes the element order. Dropping the iterator stops the thread.

Example:
    >>> import psflow as pf
    >>> [int(x) for x in pf.data.Dataset.range(3).prefetch(2)]
    [0, 1, 2]
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

from psflow import errors
from psflow.data.dataset import AUTOTUNE, Dataset, int_arg

_POLL_S = 0.05
_AUTOTUNE_BUFFER = 4
_ITEM, _END, _ERROR = 0, 1, 2


def _produce(source: Iterator[Any], q: queue.Queue, stop: threading.Event) -> None:
    """The prefetch thread: runs ``source`` and queues its items, then an end marker.

    It holds no reference to the consuming iterator, so dropping that iterator
    sets ``stop`` (from ``__del__``) and this thread ends within one poll.
    """

    def put(item: tuple[int, Any]) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    try:
        for item in source:
            if not put((_ITEM, item)):
                return
        put((_END, None))
    except BaseException as e:  # handed to the consumer, raised there
        put((_ERROR, e))
    finally:
        close = getattr(source, "close", None)
        if close is not None:
            close()


class _PrefetchIterator:
    """The consuming side of a prefetch: items in the producer's order."""

    def __init__(self, source: Iterator[Any], size: int) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=size)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(
            target=_produce,
            args=(source, self._queue, self._stop),
            name="psflow-data-prefetch",
            daemon=True,
        )
        self._thread.start()

    def __iter__(self) -> _PrefetchIterator:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        while True:  # bounded by the producer: it either queues something or dies
            try:
                kind, payload = self._queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self._done = True
                    raise errors.InternalError(
                        "The prefetch thread ended without a result"
                    ) from None
        if kind == _ITEM:
            return payload
        self._done = True
        if kind == _END:
            raise StopIteration
        raise payload

    def close(self) -> None:
        """Stops the producer thread (it exits within one poll interval)."""
        self._done = True
        self._stop.set()

    def __del__(self) -> None:
        self._stop.set()


class PrefetchDataset(Dataset):
    """``Dataset.prefetch``: a background thread keeps up to ``buffer_size`` elements ready."""

    def __init__(self, input_dataset: Dataset, buffer_size: Any) -> None:
        super().__init__(input_dataset)
        b = int_arg(buffer_size, "buffer_size")
        if b == AUTOTUNE:
            b = _AUTOTUNE_BUFFER
        elif b < 0:
            raise errors.InvalidArgumentError(
                f"prefetch: buffer_size must be >= 0 or AUTOTUNE (-1), got {b}"
            )
        self._buffer = b

    def _iter_elements(self) -> Iterator[tuple[Any, ...]]:
        src = self._inputs[0]._iter_flat()
        if self._buffer == 0:
            return src
        return _PrefetchIterator(src, self._buffer)
